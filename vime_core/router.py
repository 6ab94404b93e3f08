"""The router that spreads prompt groups over the rollout engines (vime_core.rollout) and gathers their samples, and
one rollout step: data buffer -> engines -> rewards (-> dynamic sampling)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from vime_core.metrics import rollout_metrics
from vime_core.rollout import GroupRequest, SamplingSpec
from vime_core.rpc import Stall, call_all, gather
from vime_core.sample import Sample


def assign_groups(costs: list[int], num_engines: int) -> list[list[int]]:
    """Indices of groups per engine, balancing the summed cost (prompt tokens x samples); longest first, so that
    the assignment is deterministic for a given batch."""
    loads = [0] * num_engines
    out: list[list[int]] = [[] for _ in range(num_engines)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        e = min(range(num_engines), key=lambda k: (loads[k], k))
        out[e].append(i)
        loads[e] += costs[i]
    return [sorted(ix) for ix in out]


class RolloutRouter:
    """Spreads groups over engine actors and gathers the samples back in request order."""

    def __init__(self, engines: list[Any], timeout_s: float | None = None, stall_s: float | None = None):
        if not engines:
            raise ValueError("the router needs at least one engine")
        self.engines = engines
        self.timeout_s = timeout_s  # rollout.timeout_s: a call that takes longer raises naming the engine
        # rollout.stall_timeout_s: an engine that completes no engine step for this long raises much sooner
        self.stall = (
            Stall(stall_s, "rollout.stall_timeout_s", "no engine step finished (no token produced)")
            if stall_s
            else None
        )

    def generate(
        self,
        requests: list[GroupRequest],
        spec: SamplingSpec,
        timeout_s: float | None = None,
        setting: str = "rollout.timeout_s",
        cold_cache: bool = False,
    ) -> list[list[Sample]]:
        """`timeout_s`/`setting`: another bound than rollout.timeout_s (an eval set: eval.timeout_s). `cold_cache`:
        every engine drops its prefix cache first (those given no group meanwhile, in a call of its own)."""
        parts = assign_groups([len(r.template.prompt_ids) * spec.n for r in requests], len(self.engines))
        busy = [(e, ix) for e, ix in enumerate(parts) if ix]
        futures = [self.engines[e].generate.remote([requests[i] for i in ix], spec, cold_cache) for e, ix in busy]
        idle = [e for e, ix in enumerate(parts) if not ix] if cold_cache else []
        resets = [self.engines[e].reset_prefix_cache.remote() for e in idle]
        results = gather(
            futures + resets,
            [f"vLLM engine {e}" for e, _ in busy] + [f"vLLM engine {e}" for e in idle],
            f"generate ({sum(len(ix) for _, ix in busy)} prompt groups)",
            timeout_s or self.timeout_s,
            setting,
            self.stall,
        )[: len(futures)]
        out: list[list[Sample] | None] = [None] * len(requests)
        for (_, ix), groups in zip(busy, results):
            for i, group in zip(ix, groups):
                out[i] = group
        return out  # type: ignore[return-value]

    def call_all(
        self, method: str, *args: Any, timeout_s: float | None = None, setting: str = "rollout.timeout_s"
    ) -> list[Any]:
        return call_all(self.engines, "vLLM engine", method, args, timeout_s or self.timeout_s, setting)


# --------------------------------------------------------------------------------------------------------------------
# one rollout step: buffer -> engines -> rewards (-> dynamic sampling)
# --------------------------------------------------------------------------------------------------------------------
def request_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any parts (run seed, rollout id, attempt, position): resumes sample identically."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def rollout_seed(run_seed: int, rollout_id: int, attempt: int, position: int) -> int:
    """The sampling seed of a rollout's request: the group at `position` of sampling attempt `attempt`."""
    return request_seed(run_seed, rollout_id, attempt, position)


def sampling_spec(cfg) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(r.n_samples_per_prompt, r.temperature, r.top_p, r.top_k, r.max_response_len, tuple(r.stop))


def collect_rollout(
    rollout_id: int, cfg, buffer, router: RolloutRouter, reward_model
) -> tuple[list[list[Sample]], dict[str, float], list[int]]:
    """Generate and score `rollout_batch_size` groups. With dynamic sampling, groups whose rewards are all equal
    (no learning signal) are dropped and more prompts are generated, up to `max_sampling_attempts`; if still short,
    dropped groups fill the batch (they carry zero advantage) so that the batch arithmetic holds.

    Returns (groups, metrics, dataset indices of every prompt the step consumed)."""
    r = cfg.rollout
    spec = sampling_spec(cfg)
    want = r.rollout_batch_size
    per_attempt = r.over_sampling_batch_size if r.dynamic_sampling else want
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    generated: list[list[Sample]] = []
    attempts = 0
    t0 = time.perf_counter()
    while len(kept) < want and attempts < (r.max_sampling_attempts if r.dynamic_sampling else 1):
        prompts = buffer.next_batch(per_attempt)
        base = len(generated)
        requests = [
            GroupRequest(p.template(group_id=base + i), rollout_seed(cfg.seed, rollout_id, attempts, i))
            for i, p in enumerate(prompts)
        ]
        # a cold prefix cache at every step: a resumed run then samples exactly as the uninterrupted one would
        groups = router.generate(requests, spec, cold_cache=attempts == 0)
        reward_model.score(groups)
        generated += groups
        for g in groups:
            informative = len({s.reward for s in g}) > 1
            (kept if informative or not r.dynamic_sampling else dropped).append(g)
        attempts += 1
    rollout_time = time.perf_counter() - t0
    shortfall = max(0, want - len(kept))
    batch = (kept + dropped[:shortfall])[:want]
    for gid, g in enumerate(batch):
        for s in g:
            s.group_id = gid
    consumed = [g[0].metadata.get("index") for g in generated]
    metrics = rollout_metrics(generated, rollout_time, cfg.rollout_devices)
    if r.dynamic_sampling:
        metrics.update(
            {
                "rollout/dynamic_sampling/attempts": float(attempts),
                "rollout/dynamic_sampling/kept_groups": float(len(kept)),
                "rollout/dynamic_sampling/dropped_groups": float(len(dropped)),
                "rollout/dynamic_sampling/shortfall": float(shortfall),
            }
        )
    return batch, metrics, consumed
