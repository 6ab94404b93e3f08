"""Prompt datasets and the data buffer.

Reading: `.jsonl` / `.json` / `.parquet` files in the dapo-math-17k layout (`prompt` = chat messages or a string,
`label`), and `builtin://arith`. Every problem with a row (missing key, bad JSON, non-UTF-8 bytes, a label that is
not a scalar, a prompt that is too long) raises `DatasetError` naming the file, the row and the problem, or, with
`data.bad_rows = skip`, is skipped and counted.

The buffer serves prompt batches in a seeded order per epoch and keeps its
position as a small state dict saved with checkpoints, so a resumed run continues with exactly the next batch.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vime_core.errors import VimeError
from vime_core.sample import Sample

log = logging.getLogger(__name__)


class DatasetError(VimeError, ValueError):
    """A dataset cannot be read; the message names the source, the row (1-based) and the problem."""


@dataclass
class Prompt:
    index: int  # row index in the source (stable across runs)
    prompt_ids: list[int]
    prompt: str
    label: str | None
    metadata: dict[str, Any] = field(default_factory=dict)

    def template(self, group_id: int) -> Sample:
        return Sample(
            group_id=group_id,
            prompt_ids=self.prompt_ids,
            label=self.label,
            prompt=self.prompt,
            metadata={**self.metadata, "index": self.index},
        )


@dataclass
class PromptSet:
    source: str
    prompts: list[Prompt]
    skipped: int = 0
    skipped_reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)


# --------------------------------------------------------------------------------------------------------------------
# reading rows
# --------------------------------------------------------------------------------------------------------------------
def read_rows(source: str) -> list[tuple[int, Any]]:
    """(1-based row number, raw row) pairs; bad JSON and bad bytes come back as exceptions to report per row."""
    if source.startswith("builtin://"):
        from vime_core.builtin import parse_builtin_dataset

        try:
            return list(enumerate(parse_builtin_dataset(source), 1))
        except ValueError as e:
            raise DatasetError(str(e)) from None
    path = Path(source)
    if not path.exists():
        raise DatasetError(f"dataset {source} does not exist")
    if path.is_dir():
        files = sorted([*path.glob("*.parquet"), *path.glob("*.jsonl")])
        if not files:
            raise DatasetError(f"dataset directory {source} holds no .parquet or .jsonl files")
        rows: list[tuple[int, Any]] = []
        for f in files:
            rows += [(len(rows) + i, r) for i, (_, r) in enumerate(read_rows(str(f)), 1)]  # numbered across files
        return rows
    if path.stat().st_size == 0:
        raise DatasetError(f"dataset {source} is empty")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _read_parquet(path)
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise DatasetError(f"dataset {source}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    raw = path.read_bytes()
    if path.suffix.lower() == ".json" and raw.lstrip()[:1] == b"[":
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DatasetError(f"dataset {path}: not valid UTF-8 JSON: {e}") from None
        return list(enumerate(data, 1))
    rows: list[tuple[int, Any]] = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            rows.append(
                (
                    n,
                    DatasetError(
                        f"{path}:{n}: line is not valid UTF-8 (byte {e.start}: {line[e.start : e.start + 4]!r})"
                    ),
                )
            )
            continue
        try:
            rows.append((n, json.loads(text)))
        except json.JSONDecodeError as e:
            rows.append((n, DatasetError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})")))
    if not rows:
        raise DatasetError(f"dataset {path} has no rows (only blank lines)")
    return rows


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DatasetError(f"dataset {path}: cannot read parquet: {e}") from None
    if table.num_rows == 0:
        raise DatasetError(f"dataset {path} has no rows")
    return list(enumerate(table.to_pylist(), 1))


# --------------------------------------------------------------------------------------------------------------------
# validating and tokenising
# --------------------------------------------------------------------------------------------------------------------
def _check_prompt(value: Any) -> list[dict[str, str]] | str:
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("prompt is empty")
        return value
    if hasattr(value, "tolist"):  # numpy arrays from parquet
        value = value.tolist()
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"prompt message {i} must be an object with 'role' and 'content', got {str(m)[:80]!r}")
            if not isinstance(m["content"], str):
                raise ValueError(f"prompt message {i} content must be text, got {type(m['content']).__name__}")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(
        f"prompt must be text or a non-empty list of chat messages, got {type(value).__name__}: {str(value)[:80]!r}"
    )


def _check_label(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"label {value!r} is not an answer (expected text or a number)")
    if isinstance(value, (int, float)):
        if value != value:  # NaN
            raise ValueError("label is NaN")
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("label is empty")
        return value.strip()
    raise ValueError(f"label must be text or a number, got {type(value).__name__}: {str(value)[:80]!r}")


def check_chat_template(tokenizer, data_cfg) -> None:
    """A tokenizer without a chat template cannot render any row: say so once, with the fix (not as a bad row)."""
    if data_cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"the model's tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template, so "
            "data.apply_chat_template=true cannot render prompts; set data.apply_chat_template=false to feed the "
            "prompt text as is, or use a model whose tokenizer_config.json / chat_template.jinja has one"
        )


def render_prompt(tokenizer, prompt: list[dict[str, str]] | str, apply_chat_template: bool) -> str:
    if not apply_chat_template:
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def load_prompts(
    source: str, tokenizer, data_cfg, max_prompts: int | None = None, require_label: bool = True
) -> PromptSet:
    """Read, validate and tokenise a prompt dataset (see module doc for the error rules)."""
    check_chat_template(tokenizer, data_cfg)
    rows = read_rows(source)
    out = PromptSet(source, [])

    def reject(msg: str) -> None:
        if data_cfg.bad_rows == "error":
            raise DatasetError(msg + " (set data.bad_rows=skip to skip such rows)")
        out.skipped += 1
        if len(out.skipped_reasons) < 20:
            out.skipped_reasons.append(msg)

    parsed: list[tuple[int, str, str | None, dict]] = []
    for n, row in rows:
        try:
            parsed.append(_parse_row(n, row, tokenizer, data_cfg, require_label))
        except DatasetError as e:
            reject(str(e))
        except ValueError as e:
            reject(f"{source}: row {n}: {e}")
    # one batched tokenizer call: ~50x faster than one call per row on a 17k-row dataset
    ids = tokenizer([text for _, text, _, _ in parsed], add_special_tokens=False)["input_ids"] if parsed else []
    for (n, text, label, meta), prompt_ids in zip(parsed, ids):
        if len(prompt_ids) > data_cfg.max_prompt_len:
            reject(
                f"{source}: row {n}: prompt has {len(prompt_ids)} tokens, more than data.max_prompt_len = {data_cfg.max_prompt_len}"
            )
            continue
        out.prompts.append(Prompt(index=n - 1, prompt_ids=prompt_ids, prompt=text, label=label, metadata=meta))
    if max_prompts is not None:
        del out.prompts[max_prompts:]
    if out.skipped:
        log.warning("%s: skipped %d bad row(s); first: %s", source, out.skipped, out.skipped_reasons[0])
    if not out.prompts:
        raise DatasetError(f"dataset {source} has no usable rows ({out.skipped} skipped: {out.skipped_reasons[:3]})")
    return out


def _parse_row(n: int, row: Any, tokenizer, data_cfg, require_label: bool) -> tuple[int, str, str | None, dict]:
    """(row number, rendered prompt, label, metadata) of a valid row; ValueError/DatasetError otherwise."""
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"row must be an object, got {type(row).__name__}")
    if data_cfg.prompt_key not in row:
        raise ValueError(f"no {data_cfg.prompt_key!r} key (data.prompt_key); keys are {sorted(row)[:10]}")
    prompt = _check_prompt(row[data_cfg.prompt_key])
    label = None
    if data_cfg.label_key in row:
        label = _check_label(row[data_cfg.label_key])
    elif require_label:
        raise ValueError(f"no {data_cfg.label_key!r} key (data.label_key); keys are {sorted(row)[:10]}")
    text = render_prompt(tokenizer, prompt, data_cfg.apply_chat_template)
    meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    return n, text, label, dict(meta)


def check_labels(prompts: PromptSet, usable: Callable[[list[str]], list[bool]], label_key: str) -> int:
    """Count the labels that `usable` (the reward's verifier) cannot read: such a prompt scores 0 on every sample.
    Warns with the count and examples; raises DatasetError, naming the dataset and the field, when no label is
    usable. Returns the count."""
    labelled = [p for p in prompts.prompts if p.label is not None]
    if not labelled:
        return 0
    bad = [p for p, ok in zip(labelled, usable([p.label for p in labelled])) if not ok]
    examples = ", ".join(f"row {p.index + 1}: {p.label!r}" for p in bad[:3])
    if len(bad) == len(labelled):
        raise DatasetError(
            f"dataset {prompts.source}: none of its {len(bad)} labels (field {label_key!r}, "
            f"data.label_key) can be read by the math verifier ({examples}); fix the labels, point "
            f"data.label_key at the answer field, or use a custom rollout.reward"
        )
    if bad:
        log.warning(
            "%s: %d of %d labels (field %r) cannot be read by the math verifier and will score 0 on every sample (%s)",
            prompts.source,
            len(bad),
            len(labelled),
            label_key,
            examples,
        )
    return len(bad)


# --------------------------------------------------------------------------------------------------------------------
# the buffer
# --------------------------------------------------------------------------------------------------------------------
class DataBuffer:
    """Serves prompts epoch by epoch in a seeded order. State: (epoch, offset, seed, dataset size)."""

    def __init__(self, prompts: PromptSet, seed: int, shuffle: bool = True):
        if not prompts.prompts:
            raise DatasetError(f"dataset {prompts.source} has no prompts to serve")
        self.prompts, self.seed, self.shuffle = prompts, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        while len(out) < n:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_for(self.epoch)
            take = min(n - len(out), len(self._order) - self.offset)
            out += [self.prompts.prompts[i] for i in self._order[self.offset : self.offset + take]]
            self.offset += take
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self.prompts):
            raise DatasetError(
                f"the data buffer state was saved for {state['num_prompts']} prompts but {self.prompts.source} has "
                f"{len(self.prompts)}: the dataset changed since the checkpoint"
            )
        self.epoch, self.offset, self.seed = state["epoch"], state["offset"], state["seed"]
        self._order = self._order_for(self.epoch)  # an older checkpoint's "injected": [] is ignored
