"""Everything a run checks before any actor starts: the model against the config, the weights files, every dataset,
the rewards, the output dir and whether a local Ray can hold the placement. A bad config or dataset fails here in
seconds with a clear message instead of after the engines started (25-210 s).

Below both the loop and the evaluation entry point (each calls `prepare`), so neither imports the other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config import ConfigError, RunConfig, gpu_only_problems
from vime_core.data import DatasetError, PromptSet, check_labels, load_prompts
from vime_core.builtin import builtin_model_path
from vime_core.fit import check_local_memory
from vime_core.model_files import check_light
from vime_core.models import arch_from_hf_config, check_model_compat
from vime_core.rewards import RewardModel, load_reward, usable_labels
from vime_core.sources import SourceError, dataset_path, resolve_model
from vime_core.tracking import check_tracking_socket, resolve_tracking_uri
from vime_core.metrics import check_metrics_path

log = logging.getLogger(__name__)


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
    problems = list(gpu_only_problems(cfg)) if platform == "cpu" else []  # the config saw only an explicit cpu
    if problems:
        raise ConfigError(f"{problems[0]} (cluster.platform = {cfg.cluster.platform} runs the cpu platform here)")
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
    if not eval_only:
        for note in run_notes(cfg, prompts):
            log.warning(note)
    return Prepared(cfg, platform, model_dir, tokenizer, prompts, eval_sets, reward_model)


def check_before_start(cfg: RunConfig, metrics_out: Path | None = None) -> None:
    """What the command line, the config and a local model's files alone decide, without torch (milliseconds; a
    tracking server gets 1 s to accept a connection), before `vime train` takes the output_dir lock, opens its MLflow
    run or starts Ray: a writable output dir, a --metrics-out that can be a file, the reward and generate hooks
    import, the model's JSON files, weights headers and vocab_size, the context length, the parallel layout against
    the model, the tracking server. Each of them failed only after the actors started (12-40 s in; the layout after
    the MLflow run opened, ~12 s); `preflight` checks them again (and more) for the pipeline and the evaluation."""
    from vime_core.integrity import check_writable
    from vime_core.generate_hook import load_custom_generate

    check_writable(cfg.output_dir)
    if metrics_out is not None:
        check_metrics_path(metrics_out)
    if cfg.rollout.reward != "math":
        load_reward(cfg.rollout.reward)
    if cfg.rollout.custom_generate:
        load_custom_generate(cfg.rollout.custom_generate)
    model_dir = local_model_dir(cfg.model.source)
    if model_dir is not None:
        hf_config = check_light(model_dir)
        check_context_length(cfg, hf_config, model_dir)
        check_model_compat(cfg, arch_from_hf_config(hf_config, where=model_dir))  # the parallel layout against it
    if cfg.tracking.enabled:
        check_tracking_socket(resolve_tracking_uri(cfg))


def local_model_dir(source: str) -> Path | None:
    """The directory of a builtin (cached: built on first use) or local model; None for one to download."""
    if source.startswith("builtin://"):
        try:
            return builtin_model_path(source.removeprefix("builtin://"))
        except ValueError as e:  # an unknown name, as resolve_model reports it
            raise SourceError(str(e)) from None
    path = Path(source).expanduser()
    return path if "://" not in source and path.is_dir() else None


def run_notes(cfg: RunConfig, prompts: PromptSet) -> list[str]:
    """What a run does that its settings may not make obvious, said once at start (both ran without a word): a
    sample longer than the micro-batch budget, and a dataset smaller than one rollout batch."""
    notes = []
    budget, longest = cfg.train.max_tokens_per_device, max((len(p.prompt_ids) for p in prompts.prompts), default=0)
    if budget < longest + cfg.rollout.max_response_len:
        notes.append(
            f"note: train.max_tokens_per_device = {budget} is below the longest possible sample, "
            f"{longest + cfg.rollout.max_response_len} tokens (longest prompt {longest} + rollout.max_response_len "
            f"{cfg.rollout.max_response_len}): a sample over the budget is trained alone in a micro-batch of its own "
            f"(its memory is that of its length, not of the budget); raise train.max_tokens_per_device to "
            f"{longest + cfg.rollout.max_response_len} to keep every micro-batch within it"
        )
    r = cfg.rollout
    batch = max(r.rollout_batch_size, r.over_sampling_batch_size or 0) if r.dynamic_sampling else r.rollout_batch_size
    if len(prompts) and len(prompts) < batch:
        notes.append(
            f"note: the dataset {cfg.data.source} has {len(prompts)} prompts, fewer than one rollout batch "
            f"({batch} prompts): every step wraps around into the next epoch, so a step holds some prompts more "
            "than once, each as a group of its own"
        )
    return notes


def preflight(cfg: RunConfig, platform: str, model_dir: Path, eval_only: bool) -> None:
    """What used to fail only after the actors started (25-210 s), checked in seconds: the model files (weights
    headers and sizes, tensor shapes against config.json, the tokenizer's JSON), the context length, the reward and
    custom generate functions, a writable output dir, and whether a local Ray can hold the placement."""
    from vime_core.checkpoint import check_model_files, read_hf_config  # torch
    from vime_core.cluster import check_local_fit
    from vime_core.integrity import check_writable
    from vime_core.generate_hook import load_custom_generate

    check_model_files(model_dir)
    check_model_runner(cfg)
    check_context_length(cfg, read_hf_config(model_dir), model_dir)
    if cfg.rollout.reward != "math":
        load_reward(cfg.rollout.reward)
    if cfg.rollout.custom_generate:
        load_custom_generate(cfg.rollout.custom_generate)
    if not eval_only:
        check_writable(cfg.output_dir)
    check_local_fit(cfg, platform, engines_only=eval_only)


def check_model_runner(cfg: RunConfig) -> None:
    """rollout.model_runner can do what the run asks of the installed vLLM (each engine checks again as it starts)."""
    from vime_core.rollout import installed_vllm, model_runner_env

    if installed := installed_vllm():  # else the engines' processes fail to import it, naming the package
        model_runner_env(cfg.rollout.model_runner, cfg.rollout.routing_replay, installed)


# rope types whose `factor` vLLM does not apply to max_position_embeddings (vllm/config/model.py, 0.32)
UNSCALED_ROPE = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_length(hf: dict) -> int | None:
    """The longest sequence vLLM accepts for this config.json: max_position_embeddings, times the RoPE scaling
    factor where vLLM applies it; None when the config does not say."""
    n = hf.get("max_position_embeddings")
    if not isinstance(n, int):
        return None
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not isinstance(rope, dict):
        return n
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in UNSCALED_ROPE and isinstance(rope.get("factor"), (int, float)):
        n = int(n * rope["factor"])
    return n


def check_context_length(cfg: RunConfig, hf: dict, model_dir: Path) -> None:
    """The prompt and response budgets fit the model's context (vLLM refuses a longer max_model_len when its engine
    starts, 25-210 s in)."""
    limit = context_length(hf)
    lengths = [("rollout.max_response_len", cfg.rollout.max_response_len)]
    if cfg.eval.datasets and cfg.eval.max_response_len:
        lengths.append(("eval.max_response_len", cfg.eval.max_response_len))
    for field, n in lengths if limit else []:
        total = cfg.data.max_prompt_len + n
        if total > limit:
            raise ConfigError(
                f"data.max_prompt_len + {field} = {cfg.data.max_prompt_len} + {n} = {total} tokens is above the "
                f"model's context length {limit} (max_position_embeddings in {Path(model_dir) / 'config.json'}); "
                f"lower {field} or data.max_prompt_len"
            )


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
