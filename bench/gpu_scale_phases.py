"""The GPU work of bench/gpu_scale.py, one function a phase; each runs in its own child process (see gpu_scale.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_scale_config import filter_overrides, loop_overrides  # noqa: E402
from gpu_scale_report import hf_config, is_moe, loop_passes, mfu, pack, step_flops  # noqa: E402

BUILD_INFO = "vime_bench_model.json"  # beside the random checkpoint: its shape, size and build facts


def build_checkpoint(shape: str, out: Path, device: str) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from vime_core.builtin import RECIPES, build_tokenizer

    t0 = time.time()
    tok = build_tokenizer(RECIPES["tiny-qwen3-arith"].vocab_size)  # the builtin tokenizer, without the warm-up run
    tok.padding_side = "left"
    values = hf_config(shape, tok.eos_token_id, tok.pad_token_id)
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if is_moe(values) else (Qwen3Config, Qwen3ForCausalLM)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda" if device == "cuda" else "cpu"):  # random init on the GPU: ~30 s for 1.7B incl. save
        model = model_cls(config_cls(**values))
    info = {"shape": shape, "params": sum(p.numel() for p in model.parameters())}
    if is_moe(values):
        check_routers(model)
        # what transformers runs the experts with when nobody asks (the hf phase asks for grouped_mm and eager)
        info["default_experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    info["build_s"] = round(time.time() - t0, 1)
    (tmp / BUILD_INFO).write_text(json.dumps(info))
    os.replace(tmp, out)
    return info


def check_routers(model) -> None:
    """Random routers spread the tokens over the experts; routers left at zero would tie every expert's score and
    send every token to the same top-k experts, a load no real checkpoint has."""
    zero = [n for n, p in model.named_parameters() if n.endswith("mlp.gate.weight") and not p.any()]
    if zero:
        raise RuntimeError(
            f"random init left {len(zero)} MoE routers at zero (e.g. {zero[0]}): not a usable bench model"
        )


def step_prompts(cfg, model_dir: Path, steps: int) -> list[list[list[int]]]:
    """The prompt ids of each rollout step, in the loop's order (same data buffer, seed and shuffle)."""
    from transformers import AutoTokenizer

    from vime_core.data import DataBuffer, load_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    buf = DataBuffer(load_prompts(cfg.data.source, tok, cfg.data), cfg.seed, cfg.data.shuffle)
    return [[p.prompt_ids for p in buf.next_batch(cfg.rollout.rollout_batch_size)] for _ in range(steps)]


def bench_config(args, model_dir: Path, run_dir: Path, phase: str = "loop"):
    from vime_core.config import load_config

    kept, dropped = filter_overrides(loop_overrides(args, model_dir, run_dir, phase))
    for d in dropped:
        print(f"[gpu_scale] skipped override {d}: no such field in this RunConfig", flush=True)
    return load_config(args.config, kept), kept, dropped


def loop_phase(args, model_dir: Path, partial: Path, phase: str = "loop") -> dict:
    """`vime_core.loop.run` with the bench's settings and `phase`'s (gpu_scale_config.MOE_LOOP_PHASES)."""
    from vime_core.loop import run
    from vime_core.metrics import MemorySink
    from vime_core.trainer.routing import measures_routing

    run_dir = Path(args.cache) / "runs" / f"{args.shape}-{args.response_len}-{os.getpid()}"
    cfg, kept, dropped = bench_config(args, model_dir, run_dir, phase)
    arch = json.loads((model_dir / "config.json").read_text())
    prompts = step_prompts(cfg, model_dir, args.steps)
    rec: dict = {"overrides": kept, "dropped_overrides": dropped, "steps": []}
    t0 = time.time()
    paired, before_rollout = paired_raw_vllm(cfg, prompts) if phase == "loop" else ({}, None)

    def on_step(i: int, m: dict) -> None:
        row = {k: v for k, v in m.items() if isinstance(v, (int, float))}
        row.update(paired.pop(i, {}))
        lens = [len(p) + m["rollout/response_len/mean"] for p in prompts[i] for _ in range(args.samples)]
        row["bench/train_tokens"] = sum(lens)  # prompt + mean response length per sample, as the HF phase counts
        passes = loop_passes(cfg.train.old_logprobs, cfg.num_steps_per_rollout, measures_routing(cfg.rollout, i))
        row["bench/mfu_passes"] = passes
        row["bench/mfu"] = mfu(
            step_flops(arch, lens, passes) / sum(lens) * m["perf/actor_train_tok_per_s"], 1.0, args.peak_flops
        )
        row["bench/at_s"] = round(time.time() - t0, 1)
        row["bench/end_epoch"] = time.time()  # gpu_monitor.annotate_steps finds the rollout's samples from it
        rec["steps"].append(row)
        partial.write_text(json.dumps(rec, default=str))  # survives a watchdog kill during a later step
        print(
            f"[{phase}] step {i}: rollout {m['perf/rollout_time']:.1f}s {m['perf/tokens_per_gpu_per_sec']:,.0f} tok/s | "
            f"train {m['perf/train_time']:.1f}s {m['perf/actor_train_tok_per_s']:,.0f} tok/s | sync "
            f"{m['perf/update_weights_time']:.2f}s | step {m['perf/step_time']:.1f}s | at {row['bench/at_s']}s",
            flush=True,
        )

    try:
        result = run(cfg, MemorySink(), on_step=on_step, before_rollout=before_rollout)
        rec.update(trainer_info=result.trainer_info, engine_info=result.engine_info)
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint: GBs of disk
    return rec


