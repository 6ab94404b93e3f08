"""Will the run fit? Per-device memory of the trainer and vLLM, and the node's host memory, from the architecture and
the config alone: `prepare` checks it before any actor starts, so that a run that cannot fit is refused in seconds
with the numbers and the knobs, not found out by an out-of-memory error minutes in.

The rule, per device:
- static trainer state is exact arithmetic over the parameters a rank holds (`ModelSpec.params_per_device`): bf16
  weights 2 bytes, megatron's fp32 gradient buffer 4, fp32 master copy 4 and Adam moments 8 (sharded over DP with the
  distributed optimizer, routed experts over DP / EP; on the host for the offloaded share of
  train.optimizer_cpu_offload); torch AdamW keeps weights, gradients and both moments in the weights' dtype (4 x its
  bytes);
- activations are counted at their floor, what full recompute keeps (each layer's input for the micro-batch budget,
  train.max_tokens_per_device, plus one log-prob chunk): a run refused here cannot fit at any recompute setting;
- the optimizer step adds nothing parameter-sized: Adam runs torch's fused kernel on GPUs (trainer.optim.fuse_adam);
- colocated, the device holds in turn (a) the trainer training beside vLLM asleep (or awake, cluster.engines_sleep
  false) and (b) vLLM's share (rollout.gpu_memory_utilization of the device) beside what the trainer keeps while
  vLLM generates (its weights, plus its optimizer state unless train.offload_optimizer moves it to the host);
- the host holds the offloaded optimizer state of every trainer rank on the node, at sleep level 1 each engine's
  weights, and while a checkpoint is saved each rank's host copies of the tensors being written (per file being
  written, one tensor and the one before it until it is dropped: `checkpoint.torch_dist.streamed_writes`);
  HOST_RESERVE_GIB stays for the processes themselves (vLLM, Ray, Python, CUDA), and the whole must stay under Ray's
  memory monitor, which kills the largest worker above RAY_MEMORY_THRESHOLD of the host (Qwen3-8B on one H200 at 75%
  offload: the trainer was killed at 114 GB while saving).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vime_core.config import ConfigError, RunConfig
from vime_core.models import Layout, spec_of
from vime_core.platform import RAY_MEMORY_THRESHOLD

GIB = 2**30
CONTEXT_GIB = 1.0  # CUDA context and workspaces of one process
ASLEEP_GIB = 2.0  # what a sleeping vLLM engine keeps on its device (CUDA graphs, context)
HOST_RESERVE_GIB = 14.0  # the processes' own: vLLM, Ray, Python, CUDA (Qwen3-8B run: 121 GiB used - 107 counted)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class MemoryFitError(ConfigError):
    """The run cannot fit in device or host memory; the message names the numbers and the settings that would."""


@dataclass
class MemoryPlan:
    """Bytes per device (train and rollout phases) and on the host, with the parts that make them up."""

    params: int
    train: float
    rollout: float
    host: float
    parts: dict[str, float] = field(default_factory=dict)

    def gib(self, name: str) -> float:
        return self.parts[name] / GIB


def trainer_static(cfg: RunConfig, params: int, platform: str, experts: int = 0) -> dict[str, float]:
    """Bytes of one rank's static state: `weights` (with the KL loss's frozen reference copy), `grads`,
    `optimizer_gpu` (device-resident optimizer state) and `optimizer_host` (what train.optimizer_cpu_offload keeps in
    host memory). `experts` of the `params` are routed-expert parameters, whose state megatron's distributed optimizer
    shards over the expert-data-parallel ranks (data-parallel size / EP) instead of all data-parallel ones."""
    t, w = cfg.train, DTYPE_BYTES[cfg.model.dtype]
    megatron = t.optimizer == "megatron" or (t.optimizer == "auto" and platform != "cpu")
    ref = w * params if cfg.grpo.kl_loss_coef > 0 else 0.0  # the frozen reference model of the KL loss
    if not megatron:
        return {
            "weights": w * params + ref,
            "grads": w * params,
            "optimizer_gpu": 2 * w * params,
            "optimizer_host": 0.0,
        }
    sharded = t.distributed_optimizer or t.optimizer_cpu_offload
    dp = t.data_parallel_size if sharded else 1
    edp = max(1, t.data_parallel_size // t.expert_parallel_size) if sharded else 1
    owned = (params - experts) / dp + experts / edp  # parameters whose optimizer state this rank keeps
    master = 4 if w != 4 else 0  # an fp32 model is its own master copy
    state = (master + 8) * owned
    off = t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0
    # the host side keeps master copy, moments and an fp32 gradient copy: 16 bytes per offloaded parameter
    host = off * 16 * owned
    return {
        "weights": w * params + ref,
        "grads": 4.0 * params,
        "optimizer_gpu": (1 - off) * state,
        "optimizer_host": host,
    }


SAVE_FILES_AT_ONCE = 2  # megatron's torch_dist save writes a rank's tensors into two files (its thread_count)


def staging_bytes(numels: list[int], dtype: str) -> float:
    """Host bytes a checkpoint save holds at once for one rank's weight tensors (`numels`, ModelSpec.
    tensor_numels_per_device): the save copies each tensor as it writes it, and each file being written holds the
    tensor it writes and, until it is dropped, the one before; so at most the four largest (Qwen3-8B in bf16: 2.7 GiB,
    its embedding, LM head and two MLP weights, where staging every tensor took 15.3 GiB)."""
    return float(DTYPE_BYTES[dtype] * sum(sorted(numels)[-2 * SAVE_FILES_AT_ONCE :]))


def activation_floor(cfg: RunConfig, arch: Any) -> float:
    """What the train forward keeps at least: each layer's input for one micro-batch (full recompute), the MLP of the
    one layer being recomputed in backward (input, fc1's 2F outputs, the F activations and fc2's output per token; an
    MoE layer per routed copy: top-k of each token), and one log-prob chunk's fp32 logits and their gradient
    (~4 x chunk x vocab/TP floats, train.logprob_chunk_tokens)."""
    t, w, h = cfg.train, DTYPE_BYTES[cfg.model.dtype], arch.hidden_size
    tokens = t.max_tokens_per_device
    layers = -(-arch.num_layers // t.pipeline_parallel_size)
    inputs = tokens * h * w * layers
    if arch.is_moe:
        mlp = tokens * arch.moe_topk * (2 * h + 3 * arch.moe_ffn_hidden_size // t.tensor_parallel_size) * w
    else:
        mlp = tokens * (2 * h + 3 * arch.ffn_hidden_size // t.tensor_parallel_size) * w
    chunk = 4 * min(t.logprob_chunk_tokens, tokens) * arch.vocab_size / t.tensor_parallel_size * 4
    return float(inputs + mlp + chunk)


def memory_plan(cfg: RunConfig, arch: Any, device_bytes: float, platform: str) -> MemoryPlan:
    """The plan of one device and of the node's host memory (see the module doc)."""
    t, c = cfg.train, cfg.cluster
    layout = Layout.of_config(cfg)
    spec = spec_of(arch)
    params = spec.params_per_device(arch, layout)
    static = trainer_static(cfg, params, platform, spec.expert_params_per_device(arch, layout))
    acts = activation_floor(cfg, arch)
    colocated = c.colocate and platform != "cpu"
    sleeping = colocated and c.engines_sleep
    vllm = cfg.rollout.gpu_memory_utilization * device_bytes if colocated else 0.0
    offload_between = sleeping if t.offload_optimizer == "auto" else bool(t.offload_optimizer)
    moved = static["optimizer_gpu"] if offload_between and not t.optimizer_cpu_offload else 0.0
    kept = static["weights"] + (0.0 if offload_between else static["grads"]) + static["optimizer_gpu"] - moved
    ctx = CONTEXT_GIB * GIB
    train = sum(static[k] for k in ("weights", "grads", "optimizer_gpu")) + acts + ctx
    train += (ASLEEP_GIB * GIB if sleeping else vllm) if colocated else 0.0
    rollout = kept + vllm + ctx if colocated else 0.0
    ranks = t.num_devices  # on one node: a joined cluster is not checked (see check_memory_fit)
    engine_weights = 0.0
    if sleeping and c.engine_sleep_level == 1:
        engine_weights = DTYPE_BYTES[cfg.model.engine_dtype] * params * t.model_parallel_size * cfg.rollout.num_engines
    staging = ranks * staging_bytes(spec.tensor_numels_per_device(arch, layout), cfg.model.dtype)
    host = ranks * (static["optimizer_host"] + moved) + engine_weights + staging
    parts = {
        **static,
        "activations": acts,
        "vllm": vllm,
        "moved_to_host": moved,
        "engine_weights_host": engine_weights,
        "checkpoint_staging": staging,
    }
    return MemoryPlan(params, train, rollout, host, parts)


