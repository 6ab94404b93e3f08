"""An engine's KV cache against what a rollout asks of it: vLLM's sized capacity (in tokens), scheduler width and
model runner, read from a live `LLM`, and the one-line warning when the samples a rollout runs at once cannot fit
(vLLM then preempts and recomputes them: correct, but slower)."""

from __future__ import annotations

import math


def _engine_config(llm, section: str):
    """`llm.llm_engine.vllm_config.<section>` (a config section or property), or None where this vLLM lays it out
    otherwise."""
    return getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), section, None)


def kv_cache_tokens(llm) -> int | None:
    """How many tokens the engine's KV cache holds (blocks x block size), as vLLM sized it at start; None if this
    vLLM does not say. A rollout whose samples need more than this preempts and recomputes some of them."""
    cache = _engine_config(llm, "cache_config")
    blocks = getattr(cache, "num_gpu_blocks", None)
    return int(blocks * cache.block_size) if blocks else None


def max_num_seqs(llm) -> int | None:
    """How many sequences the engine's scheduler runs at once (None if this vLLM does not say)."""
    return getattr(_engine_config(llm, "scheduler_config"), "max_num_seqs", None)


def model_runner(llm) -> str | None:
    """Which model runner vLLM picked for this engine, "v1" or "v2" (None if this vLLM does not say): the same
    work at a different host cost a step, so rollout timings compare only within one runner (rollout.model_runner
    picks it)."""
    flag = _engine_config(llm, "use_v2_model_runner")
    return None if flag is None else ("v2" if flag else "v1")


def kv_cache_shortfall(cfg, engine_infos: list[dict], platform: str) -> str | None:
    """A one-line warning when an engine's KV cache (engine `info()`) cannot hold the samples one rollout runs on it
    at once, each at data.max_prompt_len + rollout.max_response_len tokens; None when every engine can. Short of it,
    vLLM preempts running samples and recomputes them later: correct, but slower (a Qwen3-1.7B rollout at 4,096
    tokens, 128 samples, needs ~56 GiB of KV cache, close to what `gpu_memory_utilization` 0.5 leaves on an H200)."""
    r = cfg.rollout
    prompts = r.over_sampling_batch_size if r.dynamic_sampling else r.rollout_batch_size
    per_engine = math.ceil(prompts / max(1, len(engine_infos))) * r.n_samples_per_prompt  # groups stay whole
    per_sample = cfg.data.max_prompt_len + r.max_response_len
    for i, info in enumerate(engine_infos):
        held = info.get("kv_cache_tokens")
        running = min(per_engine, info.get("max_num_seqs") or per_engine)
        if held and held < running * per_sample:
            knob = (
                f"rollout.cpu_kv_cache_gib ({r.cpu_kv_cache_gib})"
                if platform == "cpu"
                else f"rollout.gpu_memory_utilization ({r.gpu_memory_utilization})"
            )
            return (
                f"vLLM engine {i}'s KV cache holds {held:,} tokens, fewer than the {running * per_sample:,} that "
                f"{running} samples of up to {per_sample:,} tokens (data.max_prompt_len + rollout.max_response_len) "
                f"reach at once: vLLM will preempt and recompute samples, a slower rollout. Raise {knob} or "
                "rollout.num_engines, or lower rollout.max_response_len"
            )
    return None
