"""The rollout -> train -> sync loop.

    for rollout_id in range(start, num_rollout):       # train_step: one step function for both modes
        groups = sched.take(rollout_id)        # prompts -> n samples each: tokens, log-probs, rewards, policy version
        trainer.train(rollout_id, groups)      # recompute log-probs, advantages, GRPO optimizer steps
        sync.push()                            # trainer -> engines (their prefix caches go stale)
        maybe save, maybe evaluate

`rollout.max_staleness = 0` samples each rollout after the previous step's push (on-policy); N > 0 runs the next
rollouts in the background while the trainer works, each on a policy at most N versions old (schedule.py).

Everything that can be checked without actors (config vs model, datasets, rewards) is checked in `prepare` first, so
a bad config or dataset fails in seconds with a clear message instead of after the engines started.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from vime_core.config import RunConfig
from vime_core.data import DataBuffer
from vime_core.prepare import Prepared, prepare
from vime_core.schedule import (
    VERSION_KEY,
    FinishedRollout,
    RolloutScheduler,
    check_staleness_resume,
    read_inflight,
    staleness_metrics,
    wait_time_ratio,
    write_inflight,
)
from vime_core.metrics import MetricsSink

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict[str, float]], None]
# before an inline rollout (rollout.max_staleness = 0) is sampled: its id and the router of the engines that will
# sample it, awake and holding the weights it samples from (bench/gpu_scale.py times plain vLLM there)
RolloutHook = Callable[[int, Any], None]


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
    check_staleness_resume(state, cfg.rollout.max_staleness)
    log.info("resuming from %s at rollout %d", latest, state["rollout_id"] + 1)
    return latest, state


RUN_OUTPUTS = ("export", "metrics.jsonl", "data_ledger.jsonl")  # what a run writes beside its checkpoints


def move_outputs_aside(cfg: RunConfig) -> list[Path]:
    """`checkpoint.start_fresh`: rename the old run's checkpoints, export/, metrics and data ledger with one
    timestamp suffix, so that nothing of it is resumed, exported (export skips an existing export/iter_N) or
    summarised again. Returns the new paths."""
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


def run(
    cfg: RunConfig,
    sink: MetricsSink,
    on_step: StepCallback | None = None,
    model_dir: Path | None = None,
    init_checkpoint: Path | None = None,
    run_state: dict | None = None,
    before_rollout: RolloutHook | None = None,
) -> RunResult:
    """`train_loop` holding cfg.output_dir exclusively (a second run on it fails at once, naming the holder)."""
    from vime_core.runlock import output_dir_lock

    with output_dir_lock(cfg.output_dir, (run_state or {}).get("prefect_flow_run_id")):
        return train_loop(cfg, sink, on_step, model_dir, init_checkpoint, run_state, before_rollout)


def train_loop(
    cfg: RunConfig,
    sink: MetricsSink,
    on_step: StepCallback | None = None,
    model_dir: Path | None = None,
    init_checkpoint: Path | None = None,
    run_state: dict | None = None,
    before_rollout: RolloutHook | None = None,
) -> RunResult:
    """Train `cfg` end to end, resuming from the latest checkpoint of its save dir if there is one.

    Metrics go to `sink` at step = rollout_id; eval rows at the number of rollout steps the policy has had (0 is the
    baseline). `run_state` (e.g. the MLflow run id) is stored in every checkpoint so that a resume continues it."""
    from vime_core.checkpoint import Checkpointer
    from vime_core.cluster import init_ray, shutdown_ray

    resume_dir, state = resume_point(cfg)
    result = start_result(cfg, resume_dir, state)
    if result.nothing_trained:
        return result
    p = prepare(cfg, model_dir)
    log.info("starting Ray, the trainer and %d vLLM engine(s)", cfg.rollout.num_engines)
    init_ray(cfg, p.platform)
    actors = Actors()
    try:
        start_again_on_a_death(actors, cfg, p, None if state else init_checkpoint)
        buffer, sched = restore(actors, cfg, p, resume_dir, state, init_checkpoint, result.start_rollout_id)
        ckpt, ledger = (
            Checkpointer(cfg.save_dir, cfg.checkpoint.keep_last),
            DataLedger(cfg.output_dir / "data_ledger.jsonl"),
        )
        parts = LoopParts(
            cfg,
            p,
            sched,
            actors.trainer,
            actors.router,
            actors.sync,
            ledger,
            ckpt,
            buffer,
            sink,
            on_step,
            run_state,
            result,
            before_rollout,
        )
        return run_steps(parts)
    finally:
        if actors.trainer is not None:
            actors.trainer.shutdown()
        shutdown_ray()


def start_result(cfg: RunConfig, resume_dir: Path | None, state: dict | None) -> RunResult:
    """Where this run starts (after the checkpoint's rollout, or at 0); `nothing_trained` says why no step is left."""
    start = state["rollout_id"] + 1 if state else 0
    result = RunResult(
        start,
        start - 1,
        resumed_from=resume_dir,
        last_checkpoint=resume_dir,
        baseline_eval=(state or {}).get("baseline_eval", {}),
    )
    if start >= cfg.rollout.num_rollout:
        result.nothing_trained = (
            f"the checkpoint {resume_dir} already covers rollout.num_rollout = "
            f"{cfg.rollout.num_rollout}: nothing to train (raise num_rollout to extend the run)"
        )
        log.warning(result.nothing_trained)
    return result


@dataclass
class Actors:
    """The run's actors, filled as they start (so that teardown stops whatever started)."""

    trainer: Any = None  # TrainerGroup
    router: Any = None  # RolloutRouter over the vLLM engines
    sync: Any = None  # WeightSync between them


def start_actors(a: Actors, cfg: RunConfig, p: Prepared, init_checkpoint: Path | None) -> None:
    """Trainer ranks and vLLM engines on one placement, ready, with the weight sync between them."""
    from vime_core.cluster import create_engines, create_trainers, make_placement
    from vime_core.kv_cache import kv_cache_shortfall
    from vime_core.router import RolloutRouter
    from vime_core.rpc import wait_ready
    from vime_core.sync import WeightSync, resolve_strategy
    from vime_core.trainer import TrainerGroup

    t_start = time.perf_counter()
    placement = make_placement(cfg, p.platform)
    model = str(p.model_dir)
    init = str(init_checkpoint) if init_checkpoint else None
    a.trainer = TrainerGroup(create_trainers(cfg, placement, p.platform, model, init), cfg)
    engines = create_engines(cfg, placement, p.platform, model)
    a.router = RolloutRouter(engines, cfg.rollout.timeout_s, cfg.rollout.stall_timeout_s)
    a.sync = WeightSync(
        a.trainer,
        a.router,
        resolve_strategy(cfg.sync.strategy, p.platform, cfg.cluster.colocate),
        cfg.sync.bucket_size_mb,
        engines_sleep=placement.engines_sleep,
        timeout_s=cfg.sync.timeout_s,
        sleep_level=cfg.cluster.engine_sleep_level,
    )
    # colocated GPUs: the trainers allocate only once the engines have sized their KV caches and gone to sleep
    timeout = max(cfg.rollout.timeout_s, cfg.train.timeout_s)
    parts = wait_ready(a.trainer.actors, a.router.engines, timeout, placement.colocated_gpu, a.sync.release_engines)
    log.info("trainer and engines ready in %.1fs (%s)", time.perf_counter() - t_start, parts)
    if kv_warning := kv_cache_shortfall(cfg, a.router.call_all("info"), p.platform):
        log.warning(kv_warning)


def start_again_on_a_death(a: Actors, cfg: RunConfig, p: Prepared, init_checkpoint: Path | None) -> None:
    """`start_actors`, once more on a fresh Ray if an actor's process died while starting (vime_core/start_retry.py)."""
    from vime_core.start_retry import start_with_retry

    def undo() -> None:
        if a.trainer is not None:
            a.trainer.shutdown()
        a.trainer = a.router = a.sync = None

    start_with_retry(cfg, p.platform, lambda: start_actors(a, cfg, p, init_checkpoint), undo)


def restore(
    a: Actors, cfg: RunConfig, p: Prepared, resume_dir, state, init_checkpoint, start: int
) -> tuple[DataBuffer, RolloutScheduler]:
    """The data buffer and the rollout scheduler at `start`: the checkpoint's trainer, buffer position and in-flight
    rollouts on a resume; the engines holding the trainer's weights."""
    buffer = DataBuffer(p.prompts, cfg.seed, cfg.data.shuffle)
    carried = []
    if state:
        a.trainer.load_checkpoint(str(resume_dir))
        buffer.load_state_dict(state["data_buffer"])
        carried = read_inflight(resume_dir, state)  # an async run's rollouts in flight at the save
    # colocated GPUs: the first rollout, like every later one, runs beside only what the trainer keeps between
    # steps (Qwen3-8B on one H200: its 30 GiB gradient buffer and the engine's awake share do not fit together)
    a.trainer.offload_optimizer()
    if state or init_checkpoint or a.sync.asleep:
        a.sync.push()  # the engines started from the HF weights (or slept them away: sleep level 2)
    sched = RolloutScheduler(
        partial(rollout_step, cfg=cfg, buffer=buffer, router=a.router, p=p),
        cfg.rollout.max_staleness,
        cfg.rollout.num_rollout,
        start,
        carried,
    )
    return buffer, sched


def run_steps(parts: "LoopParts") -> RunResult:
    """The baseline evaluation, then every step from the start to rollout.num_rollout; the run's result."""
    from vime_core.evaluation import evaluate

    cfg, p, result, trainer = parts.cfg, parts.p, parts.result, parts.trainer
    checksum_start = trainer.weights_checksum()
    if p.eval_sets and cfg.eval.before_train and result.start_rollout_id == 0:
        log.info("baseline evaluation on %s", ", ".join(p.eval_sets))
        result.baseline_eval = evaluate(parts.router, p.eval_sets, cfg, p.reward_model)
        parts.sink.log_metrics(0, result.baseline_eval)
    parts.sched.submit_ready()
    try:
        for rollout_id in range(result.start_rollout_id, cfg.rollout.num_rollout):
            if parts.before_rollout and parts.sched.inline:
                parts.before_rollout(rollout_id, parts.router)
            train_step(rollout_id, parts)
    finally:
        parts.sched.close()
    result.weights_checksum = (checksum_start, trainer.weights_checksum())
    result.trainer_info = trainer.info()
    result.engine_info = parts.router.call_all("info")
    return result


def rollout_step(
    rollout_id: int, version: int, cfg: RunConfig, buffer: DataBuffer, router, p: Prepared
) -> FinishedRollout:
    """One rollout (on the engines holding policy `version`); every sample records that version."""
    from vime_core.router import collect_rollout

    groups, metrics, consumed = collect_rollout(rollout_id, cfg, buffer, router, p.reward_model)
    for g in groups:
        for s in g:
            s.metadata[VERSION_KEY] = version
    return FinishedRollout(rollout_id, version, groups, metrics, consumed)


@dataclass
class LoopParts:
    """What a training step works with (built once by `train_loop`)."""

    cfg: RunConfig
    p: Prepared
    sched: RolloutScheduler
    trainer: Any
    router: Any
    sync: Any
    ledger: "DataLedger"
    ckpt: Any
    buffer: DataBuffer
    sink: MetricsSink
    on_step: StepCallback | None
    run_state: dict | None
    result: RunResult
    before_rollout: RolloutHook | None = None


def train_step(rollout_id: int, parts: LoopParts) -> None:
    """One step of either mode (see schedule.py): take rollout k, train on it, push version k + 1 once no rollout
    needs an older one, then save / log / evaluate. With rollout.max_staleness > 0 the next rollouts run meanwhile
    (started before the save, or after the evaluation, which needs the engines)."""
    from vime_core.evaluation import evaluate

    cfg, p, sched, trainer, sync, result = parts.cfg, parts.p, parts.sched, parts.trainer, parts.sync, parts.result
    t0 = time.perf_counter()
    done_rollout = sched.take(rollout_id)
    async_mode = not sched.inline
    parts.ledger.record(rollout_id, done_rollout.consumed, done_rollout.version if async_mode else None)
    metrics = dict(done_rollout.metrics) | staleness_metrics(rollout_id, done_rollout.versions())
    sync.release_engines()  # colocated GPUs: vLLM frees its memory while the trainer works
    t1 = time.perf_counter()
    trainer.onload_optimizer()  # colocated GPUs (train.offload_optimizer): optimizer state back from host memory
    metrics |= trainer.train(rollout_id, done_rollout.groups)
    metrics |= trainer.offload_optimizer()  # and to host memory again while vLLM wakes and generates
    metrics["perf/train_time"] = time.perf_counter() - t1
    done = rollout_id + 1
    waited = done_rollout.wait_s + sched.before_push(done)
    metrics["perf/update_weights_time"] = sync.push()
    sched.pushed(done)
    metrics["perf/step_time"] = time.perf_counter() - t0
    metrics["perf/wait_time_ratio"] = wait_time_ratio(waited, metrics["perf/step_time"])
    eval_due = bool(p.eval_sets) and due(done, cfg.eval.interval, cfg.rollout.num_rollout)
    carried = sched.carried() if async_mode else []
    buffer_state = parts.buffer.state_dict()  # nothing samples now: this position goes with the carried rollouts
    if not eval_due:
        sched.submit_ready()  # the next rollouts overlap the checkpoint save as well
    if due(done, cfg.checkpoint.save_interval, cfg.rollout.num_rollout, cfg.checkpoint.save_at_end):
        t2 = time.perf_counter()
        result.last_checkpoint = save_checkpoint(
            parts.ckpt,
            trainer,
            rollout_id,
            cfg,
            p,
            buffer_state,
            metrics,
            parts.run_state,
            result.baseline_eval,
            carried,
        )
        metrics["perf/save_time"] = time.perf_counter() - t2
    parts.sink.log_metrics(rollout_id, metrics)
    result.last_rollout_id, result.last_metrics = rollout_id, metrics
    if parts.on_step:
        parts.on_step(rollout_id, metrics)
    if eval_due:
        log.info("evaluation after step %d on %s", done, ", ".join(p.eval_sets))
        result.final_eval = evaluate(parts.router, p.eval_sets, cfg, p.reward_model)
        parts.sink.log_metrics(done, result.final_eval)
        sched.submit_ready()


def due(done: int, interval: int | None, total: int, at_end: bool = True) -> bool:
    """After `done` steps: every `interval` steps, and after the last one unless `at_end` is false."""
    return (at_end and done == total) or bool(interval and done % interval == 0)


def save_checkpoint(
    ckpt,
    trainer,
    rollout_id: int,
    cfg: RunConfig,
    p: Prepared,
    buffer_state: dict,
    metrics: dict[str, float],
    run_state: dict | None,
    baseline_eval: dict[str, float],
    carried: list[FinishedRollout] | None = None,
) -> Path:
    """`buffer_state`: the data buffer's position after the last rollout started; `carried`: the finished rollouts
    of an async run not trained yet (they go into the checkpoint; see schedule.py)."""
    from vime_core.checkpoint import HF_CONFIG_DIR, copy_hf_side_files, write_torch_dist_meta

    tmp = ckpt.begin(rollout_id)  # checks the free space first
    with ckpt.writing(tmp):  # a full disk: one error naming the path and the size needed
        trainer.save_checkpoint(str(tmp))
        copy_hf_side_files(p.model_dir, tmp / HF_CONFIG_DIR)
        # what `vime convert megatron-to-hf` needs to export it in the dtype it was trained in
        write_torch_dist_meta(
            tmp,
            dtype=cfg.model.dtype,
            source=p.model_dir,
            layout=(cfg.train.tensor_parallel_size, 1, cfg.train.expert_parallel_size),
        )
        state = {
            "fingerprint": cfg.fingerprint(),
            "fingerprint_fields": cfg.fingerprint_fields(),
            "data_buffer": buffer_state,
            "model_dir": str(p.model_dir),
            "metrics": metrics,
            "run_state": run_state or {},
            "baseline_eval": baseline_eval,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if cfg.rollout.max_staleness:  # an on-policy run's state.json stays as it was
            state["max_staleness"] = cfg.rollout.max_staleness
            state["inflight_rollouts"] = write_inflight(tmp, carried or [])
        return ckpt.commit(tmp, rollout_id, state)


class DataLedger:
    """Which prompts (dataset indices) each rollout step consumed, one JSON line per step, appended. A step redone
    after a crash appears twice; tests use it to show no batch is skipped or trained twice beyond the redone steps."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, rollout_id: int, prompt_indices: list[int], policy_version: int | None = None) -> None:
        """`policy_version`: the version that sampled the step (async runs; on-policy lines stay as they were)."""
        row: dict = {"rollout_id": rollout_id, "prompts": prompt_indices}
        if policy_version is not None:
            row["policy_version"] = policy_version
        with open(self.path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
