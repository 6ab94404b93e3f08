"""Stage 3: GRPO training. A retry (crash, preemption) resumes from the latest complete checkpoint and keeps
logging into the same MLflow run."""

from __future__ import annotations

import json
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.common import RETRY_DELAYS, artifact_key, cfg_of, markdown
from tasks.tracking import tracking_target
from vime_core.checkpoint import Checkpointer
from vime_core.loop import run
from vime_core.tracking import JsonlSink, MlflowRun, MultiSink


def start_fresh(config: dict[str, Any]) -> dict[str, Any]:
    """`checkpoint.start_fresh` in a pipeline: move the old checkpoints aside once, here, and give the train task a
    config that resumes. Left to the task, every retry would move aside the checkpoints of its own first attempt and
    train again from step 0 into the same MLflow run."""
    cfg = cfg_of(config)
    aside = Checkpointer(cfg.save_dir).move_aside()
    if aside:
        print(f"checkpoint.start_fresh: moved {cfg.save_dir} aside to {aside}")
    return {**config, "checkpoint": {**config["checkpoint"], "start_fresh": False}}


@task(name="train-grpo", retries=2, retry_delay_seconds=RETRY_DELAYS)
def train_grpo(config: dict[str, Any], model: dict[str, Any], init_checkpoint: str | None, mlflow_run_id: str | None) -> dict[str, Any]:
    cfg = cfg_of(config)
    tracker = MlflowRun(*tracking_target(cfg), run_id=mlflow_run_id) if mlflow_run_id else None
    sink = MultiSink(tracker, JsonlSink(cfg.output_dir / "metrics.jsonl", append=True))
    progress = create_progress_artifact(progress=0.0, key=artifact_key(cfg.name, "train-progress"),
                                        description=f"GRPO rollout steps of {cfg.name}")

    def on_step(rollout_id: int, metrics: dict[str, float]) -> None:
        update_progress_artifact(progress, progress=100.0 * (rollout_id + 1) / cfg.rollout.num_rollout)
        print(f"step {rollout_id + 1}/{cfg.rollout.num_rollout} reward {metrics['rollout/raw_reward']:.3f} "
              f"logprob_diff {metrics['train/train_rollout_logprob_abs_diff']:.1e} step_time {metrics['perf/step_time']:.2f}s")

    try:
        result = run(cfg, sink, on_step=on_step, model_dir=model["path"], init_checkpoint=init_checkpoint,
                     run_state={"mlflow_run_id": mlflow_run_id})
    finally:
        sink.close()
    rewards = reward_curve(cfg.output_dir / "metrics.jsonl")
    summary = {
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "resumed_from": str(result.resumed_from) if result.resumed_from else None,
        "start_rollout_id": result.start_rollout_id,
        "last_rollout_id": result.last_rollout_id,
        "baseline_eval": result.baseline_eval,
        "final_eval": result.final_eval,
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "num_rollout": cfg.rollout.num_rollout,
    }
    if tracker and result.last_checkpoint and cfg.tracking.log_checkpoints:
        tracker.log_text(json.dumps({"checkpoint_dir": str(cfg.save_dir), "latest": str(result.last_checkpoint)}, indent=2),
                         "checkpoints.json")
    markdown("GRPO training", {k: v for k, v in summary.items() if not isinstance(v, dict)}, artifact_key(cfg.name, "train"))
    return summary


def reward_curve(metrics_file) -> list[float]:
    """rollout/raw_reward by step over every attempt of this run (a redone step counts once, its last value)."""
    by_step: dict[int, float] = {}
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            row = json.loads(line)
            if "rollout/raw_reward" in row:
                by_step[row["step"]] = row["rollout/raw_reward"]
    return [by_step[k] for k in sorted(by_step)]