def fit_problems(plan: MemoryPlan, device_bytes: float, host_bytes: float | None, cfg: RunConfig) -> list[str]:
    """One line per phase that does not fit, naming the numbers and the settings that would make it fit."""
    out, p = [], plan
    dev = device_bytes / GIB
    if p.train > device_bytes:
        offload = (
            "set train.optimizer_cpu_offload = true (the fp32 master copy and Adam moments, "
            f"{p.gib('optimizer_gpu'):.1f} GiB, go to host memory)"
            if not cfg.train.optimizer_cpu_offload
            else "raise train.optimizer_offload_fraction towards 1.0"
        )
        out.append(
            f"the trainer needs at least {p.train / GIB:.1f} GiB per device to train (weights {p.gib('weights'):.1f}, "
            f"gradients {p.gib('grads'):.1f}, optimizer state {p.gib('optimizer_gpu'):.1f}, activations at full "
            f"recompute {p.gib('activations'):.1f} GiB) but a device has {dev:.1f} GiB: {offload}, raise "
            f"train.tensor_parallel_size or train.num_devices, or lower train.max_tokens_per_device"
        )
    if p.rollout > device_bytes:
        out.append(
            f"while vLLM generates, its share (rollout.gpu_memory_utilization = {cfg.rollout.gpu_memory_utilization}: "
            f"{p.gib('vllm'):.1f} GiB) and what the trainer keeps ({(p.rollout - p.parts['vllm']) / GIB:.1f} GiB) "
            f"exceed the device's {dev:.1f} GiB: lower rollout.gpu_memory_utilization or set "
            f"train.offload_optimizer = true"
        )
    if host_bytes is not None and p.host > host_bytes * RAY_MEMORY_THRESHOLD - HOST_RESERVE_GIB * GIB:
        out.append(
            f"host memory: {p.host / GIB:.1f} GiB of offloaded optimizer state, engine weights and a checkpoint's "
            f"staging copy ({p.gib('checkpoint_staging'):.1f}), with {HOST_RESERVE_GIB:.0f} GiB for the processes, "
            f"exceed {RAY_MEMORY_THRESHOLD:.0%} of this machine's {host_bytes / GIB:.1f} GiB (Ray's memory monitor "
            f"kills a worker above it): lower train.optimizer_offload_fraction (the rest stays on the GPU)"
            + (", or set cluster.engine_sleep_level = 2" if cfg.cluster.engine_sleep_level == 1 else "")
        )
    return out


def check_memory_fit(cfg: RunConfig, arch: Any, platform: str, device_bytes: float | None, host_bytes: float | None):
    """Raise MemoryFitError when the run cannot fit (see fit_problems); `device_bytes` None (no local GPU to ask, or
    CPU) checks the host only. Returns the plan, for the start-up log."""
    plan = memory_plan(cfg, arch, device_bytes or 0.0, platform)
    if platform == "cpu":  # the trainer's state is host memory itself; nothing is offloaded
        return plan
    problems = fit_problems(plan, device_bytes or float("inf"), host_bytes, cfg)
    if problems:
        raise MemoryFitError("; ".join(problems))
    return plan


def check_local_memory(cfg: RunConfig, arch: Any, platform: str) -> MemoryPlan | None:
    """`check_memory_fit` against this machine's first device and host memory (prepare, before any actor). A joined
    Ray cluster (cluster.ray_address / RAY_ADDRESS) places ranks on other nodes: not checked here."""
    if platform == "cpu" or cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS"):
        return None
    import psutil
    import torch

    device = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    return check_memory_fit(cfg, arch, platform, device, psutil.virtual_memory().total)
