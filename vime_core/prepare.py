"""Everything a run checks before any actor starts: the model against the config, the weights files, every dataset,
the rewards, the output dir and whether a local Ray can hold the placement. A bad config or dataset fails here in
seconds with a clear message instead of after the engines started (25-210 s).

Below both the loop and the evaluation entry point (each calls `prepare`), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config import ConfigError, RunConfig
from vime_core.data import DatasetError, PromptSet, check_labels, load_prompts
from vime_core.fit import check_local_memory
from vime_core.models import arch_from_hf_config, check_model_compat
from vime_core.rewards import RewardModel, usable_labels
from vime_core.sources import SourceError, dataset_path, resolve_model
from vime_core.tracking import resolve_tracking_uri


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


def prepare(cfg: RunConfig, model_dir: Path | None = None, eval_only: bool = False) -> Prepared:
    """Resolve the model, check the config against it, load and validate every dataset: all before any actor."""
    from transformers import AutoTokenizer

    from vime_core.checkpoint import read_hf_config  # torch
    from vime_core.platform import detect_platform

    platform = detect_platform(cfg.cluster.platform)
    if cfg.train.pipeline_parallel_size > 1:
        raise ConfigError(
            "train.pipeline_parallel_size > 1: the trainer runs pipeline stages of 1 only (conversion "
            "supports PP layouts); use tensor/expert parallelism"
        )
    model_dir = Path(model_dir) if model_dir else resolve_model(cfg.model.source, resolve_tracking_uri(cfg)).path
    hf_config = read_hf_config(model_dir)
    # unsupported architectures (GPT-2, ...) raise naming the field; then the layout against the model
    arch = arch_from_hf_config(hf_config, where=model_dir)
    check_model_compat(cfg, arch)
    if not eval_only:
        check_local_memory(cfg, arch, platform)  # a run that cannot fit is refused here, not by an OOM minutes in
    preflight(cfg, platform, model_dir, eval_only)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = (
        PromptSet(cfg.data.source, [])
        if eval_only
        else load_prompts(local_dataset(cfg.data.source), tokenizer, cfg.data)
    )
    eval_sets = {}
    for d in cfg.eval.datasets:
        eval_sets[d.name] = load_eval_set(d, tokenizer, cfg)
    reward_model = RewardModel(
        cfg.rollout.reward, cfg.rollout.reward_type, cfg.rollout.strict_format, cfg.rollout.reward_timeout_s
    )
    if cfg.rollout.reward == "math":  # labels the verifier cannot read score 0 everywhere: count, warn, refuse all-bad
        for ps in [prompts, *eval_sets.values()]:
            check_labels(ps, usable_labels, cfg.data.label_key)
    return Prepared(cfg, platform, model_dir, tokenizer, prompts, eval_sets, reward_model)


def preflight(cfg: RunConfig, platform: str, model_dir: Path, eval_only: bool) -> None:
    """What used to fail only after the actors started (25-210 s), checked in seconds: the weights files (headers
    and sizes), the custom generate function, a writable output dir, and whether a local Ray can hold the placement."""
    from vime_core.checkpoint import check_model_files  # torch
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
    try:
        return load_prompts(local_dataset(d.source), tokenizer, cfg.data, max_prompts=d.max_prompts)
    except (DatasetError, SourceError) as e:
        raise type(e)(f"eval dataset {d.name!r} (eval.datasets, source {d.source}): {e}") from None


def local_dataset(source: str) -> str:
    """What `load_prompts` reads: builtin sources as they are, others on disk (no content hash: the download task
    has recorded it)."""
    return source if source.startswith("builtin://") else str(dataset_path(source))


def check_resume(cfg: RunConfig) -> None:
    """What the loop's resume point refuses (checkpoint.resume = false beside checkpoints, a checkpoint written with
    other fixed settings), by the cheap look at the latest checkpoint's state: the pipeline calls it before it
    opens the MLflow run, downloads or converts the model or starts an engine. In the loop alone, a continuation
    with a wrong model.source failed after ~60 s of conversion and engine start and had marked the night's finished
    MLflow run FAILED (issue 26)."""
    from vime_core.checkpoint import Checkpointer, check_resumable
    from vime_core.resume import check_resume_setting

    if cfg.checkpoint.start_fresh:
        return
    check_resume_setting(cfg)
    latest = Checkpointer(cfg.save_dir).peek_latest() if cfg.checkpoint.resume else None
    if latest is not None:
        check_resumable(Checkpointer.read_state(latest), cfg)
