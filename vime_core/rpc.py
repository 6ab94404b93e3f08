"""Calls to groups of Ray actors with a bound: a call that does not finish in time raises naming the actor, what it
was doing and the setting that bounds it. Below the cluster (which creates the actors) and everything that calls
them (router, trainer group, weight sync), so none of those imports the cluster for it."""

from __future__ import annotations

from typing import Any, Callable

from vime_core.errors import ActorTimeoutError, ClusterError, VimeError


def gather(refs: list, who: list[str], doing: str, timeout_s: float | None, setting: str) -> list:
    """`ray.get(refs)`, but a call that does not finish within `timeout_s` raises ActorTimeoutError naming the
    actor(s) still busy (`who[i]` for `refs[i]`), what they were doing and the setting that bounds it."""
    import ray

    if timeout_s is not None and refs:
        _, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if late:
            names = [w for r, w in zip(refs, who) if r in set(late)]
            raise ActorTimeoutError(
                f"{', '.join(names)} did not finish {doing} within {timeout_s:g} s ({setting}): the actor is hung or "
                f"far slower than expected; check its log above, or raise {setting}"
            )
    return ray.get(list(refs))


def call_all(
    actors: list, kind: str, method: str, args: tuple[Any, ...], timeout_s: float | None, setting: str
) -> list:
    """`method(*args)` on every actor of a group (`kind` names one in errors: "vLLM engine", "trainer rank")."""
    refs = [getattr(a, method).remote(*args) for a in actors]
    return gather(refs, [f"{kind} {i}" for i in range(len(refs))], method, timeout_s, setting)


def wait_started(pending: dict, timeout_s: float | None) -> None:
    """Wait for the actor start calls `pending` (ref -> who, e.g. "vLLM engine 0"); one that does not finish within
    `timeout_s` raises ActorTimeoutError, one that fails raises naming the actor: a user error inside it (a bad model
    file, a config the engine refuses) as ClusterError (exit 2, not retried), anything else (an OOM-killed actor, a
    crash: a retry may pass it) as RuntimeError."""
    import ray

    refs = list(pending)
    if timeout_s is not None and refs:
        _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if late:
            raise ActorTimeoutError(
                f"{', '.join(pending[r] for r in late)} did not start within {timeout_s:g} s "
                f"(rollout.timeout_s / train.timeout_s); see the actor's log above"
            )
    for ref, who in pending.items():
        try:
            ray.get(ref)
        except Exception as e:
            if isinstance(getattr(e, "cause", None), VimeError) or isinstance(e, VimeError):
                raise ClusterError(f"{who} failed to start: {e}") from e
            raise RuntimeError(f"{who} failed to start: {e}") from e


def wait_ready(
    trainers: list,
    engines: list,
    timeout_s: float | None = None,
    engines_first: bool = False,
    before_trainers: Callable[[], object] = lambda: None,
):
    """Wait for trainers and engines to start (concurrently); a failure names the actor that failed.

    `engines_first` (colocated GPUs, `Placement.colocated_gpu`; the trainers were made with `defer_start`): the
    trainers' GPU work (`Trainer.start`) begins once every engine is up. vLLM sizes its KV cache from the whole
    device's memory change between its start and the end of its profiling run, so a trainer allocating its ~16 GiB
    (Qwen3-1.7B) on the same GPU meanwhile is charged to the engine (vllm-project/vllm#55827): a smaller cache,
    samples preempted. slime, too, creates its rollout engines first; the trainers' processes and imports still
    overlap their start. `before_trainers` runs in between: sleeping engines go to sleep (Qwen3-8B's 30 GiB gradient
    buffer did not fit beside an awake 84 GiB engine on one H200)."""
    engine_refs = {e.ready.remote(): f"vLLM engine {i}" for i, e in enumerate(engines)}
    if engines_first:
        wait_started(engine_refs, timeout_s)
        engine_refs = {}
        before_trainers()
    wait_started({a.start.remote(): f"trainer rank {i}" for i, a in enumerate(trainers)} | engine_refs, timeout_s)
