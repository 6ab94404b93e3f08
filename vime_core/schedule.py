"""When each rollout runs and which policy version it samples from: one scheduler for both loop modes.

Versions: version v is the policy after v training steps (the weights a run starts or resumes with are version
`first_version`, the step it starts at). Rollout j samples from exactly

    behaviour_version(j) = max(first_version, j - max_staleness)

so its staleness (j - version: how many optimizer rounds the trainer is ahead of the policy that sampled it) never
exceeds `rollout.max_staleness`, and which weights a rollout used never depends on timing: a resumed run repeats an
uninterrupted one. The engines only ever hold one version; version v is pushed after training step v - 1 once every
rollout that must use an older version (j <= v - 1 + max_staleness) has finished, and only then do the rollouts that
may use v start. With max_staleness = 0 that is today's on-policy loop (rollout, train, push, next rollout), run
inline on the caller's thread; with 1 it is slime's train_async.py (rollout k+1 runs while step k trains); with N,
rollouts run up to N versions ahead, one at a time in submission order (on one thread), so the data buffer serves
prompts in the same order in both modes.

A checkpoint taken after the push of version v holds the finished rollouts v .. v - 1 + N (`carried`): they were
sampled from versions the checkpoint no longer has, so a resume trains on them instead of sampling them again.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vime_core.errors import VimeError
from vime_core.sample import Sample

log = logging.getLogger(__name__)

INFLIGHT_FILE = "inflight_rollouts.json"  # in a checkpoint of an async run: the rollouts it carries
VERSION_KEY = "policy_version"  # Sample.metadata key: the policy version that generated the sample


class StalenessResumeError(VimeError, RuntimeError):
    """A checkpoint cannot be resumed with this rollout.max_staleness; the message says why and what to do."""


# --------------------------------------------------------------------------------------------------------------------
# the schedule as pure functions
# --------------------------------------------------------------------------------------------------------------------
def behaviour_version(rollout_id: int, first_version: int, max_staleness: int) -> int:
    """The policy version rollout `rollout_id` samples from."""
    return max(first_version, rollout_id - max_staleness)


def last_rollout_before_push(version: int, max_staleness: int) -> int:
    """Rollouts up to this id sample from versions older than `version`: they finish before `version` is pushed."""
    return version - 1 + max_staleness


def startable(next_id: int, loaded_version: int, max_staleness: int, num_rollout: int) -> range:
    """Rollout ids (from `next_id`, in order) that may start while the engines hold `loaded_version`."""
    return range(next_id, min(loaded_version + max_staleness, num_rollout - 1) + 1)


def staleness_metrics(rollout_id: int, versions: list[int]) -> dict[str, float]:
    """rollout/staleness/{mean,max} of the samples trained at step `rollout_id` (the trainer holds version
    rollout_id then)."""
    gaps = [rollout_id - v for v in versions] or [0]
    return {"rollout/staleness/mean": sum(gaps) / len(gaps), "rollout/staleness/max": float(max(gaps))}


def wait_time_ratio(wait_s: float, step_s: float) -> float:
    """perf/wait_time_ratio: the share of a step the trainer spent waiting for rollout data."""
    return min(1.0, wait_s / step_s) if step_s > 0 else 0.0


# --------------------------------------------------------------------------------------------------------------------
# finished rollouts (and their place in a checkpoint)
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class FinishedRollout:
    """What one rollout step produced: scored groups, rollout metrics, the dataset indices it consumed."""

    rollout_id: int
    version: int
    groups: list[list[Sample]]
    metrics: dict[str, float]
    consumed: list[int]
    wait_s: float = 0.0  # how long the trainer waited for it (set by the scheduler)

    def versions(self) -> list[int]:
        return [s.metadata.get(VERSION_KEY, self.version) for g in self.groups for s in g]

    def to_dict(self) -> dict:
        return {
            "rollout_id": self.rollout_id,
            "version": self.version,
            "metrics": self.metrics,
            "consumed": self.consumed,
            "groups": [[s.to_dict() for s in g] for g in self.groups],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "FinishedRollout":
        return cls(
            d["rollout_id"],
            d["version"],
            [[Sample.from_dict(s) for s in g] for g in d["groups"]],
            d["metrics"],
            d["consumed"],
        )


def write_inflight(ckpt_dir: Path, rollouts: list[FinishedRollout]) -> list[int]:
    """Write the carried rollouts into a checkpoint being written; returns their ids (for its state)."""
    # json writes floats by repr, which reads back to the same float: the resumed run trains on identical samples
    (ckpt_dir / INFLIGHT_FILE).write_text(json.dumps({"rollouts": [r.to_dict() for r in rollouts]}))
    return [r.rollout_id for r in rollouts]


def read_inflight(ckpt_dir: Path, state: dict) -> list[FinishedRollout]:
    ids = state.get("inflight_rollouts") or []
    if not ids:
        return []
    rollouts = [FinishedRollout.from_dict(d) for d in json.loads((ckpt_dir / INFLIGHT_FILE).read_text())["rollouts"]]
    if [r.rollout_id for r in rollouts] != ids:
        raise StalenessResumeError(
            f"{ckpt_dir / INFLIGHT_FILE} holds rollouts {[r.rollout_id for r in rollouts]} but "
            f"its state.json names {ids}: the checkpoint is inconsistent; resume from an older one"
        )
    return rollouts


def check_staleness_resume(state: dict, max_staleness: int) -> None:
    """A run resumes with the staleness it was saved with: the rollouts a checkpoint carries were scheduled for it."""
    saved = int(state.get("max_staleness", 0))
    if saved != max_staleness:
        raise StalenessResumeError(
            f"the checkpoint was written with rollout.max_staleness = {saved}, this run has {max_staleness}: the "
            f"rollouts in flight were scheduled for {saved}; set rollout.max_staleness = {saved} to resume, or start "
            f"fresh with --set checkpoint.start_fresh=true"
        )


# --------------------------------------------------------------------------------------------------------------------
# the scheduler
# --------------------------------------------------------------------------------------------------------------------
RunRollout = Callable[[int, int], FinishedRollout]  # (rollout_id, version) -> the finished rollout


@dataclass
class RolloutScheduler:
    """Runs rollouts by the schedule above. The loop calls, per step k: `take(k)`, trains, `before_push(k + 1)`,
    pushes, `pushed(k + 1)`, and `submit_ready()` once the engines may be used by rollouts again (after an
    evaluation). With max_staleness = 0 nothing runs in the background: `take` samples on the caller's thread."""

    run_rollout: RunRollout
    max_staleness: int
    num_rollout: int
    first_version: int
    carried_in: list[FinishedRollout] = field(default_factory=list)

    def __post_init__(self):
        self.loaded = self.first_version
        self.finished: dict[int, FinishedRollout] = {r.rollout_id: r for r in self.carried_in}
        self.running: dict[int, Future] = {}
        self.next_id = max(self.finished, default=self.first_version - 1) + 1
        # one thread: rollouts run one after the other in id order, as the data buffer must serve them
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="vime-rollout") if self.max_staleness > 0 else None

    @property
    def inline(self) -> bool:
        return self.pool is None

    def submit_ready(self) -> list[int]:
        """Start every rollout that may use the loaded version (none inline: `take` runs it)."""
        if self.inline:
            return []
        ids = list(startable(self.next_id, self.loaded, self.max_staleness, self.num_rollout))
        for j in ids:
            version = behaviour_version(j, self.first_version, self.max_staleness)
            assert version == self.loaded, (j, version, self.loaded)  # the schedule's invariant
            self.running[j] = self.pool.submit(self.run_rollout, j, version)
        self.next_id += len(ids)
        return ids

    def take(self, rollout_id: int) -> FinishedRollout:
        """The finished rollout of step `rollout_id`, waiting for it (inline: sampling it now)."""
        t0 = time.perf_counter()
        if self.inline and rollout_id not in self.finished:
            done = self.run_rollout(rollout_id, behaviour_version(rollout_id, self.first_version, 0))
        else:
            if rollout_id not in self.finished and rollout_id not in self.running:
                self.submit_ready()
            done = self.finished.pop(rollout_id, None) or self.running.pop(rollout_id).result()
        done.wait_s = time.perf_counter() - t0
        return done

    def before_push(self, version: int) -> float:
        """Wait for the rollouts that sample from versions older than `version`; returns the seconds waited."""
        t0 = time.perf_counter()
        last = last_rollout_before_push(version, self.max_staleness)
        for j in sorted(self.running):
            if j <= last:
                self.finished[j] = self.running.pop(j).result()
        return time.perf_counter() - t0

    def pushed(self, version: int) -> None:
        self.loaded = version

    def carried(self) -> list[FinishedRollout]:
        """The finished rollouts not trained yet, for a checkpoint (call between `before_push` and `submit_ready`:
        nothing runs then, so they and the data buffer's position belong together)."""
        if self.running:
            raise RuntimeError(f"rollouts {sorted(self.running)} still run: a checkpoint cannot record them")
        return [self.finished[j] for j in sorted(self.finished)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------------------------------
# CPU threads
# --------------------------------------------------------------------------------------------------------------------
