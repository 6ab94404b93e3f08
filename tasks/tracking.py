"""Start (or continue) the pipeline's MLflow run, and close it."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.runtime import flow_run as prefect_flow_run

from tasks.common import TIMEOUTS, artifact_key, cfg_of, is_transient, link
from vime_core.checkpoint import Checkpointer
from vime_core.config import dump_config, flatten
from vime_core.platform import detect_platform
from vime_core.tracking import (
    MlflowRun,
    check_reachable,
    environment_tags,
    find_run_by_tag,
    local_artifact_root,
    resolve_tracking_uri,
    run_url,
    safe_params,
)

FLOW_RUN_TAG = "prefect.flow_run_id"
FLOW_RUN_NAME_TAG = "prefect.flow_run_name"


def tracking_target(cfg) -> tuple[str, str]:
    return resolve_tracking_uri(cfg), cfg.tracking.experiment or cfg.name


def run_id_to_continue(cfg, flow_run_id: str | None = None) -> str | None:
    """A run that resumes from a checkpoint continues the MLflow run that wrote it; a retried flow run that had
    not checkpointed yet continues the run it opened (found by its flow run id tag)."""
    if cfg.checkpoint.start_fresh or not cfg.checkpoint.resume:
        return None
    # a cheap look (sizes, state.json): the train task's loop verifies every checksum anyway before it resumes
    latest = Checkpointer(cfg.save_dir).peek_latest()
    if latest is not None:
        run_id = Checkpointer.read_state(latest).get("run_state", {}).get("mlflow_run_id")
        if run_id:
            return run_id
    if flow_run_id:
        return find_run_by_tag(*tracking_target(cfg), FLOW_RUN_TAG, flow_run_id)
    return None


def dataset_inputs(cfg, datasets: list[dict[str, Any]]) -> list[dict[str, str]]:
    by_source = {d["source"]: d["content_hash"] for d in datasets}
    out = [
        {
            "name": "train",
            "source": cfg.data.source,
            "digest": by_source.get(cfg.data.source, ""),
            "context": "training",
        }
    ]
    out += [
        {"name": d.name, "source": d.source, "digest": by_source.get(d.source, ""), "context": "eval"}
        for d in cfg.eval.datasets
    ]
    return out


@task(
    name="start-tracking",
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["tracking"],
)
def start_tracking(
    config: dict[str, Any],
    model: dict[str, Any],
    run_name: str | None = None,
    flow_run_id: str | None = None,
    datasets: list[dict[str, Any]] | None = None,
) -> str | None:
    """-> MLflow run id (None when tracking is disabled). Params = the flattened config; tags = environment, source,
    the Prefect flow run; inputs = the datasets."""
    cfg = cfg_of(config)
    if not cfg.tracking.enabled:
        return None
    uri, experiment = tracking_target(cfg)
    # one clear, retried TrackingUnreachableError before the first lookup (a run to continue, by checkpoint or
    # flow run tag), which would otherwise end the retries in MLflow's raw "API request ... failed"
    check_reachable(uri)
    tags = environment_tags(detect_platform(cfg.cluster.platform))
    tags |= {
        "vime.config": cfg.name,
        "vime.model.source": model["source"],
        "vime.model.hash": model["content_hash"],
        "vime.output_dir": str(cfg.output_dir),
        "mlflow.source.name": "flows/grpo_pipeline.py",
        "mlflow.source.type": "JOB",
    }
    if flow_run_id:
        # `--flow-run-name` reaches MLflow: the run's name is the night's unique label, the flow run's name is a
        # tag (searchable: tags.`prefect.flow_run_name` = 'lr-probe') and the run's description
        name = prefect_flow_run.get_name()
        tags |= {FLOW_RUN_TAG: flow_run_id, FLOW_RUN_NAME_TAG: name}
        tags["mlflow.note.content"] = f"Prefect flow run `{name}` ({flow_run_id})"
    continued = run_id_to_continue(cfg, flow_run_id)
    run = MlflowRun(
        uri,
        experiment,
        run_name=run_name,
        run_id=continued,
        tags=tags,
        artifact_root=local_artifact_root(uri, cfg.output_dir),
    )
    changed = run.log_params(safe_params(flatten(cfg)))
    if changed:
        print(
            f"continuing MLflow run {run.run_id} with changed settings (tag vime.params_changed): {'; '.join(changed)}"
        )
    if continued and flow_run_id:  # the run keeps the flow run that opened it; this one is the latest to continue it
        run.set_tags({"prefect.last_flow_run_id": flow_run_id})
    run.log_text(dump_config(cfg), "config.yaml")
    run.log_datasets(dataset_inputs(cfg, datasets or []))
    experiment_id = run.client.get_run(run.run_id).info.experiment_id
    link("MLflow run of this pipeline", run_url(uri, experiment_id, run.run_id), artifact_key(cfg.name, "mlflow-run"))
    return run.run_id


@task(name="finish-tracking", timeout_seconds=TIMEOUTS["tracking"])
def finish_tracking(
    config: dict[str, Any],
    run_id: str | None,
    summary: dict[str, float],
    status: str = "FINISHED",
    step: int = 0,
    tags: dict[str, str] | None = None,
) -> str | None:
    """Log the summary, end the run; -> the run's page in the MLflow UI (None without tracking)."""
    cfg = cfg_of(config)
    if not run_id:
        return None
    uri, experiment = tracking_target(cfg)
    run = MlflowRun(uri, experiment, run_id=run_id)
    run.log_metrics(step, {f"summary/{k}": v for k, v in summary.items()})
    if tags:
        run.set_tags(tags)
    run.end(status)
    return run_url(uri, run.client.get_run(run_id).info.experiment_id, run_id)
