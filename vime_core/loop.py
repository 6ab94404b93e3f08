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
    nothing_trained: str | None = None  # why no step ran (the checkpoint already covers num_rollout); None if trained

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
    arch_from_hf_config(hf_config, where=model_dir)  # raises on architectures the mapping does not support (GPT-2, ...)
    check_model_compat(cfg, ModelArch.from_hf_config(hf_config))
    preflight(cfg, platform, model_dir, eval_only)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = PromptSet(cfg.data.source, []) if eval_only else load_prompts(_dataset_path(cfg.data.source), tokenizer, cfg.data)
    eval_sets = {}
    for d in cfg.eval.datasets:
        eval_sets[d.name] = load_eval_set(d, tokenizer, cfg)
    reward_model = RewardModel(cfg.rollout.reward, cfg.rollout.reward_type, cfg.rollout.strict_format,
                               cfg.rollout.reward_timeout_s)
    if cfg.rollout.reward == "math":  # labels the verifier cannot read score 0 everywhere: count, warn, refuse all-bad
        from vime_core.data import check_labels
        from vime_core.rewards import usable_labels

        for ps in [prompts, *eval_sets.values()]:
            check_labels(ps, usable_labels, cfg.data.label_key)
    return Prepared(cfg, platform, model_dir, tokenizer, prompts, eval_sets, reward_model)


def preflight(cfg: RunConfig, platform: str, model_dir: Path, eval_only: bool) -> None:
    """What used to fail only after the actors started (25-210 s), checked in seconds: the weights files (headers
    and sizes), the custom generate function, a writable output dir, and whether a local Ray can hold the placement."""
    from vime_core.checkpoint import check_model_files
    from vime_core.cluster import check_local_fit
    from vime_core.integrity import check_writable
    from vime_core.rollout import load_custom_generate

    check_model_files(model_dir)
    if cfg.rollout.custom_generate:
        load_custom_generate(cfg.rollout.custom_generate)
    if not eval_only:
        check_writable(cfg.output_dir)
    check_local_fit(cfg, platform, engines_only=eval_only)


def load_eval_set(d, tokenizer, cfg: RunConfig) -> PromptSet:
    """An eval dataset; its errors name the eval set (eval.datasets[name])."""
    from vime_core.data import DatasetError
    from vime_core.sources import SourceError

    try:
        return load_prompts(_dataset_path(d.source), tokenizer, cfg.data, max_prompts=d.max_prompts)
    except (DatasetError, SourceError) as e:
        raise type(e)(f"eval dataset {d.name!r} (eval.datasets, source {d.source}): {e}") from None


def _dataset_path(source: str) -> str:
    from vime_core.sources import dataset_path  # no content hash: the download task has recorded it

    return source if source.startswith("builtin://") else str(dataset_path(source))


