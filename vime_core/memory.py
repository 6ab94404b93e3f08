"""Trainer GPU memory: optimizer offload while vLLM generates (colocated GPUs), peak memory per phase, and a clear error
when a micro-batch budget does not fit.

Colocated, the trainer and vLLM share each GPU; vLLM sleeps while the trainer works, and the trainer's optimizer side
(Adam moments, fp32 main params, gradient buffers: 16 of the 18 bytes per parameter of a bf16 model with megatron's
optimizer) is idle while vLLM generates. `HostOffload` moves it to pinned host memory after the optimizer step and back
before the next training step. Measured on an H200, Qwen3-1.7B shape, megatron optimizer: allocated 28.9 GiB -> 4.6 GiB
(19.2 GiB copied to host, the 6.4 GiB fp32 gradient buffer freed), offload 0.44 s, onload 0.45 s, state bit-identical. Tensors keep their identity (`.data` is swapped), so the
optimizers and megatron's DDP see the same objects; megatron's contiguous gradient buffers are freed by resizing their
storage to 0 (their `main_grad` views stay valid) and zeroed on the way back (the next step zeroes them anyway).
"""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager

import torch

from vime_core.errors import VimeError
from vime_core.pinned import PinnedArena, buffer_bytes
from vime_core.platform import host_room_bytes


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`. On CUDA through pinned memory without blocking: a pageable copy waits for
    every kernel queued before it, so each of the ~8 per micro-batch stalled the GPU while the CPU queued the next
    one (an H200, Qwen3-1.7B: 20.1k tok/s at one 4,136-token sample per micro-batch vs 27.8k at two)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


class MemoryBudgetError(VimeError, RuntimeError):
    """A training micro-batch did not fit in device memory; the message names train.max_tokens_per_device."""


RECOMPUTE = ("none", "selective", "full")  # train.recompute, `auto` resolved


def resolve_recompute(setting: str, platform: str) -> str:
    """train.recompute `auto`: selective on GPUs (an H200, Qwen3-1.7B, micro-batches of 2 x 4,136 tokens: 39.6 GiB
    and 31.1k tok/s against none's 63.5 GiB and 34.6k), none on CPU (the small models there need no saving)."""
    if setting != "auto":
        return setting
    return "none" if platform == "cpu" else "selective"


HEAVIER_RECOMPUTE = {"none": "set train.recompute = selective / full", "selective": "set train.recompute = full"}


def budget_error(budget: int, longest: int, device: torch.device, where: str, recompute: str) -> MemoryBudgetError:
    """The out-of-memory error of a micro-batch budget, with the fixes left at `recompute` (the resolved setting)."""
    gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    suggest = max(longest, budget // 2)
    more = HEAVIER_RECOMPUTE.get(recompute)
    if suggest < budget:
        fix = f"lower it to {suggest} (the longest sample has {longest} tokens)" + (f" or {more}" if more else "")
    else:
        full = "set train.recompute = full, or " if recompute != "full" else ""
        fix = f"the longest sample alone does not fit: {full}use tensor parallelism"
    return MemoryBudgetError(
        f"train.max_tokens_per_device = {budget} does not fit on {device} (out of memory in the "
        f"{where}, peak {gib:.1f} GiB allocated): {fix}"
    )


def offload_enabled(setting, engines_sleep: bool, platform: str) -> bool:
    """train.offload_optimizer: `auto` where colocated engines sleep while the trainer works (cluster.colocate and
    cluster.engines_sleep: the memory freed goes to vLLM's KV cache), `true` on any GPU placement, never on CPU."""
    if platform == "cpu" or setting is False:
        return False
    return engines_sleep if setting == "auto" else True


def train_step_memory(train):
    """Wraps `StepRunner.train`: the step's peak GPU memory (phase `train`) and onload time join its metrics on CUDA,
    and an out-of-memory error becomes a MemoryBudgetError naming train.max_tokens_per_device."""

    @functools.wraps(train)
    def wrapper(self, rollout_id: int, steps: list) -> dict:
        try:
            with self.st.peaks.phase("train"):
                metrics = train(self, rollout_id, steps)
        except torch.OutOfMemoryError as e:
            longest = max((len(s.tokens) for step in steps for s in step), default=0)
            recompute = resolve_recompute(self.st.cfg.train.recompute, self.st.platform)
            budget = self.st.cfg.train.max_tokens_per_device
            raise budget_error(budget, longest, self.st.device, "training step", recompute) from e
        if self.st.device.type == "cuda":
            metrics["perf/trainer_peak_gib"] = self.st.peaks.last.get("train", 0.0)
            metrics["perf/trainer_logprobs_peak_gib"] = self.st.peaks.last.get("logprobs", 0.0)
            metrics["perf/optimizer_onload_time"] = (
                self.st.onload_time
            )  # before this step; the offload after it: loop.py
        return metrics

    return wrapper


class PhasePeaks:
    """Peak allocated GPU memory per phase (torch.cuda.max_memory_allocated, reset when a phase starts)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last: dict[str, float] = {}  # the latest run of each phase
        self.max: dict[str, float] = {}  # over the whole run

    @contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            if cuda:
                self.record(name, torch.cuda.max_memory_allocated(self.device) / 2**30)

    def record(self, name: str, gib: float) -> None:
        self.last[name] = gib
        self.max[name] = max(gib, self.max.get(name, 0.0))


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained / mixed-precision / distributed) optimizer, or `optimizer`.
    Leaves out megatron's host-side optimizer (train.optimizer_cpu_offload): its groups hold views of the model's own
    weights, its host part is on the host already, and its GPU part stays there on purpose (host memory, not the
    GPU, is what binds such a run: moving it would add 12 bytes per GPU-side parameter to the host peak)."""
    out = []
    for o in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(o, "optimizer", None)
        inner = inner if isinstance(inner, torch.optim.Optimizer) else o
        if type(inner).__name__ != "HybridDeviceOptimizer":
            out.append(inner)
    return out


def _grad_buffers(model) -> list[torch.Tensor]:
    """megatron DDP's contiguous gradient buffers (none for a plain module), except ones sharing storage with params."""
    out = []
    # megatron's DDP keeps lists `buffers` / `expert_parallel_buffers` (on a plain module `buffers` is nn.Module's method)
    lists = [getattr(model, name, None) for name in ("buffers", "expert_parallel_buffers")]
    for buf in [b for bufs in lists if isinstance(bufs, list) for b in bufs]:
        grad = getattr(buf, "grad_data", None)
        param = getattr(buf, "param_data", None)
        if grad is None or (
            param is not None and param.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
        ):
            continue
        out.append(grad)
    return out


class HostOffload:
    """Moves one rank's optimizer state, fp32 main params and gradients to pinned host memory and back."""

    def __init__(self, optimizer, model, module: torch.nn.Module, device: torch.device):
        self.optimizer, self.model, self.module, self.device = optimizer, model, module, device
        self._pinned: dict[int, torch.Tensor] = {}  # host buffers, kept across steps (pinning is slow)
        pin = device.type == "cuda"
        self.arena = PinnedArena(  # packed: torch rounds each pinned allocation to 2^k
            pin,
            room=host_room_bytes if pin else None,
            what="the optimizer offload (train.offload_optimizer)",
            fix="run a smaller model or fewer layers per device, or set train.offload_optimizer = false if the "
            "state fits on the GPU (the fit check says)",
        )
        self._prepin: threading.Thread | None = None
        self._prepin_error: BaseException | None = None
        self.reserved_bytes = 0  # what the pre-pinning reserved: the first offload's buffers are cut from it
        self._moved: list[torch.Tensor] = []
        self._freed: list[tuple[torch.Tensor, int]] = []
        self.offloaded = False

    def expected_host_buffers(self) -> list[tuple[torch.Size, torch.dtype]]:
        """The (shape, dtype) of what the first offload will move, known before the first step: each device-side
        parameter of the optimizer that is not a model weight (megatron's fp32 main params), two Adam moments of
        its shape and dtype per parameter, and its `step` where that lives beside it (a fused or capturable group,
        or a CPU run); the optimizers create the state lazily, in the first step."""
        own = {id(p) for p in self.module.parameters()}
        out = []
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                step_here = self.device.type == "cpu" or bool(group.get("fused") or group.get("capturable"))
                for p in group["params"]:
                    if p.device == self.device:
                        out += [(p.shape, p.dtype)] * (2 if id(p) in own else 3)
                        out += [(torch.Size(()), torch.float32)] * step_here
        return out

    def start_prepinning(self) -> None:
        """Pin the host memory of the first offload in a background thread. Pinning page-locks every page (the first
        offload of a 4B model took 26 s of a 38 s train step, later ones 1 s); started when the trainer is ready, it
        runs while vLLM generates the first rollout, when this rank is idle. It reserves slabs only (see
        PinnedArena.reserve); an error (HostMemoryError) is raised by the offload that waits for it."""
        sizes = [buffer_bytes(shape, dtype) for shape, dtype in self.expected_host_buffers()]

        def work():
            try:
                self.arena.reserve(sizes)
                self.reserved_bytes = self.arena.nbytes()
            except BaseException as e:  # noqa: BLE001 - handed to the offload, which raises it in the rank
                self._prepin_error = e

        self._prepin = threading.Thread(target=work, name="vime-prepin", daemon=True)
        self._prepin.start()

    def _host_buffers(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's host buffer: the one it had, else one cut from the arena (all new ones in one placement,
        largest first, into the reserved slabs)."""
        new = [t for t in tensors if not self._has_buffer(t)]
        for t, host in zip(new, self.arena.take([(t.shape, t.dtype) for t in new])):
            self._pinned[id(t)] = host
        return [self._pinned[id(t)] for t in tensors]

    def _has_buffer(self, t: torch.Tensor) -> bool:
        host = self._pinned.get(id(t))
        return host is not None and host.shape == t.shape and host.dtype == t.dtype

    def unforeseen_bytes(self) -> int:
        """Host memory pinned beyond what the pre-pinning reserved (0 when its forecast held)."""
        return max(0, self.arena.nbytes() - self.reserved_bytes) if self.reserved_bytes else 0

    def _tensors(self) -> list[torch.Tensor]:
        """Optimizer-side tensors on the device: state (Adam moments) and main params that are not model weights."""
        own = {id(p) for p in self.module.parameters()}
        seen, out = set(), []
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in own and p.device == self.device and id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
            for st in opt.state.values():
                for t in st.values():
                    if isinstance(t, torch.Tensor) and t.device == self.device and id(t) not in seen:
                        seen.add(id(t))
                        out.append(t)
        return out

    def offload(self) -> float:
        """Device -> pinned host; frees gradients. Returns seconds."""
        if self.offloaded:
            return 0.0
        cuda = self.device.type == "cuda"  # elsewhere (tests on CPU) the "host" copies are plain CPU tensors
        t0 = time.perf_counter()
        for p in self.module.parameters():
            p.grad = None  # torch AdamW's grads; the next step starts with zero_grad(set_to_none) anyway
        tensors = self._tensors()
        for t in tensors:
            if isinstance(t, torch.nn.Parameter):
                t.grad = None  # megatron's fp32 main grads: views of its buffer, set again by the next step
        if self._prepin is not None:  # done long before on a GPU (a rollout's time)
            self._prepin.join()
            self._prepin = None
            if self._prepin_error is not None:
                raise self._prepin_error
        hosts = self._host_buffers(tensors)
        for t, host in zip(tensors, hosts):
            host.copy_(t, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(self.device)
        for t, host in zip(tensors, hosts):
            t.data = host
        self._moved = tensors
        self._freed = []
        for grad in _grad_buffers(self.model):
            storage = grad.untyped_storage()
            self._freed.append((grad, storage.nbytes()))
            storage.resize_(0)
        self.offloaded = True
        if cuda:
            torch.cuda.empty_cache()  # hand the memory to vLLM: the caching allocator would keep it otherwise
        return time.perf_counter() - t0

    def onload(self) -> float:
        """Pinned host -> device. Returns seconds."""
        if not self.offloaded:
            return 0.0
        t0 = time.perf_counter()
        for grad, nbytes in self._freed:
            grad.untyped_storage().resize_(nbytes)
            grad.zero_()
        for t in self._moved:
            t.data = t.data.to(self.device, non_blocking=True, copy=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._moved, self._freed = [], []
        self.offloaded = False
        return time.perf_counter() - t0

    def host_bytes(self) -> int:
        """Host memory held for the offload, pinned on a GPU: the arena's slabs (a pre-pinned buffer that no tensor
        took stays in its slab)."""
        return self.arena.nbytes()
