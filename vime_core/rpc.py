"""Calls to groups of Ray actors with a bound: a call that does not finish in time raises naming the actor, what it
was doing and the setting that bounds it. Below the cluster (which creates the actors) and everything that calls
them (router, trainer group, weight sync), so none of those imports the cluster for it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from vime_core.errors import ActorStallError, ActorTimeoutError, ClusterError, VimeError

BOARD_TIMEOUT_S = 10.0  # a board that does not answer a poll in this long is skipped: the call's timeout still holds


@dataclass(frozen=True)
class Stall:
    """A progress window for `gather` (vime_core.progress): an actor that beats for none of `window_s` seconds of
    its call is hung. `what` names the progress that stopped ("no engine step"); window 0 turns the check off."""

    window_s: float
    setting: str
    what: str

    @property
    def poll_s(self) -> float:
        # a stall is reported at most this much after the window ends: 10 s at the 180 s defaults
        return min(10.0, max(0.2, self.window_s / 6))


def gather(
    refs: list, who: list[str], doing: str, timeout_s: float | None, setting: str, stall: Stall | None = None
) -> list:
    """`ray.get(refs)`, but a call that does not finish within `timeout_s` raises ActorTimeoutError naming the
    actor(s) still busy (`who[i]` for `refs[i]`), what they were doing and the setting that bounds it; with `stall`,
    one whose actor stops beating (vime_core.progress) for `stall.window_s` raises ActorStallError much sooner."""
    import ray

    watch = stall is not None and stall.window_s > 0
    if refs and (timeout_s is not None or watch):
        _wait(dict(zip(refs, who)), doing, timeout_s, setting, stall if watch else None)
    return ray.get(list(refs))


def _wait(who_of: dict, doing: str, timeout_s: float | None, setting: str, stall: Stall | None) -> None:
    import ray

    from vime_core.progress import board

    start = time.monotonic()
    deadline = start + timeout_s if timeout_s is not None else math.inf
    progress = board() if stall else None
    pending = list(who_of)
    while pending:
        step = deadline - time.monotonic()
        _, pending = ray.wait(
            pending, num_returns=len(pending), timeout=max(0.0, min(step, stall.poll_s) if stall else step)
        )
        if not pending:
            return
        names = [who_of[r] for r in pending]
        if time.monotonic() >= deadline:
            raise ActorTimeoutError(
                f"{', '.join(names)} did not finish {doing} within {timeout_s:g} s ({setting}): the actor is hung or "
                f"far slower than expected; check its log above, or raise {setting}"
            )
        if stall:
            check_progress(progress, names, doing, stall, time.monotonic() - start)


def check_progress(progress: Any, names: list[str], doing: str, stall: Stall, elapsed: float) -> None:
    """Raise ActorStallError for the actors of `names` whose last beat (or the call's start, `elapsed` s ago, if
    later) is older than the window."""
    import ray

    try:
        ages = ray.get(progress.ages.remote(names), timeout=BOARD_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the board is slow or gone: skip this poll, never fail the run for it
        return
    idle = {n: elapsed if ages.get(n) is None else min(elapsed, ages[n][0]) for n in names}
    stalled = [n for n in names if idle[n] > stall.window_s]
    if stalled:
        raise ActorStallError(
            f"{', '.join(stalled)} stalled in {doing}: {stall.what} for {max(idle[n] for n in stalled):.0f} s "
            f"(the window is {stall.setting} = {stall.window_s:g} s); the actor is hung: see its log above, or raise "
            f"{stall.setting} (0 turns the check off)"
        )


def call_all(
    actors: list, kind: str, method: str, args: tuple[Any, ...], timeout_s: float | None, setting: str
) -> list:
    """`method(*args)` on every actor of a group (`kind` names one in errors: "vLLM engine", "trainer rank")."""
    refs = [getattr(a, method).remote(*args) for a in actors]
    return gather(refs, [f"{kind} {i}" for i in range(len(refs))], method, timeout_s, setting)


def wait_started(pending: dict, timeout_s: float | None) -> dict[str, Any]:
    """Wait for the actor start calls `pending` (ref -> who, e.g. "vLLM engine 0"); returns who -> what its call
    returned. One that does not finish within `timeout_s` raises ActorTimeoutError, one that fails raises naming the
    actor: a user error inside it (a bad model file, a config the engine refuses) as ClusterError (exit 2, not
    retried), anything else (an OOM-killed actor, a crash: a retry may pass it) as RuntimeError."""
    import ray

    refs = list(pending)
    if timeout_s is not None and refs:
        _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if late:
            raise ActorTimeoutError(
                f"{', '.join(pending[r] for r in late)} did not start within {timeout_s:g} s "
                f"(rollout.timeout_s / train.timeout_s); see the actor's log above"
            )
    answers = {}
    for ref, who in pending.items():
        try:
            answers[who] = ray.get(ref)
        except Exception as e:
            if isinstance(getattr(e, "cause", None), VimeError) or isinstance(e, VimeError):
                raise ClusterError(f"{who} failed to start: {e}") from e
            if died_starting(e):
                from vime_core.actor_logs import dead_actor_tail

                tail = dead_actor_tail(e)
                raise ActorLostError(f"{who} failed to start: {e}" + (f"\n{tail}" if tail else ""), who) from e
            raise RuntimeError(f"{who} failed to start: {e}") from e
    return answers


class ActorLostError(RuntimeError):
    """An actor's process died before its start call answered: killed (the kernel's OOM killer, a signal) or crashed,
    not an exception its own code raised. The run's start may be tried again (`cluster.start_attempts`)."""

    def __init__(self, message: str, who: str):
        super().__init__(message)
        self.who = who


