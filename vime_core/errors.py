"""The one base class of the project's user-facing errors.

Every error that the user can fix (a config field, a file, a dataset, a model, a checkpoint, the cluster's size)
derives from `VimeError`; `vime` and `vime-pipeline` print such an error as one line and exit with `exit_code` (2),
with the traceback only under `--debug`. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os


class VimeError(Exception):
    """A problem the user can fix; the message names the field or file and the fix."""

    exit_code = 2


class ActorTimeoutError(VimeError, TimeoutError):
    """A Ray actor did not answer within its timeout; the message names the actor, the call and the setting."""


class ActorStallError(ActorTimeoutError):
    """A Ray actor made no progress (vime_core.progress) for its window; the message names the actor, the call, what
    stopped, for how long, and the setting."""


class ClusterError(VimeError, RuntimeError):
    """Ray could not give us what the config asks for (or an actor could not start on a user error); the message says
    what was missing."""


class DiskSpaceError(VimeError, OSError):
    """Not enough free space for a save; the message says how much is needed and where."""


class TransientError(VimeError):
    """A service that should be there could not be reached (the hub answered 5xx/429 or not at all, the MLflow
    server is down). Printed as one line like any VimeError, but a Prefect task retries it (tasks.common.is_transient):
    the same call a minute later usually succeeds, while a bad config never does."""


def one_line(e: BaseException) -> str:
    """An error as one line, prefixed by its class name (what the CLIs print): a message of several lines (a config
    with several problems) is joined with "; ", a traceback appended to it (a failed rank's) is dropped."""
    lines = []
    for line in str(e).splitlines():
        if line.startswith("Traceback"):
            break
        if line.strip():
            lines.append(line.strip())
    if not lines:
        return type(e).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} " + "; ".join(lines[1:])
    return f"{type(e).__name__}: {text}"


def user_error(e: BaseException) -> VimeError | None:
    """The user error behind `e` (itself, or the VimeError a Ray actor raised and Ray wrapped), or None."""
    cause = getattr(e, "cause", None)
    user = cause if isinstance(cause, VimeError) else e
    return user if isinstance(user, VimeError) else None


def debug_requested(argv: list[str]) -> bool:
    """`--debug` on the command line or VIME_DEBUG=1: show tracebacks of user errors too."""
    return "--debug" in argv or os.environ.get("VIME_DEBUG", "") not in ("", "0")
