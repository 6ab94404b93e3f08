"""Which settings a resume must keep, tagged on each field, and the fingerprint derived from the tags.

Every field of every section carries `FIXED` or `FREE` in its `Annotated[...]` (tests/unit/test_fingerprint.py fails on
a field with neither). FIXED: changing it changes the training math, what is generated and rewarded, or the data order,
so a resume with a new value would not continue the run (model, layout, algorithm, sampling, rewards, seed). FREE:
sizes of the run (num_rollout), timeouts, placement and memory knobs that leave the math alone, eval, checkpoint,
tracking and output settings. A checkpoint records the fixed values (`fingerprint_fields`) and a resume compares them
(vime_core/resume.py).

The calls that are not obvious:
- fixed: data.shuffle, data.max_prompt_len (with bad_rows = skip it decides which prompts are in the set) and
  rollout.over_sampling_batch_size / max_sampling_attempts (how many prompts a step consumes): the data order;
  rollout.stop, custom_generate, reward, reward_type, strict_format, dynamic_sampling, max_staleness: what is
  generated, how it is scored, which groups and which policy's samples are trained; train.clip_grad, adam_eps: the
  update; train.num_devices, the parallel sizes, sequence_parallel, distributed_optimizer, moe_grouped_gemm: the
  layout the optimizer state was saved at.
- free: data.bad_rows (under `error` a bad row stopped the run, so the set had none: `skip` changes nothing, and
  back to `error` fails loudly at load); train.max_tokens_per_device, recompute, logprob_chunk_tokens,
  logprob_keep_logits, old_logprobs, offload_optimizer, cpu_threads (memory and speed: the loss denominators are
  global, so the math is the same up to kernel noise); rollout.num_engines, engine_tensor_parallel_size and
  cluster.* (placement); every timeout_s and rollout.reward_timeout_s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

# 1: the hand-kept list before the fields were tagged (no version key in the checkpoint); 2: derived from the tags
FINGERPRINT_VERSION = 2
VERSION_KEY = "fingerprint_version"


@dataclass(frozen=True)
class Resume:
    """A field's resume class, as `Annotated` metadata; it shows in the JSON schema as `"resume": "fixed" | "free"`."""

    kind: Literal["fixed", "free"]

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        schema["resume"] = self.kind
        return schema


FIXED = Resume("fixed")
FREE = Resume("free")


def resume_kind(field: Any) -> str | None:
    """`fixed`, `free`, or None for an untagged field (a pydantic FieldInfo)."""
    kinds = [m.kind for m in field.metadata if isinstance(m, Resume)]
    return kinds[0] if kinds else None


def section_type(field: Any) -> type[BaseModel] | None:
    """The section class of a field that holds a whole section (`RunConfig.train`); it has no tag of its own: its
    fields have theirs."""
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def fixed_values(cls: type[BaseModel], dumped: dict[str, Any]) -> dict[str, Any]:
    """The FIXED fields of `dumped` (a `model_dump(mode="json")` of `cls`), nested by section."""
    out: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        sub = section_type(field)
        if sub is not None:
            inner = fixed_values(sub, dumped[name])
            if inner:
                out[name] = inner
        elif resume_kind(field) == "fixed":
            out[name] = dumped[name]
    return out


def classified(cls: type[BaseModel], prefix: str = "") -> dict[str, str | None]:
    """`section.field -> fixed | free | None` for every field (sections walked into)."""
    out: dict[str, str | None] = {}
    for name, field in cls.model_fields.items():
        sub = section_type(field)
        if sub is not None:
            out |= classified(sub, f"{prefix}{name}.")
        else:
            out[prefix + name] = resume_kind(field)
    return out
