"""`VLLMWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`, see rollout.engine_kwargs), so its
method runs next to the model, called through `collective_rpc` by `VLLMEngine.weights`. It is the worker's one door
for weights: it runs an op of the named transport's receiver (vime_core/sync/<transport>.py), one receiver per
transport and worker (the NCCL one keeps its group between pushes)."""

from __future__ import annotations

from vime_core.sync.weight_sync import transport_class


class VLLMWorkerExtension:
    """Methods added to vLLM's worker. `self` is the worker (has `model_runner`, `device`, `reload_weights`)."""

    def vime_weights(self, transport: str, op: str, *args):
        receivers = self.__dict__.setdefault("_vime_receivers", {})
        if transport not in receivers:
            receivers[transport] = transport_class(transport).receiver(self)
        return receivers[transport].call(op, *args)
