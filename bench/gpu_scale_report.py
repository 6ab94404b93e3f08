"""The pure part of bench/gpu_scale.py: the Qwen3 shape table, FLOP/MFU math, medians, micro-batch packing, and the
summary (medians, ratios, the issue's Done-when checks) of the phase records merged into one result document.
No torch, no vime_core: tests/unit/test_bench_gpu_scale.py loads it alone."""

from __future__ import annotations

import statistics

H200_BF16_PEAK = 989e12
QWEN3 = dict(vocab_size=151936, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, head_dim=128)
SHAPES = {  # public config.json values of Qwen/Qwen3-1.7B, -4B, -8B; `tiny` is the CPU smoke shape
    "1.7b": dict(
        hidden_size=2048,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=6144,
        tie_word_embeddings=True,
    ),
    "4b": dict(
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=9728,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=12288,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        tie_word_embeddings=True,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
}
DONE_WHEN = (  # the 1.7B and 4B shapes: (label, key, op, other key or constant, factor)
    ("trainer_tok_s >= 1.2 x hf_sdpa_tok_s", "trainer_tok_s", ">=", "hf_sdpa_tok_s", 1.2),
    ("trainer_peak_gib <= 60", "trainer_peak_gib", "<=", None, 60.0),
    ("rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s", "rollout_tok_per_gpu_s", ">=", "raw_vllm_tok_s", 0.95),
    ("sync_s <= 0.5", "sync_s", "<=", None, 0.5),
)
DONE_WHEN_8B = (  # Qwen3-8B on one GPU against vime's run on two MI355X (~4,100 tok/s/GPU)
    ("rollout_tok_per_gpu_s >= 4100 (vime, 2 x MI355X)", "rollout_tok_per_gpu_s", ">=", None, 4100.0),
    ("rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s", "rollout_tok_per_gpu_s", ">=", "raw_vllm_tok_s", 0.95),
    ("trainer_tok_s >= 1.0 x hf_sdpa_tok_s", "trainer_tok_s", ">=", "hf_sdpa_tok_s", 1.0),
    ("host_peak_gib < 110", "host_peak_gib", "<=", None, 110.0),
    ("sync_s <= 1.5", "sync_s", "<=", None, 1.5),
)


def hf_config(shape: str, eos_token_id: int = 2, pad_token_id: int = 0) -> dict:
    c = {**QWEN3, **SHAPES[shape]}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **c,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": c["num_hidden_layers"],
        "initializer_range": 0.02,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "dtype": "bfloat16",
    }


def layer_params(c: dict) -> int:
    h, d = c["hidden_size"], c["head_dim"]
    attn = h * c["num_attention_heads"] * d * 2 + h * c["num_key_value_heads"] * d * 2  # q, o; k, v
    return attn + 3 * h * c["intermediate_size"] + 2 * h + 2 * d  # gate/up/down; two RMSNorms; q/k norms


def param_count(c: dict) -> int:
    emb = c["vocab_size"] * c["hidden_size"]
    return c["num_hidden_layers"] * layer_params(c) + emb * (1 if c["tie_word_embeddings"] else 2) + c["hidden_size"]


def matmul_params(c: dict) -> int:
    """Parameters that take part in a matmul per token: the layers and the LM head (the embedding is a lookup)."""
    return c["num_hidden_layers"] * layer_params(c) + c["vocab_size"] * c["hidden_size"]


def step_flops(c: dict, seq_lens: list[float], passes: int = 4) -> float:
    """Model FLOPs of a GRPO step over sequences of these lengths. One pass (a forward) costs 2 x matmul params per
    token plus causal attention 2 x s x layers x heads x head_dim per token (QK^T and AV, halved by the mask);
    backward = 2 passes; 4 = no-grad forward for the old log-probs + forward/backward. Recompute is not counted."""
    attn = 2 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"]
    return passes * sum(2 * matmul_params(c) * s + attn * s * s for s in seq_lens)


def loop_passes(old_logprobs: str, steps_per_rollout: int) -> float:
    """Passes per trained sample that the loop's trainer runs: forward + backward (3), plus the no-grad old-log-prob
    forward over the samples it covers: with train.old_logprobs auto, all but the first optimizer step's."""
    if old_logprobs == "forward":
        return 4.0
    return 3.0 + (steps_per_rollout - 1) / steps_per_rollout


