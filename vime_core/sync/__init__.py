"""Weight sync: trainer -> vLLM engines. One interface (`WeightSync.push`), one transport per mode, each in its own
module holding the driver's push, the trainer rank's send half and the engine worker's receive half:

- `cpu`: full HF-named weights from trainer rank 0 through Ray's object store; each engine reloads them in place.
- `cuda_ipc` (colocated): buckets packed on every trainer GPU, CUDA IPC handles keyed by device UUID.
- `nccl` (disaggregated): buckets broadcast by trainer rank 0 over a NCCL group spanning trainer and engines.

Every transport goes through the engine's one weights door, `VLLMEngine.weights`, which marks the prefix cache stale:
the engine drops it before its next generate (cached KV of the old weights would otherwise be reused: log-prob diffs
of 0.6-0.9 instead of 4e-7).

`base` holds the transport protocol and what the transports share (the bucket loop, the trainer's bucket export, the
engine-side load), `packing` the pure bucket packing, `worker` the vLLM worker extension, `weight_sync` the
`WeightSync` facade and the transport registry.
"""

from vime_core.sync.base import BucketExport, Peers, Transport, bucket_loop
from vime_core.sync.packing import buckets, pack_bucket, unpack, view
from vime_core.sync.weight_sync import TRANSPORTS, WeightSync, resolve_strategy, transport_class
from vime_core.sync.worker import VLLMWorkerExtension

__all__ = [
    "TRANSPORTS",
    "BucketExport",
    "Peers",
    "Transport",
    "VLLMWorkerExtension",
    "WeightSync",
    "bucket_loop",
    "buckets",
    "pack_bucket",
    "resolve_strategy",
    "transport_class",
    "unpack",
    "view",
]
