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
    engine_info: list[dict] = field(default_factory=list)
    resumed_from: Path | None = None
    last_checkpoint: Path | None = None
    weights_checksum: tuple[float, float] | None = None  # (at start, at end): tests check that training moved them

    @property
    def steps_done(self) -> int:
        return self.last_rollout_id - self.start_rollout_id + 1


def prepare(cfg: RunConfig, model_dir: Path | None = None, eval_only: bool = False) -> Prepared:
    """Resolve the model, check the config against it, load and validate every dataset: all before any actor."""
    from transformers import AutoTokenizer

    from vime_core.checkpoint import read_hf_config
    from vime_core.platform import detect_platform
    from vime_core.qwen3_mapping import arch_from_hf_config
    from vime_core.sources import resolve_model
    from vime_core.tracking import resolve_tracking_uri

    platform = detect_platform(cfg.cluster.platform)
    if cfg.train.pipeline_parallel_size > 1:
        from vime_core.config import ConfigError

        raise ConfigError("train.pipeline_parallel_size > 1: the trainer runs pipeline stages of 1 only (conversion "
                          "supports PP layouts); use tensor/expert parallelism")
    model_dir = Path(model_dir) if model_dir else resolve_model(cfg.model.source, resolve_tracking_uri(cfg)).path
    hf_config = read_hf_config(model_dir)
    check_model_compat(cfg, ModelArch.from_hf_config(hf_config))
    arch_from_hf_config(hf_config)  # raises on architectures the weight mapping does not support
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = PromptSet(cfg.data.source, []) if eval_only else load_prompts(_dataset_path(cfg.data.source), tokenizer, cfg.data)
    eval_sets = {}
    for d in cfg.eval.datasets:
        eval_sets[d.name] = load_prompts(_dataset_path(d.source), tokenizer, cfg.data, max_prompts=d.max_prompts)
    reward_model = RewardModel(cfg.rollout.reward, cfg.rollout.reward_type, cfg.rollout.strict_format)
    return Prepared(cfg, platform, model_dir, tokenizer, prompts, eval_sets, reward_model)


def _dataset_path(source: str) -> str:
    from vime_core.sources import dataset_path  # no content hash: the download task has recorded it

    return source if source.startswith("builtin://") else str(dataset_path(source))