def paired_raw_vllm(cfg, prompts: list) -> tuple[dict, Callable[[int, Any], None]]:
    """The paired raw-vLLM baseline of phase `loop`: before rollout i (i >= 1: the first one warms the engine up),
    the loop's own engine generates rollout i's prompts with its seeds through vLLM alone (VLLMEngine.generate_plain),
    holding the weights rollout i samples from. Where vLLM's engine-core thread bounds the rollout (Qwen3-30B-A3B's
    first 6 layers on one H200), raw vLLM in a process of its own (phase `vllm`) ran the same generation 11% faster
    than the loop's engine on one loan and 9% slower on another, steady within each process: this pair shares the
    process, its host core and the minute. Returns (step -> the row's `bench/paired_raw_vllm_*` keys, the hook)."""
    import ray

    from vime_core.router import rollout_seed, sampling_spec

    paired: dict[int, dict] = {}

    def before_rollout(i: int, router) -> None:
        if i == 0 or i >= len(prompts) or len(router.engines) != 1:  # one engine: the loop's split is then trivial
            return
        seeds = [rollout_seed(cfg.seed, i, 0, j) for j in range(len(prompts[i]))]  # the first sampling attempt's
        got = ray.get(router.engines[0].generate_plain.remote(prompts[i], seeds, sampling_spec(cfg)))
        paired[i] = {f"bench/paired_raw_vllm_{k}": got[k] for k in ("seconds", "tok_s", "response_len_mean")}
        print(f"[loop] paired raw vLLM before rollout {i}: {got['seconds']:.1f}s {got['tok_s']:,.0f} tok/s", flush=True)

    return paired, before_rollout


def vllm_phase(args, model_dir: Path, partial: Path, sleep_mode: bool = False) -> dict:
    """Raw vLLM. `sleep_mode` (phase `vllm_sleep`, a diagnostic): as the loop's engine runs, vLLM's sleep-mode
    allocator on, asleep between steps at the loop's `cluster.engine_sleep_level` and woken as the loop wakes it
    (level 2: weights, then the checkpoint reloaded by vLLM itself, then the KV cache), without Ray or a trainer."""
    from vime_core.kv_cache import kv_cache_tokens, model_runner
    from vime_core.platform import apply_offline_env
    from vime_core.rollout import timed_generate, use_model_runner
    from vime_core.router import rollout_seed, sampling_spec
    from vime_core.stack_sampler import sampled_stacks

    if sleep_mode and args.device == "cpu":
        return {"steps": [], "skipped": "vLLM's sleep mode needs a GPU"}
    apply_offline_env()
    cfg, _, _ = bench_config(args, model_dir, Path(args.cache) / "runs" / "unused")
    prompts = step_prompts(cfg, model_dir, args.steps)
    if args.device == "cpu":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    use_model_runner(cfg.rollout.model_runner, routing_replay=False)  # as the loop's engines
    from vllm import LLM

    kwargs = raw_engine_kwargs(cfg, model_dir, sleep_mode)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    llm.collective_rpc("vime_gc")  # the worker's GC clock, as the loop's engine starts it (vime_core/engine_gc.py)
    rec: dict = {
        "engine_kwargs": {k: str(v) for k, v in kwargs.items()},
        "start_s": time.perf_counter() - t0,
        "kv_cache_tokens": kv_cache_tokens(llm),  # beside the loop engine's (engine_info): a smaller cache preempts
        "model_runner": model_runner(llm),  # beside the loop engine's: V1 and V2 differ in host cost a step
        "seeded": not args.vllm_no_seed,
        "sleep_mode": sleep_mode,
        "sleep_level": cfg.cluster.engine_sleep_level if sleep_mode else None,
        "steps": [],
    }
    spec = sampling_spec(cfg)
    for step, batch in enumerate(prompts):
        if sleep_mode and step:
            sleep_and_wake(llm, cfg.cluster.engine_sleep_level)
        params = [
            spec.vllm_params(seed=None if args.vllm_no_seed else rollout_seed(cfg.seed, step, 0, i))
            for i in range(len(batch))
        ]
        llm.reset_prefix_cache()  # as the loop does at every step
        stacks: list[dict] = []  # as the loop's engine samples its stacks (vime_core/stack_sampler.py)
        with sampled_stacks(llm, cfg.rollout.engine_stack_sample_ms, stacks):
            row = timed_generate(llm, batch, params)
        if stacks:  # stopped first: the GC read below walks the heap, which is not the generate call's time
            row["engine_stacks"] = stacks[0]
        row["engine_gc"] = llm.collective_rpc("vime_gc")[0]  # totals so far, read outside the timing
        rec["steps"].append(row)
        partial.write_text(json.dumps(rec, default=str))
        print(
            f"[vllm{'_sleep' if sleep_mode else ''}] step {step}: {row['seconds']:.1f}s {row['tok_s']:,.0f} tok/s "
            f"({row['samples']} samples; engine GC so far {sum(row['engine_gc']['gc_seconds']):.2f}s)",
            flush=True,
        )
    return rec