def resume_point(cfg: RunConfig) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from and its state (None, None for a fresh start). Checked before actors start."""
    from vime_core.checkpoint import Checkpointer, check_resumable
    from vime_core.resume import check_resume_setting

    ckpt = Checkpointer(cfg.save_dir, cfg.checkpoint.keep_last)
    if cfg.checkpoint.start_fresh:
        move_outputs_aside(cfg)
        return None, None
    check_resume_setting(cfg)  # resume = false beside old checkpoints: refused (they would mix with the new ones)
    latest = ckpt.latest() if cfg.checkpoint.resume else None
    if latest is None:
        return None, None
    state = Checkpointer.read_state(latest)
    check_resumable(state, cfg)
    log.info("resuming from %s at rollout %d", latest, state["rollout_id"] + 1)
    return latest, state


RUN_OUTPUTS = ("export", "metrics.jsonl", "data_ledger.jsonl")  # what a run writes beside its checkpoints


def move_outputs_aside(cfg: RunConfig) -> list[Path]:
    """`checkpoint.start_fresh`: rename the old run's checkpoints, export/, metrics and data ledger with one
    timestamp suffix, so that nothing of it is resumed, exported (export skips an existing export/iter_N) or
    summarised again. Returns the new paths."""
    import os

    from vime_core.checkpoint import Checkpointer

    ckpt_aside = Checkpointer(cfg.save_dir).move_aside()
    suffix = ckpt_aside.name.removeprefix(cfg.save_dir.name) if ckpt_aside else time.strftime(".old-%Y%m%d-%H%M%S")
    moved = [ckpt_aside] if ckpt_aside else []
    for name in RUN_OUTPUTS:
        path = cfg.output_dir / name
        if path.exists():
            os.replace(path, path.with_name(name + suffix))
            moved.append(path.with_name(name + suffix))
    if moved:
        log.info("checkpoint.start_fresh: moved aside %s", ", ".join(str(m) for m in moved))
    return moved


def run(cfg: RunConfig, sink: MetricsSink, on_step: StepCallback | None = None, model_dir: Path | None = None,
        prepared: Prepared | None = None, init_checkpoint: Path | None = None, run_state: dict | None = None) -> RunResult:
    """`train_loop` holding cfg.output_dir exclusively (a second run on it fails at once, naming the holder)."""
    from vime_core.runlock import output_dir_lock

    with output_dir_lock(cfg.output_dir, (run_state or {}).get("prefect_flow_run_id")):
        return train_loop(cfg, sink, on_step, model_dir, prepared, init_checkpoint, run_state)


def train_loop(cfg: RunConfig, sink: MetricsSink, on_step: StepCallback | None = None, model_dir: Path | None = None,
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
        result.nothing_trained = (f"the checkpoint {resume_dir} already covers rollout.num_rollout = "
                                  f"{cfg.rollout.num_rollout}: nothing to train (raise num_rollout to extend the run)")
        log.warning(result.nothing_trained)
        return result
    p = prepared or prepare(cfg, model_dir)
    ckpt = Checkpointer(cfg.save_dir, cfg.checkpoint.keep_last)
    ledger = DataLedger(cfg.output_dir / "data_ledger.jsonl")
    log.info("starting Ray, the trainer and %d vLLM engine(s)", cfg.rollout.num_engines)
    t_start = time.perf_counter()
    init_ray(cfg, p.platform)
    trainer = None
    try:
        placement = make_placement(cfg, p.platform)
        trainer = TrainerGroup(create_trainers(cfg, placement, p.platform, str(p.model_dir),
                                               None if state else (str(init_checkpoint) if init_checkpoint else None)), cfg)
        router = RolloutRouter(create_engines(cfg, placement, p.platform, str(p.model_dir)), cfg.rollout.timeout_s)
        wait_ready(trainer.actors, router.engines, max(cfg.rollout.timeout_s, cfg.train.timeout_s))
        log.info("trainer and engines ready in %.1fs", time.perf_counter() - t_start)
        sync = WeightSync(trainer, router, resolve_strategy(cfg.sync.strategy, p.platform, cfg.cluster.colocate),
                          cfg.sync.bucket_size_mb, engines_sleep=placement.engines_sleep, timeout_s=cfg.sync.timeout_s)
        buffer = DataBuffer(p.prompts, cfg.seed, cfg.data.shuffle)
        if state:
            trainer.load_checkpoint(str(resume_dir))
            buffer.load_state_dict(state["data_buffer"])
        if state or init_checkpoint:
            sync.push()  # the engines started from the HF weights
        checksum_start = trainer.weights_checksum()
        if p.eval_sets and cfg.eval.before_train and start == 0:
            log.info("baseline evaluation on %s", ", ".join(p.eval_sets))
            result.baseline_eval = evaluate(router, p.eval_sets, cfg, p.reward_model)
            sink.log_metrics(0, result.baseline_eval)

        for rollout_id in range(start, cfg.rollout.num_rollout):
            t0 = time.perf_counter()
            groups, metrics, consumed = collect_rollout(rollout_id, cfg, buffer, router, p.reward_model)
            ledger.record(rollout_id, consumed)
            sync.release_engines()  # colocated GPUs: vLLM frees its memory while the trainer works
            t1 = time.perf_counter()
            trainer.onload_optimizer()  # colocated GPUs (train.offload_optimizer): optimizer state back from host memory
            metrics |= trainer.train(rollout_id, groups)
            trainer.offload_optimizer()  # and to host memory again while vLLM wakes and generates
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
                log.info("evaluation after step %d on %s", done, ", ".join(p.eval_sets))
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

    tmp = ckpt.begin(rollout_id)  # checks the free space first
    with ckpt.writing(tmp):  # a full disk: one error naming the path and the size needed
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
