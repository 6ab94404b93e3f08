"""Calls to groups of Ray actors with a bound: a call that does not finish in time raises naming the actor, what it
was doing and the setting that bounds it. Below the cluster (which creates the actors) and everything that calls
them (router, trainer group, weight sync), so none of those imports the cluster for it."""

from __future__ import annotations

from typing import Any

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
