"""Where a CPU-bound engine process spends its time: a sampling profiler of its Python stacks, by thread.

A small model decodes in a few milliseconds of GPU work a step, so vLLM's engine core is bound by its own Python
(scheduling, input preparation, sampling, output encoding): a new cost shows as a new function in the stacks, and
the same functions taking longer, with the process's CPU seconds equal to its wall seconds, point below Python (kernel
launches, a spinning wait for the GPU).
Tools like py-spy need ptrace rights the machines may not grant; this runs inside the process instead, started and
stopped through the worker extension (`vime_stacks`, vime_core/sync/worker.py) around one generate call when
`rollout.engine_stack_sample_ms` is set. A sample costs the engine the GIL for the walk of every thread's frames
(tens of microseconds), so the default interval keeps the overhead near 1%.

Beside the stacks, `host_probe` times a fixed piece of Python and a burst of tiny kernel launches at the call's start
and end: when the same engine work takes longer from one call to the next, a slower probe says the host's CPU got
slower for everyone (clock, a noisy neighbour), an unchanged one that the engine itself does more."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType

TOP = 25  # functions reported per thread and kind: enough to see the hot path, small enough for a result file


class StackSampler:
    """A daemon thread that counts, every `interval_s`, each thread's leaf function (`self`) and every function on
    its stack once (`inclusive`), keyed `file.py:function`; `report()` gives the top ones per thread name."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.samples: Counter[str] = Counter()
        self.leaf: dict[str, Counter[str]] = {}
        self.inclusive: dict[str, Counter[str]] = {}
        self.keys: dict[CodeType, str] = {}  # code object -> key: a sample formats each function once per run
        self.usage_at_start: dict[str, float] = {}
        self.probe_at_start: dict = {}
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.run, name="vime-stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self.probe_at_start = host_probe()
        self.usage_at_start = process_usage()
        self.thread.start()
        return self

    def stop(self) -> dict:
        self.halt.set()
        self.thread.join(timeout=5.0)
        end = process_usage()
        usage = {k: round(end[k] - self.usage_at_start[k], 4) for k in end}
        probe = {"start": self.probe_at_start, "end": host_probe()}
        return {**self.report(), "usage": usage, "cpus_allowed": len(os.sched_getaffinity(0)), "probe": probe}

    def run(self) -> None:
        me = threading.get_ident()
        while not self.halt.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.record(names.get(ident, str(ident)), frame)

    def record(self, thread: str, frame: FrameType | None) -> None:
        self.samples[thread] += 1
        seen: set[str] = set()
        leaf = True
        while frame is not None:
            key = self.key(frame.f_code)
            if leaf:
                self.leaf.setdefault(thread, Counter())[key] += 1
                leaf = False
            if key not in seen:  # a recursive function counts once per sample
                seen.add(key)
                self.inclusive.setdefault(thread, Counter())[key] += 1
            frame = frame.f_back

    def key(self, code: CodeType) -> str:
        key = self.keys.get(code)
        if key is None:
            key = self.keys[code] = f"{os.path.basename(code.co_filename)}:{code.co_name}"
        return key

    def report(self) -> dict:
        """{"interval_s", "threads": {name: {"samples", "self": [[key, share]...], "inclusive": [...]}}}, shares of
        that thread's samples, largest first."""
        threads = {
            name: {
                "samples": n,
                "self": shares(self.leaf.get(name, Counter()), n),
                "inclusive": shares(self.inclusive.get(name, Counter()), n),
            }
            for name, n in self.samples.most_common()
        }
        return {"interval_s": self.interval_s, "threads": threads}


def process_usage() -> dict[str, float]:
    """This process's clocks and counters (getrusage): CPU seconds beside wall seconds tell a process that waited
    from one that worked; page faults and involuntary context switches tell memory or CPU contention."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall_s": time.perf_counter(),
        "user_s": r.ru_utime,
        "sys_s": r.ru_stime,
        "minor_faults": r.ru_minflt,
        "major_faults": r.ru_majflt,
        "voluntary_switches": r.ru_nvcsw,
        "involuntary_switches": r.ru_nivcsw,
    }


PROBE_LOOP = 100_000  # iterations of host_probe's Python loop: ~3-5 ms on a server core
PROBE_LAUNCHES = 256  # tiny kernels per launch probe: enough to average out one slow launch, ~2 ms of GPU queue


def python_work() -> int:
    return sum(i * i for i in range(PROBE_LOOP))


def host_probe() -> dict:
    """How fast this process's CPU runs right now: the best of three timings of a fixed Python loop, the CPU the
    process last ran on and that CPU's clock as Linux reports it (a VM may report a fixed figure), and, where this
    process already drives a CUDA device, the host time per launch of a tiny kernel."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        python_work()
        best = min(best, time.perf_counter() - t0)
    cpu = current_cpu()
    out: dict = {"python_ms": round(best * 1e3, 3), "cpu": cpu, "cpu_mhz": cpu_mhz(cpu)}
    torch = sys.modules.get("torch")  # never imported for a probe: a process without torch has no kernels to time
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["launch_us"] = launch_time_us(torch)
    return out


def launch_time_us(torch) -> float:
    """Host microseconds per launch of a one-element kernel on the current device (the queue drained before and
    after, so the figure is the launch path, not other work)."""
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(PROBE_LAUNCHES):
        x.add_(1)
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / PROBE_LAUNCHES * 1e6, 2)


def current_cpu() -> int | None:
    """The CPU this process last ran on (field 39 of /proc/self/stat), None off Linux."""
    try:
        stat = Path("/proc/self/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[36])  # the fields after the command name start at field 3
    except (OSError, ValueError, IndexError):
        return None


def cpu_mhz(cpu: int | None) -> float | None:
    """`cpu MHz` of /proc/cpuinfo for `cpu`, None where Linux does not say."""
    if cpu is None:
        return None
    try:
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")
    except OSError:
        return None
    for block in blocks:
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if fields.get("processor") == str(cpu) and "cpu MHz" in fields:
            return float(fields["cpu MHz"])
    return None


def shares(counts: Counter[str], total: int) -> list[list]:
    """The TOP keys of `counts` as [key, share of `total`], largest first."""
    return [[k, round(v / total, 4)] for k, v in counts.most_common(TOP)]


def worker_stacks(holder: object, op: str, interval_ms: float = 10.0) -> dict | None:
    """`start` a sampler kept on `holder` (the vLLM worker) or `stop` it and return its report (None if none ran)."""
    if op == "start":
        old = holder.__dict__.pop("_vime_stack_sampler", None)
        if old is not None:
            old.stop()
        holder.__dict__["_vime_stack_sampler"] = StackSampler(interval_ms / 1000.0).start()
        return None
    if op == "stop":
        sampler = holder.__dict__.pop("_vime_stack_sampler", None)
        return sampler.stop() if sampler is not None else None
    raise ValueError(f"vime_stacks takes 'start' or 'stop', not {op!r}")


@contextlib.contextmanager
def sampled_stacks(llm, interval_ms: float, reports: list[dict], keep: int | None = None):
    """Around a vLLM `LLM` call: with `interval_ms` > 0 its worker samples stacks for the block and the report is
    appended to `reports` (of which the last `keep` stay); 0 does nothing. The one door for both the loop's engine
    and the bench's raw vLLM."""
    if not interval_ms:
        yield
        return
    llm.collective_rpc("vime_stacks", args=("start", interval_ms))
    try:
        yield
    finally:
        reports.append(llm.collective_rpc("vime_stacks", args=("stop",))[0])
        if keep is not None:
            del reports[:-keep]
