"""HF checkpoints: safetensors weights in and out, with their config and tokenizer files.

(HF <-> Megatron torch_dist conversion (convert.py) and training checkpoints with exact resume (vime_core/resume.py)
build on this module.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from vime_core.errors import VimeError
from vime_core.fsutil import replacing_dir
from vime_core.integrity import check_weights

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class ModelFileError(VimeError, FileNotFoundError):
    """A model directory lacks a file it needs; the message says which and where."""


def weight_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelFileError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise ModelFileError(f"model directory {d} has no config.json")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ModelFileError(
                f"model directory {d}: shard(s) listed in model.safetensors.index.json are missing: {missing}"
            )
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelFileError(
            f"model directory {d} has no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    return files


def check_model_files(model_dir: str | Path) -> None:
    """Every weights file of `model_dir` is present and as long as its safetensors header says (headers only:
    milliseconds, in `prepare`), so a truncated download fails before any actor starts."""
    check_weights(weight_files(model_dir))


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            out.update(load_file(str(f)))
        except Exception as e:
            raise ModelFileError(f"cannot read weights file {f}: {e}") from e
    return out


def read_hf_config(model_dir: str | Path) -> dict:
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        raise ModelFileError(f"model directory {model_dir} has no config.json")
    try:
        return json.loads(p.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(
            f"{p} is not valid JSON ({type(e).__name__}: {str(e)[:100]}); download or copy the model again"
        ) from None


def save_hf_checkpoint(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    source_dir: str | Path,
    max_shard_bytes: int = 4 * 2**30,
) -> Path:
    """Write safetensors (sharded with an index above `max_shard_bytes`) and copy config/tokenizer files from
    `source_dir`. Written to a temporary sibling and renamed, so `out_dir` is complete or absent."""
    out = Path(out_dir)
    with replacing_dir(out) as tmp:
        _write_safetensors(tensors, tmp, max_shard_bytes)
        copy_hf_side_files(Path(source_dir), tmp)
    return out


def _write_safetensors(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], tmp: Path, max_shard_bytes: int
) -> None:
    from safetensors.torch import save_file

    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for _, t in items)
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )


def copy_hf_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
