"""The shutdown shortcuts of `vime train` (issue 14 item 5), on real processes: shutdown stops Ray's processes only;
the fast exit still runs atexit handlers and keeps the exit code. The rest of the start-up shortcuts:
tests/unit/test_fast_start.py."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.tiny import REPO
from vime_core import cluster


def test_shutdown_stops_ray_programs_only(monkeypatch):
    """Children running the ray package's files (and their children) are Ray's; a math-verify worker is not."""
    import ray

    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    ray_like = subprocess.Popen([sys.executable, "-c", sleeper, f"{ray.__path__[0]}/fake_raylet"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vime_core.verify_pool"])
    monkeypatch.setattr(cluster._local, "preexisting", frozenset())
    try:
        deadline = time.time() + 20
        while not psutil.Process(ray_like.pid).children() and time.time() < deadline:
            time.sleep(0.1)
        grandchildren = {c.pid for c in psutil.Process(ray_like.pid).children()}
        pids = {p.pid for p in cluster._ray_descendants()}
        assert ray_like.pid in pids
        assert grandchildren and grandchildren <= pids  # a Ray program's children (workers, actors) count too
        assert other.pid not in pids
    finally:
        for proc in (ray_like, other):
            proc.kill()
            proc.wait()


def test_exit_now_runs_atexit_and_keeps_the_code():
    code = (
        "import atexit, threading, time\n"
        "from vime_core.cli import exit_now\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["thread done", "atexit ran"]


def test_a_deferred_trainer_builds_nothing_until_start(dense_model_dir):
    from tests.helpers.trainer_ranks import spawn

    (r,) = spawn("deferred_start", 1, str(dense_model_dir))
    assert r["before"] == {"model": False, "process_group": False}
    assert r["model"] and r["first"]["params"] > 0 and r["first"]["step"] == 0
    assert r["again"]["params"] == r["first"]["params"]  # a second start() only answers


@pytest.mark.parametrize(
    "start",
    [
        "cluster.init_ray(cfg, 'cpu')",
        # vime train and vime-pipeline: Ray starts in a background thread, and init_ray comes later (after the
        # checkpoint conversion in the pipeline); the signal comes before it
        "start_ray_early(cfg)",
    ],
)
def test_sigterm_after_ray_starts_runs_a_slow_cleanup_to_its_exit_code(tmp_path, start):
    """Ray's core worker puts abseil's crash handler on SIGTERM; left there, it aborts the process 3 s into the
    cleanup (exit -6: a CI run of `vime train` died so). Ray's start gives SIGTERM back to Python's handler."""
    code = (
        "import os, signal, sys, time\n"
        "from tests.helpers.tiny import tiny_config\n"
        "from vime_core import cluster\n"
        "from vime_core.early_ray import start_ray_early\n"
        "def stop(signum, frame):\n"
        "    raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"cfg = tiny_config({str(tmp_path)!r}, 'cluster.num_cpus=2', 'eval.datasets=[]')\n"
        f"{start}\n"
        "import ray\n"
        "while not ray.is_initialized():  # the signal comes once Ray is up (and its core worker's handler in)\n"
        "    time.sleep(0.1)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    time.sleep(4)  # longer than abseil's 3 s alarm\n"
        "    cluster.shutdown_ray()\n"
        "    print('cleaned up', flush=True)\n"
        "    os._exit(143)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (143, "cleaned up"), proc.stderr[-2000:]