def sleep_and_wake(llm, level: int) -> None:
    """The loop engine's cycle between two rollouts (vime_core.sync.weight_sync), less the trainer: level 2 drops
    the weights, so they come back before the KV cache as the loop's push does, here from the checkpoint on disk."""
    llm.sleep(level=level)
    if level == 1:
        llm.wake_up()
        return
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])


def raw_engine_kwargs(cfg, model_dir: Path, sleep_mode: bool) -> dict:
    """vLLM's `LLM` arguments as the loop's engine gets them (vime_core.rollout.engine_kwargs). Its worker extension
    stays: it only adds methods, of which raw vLLM calls `vime_gc` (the GC clock) and never the weight door."""
    from vime_core.rollout import EngineOptions, engine_kwargs

    kwargs = engine_kwargs(
        EngineOptions(
            model_path=str(model_dir),
            dtype=cfg.model.engine_dtype,
            seed=cfg.seed,
            platform=cfg.cluster.platform,
            max_model_len=cfg.data.max_prompt_len + max(cfg.rollout.max_response_len, cfg.eval.max_response_len or 0),
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            cpu_kv_cache_gib=cfg.rollout.cpu_kv_cache_gib,
            enforce_eager=cfg.rollout.enforce_eager,
            sleep_mode=sleep_mode,
            extra=dict(cfg.rollout.vllm_kwargs),  # `--set rollout.vllm_kwargs.x=y` reaches both phases
        )
    )
    return kwargs


def hf_batches(seqs: list[list[int]], starts: list[int], adv: list[float], budget: int, device):
    """(input ids, shifted response targets with -100 elsewhere, per-token advantages) per micro-batch."""
    import torch

    out = []
    for mb in pack([len(s) for s in seqs], budget):
        width = max(len(seqs[i]) for i in mb)
        ids = torch.zeros(len(mb), width, dtype=torch.long)
        tgt = torch.full((len(mb), width), -100, dtype=torch.long)
        a = torch.zeros(len(mb), width)
        for r, i in enumerate(mb):
            s = torch.tensor(seqs[i])
            ids[r, : len(s)] = s
            tgt[r, starts[i] - 1 : len(s) - 1] = s[starts[i] :]
            a[r, starts[i] - 1 : len(s) - 1] = adv[i]
        out.append((ids.to(device), tgt.to(device), a.to(device)))
    return out


def hf_model(model_dir: Path, dev, experts: str | None = None):
    """The baseline: transformers + SDPA in training mode and its fused AdamW (bf16 params and state on CUDA);
    `experts`: an MoE's experts implementation (transformers' `experts_implementation`)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kwargs = {"experts_implementation": experts} if experts else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa", **kwargs).to(dev)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-6, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, fused=dev.type == "cuda"
    )
    return model, opt


def token_logp(model, ids, tgt):
    """log p of each target token (-100: none) from the full logits, as a user's script computes them."""
    import torch.nn.functional as F

    logits = model(input_ids=ids).logits
    return -F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100, reduction="none").view_as(
        tgt
    )


