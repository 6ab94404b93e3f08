"""math-verify in worker processes with a hard time limit per call.

math-verify bounds its own work with `signal.alarm`, which works only in a process's main thread: in a Prefect task
thread or a Ray actor it runs unbounded, and `\\boxed{9^{9^{9^{9}}}}` hung a thread for > 120 s. Even in the main
thread an alarm cannot interrupt one long C-level bignum operation. So the symbolic comparison runs in plain
worker subprocesses (`python -m vime_core.verify_pool`: no multiprocessing, so no re-import of the caller's
`__main__`), where math-verify's alarms work; a call still running at its deadline has its worker killed (a new one
starts on demand) and scores as "not equal". Requests and replies are JSON lines over the worker's stdin/stdout.

Workers start on first use (~0.5 s each, math-verify and sympy imports) and are reused; the cheap string and
number comparisons in rewards.py never come here.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# worker side (runs in the subprocess's main thread)
# --------------------------------------------------------------------------------------------------------------------
def symbolic_equal(pred: str, label: str, timeout: int | None) -> bool:
    from math_verify import parse, verify

    try:
        gold = parse(f"${label}$", parsing_timeout=timeout)
        target = parse(f"${pred}$", parsing_timeout=timeout)
        return bool(gold and target and verify(gold, target, timeout_seconds=timeout))
    except Exception:  # a parse bug must cost one sample's reward, not the run
        return False


def label_parses(label: str, timeout: int | None) -> bool:
    """math-verify turns the label into a math object (it returns only the input string when it cannot)."""
    from math_verify import parse

    try:
        return any(not isinstance(x, str) for x in parse(f"${label}$", parsing_timeout=timeout))
    except Exception:
        return False


OPS = {"equal": symbolic_equal, "label": label_parses}


PARENT_ENV = "VIME_VERIFY_PARENT"  # the caller's pid: a worker whose caller is gone exits


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this worker when its parent goes (PR_SET_PDEATHSIG), even when the worker is stuck
    in one C-level bignum operation (no Python watchdog thread gets the GIL then). The signal follows the parent
    *thread* that started the worker: the pool starts workers from one long-lived thread (`_spawn`). Elsewhere: no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.environ.get(PARENT_ENV) not in (None, str(os.getppid())):  # the parent died before the prctl
        os._exit(1)


def _worker_main() -> None:
    die_with_parent()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (imported before the first request, so that it does not count against it)

    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        op, args, timeout = json.loads(line)
        out.write(json.dumps(OPS[op](*args, timeout)) + "\n")
        out.flush()


# --------------------------------------------------------------------------------------------------------------------
# caller side
# --------------------------------------------------------------------------------------------------------------------
STARTUP_TIMEOUT_S = 120.0  # a worker imports math-verify and sympy: 0.3-1 s measured, minutes on a swapping host


_SPAWNER: tuple[int, "queue.Queue"] | None = None  # (pid, requests) of the thread that starts every worker
_SPAWNER_LOCK = threading.Lock()


def _spawner_loop(requests: "queue.Queue") -> None:
    while True:
        args, kwargs, done = requests.get()
        try:
            done.set_result(subprocess.Popen(args, **kwargs))
        except BaseException as e:
            done.set_exception(e)


def _spawn() -> subprocess.Popen:
    """A worker started from one daemon thread that lives as long as the process (per process: a forked child gets
    its own), so that the worker's PR_SET_PDEATHSIG fires when the process dies, not when a caller thread ends."""
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None or _SPAWNER[0] != os.getpid():
            requests: queue.Queue = queue.Queue()
            threading.Thread(target=_spawner_loop, args=(requests,), name="verify-pool-spawner", daemon=True).start()
            _SPAWNER = (os.getpid(), requests)
    done: Future = Future()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())}
    _SPAWNER[1].put(
        (
            [sys.executable, "-m", "vime_core.verify_pool"],
            dict(
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1, env=env
            ),
            done,
        )
    )
    return done.result()


