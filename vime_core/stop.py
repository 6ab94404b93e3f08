"""A run stopped by a signal: Ctrl-C (SIGINT) or SIGTERM ends `vime train`, `vime-pipeline` and a deployment's flow
run through their cleanup (the MLflow run ends KILLED, the actors and Ray stop), then one line says what was saved
and the process exits 128 + the signal.

In a Prefect flow run SIGTERM is Prefect's: its handler raises `prefect.exceptions.TerminationSignal` (a worker
cancelling the run sends it), which `stop_signal` reads by its `signal` attribute, so vime_core needs no Prefect.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOPS = (signal.SIGINT, signal.SIGTERM)

# A signal that lands in a finalizer comes again 50 ms later, at most this many times (~2 s): a `__del__` that
# blocks must not make Ctrl-C wait for it forever
MAX_DEFERRALS = 40

# The signal stop_on_signal caught in this process, if any: read by the pipeline's retry condition, since a Ctrl-C
# also reaches the actors and one of them may die of it first (an ordinary error, which would be retried).
_caught: list[int] = []


@contextmanager
def stop_on_signal(signals: tuple[int, ...] = STOPS) -> Iterator[list[int]]:
    """`signals` raise KeyboardInterrupt in the main thread, so that the run's cleanup runs; yields the list that gets
    the signal's number. A second signal during that cleanup ends the process at once (the orphan watchdog still
    stops Ray's processes)."""

    deferred = 0

    def handler(signum, frame):
        nonlocal deferred
        if _caught:
            os._exit(128 + signum)
        if in_finalizer(frame) and deferred < MAX_DEFERRALS:
            deferred += 1
            redeliver(signum)
            return
        _caught.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield _caught
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _caught.clear()  # read inside the block only: a later run in this process starts unstopped


def in_finalizer(frame) -> bool:
    """Whether the main thread is inside a `__del__` (the garbage collector runs them at any bytecode) or a weakref
    callback: Python prints an exception raised there as "Exception ignored" and goes on, so a Ctrl-C raised in one
    was lost and the run went on to the end (seen: asyncio's transport finalizer during an evaluation)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith("weakref.py"):
            return True
        frame = frame.f_back
    return False


def redeliver(signum: int) -> None:
    """The signal again, to the main thread, once the finalizer it hit has returned: a real signal (not
    `_thread.interrupt_main`) so that a blocking call in the main thread is interrupted as by the first one."""
    main = threading.main_thread().ident
    timer = threading.Timer(0.05, signal.pthread_kill, (main, signum))
    timer.daemon = True  # a process already on its way out need not wait for it
    timer.start()


def stop_signal(e: BaseException | None = None) -> int | None:
    """The signal that stopped this run: the one stop_on_signal caught, else the one `e` stands for (a bare
    KeyboardInterrupt is a Ctrl-C; Prefect's TerminationSignal carries its number); None for any other error."""
    if _caught:
        return _caught[0]
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    number = getattr(e, "signal", None)
    if isinstance(e, BaseException) and not isinstance(e, Exception) and number in STOPS:
        return number
    return None


def stop_reason(e: BaseException) -> str | None:
    """The MLflow tag text of a run that `e` ended: None for an error, else the signal that stopped it (a Ctrl-C
    may surface as another error, such as an actor that died of the same Ctrl-C)."""
    signum = stop_signal(e)
    return None if signum is None else f"{type(e).__name__}: stopped by {signal.Signals(signum).name}"


def saved_line(cfg, signum: int) -> str:
    """What a stopped run leaves: its last complete checkpoint (by the cheap look: nothing is verified or set aside
    here; the next run does that), or that there is none."""
    from vime_core.checkpoint import Checkpointer

    name = signal.Signals(signum).name
    try:
        latest = Checkpointer(cfg.save_dir).peek_latest()
        done = Checkpointer.read_state(latest)["rollout_id"] + 1 if latest else 0
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint: the next run sets it aside and names it
        return f"stopped by {name}: the checkpoints in {cfg.save_dir} could not be read ({type(e).__name__})"
    if latest is None:
        return f"stopped by {name}: no checkpoint saved yet in {cfg.save_dir}; a rerun starts from step 1"
    return (
        f"stopped by {name}: last checkpoint {latest} (after rollout step {done}/{cfg.rollout.num_rollout}); "
        f"a rerun resumes from it"
    )
