"""Platform facts in one place: cpu | cuda | rocm, device facts, worker environments, process limits, offline
variables, and the megatron-core CPU shims.

The rest of the code asks this module for device facts instead of calling `torch.cuda` directly, so that ROCm
(where torch reports itself as `cuda` and `torch.version.hip` is set) and CPU follow the same paths.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Literal, Mapping

from vime_core.errors import VimeError

log = logging.getLogger(__name__)

PlatformName = Literal["cpu", "cuda", "rocm"]

# Services that phone home unless told not to (Prefect, MLflow, Ray, vLLM, HF). Set wherever we start them.
OFFLINE_ENV: dict[str, str] = {
    "DO_NOT_TRACK": "true",  # Prefect client and MLflow (MLflow only accepts "true")
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # the default 20 s is too short on 2 cores
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # 2 server processes instead of 10
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Only for a *local* Ray (cluster.init_ray): makes it bind 127.0.0.1 instead of the primary interface. Never in a
# process that joins a multi-node cluster: `ray start` there aborts with "Multi-node Ray clusters are not supported".
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

RECOMMENDED_NOFILE = 1_048_576
NOSET_CUDA = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
NOSET_HIP = "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"


class PlatformError(VimeError, RuntimeError):
    """The platform or its environment cannot run what was asked."""


@dataclass(frozen=True)
class DeviceFacts:
    platform: PlatformName
    count: int
    names: list[str] = field(default_factory=list)  # MLflow's vime.devices tag


def apply_offline_env(environ: os._Environ | dict = os.environ) -> None:
    """Set the offline variables unless the user set them already."""
    for k, v in OFFLINE_ENV.items():
        environ.setdefault(k, v)


def detect_platform(requested: str = "auto") -> PlatformName:
    """The platform to run on. `auto` picks rocm/cuda when torch sees a GPU, else cpu."""
    import torch

    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    is_hip = getattr(torch.version, "hip", None) is not None
    actual: PlatformName = ("rocm" if is_hip else "cuda") if has_gpu else "cpu"
    if requested == "auto":
        return actual
    if requested != "cpu" and requested != actual:
        raise PlatformError(
            f"cluster.platform = {requested} but this machine's torch sees {actual} "
            f"(torch {torch.__version__}, hip={torch.version.hip}, cuda available={has_gpu}); "
            "set cluster.platform to auto or install the matching torch build"
        )
    return requested  # type: ignore[return-value]


def device_facts(platform: PlatformName) -> DeviceFacts:
    """Count and names of the visible devices."""
    if platform == "cpu":
        return DeviceFacts("cpu", 0)
    import torch

    n = torch.cuda.device_count()
    return DeviceFacts(platform, n, [torch.cuda.get_device_properties(i).name for i in range(n)])


def current_device_uuid(platform: PlatformName) -> str:
    """The UUID of this process's device: it keys CUDA IPC handles across processes (see sync/cuda_ipc.py)."""
    if platform == "cpu":
        return "cpu"
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def dist_backend(platform: PlatformName) -> str:
    # RCCL answers to the "nccl" backend name on ROCm.
    return "gloo" if platform == "cpu" else "nccl"


def check_visible_devices_env(environ: Mapping[str, str]) -> None:
    """Refuse environments that make Ray or HIP misbehave in confusing ways later."""
    if environ.get("ROCR_VISIBLE_DEVICES") and not environ.get("HIP_VISIBLE_DEVICES"):
        raise PlatformError(
            "ROCR_VISIBLE_DEVICES is set without HIP_VISIBLE_DEVICES: Ray refuses this (and `import ray` raises). "
            f"Set HIP_VISIBLE_DEVICES={environ['ROCR_VISIBLE_DEVICES']} instead (and unset ROCR_VISIBLE_DEVICES)."
        )