def hf_step(model, opt, seqs, starts, adv, budget: int, dev, old_forward: bool = True) -> tuple:
    """One GRPO-like step of the baseline: no-grad forward (old log-probs), forward + backward of the clipped token
    loss per micro-batch, clip, AdamW. -> (seconds, micro-batches); the peak memory stats are reset first.
    `old_forward` False: the old log-probs are the training forward's own, detached (what TRL and our loop do at one
    optimizer step per rollout: the weights are the old policy's), so the step runs the loop's 3 passes, not 4."""
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    mbs = hf_batches(seqs, starts, adv, budget, dev)
    with torch.no_grad():
        old = [token_logp(model, ids, tgt) if old_forward else None for ids, tgt, _ in mbs]
    n_tok = sum(int((tgt != -100).sum()) for _, tgt, _ in mbs)
    for (ids, tgt, a), o in zip(mbs, old):
        logp = token_logp(model, ids, tgt)
        ratio = (logp - (logp.detach() if o is None else o)).exp()
        pg = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
        ((pg * (tgt != -100)).sum() / n_tok).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, len(mbs)


# the transformers phases: hf_phase's arguments for each (hf_eager: MoE shapes only)
HF_VARIANTS = {"hf": {}, "hf_eager": {"experts": "eager"}, "hf_detached": {"old_forward": False}}


def hf_phase(args, model_dir: Path, partial: Path, experts: str | None = None, old_forward: bool = True) -> dict:
    """The transformers baseline. An MoE's experts run as `experts` asks, grouped_mm unless told (phase hf_eager:
    eager, a Python loop over the experts that tokens chose); batched_mm is not offered: it gathers a copy of the
    expert weights per (token, expert) pair, ~0.7 TB a layer for a 9,216-token micro-batch at Qwen3-30B-A3B width.
    `old_forward` False (phase hf_detached): no old-log-prob forward, see `hf_step`."""
    import torch

    dev = torch.device("cuda" if args.device == "cuda" else "cpu")
    cfg, _, _ = bench_config(args, model_dir, Path(args.cache) / "runs" / "unused")
    prompts = step_prompts(cfg, model_dir, args.steps)
    arch = json.loads((model_dir / "config.json").read_text())
    experts = (experts or "grouped_mm") if is_moe(arch) else None
    model, opt = hf_model(model_dir, dev, experts)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rec: dict = {"micro_batch_tokens": args.hf_micro_batch_tokens, "dtype": str(model.dtype), "steps": []}
    rec["old_logprobs"] = "forward" if old_forward else "detached"
    if experts:
        info = json.loads((model_dir / BUILD_INFO).read_text()) if (model_dir / BUILD_INFO).is_file() else {}
        rec["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
        rec["default_experts_implementation"] = info.get("default_experts_implementation")
    for step, batch in enumerate(prompts):
        seqs = [
            p + torch.randint(3, vocab, (args.response_len,), generator=g).tolist()
            for p in batch
            for _ in range(args.samples)
        ]
        starts = [len(p) for p in batch for _ in range(args.samples)]
        adv = [1.0 if (i % 2) else -1.0 for i in range(len(seqs))]
        try:
            dt, n_mbs = hf_step(model, opt, seqs, starts, adv, args.hf_micro_batch_tokens, dev, old_forward)
        except torch.OutOfMemoryError as e:  # the baseline does not fit (Qwen3-8B on one H200): say so, with where
            peak = torch.cuda.max_memory_allocated() / 2**30
            rec["oom"] = f"step {step}: out of memory at a {peak:.1f} GiB allocator peak: {str(e).splitlines()[0]}"
            print(f"[hf] {rec['oom']}", flush=True)
            partial.write_text(json.dumps(rec))
            break
        rec["steps"].append(hf_row(args, arch, seqs, dt, n_mbs, dev, 4 if old_forward else 3))
        partial.write_text(json.dumps(rec))
        print(
            f"[hf{', ' + experts + ' experts' if experts else ''}] step {step}: {dt:.1f}s {rec['steps'][-1]['tok_s']:,.0f} tok/s, "
            f"{n_mbs} micro-batches, peak {rec['steps'][-1]['peak_gib']} GiB",
            flush=True,
        )
    return rec


def hf_row(args, arch: dict, seqs: list[list[int]], seconds: float, n_mbs: int, dev, passes: int) -> dict:
    import torch

    tokens = sum(len(s) for s in seqs)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
        "micro_batches": n_mbs,
        "mfu": mfu(step_flops(arch, [len(s) for s in seqs], passes), seconds, args.peak_flops),
    }
