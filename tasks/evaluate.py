"""Stage 5: held-out evaluation of a policy through vLLM (pass@1, pass@k, response length, truncation)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext

from tasks.common import RETRY_DELAYS, TIMEOUTS, artifact_key, cfg_of, is_transient, table
from tasks.tracking import tracking_target
from vime_core.evaluation import eval_rows, evaluate_model
from vime_core.sources import content_hash, weights_digest
from vime_core.tracking import WEIGHTS_TAG, MlflowRun


def _cache_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    """Same weights + same eval settings = same numbers (eval sampling is seeded)."""
    cfg = cfg_of(params["config"])
    ev = json.dumps(
        {"eval": cfg.eval.model_dump(mode="json"), "seed": cfg.seed, "reward": cfg.rollout.reward}, sort_keys=True
    )
    return f"evaluate-{content_hash(Path(params['model_dir']))}-{hashlib.sha256(ev.encode()).hexdigest()[:16]}"


@task(
    name="evaluate",
    retries=1,
    retry_delay_seconds=RETRY_DELAYS,
    cache_key_fn=_cache_key,
    persist_result=True,
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["evaluate"],
)
def evaluate(config: dict[str, Any], model_dir: str) -> dict[str, float]:
    """Evaluate `model_dir` (HF) on cfg.eval.datasets. Pure (cached by weights + settings); logging is separate."""
    get_run_logger().info(f"evaluating {model_dir} on {', '.join(d.name for d in cfg_of(config).eval.datasets)}")
    return evaluate_model(cfg_of(config), model_dir)


@task(name="log-evaluation", retries=2, retry_delay_seconds=[2, 10], timeout_seconds=TIMEOUTS["tracking"])
def log_evaluation(
    config: dict[str, Any],
    metrics: dict[str, float],
    model_dir: str,
    parent_run_id: str | None = None,
    label: str = "final",
    step: int | None = None,
) -> None:
    """An MLflow run of its own (a child of the pipeline's run when there is one) at `step` = the rollout steps the
    evaluated weights were trained on, the `final_` metrics on the parent at that step, and a Prefect artifact. The
    child's tag vime.weights_sha256 identifies the files scored (the registered version carries the same tag)."""
    cfg = cfg_of(config)
    step = cfg.rollout.num_rollout if step is None else step
    if cfg.tracking.enabled:
        uri, experiment = tracking_target(cfg)
        child = MlflowRun(
            uri,
            experiment,
            run_name=f"evaluate-{label}",
            parent_run_id=parent_run_id,
            tags={
                "vime.stage": "evaluate",
                "vime.model_dir": str(model_dir),
                "vime.eval.step": str(step),
                WEIGHTS_TAG: weights_digest(Path(model_dir)),
            },
        )
        child.log_metrics(step, metrics)
        child.end()
        if parent_run_id:
            MlflowRun(uri, experiment, run_id=parent_run_id).log_metrics(
                step, {f"final_{k}": v for k, v in metrics.items()}
            )
    table(
        f"Held-out evaluation ({label}), one row per dataset",
        eval_rows(metrics),
        artifact_key(cfg.name, "evaluate", label),
    )
