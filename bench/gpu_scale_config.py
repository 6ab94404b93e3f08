"""The loop phase's config overrides for bench/gpu_scale.py (its parent and its phases both read them, so they live
below both: no import cycle between gpu_scale.py and gpu_scale_phases.py)."""

from __future__ import annotations

from pathlib import Path


def field_exists(path: list[str]) -> bool:
    """Whether `a.b` names a field of RunConfig (fields such as train.recompute appear as the trainer changes)."""
    from pydantic import BaseModel

    from vime_core.config import RunConfig

    model: type | None = RunConfig
    for part in path:
        if model is None or part not in model.model_fields:
            return False
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return True


def filter_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    kept, dropped = [], []
    for item in items:
        (kept if field_exists(item.split("=", 1)[0].strip().split(".")) else dropped).append(item)
    return kept, dropped


def loop_overrides(args, model_dir: Path, run_dir: Path) -> list[str]:
    cpu = args.device == "cpu"
    dev = (
        ["cluster.platform=cpu", "model.dtype=float32", "train.optimizer=adamw", "rollout.cpu_kv_cache_gib=0.25"]
        if cpu
        else ["cluster.platform=cuda", "model.dtype=bfloat16", "train.optimizer=megatron"]
    )
    return (
        dev
        + [
            f"model.source={model_dir}",
            "cluster.colocate=true",
            "tracking.enabled=false",
            "data.source=builtin://arith",
            "data.max_prompt_len=128",
            f"rollout.num_rollout={args.steps}",
            f"rollout.rollout_batch_size={args.prompts}",
            f"rollout.n_samples_per_prompt={args.samples}",
            f"rollout.max_response_len={args.response_len}",
            f"train.global_batch_size={args.prompts * args.samples}",
            "eval.datasets=[]",
            "checkpoint.resume=false",
            "checkpoint.save_optimizer=false",
            f"output_dir={run_dir}",  # the loop always saves after the last step
        ]
        + list(args.set)
    )
