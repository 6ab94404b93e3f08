"""`VLLMWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`, see rollout.engine_kwargs), so its
methods run next to the model, called through `collective_rpc`. `vime_weights` (from `VLLMEngine.weights`) is the
worker's one door for weights: it runs an op of the named transport's receiver (vime_core/sync/<transport>.py), one
receiver per transport and worker (the NCCL one keeps its group between pushes). `vime_gc` reads the worker
process's garbage-collector clock (vime_core/engine_gc.py), started by its first call; `vime_stacks` starts and
stops its stack sampler (vime_core/stack_sampler.py)."""

from __future__ import annotations

from vime_core.engine_gc import worker_gc_clock
from vime_core.stack_sampler import worker_stacks
from vime_core.sync.weight_sync import transport_class


class VLLMWorkerExtension:
    """Methods added to vLLM's worker. `self` is the worker (has `model_runner`, `device`, `reload_weights`)."""

    def vime_weights(self, transport: str, op: str, *args):
        receivers = self.__dict__.setdefault("_vime_receivers", {})
        if transport not in receivers:
            receivers[transport] = transport_class(transport).receiver(self)
        return receivers[transport].call(op, *args)

    def vime_gc(self) -> dict:
        return worker_gc_clock(self).report()

    def vime_stacks(self, op: str, interval_ms: float = 10.0) -> dict | None:
        return worker_stacks(self, op, interval_ms)