def died_starting(error: BaseException) -> bool:
    """Ray's error for an actor whose process is gone (RayActorError) other than one whose `__init__` raised: that
    one is its code's answer, and a second start would give it again."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # no Ray (a unit test's stand-in): nothing died
        return False
    return isinstance(error, RayActorError) and not error.actor_init_failed


def wait_ready(
    trainers: list,
    engines: list,
    timeout_s: float | None = None,
    engines_first: bool = False,
    before_trainers: Callable[[], object] = lambda: None,
) -> str:
    """Wait for trainers and engines to start (concurrently); a failure names the actor that failed. Returns where
    the start's time went, for the log (`start_parts`): a GPU start takes minutes, and the parts say which to cut.

    `engines_first` (colocated GPUs, `Placement.colocated_gpu`; the trainers were made with `defer_start`): the
    trainers' GPU work (`Trainer.start`) begins once every engine is up. vLLM sizes its KV cache from the whole
    device's memory change between its start and the end of its profiling run, so a trainer allocating its ~16 GiB
    (Qwen3-1.7B) on the same GPU meanwhile is charged to the engine (vllm-project/vllm#55827): a smaller cache,
    samples preempted. slime, too, creates its rollout engines first; the trainers' processes and imports still
    overlap their start. `before_trainers` runs in between: sleeping engines go to sleep (Qwen3-8B's 30 GiB gradient
    buffer did not fit beside an awake 84 GiB engine on one H200)."""
    t0 = time.perf_counter()
    engine_refs = {e.ready.remote(): f"vLLM engine {i}" for i, e in enumerate(engines)}
    engine_names = list(engine_refs.values())  # each one's ready() answers its LLM()'s seconds
    marks, answers = [], {}
    if engines_first:
        answers = wait_started(engine_refs, timeout_s)
        marks.append(("engines up", time.perf_counter() - t0))
        engine_refs = {}
        before_trainers()
        marks.append(("asleep", time.perf_counter() - t0))
    trainer_refs = {a.start.remote(): f"trainer rank {i}" for i, a in enumerate(trainers)}
    answers |= wait_started(trainer_refs | engine_refs, timeout_s)
    marks.append(("all up", time.perf_counter() - t0))
    return start_parts(marks, max((answers[name] for name in engine_names), default=None))


def start_parts(marks: list[tuple[str, float]], llm_s: float | None) -> str:
    """Each mark's time since the actors were asked to start, and the slowest engine's `LLM()`: e.g. "engines up at
    80.1 s, asleep at 81.3 s, all up at 139.0 s; vLLM's LLM() 61.0 s". What LLM() leaves of the engines' part is
    their processes' start and imports."""
    text = ", ".join(f"{name} at {at:.1f} s" for name, at in marks)
    return text if llm_s is None else f"{text}; vLLM's LLM() {llm_s:.1f} s"