def worker_env(
    platform: PlatformName, device_ids: list[int] | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment variables for a worker process (a Ray actor) that owns `device_ids`.

    Ray is told not to rewrite device visibility (`RAY_EXPERIMENTAL_NOSET_*`): each actor is given the list it
    should see and picks its device itself. On ROCm, HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES carry the same list
    (HIP reads the first, parts of the stack the second).
    """
    base = dict(os.environ if base is None else base)
    check_visible_devices_env(base)
    env = {k: v for k, v in OFFLINE_ENV.items() if k not in base}
    if platform == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env
    ids = ",".join(str(i) for i in (device_ids or []))
    env[NOSET_CUDA] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ids
    if platform == "rocm":
        env[NOSET_HIP] = "1"
        env["HIP_VISIBLE_DEVICES"] = ids
    return env


RAY_MEMORY_THRESHOLD = 0.95  # Ray's default memory_usage_threshold: above it Ray kills a worker
HOST_ROOM_MARGIN = 1 << 30  # left below that line for what the other processes allocate meanwhile


def host_room_bytes() -> int:
    """Host memory this process may still take before the host passes Ray's memory-monitor line (used as total
    minus available, as psutil reads /proc/meminfo), less a margin for the other processes. Negative when past it."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.total * RAY_MEMORY_THRESHOLD - (vm.total - vm.available) - HOST_ROOM_MARGIN)


def rss_gib() -> float:
    """Resident memory of this process now (pinned host buffers included)."""
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def max_rss_gib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def raise_fd_limit(gpu: bool) -> int:
    """Raise the soft open-file limit to the hard limit; warn on GPU runs when it stays below 1,048,576.

    Ray, NCCL/RCCL and vLLM open many descriptors (sockets, shared memory, IPC handles); AMD's scripts raise it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = RECOMMENDED_NOFILE if hard == resource.RLIM_INFINITY else hard
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as e:
                log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    if gpu and soft < RECOMMENDED_NOFILE:
        log.warning(
            "open-file limit is %d (< %d): GPU runs can fail with 'too many open files'; raise it with "
            "`ulimit -n %d` (or the container's nofile ulimit)",
            soft,
            RECOMMENDED_NOFILE,
            RECOMMENDED_NOFILE,
        )
    return soft


# --------------------------------------------------------------------------------------------------------------------
# megatron-core on CPU
# --------------------------------------------------------------------------------------------------------------------
_SHIMS_APPLIED = False


def apply_megatron_compat() -> None:
    """Every platform: megatron-core 0.16.1's `moe_utils` refers to `te_general_gemm`, undefined without
    Transformer Engine (NameError in the first MoE forward)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_megatron_cpu_shims() -> None:
    """Make megatron-core 0.16.1 run on CPU. Call once per process, only on the cpu platform.

    - modules allocate with `device=torch.cuda.current_device()` (rotary `inv_freq` among them): answer "cpu";
    - checkpoint save and DDP call `torch.cuda.synchronize()` / `empty_cache()` unconditionally: make them no-ops;
    - the default causal mask is built on `cuda`: we always pass an explicit mask, and patch the helper too.
    RNG: seed with `model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)` (see train).
    """
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED:
        return
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]

    import megatron.core.fusions.fused_softmax as fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    apply_megatron_compat()
    _SHIMS_APPLIED = True


def cpu_threads(
    cores: int, max_staleness: int, role: str, num_trainers: int = 1, num_engines: int = 1, explicit: int | None = None
) -> int:
    """Threads of one trainer rank (`role` = "train") or one engine ("rollout") on the CPU platform.

    On-policy the trainer and the engines take turns, so each may use every core. With max_staleness > 0 they run
    at the same time: two 2-thread OpenMP pools on 2 cores fight (measured: rollout 0.9-2.0 s and train 1.0-2.0 s per
    step instead of 0.43 s / 0.42 s), so the cores are split between the processes that overlap."""
    if explicit:
        return explicit
    if max_staleness == 0:
        return max(1, cores)
    return max(1, cores // max(1, num_trainers + num_engines))


def ray_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): where an actor was placed, as Ray sees it."""
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        return None
    return sys.modules["ray"].get_runtime_context().get_node_id()
