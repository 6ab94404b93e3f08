"""What the device and the host do while a gpu_scale phase runs: one sample a second of the GPU (memory in use, SM
and memory clocks, power, temperature, utilisation, active clock-throttle reasons: nvidia-smi) and of the phase's
process tree (CPU % per process: psutil), so that a slow rollout step can be told apart as a throttled GPU, a busy
host or the engine itself (run 4: the loop's rollout at 1.7B x 1,024 ran ~8% slower only after its first training
step, raw vLLM did not)."""

from __future__ import annotations

import statistics
import subprocess
import threading
import time

GPU_FIELDS = (
    "memory.used",
    "clocks.sm",
    "clocks.mem",
    "power.draw",
    "temperature.gpu",
    "utilization.gpu",
    "clocks_throttle_reasons.active",
)
NAMES = ("used_gib", "sm_mhz", "mem_mhz", "power_w", "temp_c", "util_pct")
TOP_PROCS = 4  # per sample: the busiest processes of the phase's tree (CPU %, > 5)


def gpu_sample() -> dict | None:
    """One nvidia-smi reading of GPU 0, or None where nvidia-smi is missing or fails (a CPU box)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()[0]
        vals = [v.strip() for v in out.split(",")]
        row = {n: float(v) for n, v in zip(NAMES, vals)}
        row["used_gib"] /= 1024
        row["throttle"] = vals[len(NAMES)]
        return row
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def proc_label(p) -> str:
    """`name:pid`; Ray sets a worker's title to `ray::Actor.method`."""
    try:
        cmd = p.cmdline()
        name = cmd[0] if cmd and cmd[0].startswith(("ray::", "VLLM")) else p.name()
        return f"{name[:40]}:{p.pid}"  # the pid keeps two `python3` processes (a front end, its engine core) apart
    except Exception:  # gone between listing and reading
        return "?"


class DeviceMonitor(threading.Thread):
    """Samples every `interval_s` until `stop` is set; `peak` is the most device memory seen in use (vLLM + trainer +
    CUDA contexts, unlike the allocators' figures)."""

    def __init__(self, root_pid: int | None = None, interval_s: float = 1.0):
        super().__init__(daemon=True)
        self.root_pid, self.interval_s = root_pid, interval_s
        self.peak, self.samples, self.stop = None, [], threading.Event()
        self.host_peak = None  # the most host memory seen in use (psutil `used`: no page cache), GiB
        self._procs: dict = {}

    def run(self):
        while not self.stop.wait(self.interval_s):
            row = gpu_sample() or {}
            if row:
                self.peak = max(self.peak or 0.0, row["used_gib"])
            row.update(self.host_sample())
            if "host_used_gib" in row:
                self.host_peak = max(self.host_peak or 0.0, row["host_used_gib"])
            self.samples.append({"t": round(time.time(), 2), **row})

    def host_sample(self) -> dict:
        try:
            import psutil
        except ImportError:
            return {}
        out: dict = {"host_cpu_pct": psutil.cpu_percent(None), "host_used_gib": psutil.virtual_memory().used / 2**30}
        if self.root_pid is None:
            return out
        try:
            root = psutil.Process(self.root_pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return out
        busy = []
        for p in tree:
            cached = self._procs.setdefault(p.pid, p)  # cpu_percent() counts from this object's previous call
            try:
                busy.append((cached.cpu_percent(None), proc_label(cached)))
            except psutil.Error:
                continue
        out["procs"] = {label: round(pct) for pct, label in sorted(busy, reverse=True)[:TOP_PROCS] if pct > 5}
        return out


def window_stats(samples: list[dict], start: float, end: float) -> dict | None:
    """Medians of the samples taken in [start, end] (a rollout step), the throttle reasons seen and the busiest
    processes by median CPU %."""
    rows = [s for s in samples if start <= s["t"] <= end]
    if not rows:
        return None
    stats = {}
    for n in (*NAMES, "host_cpu_pct"):
        vals = [r[n] for r in rows if n in r]  # a failed nvidia-smi call leaves a sample without the GPU fields
        if vals:
            stats[n] = round(statistics.median(vals), 1)
    stats["samples"] = len(rows)
    stats["throttle"] = sorted({r["throttle"] for r in rows if "throttle" in r})
    labels = {label for r in rows for label in r.get("procs", {})}
    procs = {label: statistics.median(r.get("procs", {}).get(label, 0) for r in rows) for label in labels}
    stats["procs"] = {k: v for k, v in sorted(procs.items(), key=lambda kv: -kv[1])[:TOP_PROCS] if v > 5}
    return stats


def annotate_steps(rec: dict, samples: list[dict]) -> None:
    """Attach window_stats of each step's generation to the step rows: a raw-vLLM step records its own start and end;
    a synchronous loop step (perf/step_time, ending at `bench/end_epoch`) starts with its rollout (schedule.py)."""
    for row in rec.get("steps", []):
        if "start_epoch" in row:
            win = (row["start_epoch"], row["end_epoch"])
        elif "bench/end_epoch" in row and "perf/step_time" in row:
            start = row["bench/end_epoch"] - row["perf/step_time"]
            win = (start, start + row.get("perf/rollout_time", 0.0))
        else:
            continue
        row["bench/rollout_device"] = window_stats(samples, *win)


def step_lines(phase: str, rec: dict) -> list[str]:
    """One printed line per step: what the device and host did while it generated."""
    lines = []
    for i, row in enumerate(rec.get("steps", [])):
        d = row.get("bench/rollout_device")
        if d:
            gpu = " ".join(f"{n}={d[n]:g}" for n in NAMES if n in d)
            lines.append(
                f"[{phase}] step {i} rollout device: {gpu} throttle={d['throttle']} host={d.get('host_cpu_pct')}% procs={d['procs']}"
            )
    return lines
