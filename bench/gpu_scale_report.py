"""The pure part of bench/gpu_scale.py: the Qwen3 and Qwen3-MoE shape table, FLOP/MFU math, medians, micro-batch
packing, and the summary (medians, ratios, the issues' Done-when checks) of the phase records merged into one result
document. No torch, no vime_core: tests/unit/test_bench_gpu_scale.py loads it alone."""

from __future__ import annotations

import operator
import re
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
# what every MoE shape here shares with Qwen3-30B-A3B: normalised top-k, every layer MoE, untied embeddings
MOE_COMMON = dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
# the CPU smoke shape of the MoE path: `tiny` with experts, expert rows of 16 bytes in fp32
SHAPES["tiny-moe"] = dict(SHAPES["tiny"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, **MOE_COMMON)
# Qwen/Qwen3-30B-A3B's public config.json values; the bench builds its first L of 48 layers (30b-a3b-<L>l), every
# layer at full width, so that one GPU holds them beside vLLM
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    **MOE_COMMON,
)
MOE_LAYERS = 48
MOE_SHAPE = re.compile(r"30b-a3b-([1-9]\d*)l")
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
    ("loop_steps_run >= 3", "loop_steps_run", ">=", None, 3.0),  # a phase cut by its watchdog ran fewer
)


DONE_WHEN_MOE = (  # Qwen3-30B-A3B layers on one GPU (issue 25); raw vLLM paired in the loop's engine (host-bound)
    (
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_paired_tok_s",
        "rollout_tok_per_gpu_s",
        ">=",
        "raw_vllm_paired_tok_s",
        0.95,
    ),
    ("trainer_tok_s >= 2 x sequential_mlp_tok_s", "trainer_tok_s", ">=", "sequential_mlp_tok_s", 2.0),
    ("trainer_tok_s >= 1.0 x hf_tok_s", "trainer_tok_s", ">=", "hf_tok_s", 1.0),
    ("logprob_abs_diff_r3 < logprob_abs_diff_no_r3", "logprob_abs_diff_r3", "<", "logprob_abs_diff_no_r3", 1.0),
)
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}
LOGPROB_DIFF = "train/train_rollout_logprob_abs_diff"
# vime_core.metrics.ROUTING_METRICS: what the trainer logs with rollout.routing_replay (the test checks the names)
ROUTING_AGREEMENT, LOGPROB_DIFF_NO_REPLAY = "train/routing_agreement", "train/train_rollout_logprob_abs_diff_no_replay"


def shape_params(shape: str) -> dict:
    """config.json values of a shape: a SHAPES entry or 30b-a3b-<L>l. ValueError, naming the valid shapes, else."""
    if shape in SHAPES:
        return {**QWEN3, **SHAPES[shape]}
    m = MOE_SHAPE.fullmatch(shape)
    if m and 1 <= int(m.group(1)) <= MOE_LAYERS:
        return {**QWEN3, **QWEN3_30B_A3B, "num_hidden_layers": int(m.group(1))}
    raise ValueError(
        f"unknown shape {shape!r}: use one of {', '.join(SHAPES)} or 30b-a3b-<L>l (Qwen3-30B-A3B's first L layers, "
        f"1 <= L <= {MOE_LAYERS}, e.g. 30b-a3b-6l)"
    )


def num_experts(c: dict) -> int:
    """Experts per MoE layer, 0 for a dense model. transformers 5 saves `num_experts` as `num_local_experts`."""
    return int(c.get("num_experts") or c.get("num_local_experts") or 0)


def is_moe(c: dict) -> bool:
    return num_experts(c) > 0


def is_moe_shape(shape: str | None) -> bool:
    try:
        return is_moe(shape_params(shape or ""))
    except ValueError:
        return False


