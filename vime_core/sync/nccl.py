"""`nccl` transport (disaggregated GPUs): trainer rank 0 broadcasts each bucket to every engine worker over one NCCL
group (vLLM's stateless group) made on the first push: rank 0 is the trainer, then each engine's workers."""

from __future__ import annotations

import torch

from vime_core.sync.base import BucketExport, BucketExporter, Ops, Transport, bucket_loop, load_into_engine
from vime_core.sync.packing import Layout, unpack


class NcclExporter(BucketExporter):
    """Trainer half (rank 0 broadcasts): `free_address`, `join` the group, then per bucket `next` -> (layout,
    nbytes) and `broadcast`."""

    OPS = ("free_address", "join", "begin", "next", "broadcast", "end")

    def __init__(self, source):
        super().__init__(source)
        self.comm = None  # rank 0's group handle, made on the first push

    def free_address(self) -> tuple[str, int]:
        return free_address()

    def join(self, address: str, port: int, world_size: int) -> None:
        self.comm = join_trainer(address, port, world_size, self.source.device)

    def pack(self, export: BucketExport):
        return send(export)

    def broadcast(self) -> None:
        broadcast(self.comm, self.export)


class NcclReceiver(Ops):
    """Engine half: `join` the trainer's group (once), then `load` each broadcast bucket."""

    OPS = ("join", "load")

    def __init__(self, worker):
        self.worker, self.comm = worker, None

    def join(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
        self.comm = join_engine(self.worker, address, port, rank_offset, world_size)

    def load(self, layout: Layout, nbytes: int) -> int:
        return receive(self.worker, self.comm, layout, nbytes)


class NcclTransport(Transport):
    name = "nccl"
    exporter, receiver = NcclExporter, NcclReceiver

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
                [rank0.weights.remote("broadcast")]
                + [e.weights.remote(self.name, "load", layout, nbytes) for e in engines],
                ["trainer rank 0"] + [f"vLLM engine {i}" for i in range(len(engines))],
                "the NCCL weight broadcast",
            )

        bucket_loop(self.peers, self.bucket_bytes, deliver)

    def _rendezvous(self, rank0, engines: list) -> None:
        address, port = self.peers.get([rank0.weights.remote("free_address")], ["trainer rank 0"], "free_address")[0]
        tp = self.peers.trainer.cfg.rollout.engine_tensor_parallel_size
        world = 1 + tp * len(engines)
        self.peers.get(
            [rank0.weights.remote("join", address, port, world)]
            + [e.weights.remote(self.name, "join", address, port, 1 + i * tp, world) for i, e in enumerate(engines)],
            ["trainer rank 0"] + [f"vLLM engine {i}" for i in range(len(engines))],
            "joining the NCCL weight group (rendezvous)",
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
