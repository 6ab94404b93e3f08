"""vime_core/stack_sampler.py: the in-process stack sampler a vLLM worker runs through `vime_stacks`."""

import threading
import time

import pytest

from tests.helpers.bench import load_bench
from vime_core.stack_sampler import StackSampler, shares, worker_stacks


def spin_in_a_named_function(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def test_a_busy_function_dominates_its_threads_samples():
    sampler = StackSampler(0.002).start()
    spin_in_a_named_function(0.4)
    report = sampler.stop()
    main = report["threads"][threading.main_thread().name]
    assert main["samples"] >= 20
    inclusive = dict(main["inclusive"])
    assert inclusive["test_stack_sampler.py:spin_in_a_named_function"] > 0.8
    assert "vime-stack-sampler" not in report["threads"]  # the sampler does not sample itself
    assert not sampler.thread.is_alive()
    usage = report["usage"]  # the spin is CPU work: user seconds near its wall seconds
    assert usage["wall_s"] >= 0.4 and usage["user_s"] + usage["sys_s"] > 0.2
    assert report["cpus_allowed"] >= 1


def test_a_recursive_function_counts_once_per_sample():
    sampler = StackSampler(1.0)

    def down(k, frame_holder):
        if k == 0:
            import sys

            frame_holder.append(sys._getframe())
            return
        down(k - 1, frame_holder)

    held: list = []
    down(5, held)
    sampler.record("t", held[0])
    counts = dict(sampler.report()["threads"]["t"]["inclusive"])
    assert counts["test_stack_sampler.py:down"] == 1.0


def test_shares_are_fractions_of_the_thread_total_largest_first():
    from collections import Counter

    assert shares(Counter({"a": 1, "b": 3}), 4) == [["b", 0.75], ["a", 0.25]]


def test_a_worker_starts_and_stops_one_sampler():
    class Worker:
        pass

    worker = Worker()
    assert worker_stacks(worker, "stop") is None  # nothing ran yet
    assert worker_stacks(worker, "start", 1.0) is None
    first = worker.__dict__["_vime_stack_sampler"]
    worker_stacks(worker, "start", 1.0)  # a second start replaces (and stops) the first
    assert not first.thread.is_alive()
    spin_in_a_named_function(0.05)
    report = worker_stacks(worker, "stop")
    assert report["interval_s"] == 0.001 and report["threads"]
    with pytest.raises(ValueError, match="'start' or 'stop'"):
        worker_stacks(worker, "pause")


def test_each_report_carries_the_hosts_speed_at_the_start_and_the_end():
    sampler = StackSampler(0.01).start()
    spin_in_a_named_function(0.05)
    probe = sampler.stop()["probe"]
    for when in ("start", "end"):
        assert probe[when]["python_ms"] > 0.0
        assert "launch_us" not in probe[when]  # no CUDA device driven by this process: no kernels timed
    import os

    assert probe["end"]["cpu"] in os.sched_getaffinity(0)


def test_the_bench_lists_each_calls_probe_per_phase():
    rp = load_bench("gpu_scale_report")
    report = lambda ms: {"probe": {"start": {"python_ms": 1.0}, "end": {"python_ms": ms, "launch_us": 4.0}}}  # noqa: E731
    ph = {
        "loop": {"engine_info": [{"engine_stacks": [report(5.0), report(7.5)]}]},
        "vllm": {"steps": [{"engine_stacks": report(5.0)}, {}]},  # a step without stacks sampled: None
    }
    assert rp.engine_probes(ph) == {"loop": [[5.0, 4.0], [7.5, 4.0]], "vllm": [[5.0, 4.0], None], "vllm_sleep": None}
    assert rp.engine_probes({}) == {"loop": None, "vllm": None, "vllm_sleep": None}
