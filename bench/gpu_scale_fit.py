"""`gpu_scale.py --fit`: the memory fit check that `prepare` runs before any actor starts (vime_core/fit.py), on the
loop phases' configs of a shape, without a GPU or a checkpoint (the architecture comes from the shape's config.json
values). For the MoE shapes it also names the largest 30b-a3b-<L>l whose loop phases the check accepts: the bench's
choice of L. The check counts activations at their floor (full recompute), so a shape it accepts can still run out of
memory at the loop's default selective recompute; one it refuses cannot run at all.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_scale_config import MOE_LOOP_PHASES, filter_overrides, loop_overrides  # noqa: E402
from gpu_scale_report import MOE_LAYERS, hf_config, is_moe_shape  # noqa: E402

DEVICE_GIB = 139.8  # one H200 as torch reports it (143,771 MiB)
HOST_GIB = 125.0  # the lent H200 machine's host memory as psutil reports it


def phase_plan(args, phase: str, device_gib: float, host_gib: float) -> dict:
    """The fit check of `phase`'s loop config for args.shape on CUDA: whether it fits, the refusal, the plan in GiB."""
    from vime_core.config import load_config
    from vime_core.fit import GIB, HOST_RESERVE_GIB, RAY_MEMORY_THRESHOLD, MemoryFitError, check_memory_fit, memory_plan
    from vime_core.models import arch_from_hf_config, check_model_compat

    a = copy.copy(args)
    a.device = "cuda"
    kept, _ = filter_overrides(loop_overrides(a, Path("/fit-check/model"), Path("/fit-check/run"), phase))
    cfg = load_config(a.config, kept)
    arch = arch_from_hf_config(hf_config(a.shape))
    check_model_compat(cfg, arch)
    try:
        plan, problem = check_memory_fit(cfg, arch, "cuda", device_gib * GIB, host_gib * GIB), None
    except MemoryFitError as e:
        plan, problem = memory_plan(cfg, arch, device_gib * GIB, "cuda"), str(e)
    return {
        "shape": a.shape,
        "phase": phase,
        "fits": problem is None,
        "problem": problem,
        "params": plan.params,
        "train_gib": round(plan.train / GIB, 1),
        "rollout_gib": round(plan.rollout / GIB, 1),
        "host_gib": round(plan.host / GIB, 1),
        "device_limit_gib": device_gib,
        "host_limit_gib": round(host_gib * RAY_MEMORY_THRESHOLD - HOST_RESERVE_GIB, 1),
        "parts_gib": {k: round(v / GIB, 1) for k, v in plan.parts.items()},
    }


def shape_plans(args, device_gib: float = DEVICE_GIB, host_gib: float = HOST_GIB) -> list[dict]:
    """The plan of every loop phase the shape runs (one for a dense shape)."""
    phases = list(MOE_LOOP_PHASES) if is_moe_shape(args.shape) else ["loop"]
    return [phase_plan(args, p, device_gib, host_gib) for p in phases]


def largest_moe_layers(args, device_gib: float = DEVICE_GIB, host_gib: float = HOST_GIB) -> tuple[int, list[dict]]:
    """(the largest L whose 30b-a3b-<L>l loop phases all fit, or 0; the plans of L and L + 1). The plan grows with L,
    so the first L that does not fit ends the walk."""
    best, fitting, plans = 0, [], []
    for layers in range(1, MOE_LAYERS + 1):
        a = copy.copy(args)
        a.shape = f"30b-a3b-{layers}l"
        plans = shape_plans(a, device_gib, host_gib)
        if not all(p["fits"] for p in plans):
            break
        best, fitting, plans = layers, plans, []
    return best, fitting + plans


def fit_report(args) -> dict:
    """--fit: the shape's plans and, for an MoE shape, the largest L the check accepts under the same settings."""
    out: dict = {"plans": shape_plans(args, args.fit_device_gib, args.fit_host_gib)}
    if is_moe_shape(args.shape):
        best, plans = largest_moe_layers(args, args.fit_device_gib, args.fit_host_gib)
        out["largest_moe_shape"] = f"30b-a3b-{best}l" if best else None
        out["largest_and_next"] = [p for p in plans if p["phase"] == "loop"]
    return out
