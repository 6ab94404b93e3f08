"""`nccl` transport (disaggregated GPUs): trainer rank 0 broadcasts each bucket to every engine worker over one NCCL
group (vLLM's stateless group) made on the first push: rank 0 is the trainer, then each engine's workers."""

from __future__ import annotations

import torch

from vime_core.sync.base import BucketExport, Transport, bucket_loop, load_into_engine
from vime_core.sync.packing import Layout, unpack


class NcclTransport(Transport):
    name = "nccl"

    def __init__(self, peers, bucket_bytes: int):
        super().__init__(peers, bucket_bytes)
        self.ready = False  # the group exists (made once, on the first push)

    def push(self) -> None:
        rank0, engines = self.peers.trainer.actors[0], self.peers.router.engines
        if not self.ready:
            self._rendezvous(rank0, engines)
            self.ready = True

        def deliver(parts: list) -> None:
            layout, nbytes = parts[0]
            self.peers.get(
                [rank0.broadcast_bucket.remote()] + [e.load_weights_nccl.remote(layout, nbytes) for e in engines],
                ["trainer rank 0"] + [f"vLLM engine {i}" for i in range(len(engines))],
                "the NCCL weight broadcast",
            )

        bucket_loop(self.peers, self.bucket_bytes, "next_nccl_bucket", deliver)

    def _rendezvous(self, rank0, engines: list) -> None:
        address, port = self.peers.get([rank0.free_address.remote()], ["trainer rank 0"], "free_address")[0]
        tp = self.peers.trainer.cfg.rollout.engine_tensor_parallel_size
        world = 1 + tp * len(engines)
        self.peers.get(
            [rank0.init_weight_group.remote(address, port, world)]
            + [e.init_weight_group.remote(address, port, 1 + i * tp, world) for i, e in enumerate(engines)],
            ["trainer rank 0"] + [f"vLLM engine {i}" for i in range(len(engines))],
            "init_weight_group (NCCL rendezvous)",
        )


def _communicator(address: str, port: int, rank: int, world_size: int, device: torch.device):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=address, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


# -- trainer half (rank 0) --------------------------------------------------------------------------------------------
def free_address() -> tuple[str, int]:
    """This node's IP and a free port on it: where the group meets."""
    import ray

    from vime_core.ports import free_port

    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)


def join_trainer(address: str, port: int, world_size: int, device: torch.device):
    """Rank 0 joins the NCCL group it shares with every engine worker, as rank 0 of it."""
    return _communicator(address, port, 0, world_size, device)


def send(export: BucketExport) -> tuple[Layout, int] | None:
    """Pack the next bucket; -> (layout, nbytes) or None. Rank 0 then broadcasts it (`broadcast`)."""
    layout = export.next()
    return None if layout is None else (layout, export.bucket.numel())


def broadcast(comm, export: BucketExport) -> None:
    comm.broadcast(export.bucket, src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize(export.device)


# -- engine half ------------------------------------------------------------------------------------------------------
def join_engine(worker, address: str, port: int, rank_offset: int, world_size: int):
    """An engine worker joins the group as rank `rank_offset` + its rank within the engine."""
    rank = rank_offset + int(getattr(worker, "rank", 0))
    return _communicator(address, port, rank, world_size, worker.device)


def receive(worker, comm, layout: Layout, nbytes: int) -> int:
    bucket = torch.empty(nbytes, dtype=torch.uint8, device=worker.device)
    comm.broadcast(bucket, src=0, stream=torch.cuda.current_stream())
    torch.cuda.synchronize(worker.device)
    return load_into_engine(worker, unpack(bucket, layout))