def phase_timeout(timeout: float) -> int:
    """math-verify's own alarm per phase (parse label, parse answer, verify: 3 in a row), so that it fires before the
    caller's deadline kills the worker (a new one costs ~0.5 s of imports); whole seconds (signal.alarm)."""
    return max(1, int(timeout) // 3)


class _Worker:
    def __init__(self):
        self.proc = _spawn()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> bool:
        """The worker's start (imports) does not count against a call's limit: wait for its `ready` line first."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout) and self.proc.stdout.readline().strip() == "ready":
                return True
        self.kill()
        return False

    def send(self, op: str, args: tuple, timeout: float) -> None:
        self.proc.stdin.write(json.dumps([op, list(args), phase_timeout(timeout)]) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class VerifyPool:
    """Up to `workers` math-verify subprocesses; `run` answers a batch of calls, each within `timeout_s`."""

    def __init__(self, workers: int):
        self.size = max(1, workers)
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()  # one batch at a time (rewards of one step; threads share the pool)
        self.killed = 0  # workers killed at their deadline (tests and logs look at it)

    def run(self, op: str, calls: list[tuple], timeout_s: float, default: bool = False) -> list[bool]:
        if not calls:
            return []
        with self.lock:
            return self._run(op, calls, timeout_s, default)

    def _run(self, op: str, calls: list[tuple], timeout_s: float, default: bool) -> list[bool]:
        results: list[bool] = [default] * len(calls)
        pending = deque(range(len(calls)))
        busy: dict[int, tuple[_Worker, int, float]] = {}  # fd -> (worker, call index, deadline)
        sel = selectors.DefaultSelector()
        try:
            while pending or busy:
                self._start_workers(min(self.size, len(pending) + len(busy)) - len(busy) - len(self.idle))
                while pending and self.idle:
                    w = self.idle.pop()
                    i = pending.popleft()
                    try:
                        w.send(op, calls[i], timeout_s)
                    except OSError:  # a worker that died while idle: replace it, retry the call
                        w.kill()
                        pending.appendleft(i)
                        continue
                    busy[w.proc.stdout.fileno()] = (w, i, time.monotonic() + timeout_s)
                    sel.register(w.proc.stdout, selectors.EVENT_READ)
                if not busy:  # a worker died before taking its call: start another
                    continue
                wait = max(0.0, min(d for _, _, d in busy.values()) - time.monotonic())
                for key, _ in sel.select(wait):
                    w, i, _ = busy.pop(key.fd)
                    sel.unregister(key.fileobj)
                    line = w.proc.stdout.readline()
                    if line:
                        results[i] = bool(json.loads(line))
                        self.idle.append(w)
                    else:  # the worker died (out of memory...): this call scores `default`
                        w.kill()
                now = time.monotonic()
                for fd, (w, i, deadline) in list(busy.items()):
                    if now >= deadline:
                        busy.pop(fd)
                        sel.unregister(w.proc.stdout)
                        w.kill()
                        self.killed += 1
                        log.warning(
                            "math-verify took more than %.0f s on %.200r: killed, scored as %s",
                            timeout_s,
                            calls[i],
                            default,
                        )
        finally:
            for w, _, _ in busy.values():  # an exception (KeyboardInterrupt) mid-batch: do not leave them running
                w.kill()
            sel.close()
        return results

    def _start_workers(self, n: int) -> None:
        new = [_Worker() for _ in range(n)]  # started together, so their imports overlap
        self.idle += [w for w in new if w.wait_ready()]
        if n > 0 and not self.idle:
            raise RuntimeError(
                f"math-verify worker processes ({sys.executable} -m vime_core.verify_pool) did not start "
                f"within {STARTUP_TIMEOUT_S:.0f} s; check that math-verify is installed"
            )

    def close(self) -> None:
        with self.lock:
            for w in self.idle:
                w.kill()
            self.idle.clear()


_POOL: VerifyPool | None = None
_POOL_LOCK = threading.Lock()


def shared_pool() -> VerifyPool:
    """The process's pool: min(4, cores) workers, closed at exit."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = VerifyPool(min(4, os.cpu_count() or 1))
            atexit.register(_POOL.close)
        return _POOL


if __name__ == "__main__":
    _worker_main()
