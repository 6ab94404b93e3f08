"""What a dead actor's process wrote last. Ray forwards an actor's output to the driver only while the actor lives and
only as fast as its log monitor reads; a process killed or crashed while starting often leaves its last lines (a
faulthandler trace, vLLM's last message) in its own files alone: `worker-<id>-<job>-<pid>.err` / `.out` under the
session's logs dir. These are what an error about that actor quotes."""

from __future__ import annotations

import re
from pathlib import Path

TAIL_LINES = 12
PID = re.compile(r"\bpid: (\d+)")


def dead_actor_pid(error: BaseException) -> int | None:
    """The process id Ray's ActorDiedError names ("pid: 14649"); None when it names none."""
    m = PID.search(str(error))
    return int(m.group(1)) if m else None


def logs_dir() -> Path | None:
    """The local Ray session's logs dir; None without a local node (a joined cluster's actors may log elsewhere)."""
    try:
        from ray._private import worker  # Ray has no public accessor for the session's paths

        node = worker.global_worker.node
        return Path(node.get_logs_dir_path()) if node is not None else None
    except Exception:  # Ray not started, or its internals moved: the error is still raised, without the tail
        return None


def log_tail(pid: int, logs: Path | None, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of the process's stderr and stdout files (stderr first), "" when there are none."""
    if logs is None or not logs.is_dir():
        return ""
    out = []
    for suffix in ("err", "out"):
        for path in sorted(logs.glob(f"worker-*-{pid}.{suffix}")):
            try:
                text = path.read_text(errors="replace").strip()
            except OSError:
                continue
            if text:
                out.append(f"--- {path.name} (last {lines} lines) ---")
                out += text.splitlines()[-lines:]
    return "\n".join(out)


def dead_actor_tail(error: BaseException) -> str:
    """`log_tail` of the process `error` names, for the error's message; "" when there is nothing to quote."""
    pid = dead_actor_pid(error)
    return log_tail(pid, logs_dir()) if pid is not None else ""
