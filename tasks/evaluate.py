"""Stage 5: held-out evaluation of a policy through vLLM (pass@1, pass@k, response length, truncation)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from tasks.common import RETRY_DELAYS, artifact_key, cfg_of, markdown
from tasks.tracking import tracking_target
from vime_core.evaluation import evaluate_model
from vime_core.sources import content_hash
from vime_core.tracking import MlflowRun


def _cache_key(context: TaskRunContext, params: dict[str, Any]) -> str:
    """Same weights + same eval settings = same numbers (eval sampling is seeded)."""
    cfg = cfg_of(params["config"])
    ev = json.dumps({"eval": cfg.eval.model_dump(mode="json"), "seed": cfg.seed, "reward": cfg.rollout.reward}, sort_keys=True)
    return f"evaluate-{content_hash(Path(params['model_dir']))}-{hashlib.sha256(ev.encode()).hexdigest()[:16]}"


@task(name="evaluate", retries=1, retry_delay_seconds=RETRY_DELAYS, cache_key_fn=_cache_key, persist_result=True)
def evaluate(config: dict[str, Any], model_dir: str) -> dict[str, float]:
    """Evaluate `model_dir` (HF) on cfg.eval.datasets. Pure (cached by weights + settings); logging is separate."""
    return evaluate_model(cfg_of(config), model_dir)


@task(name="log-evaluation", retries=2, retry_delay_seconds=[2, 10])
def log_evaluation(config: dict[str, Any], metrics: dict[str, float], model_dir: str, parent_run_id: str | None = None,
                   label: str = "final") -> None:
    """An MLflow run of its own (a child of the pipeline's run when there is one), the summary on the parent, and a
    Prefect artifact."""
    cfg = cfg_of(config)
    if cfg.tracking.enabled:
        uri, experiment = tracking_target(cfg)
        child = MlflowRun(uri, experiment, run_name=f"evaluate-{label}", parent_run_id=parent_run_id,
                          tags={"vime.stage": "evaluate", "vime.model_dir": str(model_dir)})
        child.log_metrics(0, metrics)
        child.end()
        if parent_run_id:
            MlflowRun(uri, experiment, run_id=parent_run_id).log_metrics(
                cfg.rollout.num_rollout, {f"final_{k}": v for k, v in metrics.items()})
    markdown(f"Held-out evaluation ({label})", {k: v for k, v in metrics.items() if k.startswith("eval/")},
             artifact_key(cfg.name, "evaluate", label))
