"""Python's garbage collector inside a vLLM engine's worker process: how long its collections took, by generation.

vLLM freezes the worker's heap after its warm-up (`gc.freeze`) so that collections skip the static objects; whatever
a long run adds later (weight pushes, sleep and wake-up) is scanned by every full collection. A decode step is a few
milliseconds of CPU work on a small model, so collection pauses show up directly in rollout speed. This clock tells
that cost from the rest: `report()` is read through the worker extension (`vime_gc`) into `VLLMEngine.info()`."""

from __future__ import annotations

import gc
import time


class GcClock:
    """A `gc.callbacks` entry summing the wall time of every collection, per generation (0, 1, 2)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self.started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        generation = info.get("generation", 2)
        self.seconds[generation] += time.perf_counter() - self.started
        self.collections[generation] += 1

    def report(self) -> dict:
        """Totals since the clock started, the objects the collector tracks now, and how many are frozen."""
        return {
            "gc_seconds": [round(s, 4) for s in self.seconds],
            "gc_collections": list(self.collections),
            "gc_tracked_objects": len(gc.get_objects()),
            "gc_frozen_objects": gc.get_freeze_count(),
        }


def worker_gc_clock(holder: object) -> GcClock:
    """The clock of this process (kept on `holder`, the vLLM worker), started at the first call."""
    clock = holder.__dict__.get("_vime_gc_clock")
    if clock is None:
        clock = holder.__dict__["_vime_gc_clock"] = GcClock()
        gc.callbacks.append(clock)
    return clock
