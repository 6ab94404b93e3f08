"""Progress heartbeats: how the driver tells a hung actor from a slow one long before the call's own timeout.

A vLLM engine beats once per engine step (every few milliseconds while it produces tokens), a trainer rank once per
micro-batch and optimizer step. A beat is a fire-and-forget call to one small named actor, the board, at most one
per `BEAT_EVERY_S` per actor; `vime_core.rpc.gather` asks the board, while it waits for a call, how long each busy
actor has gone without one. A hung engine or rank stops beating at once, however long its call may legitimately
take in total (an 8B 4,096-token step: 60-120 s of training, 60-90 s of rollout on an H200), so the window is about
progress, not call time: a single beat-less gap of `rollout.stall_timeout_s` / `train.stall_timeout_s` is a hang.

The board runs with the actor's own clock only: ages are measured where the beats arrive, so clocks of other nodes
never enter. Without Ray, or before the driver made the board, a beat does nothing.
"""

from __future__ import annotations

import time
from typing import Any

BOARD_NAME = "vime-progress"
BEAT_EVERY_S = 1.0  # one actor call a second per actor at most: ~0.1 ms each, against windows of minutes


class ProgressBoard:
    """The Ray actor that holds every actor's last beat (created by `board`, one per Ray job)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, str]] = {}

    def beat(self, who: str, what: str) -> None:
        self.last[who] = (time.monotonic(), what)

    def ages(self, names: list[str]) -> dict[str, tuple[float, str] | None]:
        """Seconds since each actor's last beat and what it last did; None for one that never beat."""
        now = time.monotonic()
        return {n: (now - self.last[n][0], self.last[n][1]) if n in self.last else None for n in names}


# the driver's handle of the board, per Ray cluster and job: (node id, job id) -> handle
_held: dict[tuple[str, str], Any] = {}


def board() -> Any:
    """The job's board (created on first use; the actors find it by name). The driver holds its handle for the
    whole job: Ray destroys an actor that is not detached once its last handle goes, named or not, so a handle
    dropped after each call made a new board process per call (twice a step: 85 of them in one 10-step run of the
    CPU default, each a Python start of ~1 s of CPU on 2 cores), and the actors' beats went to the dead ones."""
    import ray

    ctx = ray.get_runtime_context()
    key = (ctx.get_node_id(), ctx.get_job_id())  # a new `ray.init` (a retried task, a test) gets its own board
    if key not in _held:
        _held.clear()  # a board of an earlier cluster or job is gone with it
        _held[key] = ray.remote(ProgressBoard).options(name=BOARD_NAME, get_if_exists=True, num_cpus=0).remote()
    return _held[key]


class Heartbeat:
    """An actor's side: `beat(what)` wherever it makes progress; costs nothing between two sends."""

    def __init__(self, who: str):
        self.who = who
        self._board: Any = None
        self._next_beat = 0.0

    def beat(self, what: str) -> None:
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + BEAT_EVERY_S
        target = self._find()
        if target is not None:
            target.beat.remote(self.who, what)

    def _find(self) -> Any:
        if self._board is None:  # looked up at most once per BEAT_EVERY_S: a GCS call of ~1 ms
            try:
                import ray

                if ray.is_initialized():
                    self._board = ray.get_actor(BOARD_NAME)
            except (ImportError, ValueError):  # no Ray here, or the driver has not made the board yet
                pass
        return self._board
