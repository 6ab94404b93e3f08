"""Children die with their parent.

A SIGKILLed `vime train` or `vime-pipeline` cannot clean up after itself: without help its temporary Prefect server,
Ray's processes, megatron's checkpoint helper (a 318 MB multiprocessing manager spawned by each trainer rank) and
vLLM's workers outlive it. Two mechanisms:

- `die_with_parent()`: PR_SET_PDEATHSIG (Linux prctl through ctypes) in a process we start: the kernel sends it
  SIGKILL when its parent exits, however that happens. Use it as `preexec_fn` or at the start of a spawned helper.
- `start_watchdog()`: a small process that watches this one and remembers its descendants (re-listed every
  `WATCH_INTERVAL_S`); when this process is gone it terminates every remembered descendant still alive (same pid
  and start time, so a recycled pid is never hit). This covers children started by libraries we cannot give a
  `preexec_fn` (Prefect's server, Ray's gcs/raylet and workers, their own helpers).

    python -m vime_core.orphans <parent pid>
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5  # psutil walks ~30 processes in ~5 ms: negligible next to a run
TERM_GRACE_S = 3.0


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_watchdog() -> subprocess.Popen | None:
    """Start the watchdog of this process (see module doc); None where psutil is missing. Idempotent per process."""
    global _WATCHDOG
    if _WATCHDOG is not None and _WATCHDOG.poll() is None:
        return _WATCHDOG
    try:
        import psutil  # noqa: F401
    except ImportError:
        return None
    _WATCHDOG = subprocess.Popen(
        [sys.executable, "-m", "vime_core.orphans", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    return _WATCHDOG


_WATCHDOG: subprocess.Popen | None = None


def watchdog_pid() -> int | None:
    return _WATCHDOG.pid if _WATCHDOG is not None and _WATCHDOG.poll() is None else None


def _registry(parent_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"vime-watchdog-{parent_pid}.paths"


def remove_on_death(path: Path) -> None:
    """Have the watchdog (if one runs) delete `path` after this process died and its descendants were reaped: a
    SIGKILLed run's Ray session dir and the actors' temporary dir do not pile up under /tmp."""
    if watchdog_pid() is not None:
        with open(_registry(os.getpid()), "a") as fh:
            fh.write(f"{path}\n")


def _remove_registered(parent_pid: int) -> None:
    reg = _registry(parent_pid)
    try:
        paths = reg.read_text().splitlines()
    except OSError:
        return
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
    reg.unlink(missing_ok=True)


def _snapshot(parent, me: int) -> dict[int, float]:
    import psutil

    out = {}
    try:
        for p in parent.children(recursive=True):
            if p.pid != me:
                try:
                    out[p.pid] = p.create_time()
                except psutil.Error:
                    pass
    except psutil.Error:
        pass
    return out


def _alive(known: dict[int, float]) -> list:
    import psutil

    alive = []
    for pid, started in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def reap(known: dict[int, float]) -> int:
    """SIGTERM the remembered descendants still alive, SIGKILL those left after TERM_GRACE_S; returns how many."""
    import psutil

    victims = _alive(known)
    for p in victims:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(victims, timeout=TERM_GRACE_S)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(victims)


def watch(parent_pid: int) -> int:
    import psutil

    # a terminal's Ctrl-C or a SIGTERM to the group reaches the parent, which cleans up itself; we stay to reap
    # whatever it leaves behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        parent = psutil.Process(parent_pid)
    except psutil.Error:
        return 0
    known: dict[int, float] = {}
    while _running(parent):
        known.update(_snapshot(parent, os.getpid()))
        time.sleep(WATCH_INTERVAL_S)
    # a process started in the last interval (Ray's raylet starts workers on its own, also after the driver died)
    # is a child of one we know: take the known ones' descendants too, until a pass finds nobody alive
    for _ in range(3):
        for p in _alive(known):
            known.update(_snapshot(p, os.getpid()))
        if not reap(known):
            break
    _remove_registered(parent_pid)
    return 0


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


if __name__ == "__main__":  # pragma: no cover - run as the watchdog process
    sys.exit(watch(int(sys.argv[1])))
