"""The rollout -> train -> sync loop.

    for rollout_id in range(start, num_rollout):
        groups = collect_rollout(...)          # prompts -> n samples each: tokens, log-probs, rewards
        trainer.train(rollout_id, groups)      # recompute log-probs, advantages, GRPO optimizer steps
        sync.push()                            # trainer -> engines, prefix caches dropped
        maybe save, maybe evaluate

Everything that can be checked without actors (config vs model, datasets, rewards) is checked in `prepare` first, so
a bad config or dataset fails in seconds with a clear message instead of after the engines started.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from vime_core.config import ModelArch, RunConfig, check_model_compat
from vime_core.data import DataBuffer, PromptSet, load_prompts
from vime_core.rewards import RewardModel
from vime_core.tracking import MetricsSink

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict[str, float]], None]


@dataclass
class Prepared:
    """What a run needs before any actor starts."""

    cfg: RunConfig
    platform: str
    model_dir: Path
    tokenizer: Any
    prompts: PromptSet
    eval_sets: dict[str, PromptSet]
    reward_model: RewardModel


@dataclass
class RunResult:
    start_rollout_id: int
    last_rollout_id: int
    baseline_eval: dict[str, float] = field(default_factory=dict)
    final_eval: dict[str, float] = field(default_factory=dict)
    last_metrics: dict[str, float] = field(default_factory=dict)
    trainer_info: list[dict] = field(default_factory=list)


def prepare(cfg: RunConfig, model_dir: Path | None = None) -> Prepared:
    from transformers import AutoTokenizer

    from vime_core.checkpoint import read_hf_config
    from vime_core.platform import detect_platform
    from vime_core.qwen3_mapping import arch_from_hf_config
    from vime_core.sources import resolve_dataset, resolve_model

    platform = detect_platform(cfg.cluster.platform)
    if cfg.train.pipeline_parallel_size > 1:
        from vime_core.config import ConfigError

        raise ConfigError("train.pipeline_parallel_size > 1: the trainer runs pipeline stages of 1 only (conversion "
                          "supports PP layouts); use tensor/expert parallelism")
    model_dir = Path(model_dir) if model_dir else resolve_model(cfg.model.source).path
    hf_config = read_hf_config(model_dir)
    check_model_compat(cfg, ModelArch.from_hf_config(hf_config))
    arch_from_hf_config(hf_config)  # raises on architectures the weight mapping does not support
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(str(resolve_dataset(cfg.data.source).path if not cfg.data.source.startswith("builtin://") else cfg.data.source), tokenizer, cfg.data)
    eval_sets = {}
    for d in cfg.eval.datasets:
        src = d.source if d.source.startswith("builtin://") else str(resolve_dataset(d.source).path)
        eval_sets[d.name] = load_prompts(src, tokenizer, cfg.data, max_prompts=d.max_prompts)
    reward_model = RewardModel(cfg.rollout.reward, cfg.rollout.reward_type, cfg.rollout.strict_format)
    return Prepared(cfg, platform, model_dir, tokenizer, prompts, eval_sets, reward_model)


def run(cfg: RunConfig, sink: MetricsSink, on_step: StepCallback | None = None, model_dir: Path | None = None,
        prepared: Prepared | None = None) -> RunResult:
    """Train `cfg` end to end. Metrics go to `sink` (step = rollout_id; eval rows at the number of steps done)."""
    from vime_core.cluster import create_engines, create_trainers, init_ray, make_placement, shutdown_ray, wait_ready
    from vime_core.evaluation import evaluate
    from vime_core.rollout import RolloutRouter, collect_rollout
    from vime_core.sync import WeightSync, resolve_strategy
    from vime_core.train import TrainerGroup

    p = prepared or prepare(cfg, model_dir)
    init_ray(cfg, p.platform)
    trainer = router = None
    try:
        placement = make_placement(cfg, p.platform)
        trainer = TrainerGroup(create_trainers(cfg, placement, p.platform, str(p.model_dir)), cfg)
        router = RolloutRouter(create_engines(cfg, placement, p.platform, str(p.model_dir)))
        wait_ready(trainer.actors, router.engines)
        sync = WeightSync(trainer, router, resolve_strategy(cfg.sync.strategy, p.platform, cfg.cluster.colocate))
        buffer = DataBuffer(p.prompts, cfg.seed, cfg.data.shuffle)
        start = 0
        result = RunResult(start, start - 1)
        if p.eval_sets and cfg.eval.before_train and start == 0:
            result.baseline_eval = evaluate(router, p.eval_sets, cfg, p.reward_model)
            sink.log_metrics(0, result.baseline_eval)

        for rollout_id in range(start, cfg.rollout.num_rollout):
            t0 = time.perf_counter()
            groups, metrics = collect_rollout(rollout_id, cfg, buffer, router, p.reward_model)
            t1 = time.perf_counter()
            metrics |= trainer.train(rollout_id, groups)
            metrics["perf/train_time"] = time.perf_counter() - t1
            metrics["perf/update_weights_time"] = sync.push()
            metrics["perf/step_time"] = time.perf_counter() - t0
            sink.log_metrics(rollout_id, metrics)
            result.last_rollout_id, result.last_metrics = rollout_id, metrics
            if on_step:
                on_step(rollout_id, metrics)
            done = rollout_id + 1
            if p.eval_sets and (done == cfg.rollout.num_rollout or (cfg.eval.interval and done % cfg.eval.interval == 0)):
                result.final_eval = evaluate(router, p.eval_sets, cfg, p.reward_model)
                sink.log_metrics(done, result.final_eval)
        result.trainer_info = trainer.info()
        return result
    finally:
        if trainer is not None:
            trainer.shutdown()
        shutdown_ray()
