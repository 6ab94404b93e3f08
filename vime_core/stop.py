"""A run stopped by a signal: Ctrl-C (SIGINT) or SIGTERM ends `vime train`, `vime-pipeline` and a deployment's flow
run through their cleanup (the MLflow run ends KILLED, the actors and Ray stop), then one line says what was saved
and the process exits 128 + the signal.

In a Prefect flow run SIGTERM is Prefect's: its handler raises `prefect.exceptions.TerminationSignal` (a worker
cancelling the run sends it), which `stop_signal` reads by its `signal` attribute, so vime_core needs no Prefect.
"""

from __future__ import annotations

import functools
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

# A stop signal that lands in the main thread inside `shielded()` is held until the block ends, at most HOLD_S:
# `depth` of nested blocks, the `held` signal and its `timer`, and `late`, the held signal sent again once HOLD_S ran
# out (the handler then raises it, or drops it where the block ended first and raised it already).
HOLD_S = 2.0
_shield: dict = {"depth": 0, "held": None, "timer": None, "late": None}
_shield_lock = threading.RLock()  # the hold's timer thread against the main thread; reentrant for the handler


@contextmanager
def stop_on_signal(signals: tuple[int, ...] = STOPS) -> Iterator[list[int]]:
    """`signals` raise KeyboardInterrupt in the main thread, so that the run's cleanup runs; yields the list that gets
    the signal's number. A second signal during that cleanup ends the process at once (the orphan watchdog still
    stops Ray's processes)."""

    deferred = 0

    def handler(signum, frame):
        nonlocal deferred
        if _shield["late"] == signum:  # a held signal whose HOLD_S ran out
            _shield["late"] = None
            if _shield["held"] is None:
                return  # the block ended first and raised it
        elif _caught:
            os._exit(128 + signum)
        elif _shield["depth"] and _shield["held"] is None:
            hold(signum)
            return
        if in_finalizer(frame) and deferred < MAX_DEFERRALS:
            deferred += 1
            redeliver(signum)
            return
        drop_held()  # a second signal inside a shielded block, or the hold ran out: it stops the run now
        stop_run(signum)

    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield _caught
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _caught.clear()  # read inside the block only: a later run in this process starts unstopped
        drop_held()
        _shield["late"] = None


@contextmanager
def shielded() -> Iterator[None]:
    """A block that a stop signal must not cut in two: a signal that lands in the main thread inside it stops the
    run as the block ends (at most HOLD_S later; a second one at once). Every MLflow client call runs in one
    (tracking.mlflow_client): a SIGTERM raised inside SQLAlchemy's read of a run left its rollback to meet a locked
    sqlite database, and MLflow printed the traceback into a run that had stopped cleanly. Other threads' blocks
    hold nothing: signals reach the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _shield["depth"] += 1
    try:
        yield
    finally:
        _shield["depth"] -= 1
        if _shield["depth"] == 0:
            release_held()


class ShieldedCalls:
    """`obj` whose every method call runs in `shielded()` (tracking.mlflow_client wraps its MlflowClient in one)."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __getattr__(self, name: str):
        if name == "obj":  # not set yet (a copy or an unpickling): no recursion through self.obj
            raise AttributeError(name)
        attr = getattr(self.obj, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def call(*args, **kwargs):
            with shielded():
                return attr(*args, **kwargs)

        return call


def hold(signum: int) -> None:
    """Keep `signum` for the end of the shielded block; past HOLD_S it comes again as `late` and goes through."""

    def expire() -> None:
        with _shield_lock:
            if _shield["held"] == signum:
                _shield["late"] = signum
                signal.pthread_kill(threading.main_thread().ident, signum)

    timer = threading.Timer(HOLD_S, expire)
    timer.daemon = True
    _shield.update(held=signum, timer=timer)
    timer.start()


def drop_held() -> None:
    with _shield_lock:
        if _shield["timer"] is not None:
            _shield["timer"].cancel()
        _shield.update(held=None, timer=None)


def release_held() -> None:
    """At the end of the outermost shielded block: the held signal, if any, stops the run now."""
    with _shield_lock:
        signum = _shield["held"]
        drop_held()
    if signum is not None:
        stop_run(signum)


def stop_run(signum: int) -> None:
    """Record `signum` as the run's stop and unwind the main thread with it."""
    _caught.append(signum)
    raise KeyboardInterrupt(signal.Signals(signum).name)


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
