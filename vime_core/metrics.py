"""Metrics sinks: one interface (`MetricsSink`), the JSON-lines, in-memory and fan-out sinks, and the metric names
the loop logs every step (dashboards and the e2e tests rely on them). MLflow's sink is vime_core.tracking's
`MlflowRun`.

Metric names are vime's (DESIGN.md section 5); step = rollout_id. Eval metrics are logged at the step that equals
the number of rollout steps the evaluated policy was trained on (0 = before training).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, Protocol

from vime_core.errors import VimeError
from vime_core.sample import Sample

# the names the loop logs every step (see loop.py); tests and the notebook rely on them
ROLLOUT_METRICS = ("rollout/raw_reward", "rollout/rewards", "rollout/response_len/mean", "rollout/truncated_ratio")
TRAIN_METRICS = (
    "train/loss",
    "train/pg_loss",
    "train/pg_clipfrac",
    "train/ppo_kl",
    "train/entropy_loss",
    "train/grad_norm",
    "train/train_rollout_logprob_abs_diff",
)
# logged with rollout.routing_replay on, every rollout.routing_metrics_every rollouts (R3, vime_core.trainer.routing)
ROUTING_METRICS = ("train/routing_agreement", "train/train_rollout_logprob_abs_diff_no_replay")
PERF_METRICS = (
    "perf/tokens_per_gpu_per_sec",
    "perf/rollout_time",
    "perf/train_time",
    "perf/update_weights_time",
    "perf/step_time",
    "perf/actor_train_tok_per_s",
)


def rollout_metrics(generated: list[list[Sample]], rollout_time: float, devices: int) -> dict[str, float]:
    """The step's rollout metrics over every generated sample (dropped groups of dynamic sampling included)."""
    everything = [s for g in generated for s in g]
    resp_lens = [s.response_len for s in everything]
    return {
        "rollout/raw_reward": statistics.fmean(s.reward for s in everything),
        "rollout/response_len/mean": statistics.fmean(resp_lens),
        "rollout/response_len/max": float(max(resp_lens)),
        "rollout/truncated_ratio": statistics.fmean(1.0 if s.truncated else 0.0 for s in everything),
        "rollout/zero_std_ratio": statistics.fmean(0.0 if len({s.reward for s in g}) > 1 else 1.0 for g in generated),
        "perf/rollout_time": rollout_time,
        "perf/tokens_per_gpu_per_sec": sum(resp_lens) / rollout_time / max(1, devices),
    }


class MetricsSink(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class MetricsPathError(VimeError, ValueError):
    """`--metrics-out` names something that cannot be a metrics file; the message names it."""


def check_metrics_path(path: Path) -> None:
    """`--metrics-out` can be a file: not a directory, its parent not a file (found before the run starts; the sink
    opens the file at the first step, 20+ s in)."""
    path = Path(path)
    if path.is_dir():
        raise MetricsPathError(f"--metrics-out {path} is a directory; give a file path, e.g. {path / 'metrics.jsonl'}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise MetricsPathError(f"--metrics-out {path}: {parent} is a file, not a directory; choose another path")
    if parent is not None and not os.access(parent, os.W_OK):
        raise MetricsPathError(f"--metrics-out {path}: {parent} is not writable; choose another path")


class JsonlSink:
    """One JSON object per call: {"step": rollout_id, "<metric>": value, ...} (`vime train --metrics-out`)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a" if append else "w")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: finite_or_none(v) for k, v in metrics.items()}}
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class MemorySink:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append({"step": step, **metrics})

    def close(self) -> None:
        pass


class MultiSink:
    def __init__(self, *sinks: MetricsSink):
        self.sinks = [s for s in sinks if s is not None]

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.log_metrics(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
