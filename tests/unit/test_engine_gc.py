"""vime_core/engine_gc.py: the garbage-collector clock that vLLM's worker process reports through `vime_gc`."""

import gc

from tests.helpers.bench import load_bench
from vime_core.engine_gc import GcClock, worker_gc_clock


def test_the_clock_sums_every_collection_by_generation():
    clock = GcClock()
    gc.callbacks.append(clock)
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.callbacks.remove(clock)
    report = clock.report()
    assert report["gc_collections"][0] >= 1 and report["gc_collections"][2] >= 2
    assert report["gc_seconds"][2] > 0.0
    assert report["gc_tracked_objects"] > 0 and report["gc_frozen_objects"] >= 0


def test_one_clock_per_worker_however_often_it_is_read():
    class Worker:
        pass

    worker, before = Worker(), len(gc.callbacks)
    try:
        first = worker_gc_clock(worker)
        assert worker_gc_clock(worker) is first
        assert len(gc.callbacks) == before + 1
    finally:
        gc.callbacks.remove(first)


def test_the_bench_reports_each_engines_gc_seconds():
    rp = load_bench("gpu_scale_report")
    gc_a = {"gc_seconds": [0.5, 0.25, 1.0]}
    gc_b = {"gc_seconds": [0.1, 0.0, 0.0]}
    ph = {
        "loop": {"engine_info": [{"engine_gc": gc_a}, {"engine_gc": gc_b}]},
        "vllm": {"steps": [{"engine_gc": gc_b}, {"engine_gc": gc_a}]},  # totals so far: the last step's counts
    }
    assert rp.engine_gc_seconds(ph) == {"loop_engine": 1.75, "raw_vllm": 1.75, "raw_vllm_sleep_mode": None}
    assert rp.engine_gc_seconds({"loop": {"engine_info": [{}]}})["loop_engine"] is None