def hf_config(shape: str, eos_token_id: int = 2, pad_token_id: int = 0) -> dict:
    c = shape_params(shape)
    moe = is_moe(c)
    return {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        **c,
        **({"output_router_logits": False, "router_aux_loss_coef": 0.001} if moe else {}),
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


def attention_params(c: dict) -> int:
    h, d = c["hidden_size"], c["head_dim"]
    return h * c["num_attention_heads"] * d * 2 + h * c["num_key_value_heads"] * d * 2  # q, o; k, v


def layer_params(c: dict) -> int:
    h = c["hidden_size"]
    if is_moe(c):  # every expert's gate/up/down and the router
        mlp = num_experts(c) * (3 * h * c["moe_intermediate_size"] + h)
    else:
        mlp = 3 * h * c["intermediate_size"]  # gate/up/down
    return attention_params(c) + mlp + 2 * h + 2 * c["head_dim"]  # two RMSNorms; q/k norms


def param_count(c: dict) -> int:
    emb = c["vocab_size"] * c["hidden_size"]
    return c["num_hidden_layers"] * layer_params(c) + emb * (1 if c["tie_word_embeddings"] else 2) + c["hidden_size"]


def matmul_params(c: dict) -> int:
    """Parameters that take part in a matmul: the layers and the LM head (the embedding is a lookup). For an MoE,
    every expert's: a token uses only `active_params`."""
    return c["num_hidden_layers"] * layer_params(c) + c["vocab_size"] * c["hidden_size"]


def active_params(c: dict) -> int:
    """MoE: the matmul parameters one token uses: per layer attention, the router and its top-k experts (gate, up,
    down), then the LM head. Norms are not matmuls."""
    h = c["hidden_size"]
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    layer = attention_params(c) + h * num_experts(c) + experts
    return c["num_hidden_layers"] * layer + c["vocab_size"] * h


def flop_params(c: dict) -> int:
    """The parameters a token's forward multiplies with: all matmul parameters of a dense model, the active ones of
    an MoE (MFU over every expert would count work that no token asks for)."""
    return active_params(c) if is_moe(c) else matmul_params(c)


def step_flops(c: dict, seq_lens: list[float], passes: float) -> float:
    """Model FLOPs of a GRPO step over sequences of these lengths. One pass (a forward) costs 2 x `flop_params` per
    token plus causal attention 2 x s x layers x heads x head_dim per token (QK^T and AV, halved by the mask);
    backward = 2 passes; 4 = no-grad forward for the old log-probs + forward/backward. Recompute is not counted."""
    attn = 2 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"]
    return passes * sum(2 * flop_params(c) * s + attn * s * s for s in seq_lens)


def loop_passes(old_logprobs: str, steps_per_rollout: int, routing_measured: bool = False) -> float:
    """Passes per trained sample that the loop's trainer runs on one rollout: forward + backward (3), plus the no-grad
    old-log-prob forward over the samples it covers (with train.old_logprobs auto, all but the first optimizer step's),
    plus, on a rollout where R3 measures routing agreement (vime_core.trainer.routing.measures_routing), the no-grad
    forward without replay over all samples. Per rollout, not averaged: MFU counts the passes that step ran."""
    extra = 1.0 if routing_measured else 0.0
    if old_logprobs == "forward":
        return 4.0 + extra
    return 3.0 + (steps_per_rollout - 1) / steps_per_rollout + extra


def mfu(flops: float, seconds: float, peak: float = H200_BF16_PEAK) -> float | None:
    return flops / seconds / peak if seconds > 0 else None


def median_after_first(xs: list[float]) -> float | None:
    """Median over steps after the first (which includes warm-up: CUDA graphs, allocator growth); the only value if
    there is one step."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs[1:] if len(xs) > 1 else xs) if xs else None


def median_given(xs: list) -> float | None:
    """Median of the values present (a column with no warm-up step to drop); None if there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


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


def column(doc: dict, phase: str, key: str) -> list:
    """One metric of a phase, step by step (None where a step lacks it)."""
    return [r.get(key) for r in doc.get("phases", {}).get(phase, {}).get("steps", [])]


def summarize(doc: dict) -> dict:
    """The issue's keys (medians over steps after the first), ratios and Done-when checks from the phase records."""
    ph = doc.get("phases", {})
    col = lambda name, key: column(doc, name, key)  # noqa: E731
    rollout, raw = matched_steps(col("loop", "perf/tokens_per_gpu_per_sec"), col("vllm", "tok_s"))
    _, raw_sleep = matched_steps(col("loop", "perf/tokens_per_gpu_per_sec"), col("vllm_sleep", "tok_s"))
    trainer, hf = matched_steps(col("loop", "perf/actor_train_tok_per_s"), col("hf", "tok_s"))
    s = {
        "rollout_tok_per_gpu_s": median_after_first(rollout),
        "raw_vllm_tok_s": median_after_first(raw),
        "raw_vllm_sleep_mode_tok_s": median_after_first(raw_sleep),  # phase vllm_sleep, a diagnostic
        # in the loop's engine before its rollouts 1.. (gpu_scale_phases.paired_raw_vllm): no first step to skip
        "raw_vllm_paired_tok_s": median_given(col("loop", "bench/paired_raw_vllm_tok_s")),
        "raw_vllm_paired_response_len_mean": median_given(col("loop", "bench/paired_raw_vllm_response_len_mean")),
        "trainer_tok_s": median_after_first(trainer),
        "hf_sdpa_tok_s": median_after_first(hf),
        "trainer_peak_gib": None,
        "hf_sdpa_peak_gib": median_after_first(col("hf", "peak_gib")),
        "sync_s": median_after_first(col("loop", "perf/update_weights_time")),
        "step_s": median_after_first(col("loop", "perf/step_time")),
        "logprob_abs_diff": median_after_first(col("loop", LOGPROB_DIFF)),
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
        # phase hf_detached, a diagnostic: the transformers step without its old-log-prob forward, as the loop runs
        "hf_detached_tok_s": median_after_first(matched_steps(trainer, col("hf_detached", "tok_s"))[1]),
    }
    s.update(engine_facts(doc))
    # the steps the loop finished (a watchdog or a crash can cut it short of the header's `steps`), and why it stopped
    s["loop_steps_run"] = len(ph["loop"].get("steps", [])) if "loop" in ph else None
    s["loop_error"] = ph.get("loop", {}).get("error")
    peak = trainer_peak(ph.get("loop", {}))
    if peak:
        s["trainer_peak_gib"], s["trainer_peak_source"] = peak
    s["ratios"] = ratios(s)
    checks = DONE_WHEN_8B if doc.get("shape") == "8b" else DONE_WHEN
    if is_moe_shape(doc.get("shape")):
        s.update(moe_summary(doc, s))
        s["ratios"].update(
            trainer_vs_sequential_mlp=ratio(s, "trainer_tok_s", "sequential_mlp_tok_s"),
            alltoall_vs_allgather=ratio(s, "alltoall_tok_s", "trainer_tok_s"),
            hf_vs_hf_eager=ratio(s, "hf_tok_s", "hf_eager_tok_s"),
        )
        checks = DONE_WHEN_MOE
    s["done_when"] = done_when(s, checks)
    return s


def ratios(s: dict) -> dict:
    return {
        "trainer_vs_hf_sdpa": ratio(s, "trainer_tok_s", "hf_sdpa_tok_s"),
        "trainer_vs_hf_detached": ratio(s, "trainer_tok_s", "hf_detached_tok_s"),
        "rollout_vs_raw_vllm": ratio(s, "rollout_tok_per_gpu_s", "raw_vllm_tok_s"),
        "raw_vllm_sleep_mode_vs_raw_vllm": ratio(s, "raw_vllm_sleep_mode_tok_s", "raw_vllm_tok_s"),
        "rollout_vs_raw_vllm_paired": ratio(s, "rollout_tok_per_gpu_s", "raw_vllm_paired_tok_s"),
        "trainer_peak_vs_hf_sdpa_peak": ratio(s, "trainer_peak_gib", "hf_sdpa_peak_gib"),
    }


def ratio(s: dict, a: str, b: str) -> float | None:
    return s[a] / s[b] if s.get(a) is not None and s.get(b) else None


def done_when(s: dict, checks: tuple) -> dict:
    """label -> whether the summary passes the check; None where a value is missing (a phase did not run)."""
    out = {}
    for label, a, op, b, f in checks:
        x, y = s.get(a), (s.get(b) if b else 1.0)
        out[label] = None if x is None or y is None else OPS[op](x, f * y)
    return out


def trainer_peak(loop: dict) -> tuple[float | None, str] | None:
    """(the loop trainer's peak GiB, where it comes from), or None where the phase recorded none."""
    keys = trainer_peak_keys(loop.get("steps", []))
    if keys:  # per-step trainer peaks (e.g. perf/trainer_peak_gib, perf/trainer_logprobs_peak_gib): the step's max
        per_step = [max((r[k] for k in keys if r.get(k) is not None), default=None) for r in loop["steps"]]
        return median_after_first(per_step), "max of " + ", ".join(keys)
    if loop.get("trainer_info"):
        peak = max(i.get("max_gpu_mem_gib", 0.0) for i in loop["trainer_info"])
        return peak, "trainer_info.max_gpu_mem_gib (torch allocator peak of the trainer over the run)"
    return None


def moe_summary(doc: dict, s: dict) -> dict:
    """The MoE keys: the loop's variants (SequentialMLP experts, routing replay, the alltoall token dispatcher; each
    beside `loop`, the grouped experts behind the allgather dispatcher), the transformers baselines (the
    grouped_mm and eager experts) and the active-parameter MFU, each a median over steps after the first."""
    col = lambda name, key: column(doc, name, key)  # noqa: E731
    trainer = col("loop", "perf/actor_train_tok_per_s")

    def beside_loop(phase: str, key: str = "perf/actor_train_tok_per_s") -> float | None:
        """`phase`'s tok/s over the steps the loop ran too (matched_steps), median after the first."""
        return median_after_first(matched_steps(trainer, col(phase, key))[1])

    return {
        "sequential_mlp_tok_s": beside_loop("loop_sequential"),
        "alltoall_tok_s": beside_loop("loop_alltoall"),
        # the same forward math behind another dispatcher: this diff should match logprob_abs_diff
        "logprob_abs_diff_alltoall": median_after_first(col("loop_alltoall", LOGPROB_DIFF)),
        "hf_tok_s": s["hf_sdpa_tok_s"],
        "hf_eager_tok_s": beside_loop("hf_eager", "tok_s"),
        "hf_experts_implementation": doc.get("phases", {}).get("hf", {}).get("experts_implementation"),
        "mfu_active": s["mfu"],  # the loop's MFU: an MoE's model FLOPs count its active parameters (flop_params)
        "logprob_abs_diff_r3": median_after_first(col("loop_r3", LOGPROB_DIFF)),
        "logprob_abs_diff_no_r3": s["logprob_abs_diff"],
        # loop_r3's own no-grad forward without replay: the same samples as logprob_abs_diff_r3
        "logprob_abs_diff_no_r3_same_samples": median_after_first(col("loop_r3", LOGPROB_DIFF_NO_REPLAY)),
        "routing_agreement": median_after_first(col("loop_r3", ROUTING_AGREEMENT)),
    }


def engine_facts(doc: dict) -> dict:
    """What the rollout phases' engines said about themselves: KV-cache capacity, model runner, collection pauses and
    the stack sampler's probe."""
    ph = doc.get("phases", {})
    return {
        "kv_cache_tokens": kv_cache_tokens(doc),
        "model_runner": model_runners(ph),
        "engine_gc_s": engine_gc_seconds(ph),
        "engine_probe": engine_probes(ph),
    }


def model_runners(ph: dict) -> dict:
    """vLLM's model runner ("v1" / "v2", vime_core.kv_cache.model_runner) in each rollout phase: the loop's engines
    (one value when they agree) and raw vLLM's. A rollout ratio means little across runners: on a host-bound rollout
    they differ in host cost a step. None where a phase did not record it."""
    engines = {i.get("model_runner") for i in ph.get("loop", {}).get("engine_info", [])}
    return {
        "loop_engine": engines.pop() if len(engines) == 1 else (sorted(map(str, engines)) or None),
        "raw_vllm": ph.get("vllm", {}).get("model_runner"),
        "raw_vllm_sleep_mode": ph.get("vllm_sleep", {}).get("model_runner"),
    }


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


def engine_gc_seconds(ph: dict) -> dict:
    """Seconds vLLM's worker process spent in garbage collections (vime_core/engine_gc.py) over the whole phase,
    every generation: the loop's engine from its `engine_info` at the end, raw vLLM from its last step's record. A
    full collection scans every object made after vLLM froze its heap, so a count that grows with the steps shows up
    here before it shows in tok/s. None where a phase did not record it."""
    total = lambda r: round(sum(r["gc_seconds"]), 3) if r else None  # noqa: E731
    last_step = lambda name: (ph.get(name, {}).get("steps") or [{}])[-1].get("engine_gc")  # noqa: E731
    loop = [total(i.get("engine_gc")) for i in ph.get("loop", {}).get("engine_info", [])]
    return {
        "loop_engine": max(loop) if loop and None not in loop else None,
        "raw_vllm": total(last_step("vllm")),
        "raw_vllm_sleep_mode": total(last_step("vllm_sleep")),
    }


def engine_probes(ph: dict) -> dict:
    """Per generate call of each phase, the engine process's host probe at the call's end (stack_sampler.host_probe:
    [python_ms, launch_us]), with rollout.engine_stack_sample_ms on: a rollout that slows step by step while these
    stay put is the engine's own doing; slower probes are the host's. None where no stacks were sampled."""

    def row(report: dict | None) -> list | None:
        end = (report or {}).get("probe", {}).get("end")
        return [end.get("python_ms"), end.get("launch_us")] if end else None

    info = ph.get("loop", {}).get("engine_info") or [{}]
    out = {"loop": [row(r) for r in info[0].get("engine_stacks", [])] or None}
    for name in ("vllm", "vllm_sleep"):
        out[name] = [row(r.get("engine_stacks")) for r in ph.get(name, {}).get("steps", [])] or None
    return out


# every key `summarize` may return: a merge drops them all before recomputing (a test holds the two together)
SUMMARY_KEYS = set(
    """
    rollout_tok_per_gpu_s raw_vllm_tok_s raw_vllm_sleep_mode_tok_s raw_vllm_paired_tok_s
    raw_vllm_paired_response_len_mean trainer_tok_s hf_sdpa_tok_s trainer_peak_gib hf_sdpa_peak_gib sync_s
    step_s logprob_abs_diff mfu host_peak_gib optimizer_step_s offload_s onload_s rollout_s train_s hf_sdpa_mfu
    hf_sdpa_oom loop_response_len_mean raw_vllm_response_len_mean loop_train_tokens hf_sdpa_train_tokens
    hf_detached_tok_s trainer_peak_source kv_cache_tokens model_runner engine_gc_s engine_probe loop_steps_run
    loop_error ratios done_when sequential_mlp_tok_s alltoall_tok_s logprob_abs_diff_alltoall hf_tok_s
    hf_eager_tok_s hf_experts_implementation mfu_active logprob_abs_diff_r3 logprob_abs_diff_no_r3
    logprob_abs_diff_no_r3_same_samples routing_agreement
    """.split()
)


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
