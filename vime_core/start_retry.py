"""A start again on a fresh Ray when an actor's process dies while starting (rpc.ActorLostError: killed by the kernel's
OOM killer or a signal, or crashed; not an exception of its own code, not a timeout), up to cluster.start_attempts
starts in all. Such a death is mostly the machine's moment (memory another job held, a crash in a native library's
start-up), not the run's: a start again costs seconds on CPU, where a retry of the Prefect task would redo every
check before it and `vime train` has no retry at all. The train loop (trainer and engines) and a checkpoint's
evaluation (engines only) start through here."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from vime_core.config import RunConfig
from vime_core.rpc import ActorLostError

log = logging.getLogger(__name__)
T = TypeVar("T")


def start_with_retry(
    cfg: RunConfig, platform: str, start: Callable[[], T], undo: Callable[[], None] = lambda: None
) -> T:
    """`start()` (Ray already up); after an ActorLostError, `undo()` (what the failed start left that Ray's shutdown
    does not stop cleanly: the trainer ranks' process group; nothing for engines alone), then Ray again and `start()`
    again."""
    from vime_core.cluster import init_ray, shutdown_ray

    attempts = cfg.cluster.start_attempts
    for attempt in range(1, attempts):
        try:
            return start()
        except ActorLostError as e:
            log.warning(
                "%s\nstarting again on a fresh Ray (start %d of %d, cluster.start_attempts)", e, attempt + 1, attempts
            )
            undo()
            shutdown_ray()
            init_ray(cfg, platform)
    return start()  # the last one: an ActorLostError of it is the caller's
