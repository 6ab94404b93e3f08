"""The loop phase's config overrides for bench/gpu_scale.py (its parent and its phases both read them, so they live
below both: no import cycle between gpu_scale.py and gpu_scale_phases.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_scale_report import is_moe_shape  # noqa: E402

# configs/qwen3-30b-a3b.yaml lays the model over 8 GPUs; the MoE shapes run on one, trainer and vLLM colocated. Sleep
# level 2: the engine drops its weights while the trainer works instead of keeping a host copy, which the memory fit
# check counts against the host beside the optimizer state moved there between steps (vime_core/fit.py; --fit).
MOE_ONE_GPU = [
    "train.num_devices=1",
    "train.tensor_parallel_size=1",
    "train.expert_parallel_size=1",
    "rollout.num_engines=1",
    "rollout.engine_tensor_parallel_size=1",
    "cluster.engine_sleep_level=2",
]
MOE_CUDA = ["rollout.gpu_memory_utilization=0.5"]  # the default, said here because the 8-GPU file sets 0.25
# What each loop phase of an MoE shape measures, set after --set so that a phase means one thing: `loop` the grouped
# experts (train.moe_grouped_gemm's `auto` resolves to them for Qwen3-MoE) behind the allgather token dispatcher,
# `loop_sequential` megatron's SequentialMLP (a Python loop over experts), `loop_r3` the grouped experts with vLLM's
# routing replayed in the trainer (R3), `loop_alltoall` the grouped experts behind the alltoall dispatcher. `loop`
# ends in the final checkpoint save users get (its time and host peak are measured); the variants skip it, as only
# their steps are compared and each 30B-A3B slice's save took ~16 s of a scarce device loan
ALLGATHER = "train.moe_token_dispatcher=allgather"
NO_SAVE = "checkpoint.save_at_end=false"
MOE_LOOP_PHASES = {
    "loop": ["train.moe_grouped_gemm=true", ALLGATHER],
    "loop_sequential": ["train.moe_grouped_gemm=false", ALLGATHER, NO_SAVE],
    "loop_r3": ["train.moe_grouped_gemm=true", ALLGATHER, "rollout.routing_replay=true", NO_SAVE],
    "loop_alltoall": ["train.moe_grouped_gemm=true", "train.moe_token_dispatcher=alltoall", NO_SAVE],
}


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


def loop_overrides(args, model_dir: Path, run_dir: Path, phase: str = "loop") -> list[str]:
    """The loop phase's overrides: device, the bench's model/data/batch, one-GPU MoE settings, --set, the phase's."""
    cpu = args.device == "cpu"
    moe = is_moe_shape(args.shape)
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
            f"output_dir={run_dir}",  # the loop saves after its last step (MOE_LOOP_PHASES: not the variants)
        ]
        + (MOE_ONE_GPU + ([] if cpu else MOE_CUDA) if moe else [])
        + list(args.set)
        + (MOE_LOOP_PHASES[phase] if moe else [])
    )