def resume_point(cfg: RunConfig) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from and its state (None, None for a fresh start). Checked before actors start."""
    from vime_core.checkpoint import Checkpointer, check_resumable

    ckpt = Checkpointer(cfg.save_dir, cfg.checkpoint.keep_last)
    if cfg.checkpoint.start_fresh:
        aside = ckpt.move_aside()
        if aside:
            log.info("checkpoint.start_fresh: moved %s aside to %s", cfg.save_dir, aside)
        return None, None
    latest = ckpt.latest() if cfg.checkpoint.resume else None
    if latest is None:
        return None, None
    state = Checkpointer.read_state(latest)
    check_resumable(state, cfg)
    log.info("resuming from %s at rollout %d", latest, state["rollout_id"] + 1)
    return latest, state


def run(cfg: RunConfig, sink: MetricsSink, on_step: StepCallback | None = None, model_dir: Path | None = None,
        prepared: Prepared | None = None, init_checkpoint: Path | None = None, run_state: dict | None = None) -> RunResult:
    """Train `cfg` end to end, resuming from the latest checkpoint of its save dir if there is one.

    Metrics go to `sink` at step = rollout_id; eval rows at the number of rollout steps the policy has had (0 is the
    baseline). `run_state` (e.g. the MLflow run id) is stored in every checkpoint so that a resume continues it."""
    from vime_core.checkpoint import Checkpointer
    from vime_core.cluster import create_engines, create_trainers, init_ray, make_placement, shutdown_ray, wait_ready
    from vime_core.evaluation import evaluate
    from vime_core.rollout import RolloutRouter, collect_rollout
    from vime_core.sync import WeightSync, resolve_strategy
    from vime_core.train import TrainerGroup

    resume_dir, state = resume_point(cfg)
    start = state["rollout_id"] + 1 if state else 0
    result = RunResult(start, start - 1, resumed_from=resume_dir, last_checkpoint=resume_dir,
                       baseline_eval=(state or {}).get("baseline_eval", {}))
    if start >= cfg.rollout.num_rollout:
        log.warning("the checkpoint %s already covers rollout.num_rollout = %d: nothing to train (raise num_rollout "
                    "to extend the run)", resume_dir, cfg.rollout.num_rollout)
        return result
    p = prepared or prepare(cfg, model_dir)
    ckpt = Checkpointer(cfg.save_dir, cfg.checkpoint.keep_last)
    ledger = DataLedger(cfg.output_dir / "data_ledger.jsonl")
    init_ray(cfg, p.platform)
    trainer = None
    try:
        placement = make_placement(cfg, p.platform)
        trainer = TrainerGroup(create_trainers(cfg, placement, p.platform, str(p.model_dir),
                                               None if state else (str(init_checkpoint) if init_checkpoint else None)), cfg)
        router = RolloutRouter(create_engines(cfg, placement, p.platform, str(p.model_dir)))
        wait_ready(trainer.actors, router.engines)
        sync = WeightSync(trainer, router, resolve_strategy(cfg.sync.strategy, p.platform, cfg.cluster.colocate),
                          cfg.sync.bucket_size_mb, engines_sleep=placement.engines_sleep)
        buffer = DataBuffer(p.prompts, cfg.seed, cfg.data.shuffle)
        if state:
            trainer.load_checkpoint(str(resume_dir))
            buffer.load_state_dict(state["data_buffer"])
        if state or init_checkpoint:
            sync.push()  # the engines started from the HF weights
        checksum_start = trainer.weights_checksum()
        if p.eval_sets and cfg.eval.before_train and start == 0:
            result.baseline_eval = evaluate(router, p.eval_sets, cfg, p.reward_model)
            sink.log_metrics(0, result.baseline_eval)

        for rollout_id in range(start, cfg.rollout.num_rollout):
            t0 = time.perf_counter()
            groups, metrics, consumed = collect_rollout(rollout_id, cfg, buffer, router, p.reward_model)
            ledger.record(rollout_id, consumed)
            sync.release_engines()  # colocated GPUs: vLLM frees its memory while the trainer works
            t1 = time.perf_counter()
            metrics |= trainer.train(rollout_id, groups)
            metrics["perf/train_time"] = time.perf_counter() - t1
            metrics["perf/update_weights_time"] = sync.push()
            metrics["perf/step_time"] = time.perf_counter() - t0
            done = rollout_id + 1
            if _due(done, cfg.checkpoint.save_interval, cfg.rollout.num_rollout):
                t2 = time.perf_counter()
                result.last_checkpoint = save_checkpoint(ckpt, trainer, rollout_id, cfg, p, buffer, metrics, run_state,
                                                         result.baseline_eval)
                metrics["perf/save_time"] = time.perf_counter() - t2
            sink.log_metrics(rollout_id, metrics)
            result.last_rollout_id, result.last_metrics = rollout_id, metrics
            if on_step:
                on_step(rollout_id, metrics)
            if p.eval_sets and _due(done, cfg.eval.interval, cfg.rollout.num_rollout):
                result.final_eval = evaluate(router, p.eval_sets, cfg, p.reward_model)
                sink.log_metrics(done, result.final_eval)
        result.weights_checksum = (checksum_start, trainer.weights_checksum())
        result.trainer_info = trainer.info()
        result.engine_info = router.call_all("info")
        return result
    finally:
        if trainer is not None:
            trainer.shutdown()
        shutdown_ray()


def _due(done: int, interval: int | None, total: int) -> bool:
    """After `done` steps: every `interval` steps, and always after the last one."""
    return done == total or bool(interval and done % interval == 0)


def save_checkpoint(ckpt, trainer, rollout_id: int, cfg: RunConfig, p: Prepared, buffer: DataBuffer,
                    metrics: dict[str, float], run_state: dict | None, baseline_eval: dict[str, float]) -> Path:
    import json

    from vime_core.checkpoint import HF_CONFIG_DIR, META_FILE, _copy_hf_side_files

    tmp = ckpt.begin(rollout_id)
    trainer.save_checkpoint(str(tmp))
    _copy_hf_side_files(p.model_dir, tmp / HF_CONFIG_DIR)
    # what `vime convert megatron-to-hf` needs to export it in the dtype it was trained in
    (tmp / META_FILE).write_text(json.dumps({"format": "torch_dist", "dtype": cfg.model.dtype, "source": str(p.model_dir),
                                             "saved_layout": {"tp": cfg.train.tensor_parallel_size, "pp": 1,
                                                              "ep": cfg.train.expert_parallel_size}}, indent=2))
    state = {
        "fingerprint": cfg.fingerprint(),
        "fingerprint_fields": cfg.fingerprint_fields(),
        "data_buffer": buffer.state_dict(),
        "model_dir": str(p.model_dir),
        "metrics": metrics,
        "run_state": run_state or {},
        "baseline_eval": baseline_eval,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return ckpt.commit(tmp, rollout_id, state)


class DataLedger:
    """Which prompts (dataset indices) each rollout step consumed, one JSON line per step, appended. A step redone
    after a crash appears twice; tests use it to show no batch is skipped or trained twice beyond the redone steps."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, rollout_id: int, prompt_indices: list[int]) -> None:
        import json

        with open(self.path, "a") as fh:
            fh.write(json.dumps({"rollout_id": rollout_id, "prompts": prompt_indices}) + "\n")
