"""`cuda_ipc` transport (colocated GPUs): every trainer rank packs HF-named weights into buckets on its GPU (the full
tensors: vLLM shards them itself) and hands out a CUDA IPC handle keyed by its device UUID; each engine worker opens
the handle of *its own* device, so no byte leaves the GPU."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from vime_core.sync.base import BucketExport, BucketExporter, Ops, Transport, bucket_loop, load_into_engine
from vime_core.sync.packing import Layout, unpack


class CudaIpcExporter(BucketExporter):
    """Trainer half: every rank packs its buckets on its own GPU; `next` -> (device UUID, IPC handle, layout)."""

    def pack(self, export: BucketExport):
        return send(export, self.source.platform)


class CudaIpcReceiver(Ops):
    """Engine half: `load` the bucket whose handle names this worker's device."""

    OPS = ("load",)

    def __init__(self, worker):
        self.worker = worker

    def load(self, handles_by_uuid: dict[str, Any], layout: Layout) -> int:
        return receive(self.worker, handles_by_uuid, layout)


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    exporter, receiver = CudaIpcExporter, CudaIpcReceiver

    def push(self) -> None:
        def deliver(parts: list) -> None:
            handles = {uuid: handle for uuid, handle, _ in parts}
            engines = self.peers.router.engines
            self.peers.get(
                [e.weights.remote(self.name, "load", handles, parts[0][2]) for e in engines],
                [f"vLLM engine {i}" for i in range(len(engines))],
                "loading a CUDA IPC bucket (weight sync)",
            )

        bucket_loop(self.peers, self.bucket_bytes, deliver)


def send(export: BucketExport, platform: str) -> tuple[str, bytes, Layout] | None:
    """Trainer half: pack the next bucket on this rank's GPU; -> (device UUID, CUDA IPC handle, layout) or None."""
    from torch.multiprocessing.reductions import reduce_tensor

    from vime_core.platform import current_device_uuid

    layout = export.next()
    if layout is None:
        return None
    torch.cuda.synchronize(export.device)
    # vLLM's msgpack channel to its engine core refuses the rebuild function inside a handle: send it pickled
    return current_device_uuid(platform), pickle.dumps(reduce_tensor(export.bucket)), layout


def device_uuid(worker) -> str:
    if worker.device.type == "cpu":
        return "cpu"
    return str(torch.cuda.get_device_properties(worker.device).uuid)


def receive(worker, handles_by_uuid: dict[str, Any], layout: Layout) -> int:
    """Engine half: open the packed bucket that lives on this worker's device and load the tensors it holds."""
    uuid = device_uuid(worker)
    if uuid not in handles_by_uuid:
        raise RuntimeError(f"no IPC handle for this worker's device {uuid}; have {sorted(handles_by_uuid)}")
    func, args = pickle.loads(handles_by_uuid[uuid])  # our own trainer's handle (see `send`)
    args = list(args)
    args[6] = worker.device.index  # the handle names the sender's device index; open it on ours
    bucket = func(*args)
    tensors = unpack(bucket, layout)
    n = load_into_engine(worker, tensors)
    torch.cuda.synchronize(worker.device)
    del tensors, bucket  # the sender frees its buffer once every engine returned
    return n
