"""Held-out evaluation through the rollout engines: pass@1, pass@k (unbiased), response length, truncation.

Each eval prompt's sampling seed depends only on the run seed, the dataset and the prompt, so evaluations before and
after training draw the same random numbers: their difference measures the policy, not sampling noise.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from vime_core.algo import pass_at_k
from vime_core.data import PromptSet
from vime_core.prepare import prepare
from vime_core.rollout import GroupRequest, SamplingSpec
from vime_core.router import RolloutRouter, request_seed


def eval_spec(cfg) -> SamplingSpec:
    e = cfg.eval
    return SamplingSpec(
        e.n_samples_per_eval_prompt,
        e.temperature,
        e.top_p,
        -1,
        e.max_response_len or cfg.rollout.max_response_len,
        tuple(cfg.rollout.stop),
    )


def evaluate(router: RolloutRouter, eval_sets: dict[str, PromptSet], cfg, reward_model) -> dict[str, float]:
    spec = eval_spec(cfg)
    k = cfg.eval.pass_k
    metrics: dict[str, float] = {}
    for name, prompts in eval_sets.items():
        t0 = time.perf_counter()
        requests = [
            GroupRequest(p.template(group_id=i), request_seed(cfg.seed, "eval", name, p.index))
            for i, p in enumerate(prompts.prompts)
        ]
        groups = router.generate(requests, spec, cfg.eval.timeout_s, "eval.timeout_s")  # a whole eval set per call
        reward_model.score(groups)
        correct = [sum(1 for s in g if s.reward and s.reward > 0.5) for g in groups]
        samples = [s for g in groups for s in g]
        metrics[f"eval/{name}/pass@1"] = statistics.fmean(pass_at_k(spec.n, c, 1) for c in correct)
        if k > 1:
            metrics[f"eval/{name}/pass@{k}"] = statistics.fmean(pass_at_k(spec.n, c, k) for c in correct)
        metrics[f"eval/{name}/response_len/mean"] = statistics.fmean(s.response_len for s in samples)
        metrics[f"eval/{name}/truncated_ratio"] = statistics.fmean(1.0 if s.truncated else 0.0 for s in samples)
        metrics[f"eval/{name}/num_prompts"] = float(len(groups))
        metrics[f"perf/eval_time/{name}"] = time.perf_counter() - t0
    return metrics


def eval_rows(metrics: dict[str, float]) -> list[dict[str, float | str]]:
    """`eval/<dataset>/<stat>` metrics as one row per dataset ({"dataset": name, stat: value, ...}), in first-seen
    order: the shape of a table (a Prefect table artifact compares datasets side by side)."""
    rows: dict[str, dict[str, float | str]] = {}
    for key, value in metrics.items():
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == "eval":
            rows.setdefault(parts[1], {"dataset": parts[1]})[parts[2]] = value
    return list(rows.values())


def evaluate_model(cfg, model_dir) -> dict[str, float]:
    """Evaluate an HF checkpoint on `cfg.eval.datasets` with fresh vLLM engines (no trainer)."""
    from vime_core.cluster import create_engines, init_ray, make_placement, shutdown_ray
    from vime_core.rpc import wait_ready
    from vime_core.start_retry import start_with_retry

    p = prepare(cfg, Path(model_dir), eval_only=True)
    if not p.eval_sets:
        raise ValueError("eval.datasets is empty: nothing to evaluate")

    def start_engines() -> list:
        engines = create_engines(cfg, make_placement(cfg, p.platform, engines_only=True), p.platform, str(p.model_dir))
        wait_ready([], engines, cfg.rollout.timeout_s)
        return engines

    init_ray(cfg, p.platform)
    try:
        engines = start_with_retry(cfg, p.platform, start_engines)
        return evaluate(
            RolloutRouter(engines, cfg.rollout.timeout_s, cfg.rollout.stall_timeout_s), p.eval_sets, cfg, p.reward_model
        )
    finally:
        shutdown_ray()
