"""One writer per output_dir: an exclusive lock file with its holder's identity, so that a second run (another
`vime train`, `vime-pipeline` or flow run on the same directory) fails at once naming who holds it instead of
training the same steps twice.

The lock is an OS file lock (filelock: released by the kernel when the holder dies, so a crash never leaves a stale
lock); `<output_dir>/.vime-run.json` beside it says who holds it (pid, host, start time, Prefect flow run). The lock
is re-entrant within a process: the pipeline flow holds it for its whole run, and the loop it calls takes it again.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from vime_core.errors import VimeError

LOCK_FILE = ".vime-run.lock"
HOLDER_FILE = ".vime-run.json"

_held: dict[Path, list] = {}  # resolved output_dir -> [FileLock, depth]
_guard = threading.Lock()


class RunLockedError(VimeError, RuntimeError):
    """Another process is writing the same output_dir; the message names it."""


def holder_info(flow_run: str | None = None) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "flow_run": flow_run or os.environ.get("PREFECT__FLOW_RUN_ID"),
    }


def describe_holder(output_dir: Path) -> str:
    try:
        h = json.loads((Path(output_dir) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return "another process (no holder file)"
    text = f"pid {h.get('pid')} on {h.get('host')} since {h.get('started')}"
    return text + (f" (Prefect flow run {h['flow_run']})" if h.get("flow_run") else "")


@contextmanager
def output_dir_lock(output_dir: str | Path, flow_run: str | None = None) -> Iterator[None]:
    """Hold `output_dir` exclusively for the block; raise RunLockedError at once if another process holds it."""
    from filelock import FileLock, Timeout

    out = Path(output_dir).resolve()
    with _guard:
        entry = _held.get(out)
        if entry is not None:
            entry[1] += 1
        else:
            out.mkdir(parents=True, exist_ok=True)
            # thread_local=False: Prefect runs tasks in worker threads of the process that holds the lock
            lock = FileLock(str(out / LOCK_FILE), thread_local=False)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                raise RunLockedError(
                    f"output_dir {out} is in use by {describe_holder(out)}; wait for that run to finish, stop it, "
                    "or choose another output_dir"
                ) from None
            try:
                (out / HOLDER_FILE).write_text(json.dumps(holder_info(flow_run), indent=2))
            except BaseException:  # a full disk, a read-only dir: do not keep a lock that nobody will release
                lock.release()
                raise
            entry = _held[out] = [lock, 1]
    try:
        yield
    finally:
        with _guard:
            entry[1] -= 1
            if entry[1] == 0:
                del _held[out]
                try:
                    (out / HOLDER_FILE).unlink(missing_ok=True)
                finally:  # an unlink error (EACCES, EIO) must not keep the lock held for the rest of the process
                    entry[0].release()