def mfu(flops: float, seconds: float, peak: float = H200_BF16_PEAK) -> float | None:
    return flops / seconds / peak if seconds > 0 else None


def median_after_first(xs: list[float]) -> float | None:
    """Median over steps after the first (which includes warm-up: CUDA graphs, allocator growth); the only value if
    there is one step."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else None


def matched_steps(ours: list, baseline: list) -> tuple[list, list]:
    """Both columns cut to the steps both phases ran: step k of each phase has the same prompts (and so similar
    response lengths), and 1.7B x 4,096 raw vLLM varied 41.0-45.4 s between its own steps 0 and 1. A phase that did
    not run leaves the other whole."""
    n = min(len(ours), len(baseline)) if ours and baseline else max(len(ours), len(baseline))
    return ours[:n], baseline[:n]


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Micro-batches of sequence indices, longest first, rows x longest row <= budget (a longer sequence alone)."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def summarize(doc: dict) -> dict:
    """The issue's keys (medians over steps after the first), ratios and Done-when checks from the phase records."""
    ph = doc.get("phases", {})
    col = lambda name, key: [r.get(key) for r in ph.get(name, {}).get("steps", [])]  # noqa: E731
    rollout, raw = matched_steps(col("loop", "perf/tokens_per_gpu_per_sec"), col("vllm", "tok_s"))
    _, raw_sleep = matched_steps(col("loop", "perf/tokens_per_gpu_per_sec"), col("vllm_sleep", "tok_s"))
    trainer, hf = matched_steps(col("loop", "perf/actor_train_tok_per_s"), col("hf", "tok_s"))
    s = {
        "rollout_tok_per_gpu_s": median_after_first(rollout),
        "raw_vllm_tok_s": median_after_first(raw),
        "raw_vllm_sleep_mode_tok_s": median_after_first(raw_sleep),  # phase vllm_sleep, a diagnostic
        "trainer_tok_s": median_after_first(trainer),
        "hf_sdpa_tok_s": median_after_first(hf),
        "trainer_peak_gib": None,
        "hf_sdpa_peak_gib": median_after_first(col("hf", "peak_gib")),
        "sync_s": median_after_first(col("loop", "perf/update_weights_time")),
        "step_s": median_after_first(col("loop", "perf/step_time")),
        "logprob_abs_diff": median_after_first(col("loop", "train/train_rollout_logprob_abs_diff")),
        "mfu": median_after_first(col("loop", "bench/mfu")),
        "host_peak_gib": ph.get("loop", {}).get("host_used_peak_gib"),  # the machine's, psutil `used`, whole phase
        "optimizer_step_s": median_after_first(col("loop", "perf/optimizer_step_time")),
        "offload_s": median_after_first(col("loop", "perf/optimizer_offload_time")),
        "onload_s": median_after_first(col("loop", "perf/optimizer_onload_time")),
        "rollout_s": median_after_first(col("loop", "perf/rollout_time")),
        "train_s": median_after_first(col("loop", "perf/train_time")),
        "hf_sdpa_mfu": median_after_first(col("hf", "mfu")),
        "hf_sdpa_oom": ph.get("hf", {}).get("oom"),  # the baseline's out-of-memory error where it does not fit
        # the same work in each phase: response lengths (random weights rarely sample EOS) and trained tokens
        "loop_response_len_mean": median_after_first(col("loop", "rollout/response_len/mean")),
        "raw_vllm_response_len_mean": median_after_first(col("vllm", "response_len_mean")),
        "loop_train_tokens": median_after_first(col("loop", "bench/train_tokens")),
        "hf_sdpa_train_tokens": median_after_first(col("hf", "tokens")),
    }
    loop = ph.get("loop", {})
    s["kv_cache_tokens"] = kv_cache_tokens(doc)
    keys = trainer_peak_keys(loop.get("steps", []))
    if keys:  # per-step trainer peaks (e.g. perf/trainer_peak_gib, perf/trainer_logprobs_peak_gib): the step's max
        per_step = [max((r[k] for k in keys if r.get(k) is not None), default=None) for r in loop["steps"]]
        s["trainer_peak_gib"], s["trainer_peak_source"] = median_after_first(per_step), "max of " + ", ".join(keys)
    elif loop.get("trainer_info"):
        s["trainer_peak_gib"] = max(i.get("max_gpu_mem_gib", 0.0) for i in loop["trainer_info"])
        s["trainer_peak_source"] = "trainer_info.max_gpu_mem_gib (torch allocator peak of the trainer over the run)"
    div = lambda a, b: s[a] / s[b] if s.get(a) is not None and s.get(b) else None  # noqa: E731
    s["ratios"] = {
        "trainer_vs_hf_sdpa": div("trainer_tok_s", "hf_sdpa_tok_s"),
        "rollout_vs_raw_vllm": div("rollout_tok_per_gpu_s", "raw_vllm_tok_s"),
        "raw_vllm_sleep_mode_vs_raw_vllm": div("raw_vllm_sleep_mode_tok_s", "raw_vllm_tok_s"),
        "trainer_peak_vs_hf_sdpa_peak": div("trainer_peak_gib", "hf_sdpa_peak_gib"),
    }
    s["done_when"] = {}
    for label, a, op, b, f in DONE_WHEN_8B if doc.get("shape") == "8b" else DONE_WHEN:
        x, y = s.get(a), (s.get(b) if b else 1.0)
        s["done_when"][label] = None if x is None or y is None else (x >= f * y if op == ">=" else x <= f * y)
    return s


