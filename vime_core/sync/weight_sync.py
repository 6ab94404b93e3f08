"""`WeightSync`: the loop's one call to push the trainer's weights into the engines. It owns what is the same for
every transport (engine sleep/wake around the push) and picks the transport by name from `TRANSPORTS`. The engines
drop their prefix caches themselves (`VLLMEngine.weights` marks the cache stale)."""

from __future__ import annotations

import time

from vime_core.sync.base import Peers, Transport
from vime_core.sync.cpu import CpuTransport
from vime_core.sync.cuda_ipc import CudaIpcTransport
from vime_core.sync.nccl import NcclTransport

TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (CpuTransport, CudaIpcTransport, NcclTransport)}


def transport_class(strategy: str) -> type[Transport]:
    """The transport registered as `strategy` (sync.strategy, resolved: see resolve_strategy)."""
    if strategy not in TRANSPORTS:
        raise ValueError(f"unknown sync strategy {strategy!r}")
    return TRANSPORTS[strategy]


def resolve_strategy(requested: str, platform: str, colocate: bool) -> str:
    if requested != "auto":
        return requested
    if platform == "cpu":
        return "cpu"
    return "cuda_ipc" if colocate else "nccl"


class WeightSync:
    """Push the trainer's current weights to every engine. With `engines_sleep` (colocated GPUs) the engines release
    their memory while the trainer works (`release_engines`) and take it back around the push: weights first, then
    the KV cache once the new weights are in."""

    def __init__(
        self,
        trainer_group,
        router,
        strategy: str,
        bucket_size_mb: int = 512,
        engines_sleep: bool = False,
        timeout_s: float | None = None,
        sleep_level: int = 1,
    ):
        self.trainer, self.router, self.strategy = trainer_group, router, strategy
        self.timeout_s = timeout_s  # sync.timeout_s, for each actor call of a push
        self.bucket_bytes = bucket_size_mb * 2**20
        self.engines_sleep = engines_sleep
        self.sleep_level = sleep_level  # cluster.engine_sleep_level: 2 drops the weights, which push() re-sends
        self._asleep = False
        self.peers = Peers(trainer_group, router, timeout_s)
        self.transport = transport_class(strategy)(self.peers, self.bucket_bytes)

    @property
    def asleep(self) -> bool:
        """The engines sleep (release_engines) until the next push wakes them."""
        return self._asleep

    def release_engines(self) -> None:
        if self.engines_sleep:
            self.peers.engines("sleep", self.sleep_level)
            self._asleep = True

    def push(self) -> float:
        """Returns seconds spent (perf/update_weights_time)."""
        t0 = time.perf_counter()
        if self._asleep:
            self.peers.engines("wake_up", ["weights"])
        self.transport.push()
        if self._asleep:
            self.peers.engines("wake_up", ["kv_cache"])
            self._asleep = False
        return time.perf_counter() - t0
