"""Start (or continue) the pipeline's MLflow run, and close it."""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.common import cfg_of
from vime_core.checkpoint import Checkpointer
from vime_core.config import dump_config, flatten
from vime_core.platform import detect_platform
from vime_core.tracking import MlflowRun, environment_tags, resolve_tracking_uri, safe_params


def tracking_target(cfg) -> tuple[str, str]:
    return resolve_tracking_uri(cfg), cfg.tracking.experiment or cfg.name


def run_id_to_continue(cfg) -> str | None:
    """A run that resumes from a checkpoint continues the MLflow run that wrote it."""
    if cfg.checkpoint.start_fresh or not cfg.checkpoint.resume:
        return None
    latest = Checkpointer(cfg.save_dir).latest()
    if latest is None:
        return None
    return Checkpointer.read_state(latest).get("run_state", {}).get("mlflow_run_id")


@task(name="start-tracking", retries=2, retry_delay_seconds=[2, 10])
def start_tracking(config: dict[str, Any], model: dict[str, Any], flow_run_name: str | None = None) -> str | None:
    """-> MLflow run id (None when tracking is disabled). Params = the flattened config; tags = environment."""
    cfg = cfg_of(config)
    if not cfg.tracking.enabled:
        return None
    uri, experiment = tracking_target(cfg)
    tags = environment_tags(detect_platform(cfg.cluster.platform))
    tags |= {"vime.config": cfg.name, "vime.model.source": model["source"], "vime.model.hash": model["content_hash"]}
    if flow_run_name:
        tags["prefect.flow_run"] = flow_run_name
    run = MlflowRun(uri, experiment, run_name=flow_run_name, run_id=run_id_to_continue(cfg), tags=tags,
                    artifact_root=cfg.output_dir.resolve().parent / "mlartifacts")
    run.log_params(safe_params(flatten(cfg)))
    run.log_text(dump_config(cfg), "config.yaml")
    return run.run_id


@task(name="finish-tracking")
def finish_tracking(config: dict[str, Any], run_id: str | None, summary: dict[str, float], status: str = "FINISHED") -> None:
    cfg = cfg_of(config)
    if not run_id:
        return
    uri, experiment = tracking_target(cfg)
    run = MlflowRun(uri, experiment, run_id=run_id)
    run.log_metrics(0, {f"summary/{k}": v for k, v in summary.items()})
    run.end(status)