def kv_cache_tokens(doc: dict) -> dict:
    """Tokens the loop's engine(s) and raw vLLM could hold in their KV caches, beside the response tokens of one
    rollout step with every sample at full length (the prompts, shared by a group's samples through the prefix cache,
    add ~1% at 4,096 tokens): an engine short of it preempts and recomputes samples, a slower rollout at the same
    settings. None where a phase did not record it."""
    ph = doc.get("phases", {})
    engines = [i.get("kv_cache_tokens") for i in ph.get("loop", {}).get("engine_info", [])]
    prompts, samples, n = doc.get("prompts"), doc.get("samples"), doc.get("response_len")
    return {
        "loop_engine": min(engines) if engines and None not in engines else None,
        "raw_vllm": ph.get("vllm", {}).get("kv_cache_tokens"),
        "raw_vllm_sleep_mode": ph.get("vllm_sleep", {}).get("kv_cache_tokens"),
        "full_length_responses": prompts * samples * n if prompts and samples and n else None,
    }


SUMMARY_KEYS = {
    "rollout_tok_per_gpu_s",
    "raw_vllm_tok_s",
    "raw_vllm_sleep_mode_tok_s",
    "trainer_tok_s",
    "hf_sdpa_tok_s",
    "trainer_peak_gib",
    "hf_sdpa_peak_gib",
    "sync_s",
    "step_s",
    "logprob_abs_diff",
    "mfu",
    "host_peak_gib",
    "optimizer_step_s",
    "offload_s",
    "onload_s",
    "rollout_s",
    "train_s",
    "hf_sdpa_mfu",
    "hf_sdpa_oom",
    "loop_response_len_mean",
    "raw_vllm_response_len_mean",
    "loop_train_tokens",
    "hf_sdpa_train_tokens",
    "trainer_peak_source",
    "kv_cache_tokens",
    "ratios",
    "done_when",
}


def trainer_peak_keys(rows: list[dict]) -> list[str]:
    return sorted({k for r in rows for k in r if all(w in k.lower() for w in ("gib", "train", "peak"))})


def merge_phase(doc: dict | None, header: dict, phase: str, record: dict) -> dict:
    """Fold one phase record into a result document; a document of another batch shape is replaced."""
    doc = {k: v for k, v in (doc or {}).items() if k not in SUMMARY_KEYS}  # recomputed below
    if not doc or any(
        doc.get(k) != v for k, v in header.items() if k in ("shape", "prompts", "samples", "response_len")
    ):
        doc = {**header, "phases": {}}
    doc.update({k: v for k, v in header.items() if k != "phases"})
    doc["phases"][phase] = record
    return {**doc, **summarize(doc)}
