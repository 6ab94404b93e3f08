"""Stage 3: GRPO training. A retry (crash, preemption) resumes from the latest complete checkpoint and keeps
logging into the same MLflow run."""

from __future__ import annotations

import json
import logging
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.common import RETRY_DELAYS, artifact_key, cfg_of, is_transient, markdown
from tasks.tracking import tracking_target
from vime_core.logs import StepProgress
from vime_core.loop import move_outputs_aside, run
from vime_core.outage import OutageTolerantSink, wait_reachable
from vime_core.tracking import EvalChildRuns, MlflowRun
from vime_core.metrics import JsonlSink, MultiSink


def start_fresh(config: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint.start_fresh` in a pipeline: move the old checkpoints, export/, metrics and ledger aside once, here,
    and give the train task a config that resumes. Left to the task, every retry would move aside the checkpoints
    of its own first attempt and train again from step 0 into the same MLflow run."""
    cfg = cfg_of(config)
    for path in move_outputs_aside(cfg):
        print(f"checkpoint.start_fresh: moved aside to {path}")
    # resume too: whatever appears in the save dir from now on is this run's own (checkpoint.resume = false would
    # refuse a retry's resume from its first attempt's checkpoints)
    return {**config, "checkpoint": {**config["checkpoint"], "start_fresh": False, "resume": True}}


def system_metrics(run_id: str | None, uri: str):
    """MLflow system metrics (CPU, memory, disk, network; GPU with pynvml) every 10 s into the pipeline's run."""
    if not run_id:
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # 4 INFO lines per attempt: started, stopped
    monitor = SystemMetricsMonitor(run_id, sampling_interval=10, resume_logging=True, tracking_uri=uri)
    monitor.start()
    return monitor


def tracking_sinks(cfg, mlflow_run_id: str | None) -> tuple[MlflowRun | None, list]:
    """The pipeline's run and its evaluation child runs as metrics sinks that keep what a restarting tracking
    server does not take and send it later (`tracking.outage_s`): training goes on through the outage."""
    if not mlflow_run_id:
        return None, []
    uri, experiment = tracking_target(cfg)
    wait_reachable(uri, cfg.tracking.outage_s)  # a server restarting as the task starts is waited for, not a retry
    tracker = MlflowRun(uri, experiment, run_id=mlflow_run_id)
    evals = EvalChildRuns(tracker, experiment, uri)
    return tracker, [OutageTolerantSink(s, uri, cfg.tracking.outage_s) for s in (tracker, evals)]


@task(name="train-grpo", retries=2, retry_delay_seconds=RETRY_DELAYS, retry_condition_fn=is_transient)
def train_grpo(
    config: dict[str, Any],
    model: dict[str, Any],
    init_checkpoint: str | None,
    mlflow_run_id: str | None,
    flow_run_id: str | None = None,
) -> dict[str, Any]:
    cfg = cfg_of(config)
    logger = get_run_logger()
    uri = tracking_target(cfg)[0]
    tracker, mlflow_sinks = tracking_sinks(cfg, mlflow_run_id)
    sink = MultiSink(*mlflow_sinks, JsonlSink(cfg.output_dir / "metrics.jsonl", append=True))
    on_step = step_reporter(cfg, logger)
    monitor = system_metrics(mlflow_run_id, uri)
    logger.info(f"training {cfg.name}: rollout steps up to {cfg.rollout.num_rollout} in {cfg.output_dir}")
    try:
        result = run(
            cfg,
            sink,
            on_step=on_step,
            model_dir=model["path"],
            init_checkpoint=init_checkpoint,
            run_state={"mlflow_run_id": mlflow_run_id, "prefect_flow_run_id": flow_run_id},
        )
    finally:
        sink.close()
        if monitor:
            monitor.finish()
    summary = train_summary(cfg, result)
    if tracker and result.last_checkpoint and cfg.tracking.log_checkpoints:
        wait_reachable(uri, cfg.tracking.outage_s)
        tracker.log_text(
            json.dumps({"checkpoint_dir": str(cfg.save_dir), "latest": str(result.last_checkpoint)}, indent=2),
            "checkpoints.json",
        )
    markdown(
        "GRPO training", {k: v for k, v in summary.items() if not isinstance(v, dict)}, artifact_key(cfg.name, "train")
    )
    return summary


def step_reporter(cfg, logger):
    """The loop's on_step: the progress artifact and one log line per step with the ETA of the steps left."""
    progress = create_progress_artifact(
        progress=0.0, key=artifact_key(cfg.name, "train-progress"), description=f"GRPO rollout steps of {cfg.name}"
    )
    eta: StepProgress | None = None

    def on_step(rollout_id: int, metrics: dict[str, float]) -> None:
        nonlocal eta
        eta = eta or StepProgress(
            cfg.rollout.num_rollout, start=rollout_id, first_step_seconds=metrics["perf/step_time"]
        )
        update_progress_artifact(progress, progress=100.0 * (rollout_id + 1) / cfg.rollout.num_rollout)
        logger.info(
            f"{eta.text(rollout_id + 1)} | reward {metrics['rollout/raw_reward']:.3f} | logprob_diff "
            f"{metrics['train/train_rollout_logprob_abs_diff']:.1e} | step {metrics['perf/step_time']:.2f}s"
        )

    return on_step


def train_summary(cfg, result) -> dict[str, Any]:
    """What the task returns (and shows as its artifact): checkpoints, steps, evaluations, the reward's ends."""
    rewards = reward_curve(cfg.output_dir / "metrics.jsonl")
    last = result.last_metrics.get("rollout/raw_reward")
    return {
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "resumed_from": str(result.resumed_from) if result.resumed_from else None,
        "start_rollout_id": result.start_rollout_id,
        "last_rollout_id": result.last_rollout_id,
        "steps_trained": max(result.steps_done, 0),
        "nothing_trained": result.nothing_trained,
        "baseline_eval": result.baseline_eval,
        "final_eval": result.final_eval,
        "reward_first": rewards[0] if rewards else None,
        # this run's last step (the in-memory value; the file only when the step was trained by an earlier attempt)
        "reward_last": last if last is not None else (rewards[-1] if rewards else None),
        "num_rollout": cfg.rollout.num_rollout,
    }


def reward_curve(metrics_file) -> list[float]:
    """rollout/raw_reward by step over every attempt of this run (a redone step counts once, its last value);
    start_fresh moves the file aside, so an older run's steps never count."""
    by_step: dict[int, float] = {}
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            row = json.loads(line)
            if "rollout/raw_reward" in row:
                by_step[row["step"]] = row["rollout/raw_reward"]
    return [by_step[k] for k in sorted(by_step)]
