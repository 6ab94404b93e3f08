"""The processes a test started and what is left of them after a SIGKILL (tests/integration/test_faults_orphans.py,
tests/e2e/test_faults_orphans.py)."""

from __future__ import annotations

import time


GRACE_S = 20  # the watchdog polls every 0.5 s and gives SIGTERM 3 s before SIGKILL


def descendants(pid: int) -> dict[int, tuple[float, str]]:
    import psutil

    try:
        return {p.pid: (p.create_time(), " ".join(p.cmdline())) for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def run_dirs(known: dict[int, tuple[float, str]]) -> set[str]:
    """The Ray session dir and the actors' TMPDIR of the processes in `known` (from command lines and environments)."""
    import re

    import psutil

    dirs = set()
    for pid, (_, cmd) in known.items():
        dirs.update(re.findall(r"/tmp/ray/session_[0-9_-]+", cmd))
        try:
            tmp = psutil.Process(pid).environ().get("TMPDIR", "")
        except psutil.Error:
            continue
        if "vime-actors-" in tmp:
            dirs.add(tmp)
    return dirs


def survivors(known: dict[int, tuple[float, str]]) -> list[str]:
    import psutil

    alive = []
    for pid, (started, cmd) in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {cmd[:120]}")
        except psutil.Error:
            pass
    return alive


def wait_gone(known: dict, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := survivors(known)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
