"""`VLLMWorkerExtension` is mixed into vLLM's worker (`worker_extension_cls`, see rollout.engine_kwargs), so its
methods run next to the model, called through `collective_rpc` by `VLLMEngine`. Each delegates to the receive half
of its transport."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from vime_core.sync import cpu, cuda_ipc, nccl
from vime_core.sync.base import repack_cpu_moe
from vime_core.sync.packing import Layout


class VLLMWorkerExtension:
    """Methods added to vLLM's worker. `self` is the worker (has `model_runner`, `device`, `reload_weights`)."""

    def vime_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        return cpu.receive(self, named_tensors)

    def vime_repack_cpu_moe(self) -> int:
        return repack_cpu_moe(self)

    def vime_device_uuid(self) -> str:
        return cuda_ipc.device_uuid(self)

    def vime_load_from_ipc(self, handles_by_uuid: dict[str, Any], layout: Layout) -> int:
        return cuda_ipc.receive(self, handles_by_uuid, layout)

    def vime_init_nccl(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        self._vime_nccl = nccl.join_engine(self, master_address, master_port, rank_offset, world_size)

    def vime_load_from_nccl(self, layout: Layout, nbytes: int) -> int:
        return nccl.receive(self, self._vime_nccl, layout, nbytes)
