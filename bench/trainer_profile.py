"""Where the trainer's time goes, beside the plain transformers + SDPA step (GPU diagnostic for issue 13).

    python3 bench/trainer_profile.py --shape 1.7b --samples 16 --response-len 4096 [--set train.recompute=none ...]
                                     [--variants "train.recompute=none;train.recompute=selective"] [--profile]

Builds the real `Trainer` (one rank, megatron optimizer, bf16) on the random-weight checkpoint bench/gpu_scale.py
builds (`--only build`), trains `--steps` rollout steps of synthetic samples (prompt 40 + `--response-len` random
tokens, advantages +-1) per variant, and prints per variant the median tok/s and peak memory beside the HF + SDPA
step on the same token counts (run in the same invocation). `--profile` adds torch.profiler's top CUDA kernels of
one micro-batch forward + backward, ours and HF's, so a gap can be traced to kernels. Results print only: the
committed figures come from bench/gpu_scale.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def synthetic(n: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    import torch

    from vime_core.trainer import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        toks = torch.randint(3, vocab, (prompt_len + response_len,), generator=g).tolist()
        out.append(
            TrainSample(
                tokens=toks,
                prompt_len=prompt_len,
                loss_mask=[1] * response_len,
                rollout_logprobs=[-11.9] * response_len,
                advantage=1.0 if i % 2 else -1.0,
            )
        )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def profile_table(fn, rows: int = 18) -> dict:
    """torch.profiler's top CUDA kernels of one call of `fn`, and how busy the GPU was: the sum of the kernels' time
    against the call's wall time (well below 1: the host, not the GPU, sets the pace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU op tracing: it would slow the host
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    table = events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70)
    return {"wall_s": wall, "gpu_kernel_s": busy, "gpu_busy": busy / wall, "table": table}


def profile_config(args, model_dir: Path, overrides: list[str]):
    """The loop's defaults on one CUDA device, bf16, megatron's optimizer; `args.samples` groups of 8 in one
    optimizer step; `overrides` (a variant's `section.field=value`) on top."""
    from vime_core.config import load_config

    return load_config(
        None,
        [
            "cluster.platform=cuda",
            "model.dtype=bfloat16",
            "train.optimizer=megatron",
            f"model.source={model_dir}",
            f"rollout.rollout_batch_size={args.samples}",
            "rollout.n_samples_per_prompt=8",
            f"train.global_batch_size={args.samples * 8}",
            f"rollout.max_response_len={args.response_len}",
            *overrides,
        ],
    )


def run_trainer(args, model_dir: Path, overrides: list[str]) -> dict:
    import torch

    from vime_core.trainer import Trainer, split_steps_and_ranks

    cfg = profile_config(args, model_dir, overrides)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    tr = Trainer(cfg, str(model_dir), 0, 1, "127.0.0.1", free_port(), "cuda")
    vocab = tr.state.arch.vocab_size
    label = " ".join(overrides) or "defaults"
    rows = []
    for step in range(args.steps):
        samples = synthetic(cfg.train.global_batch_size, 40, args.response_len, vocab, step)
        steps = split_steps_and_ranks(samples, cfg.num_steps_per_rollout, 1)[0]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        m = tr.train(step, steps)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tokens = sum(len(s.tokens) for s in samples)
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(
            {"s": dt, "tok_s": tokens / dt, "peak_gib": peak, "reported_tok_s": m.get("perf/actor_train_tok_per_s")}
        )
        print(f"[ours {label}] step {step}: {dt:.1f}s {tokens / dt:,.0f} tok/s peak {peak:.1f} GiB", flush=True)
    table = profile_micro_batch(tr, args, vocab) if args.profile else None
    tr.shutdown()
    torch.cuda.empty_cache()
    return {
        "overrides": overrides,
        "steps": rows,
        "median_tok_s": statistics.median(r["tok_s"] for r in rows[1:] or rows),
        "peak_gib": max(r["peak_gib"] for r in rows),
        "profile": table,
    }


def profile_micro_batch(tr, args, vocab: int) -> dict:
    """torch.profiler's top kernels of one two-sample micro-batch's forward + backward, and how busy the GPU was."""
    mb = synthetic(2, 40, args.response_len, vocab, 99)
    tr.state.model.train()

    def fwd_bwd():
        logp, _, _ = tr.steps.forward(tr.state.model, mb, with_entropy=True)
        logp.sum().backward()

    table = profile_table(fwd_bwd)
    print(table["table"], f"wall {table['wall_s']:.3f}s, GPU busy {table['gpu_busy']:.2f}", flush=True)
    return table


def run_hf(args, model_dir: Path) -> dict:
    import torch

    from gpu_scale_phases import hf_batches, hf_model, hf_step, token_logp

    dev = torch.device("cuda")
    model, opt = hf_model(model_dir, dev)
    vocab = model.config.vocab_size
    rows = []
    for step in range(args.steps):
        samples = synthetic(args.samples * 8, 40, args.response_len, vocab, step)
        seqs, starts = [s.tokens for s in samples], [s.prompt_len for s in samples]
        dt, _ = hf_step(model, opt, seqs, starts, [s.advantage for s in samples], 9216, dev)
        tokens = sum(len(s) for s in seqs)
        rows.append({"s": dt, "tok_s": tokens / dt, "peak_gib": torch.cuda.max_memory_allocated() / 2**30})
        print(f"[hf] step {step}: {dt:.1f}s {tokens / dt:,.0f} tok/s peak {rows[-1]['peak_gib']:.1f} GiB", flush=True)
    table = None
    if args.profile:
        mbs = hf_batches(
            [s.tokens for s in synthetic(2, 40, args.response_len, vocab, 99)], [40, 40], [1.0, -1.0], 9216, "cuda"
        )

        def fwd_bwd():
            token_logp(model, mbs[0][0], mbs[0][1]).sum().backward()

        table = profile_table(fwd_bwd)
        print(table["table"], f"wall {table['wall_s']:.3f}s, GPU busy {table['gpu_busy']:.2f}", flush=True)
    return {
        "steps": rows,
        "median_tok_s": statistics.median(r["tok_s"] for r in rows[1:] or rows),
        "peak_gib": max(r["peak_gib"] for r in rows),
        "profile": table,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1.7b")
    ap.add_argument("--cache", default="/tmp/vime-gpu-scale")
    ap.add_argument("--samples", type=int, default=16, help="prompts (x 8 samples each)")
    ap.add_argument("--response-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--variants", default="", help="';'-separated override sets, each ','-separated")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from vime_core.platform import apply_offline_env

    apply_offline_env()
    model_dir = Path(args.cache) / "models" / f"qwen3-{args.shape}-random"
    if not model_dir.exists():
        print(f"{model_dir} missing: run bench/gpu_scale.py --only build first", file=sys.stderr)
        return 2
    variants = [[o for o in v.split(",") if o] for v in args.variants.split(";")] if args.variants else [[]]
    results = {"ours": [run_trainer(args, model_dir, v) for v in variants]}
    if not args.no_hf:
        results["hf"] = run_hf(args, model_dir)
    for r in results["ours"]:
        ratio = r["median_tok_s"] / results["hf"]["median_tok_s"] if "hf" in results else float("nan")
        print(
            f"ours {' '.join(r['overrides']) or 'defaults'}: {r['median_tok_s']:,.0f} tok/s ({ratio:.2f}x HF), "
            f"peak {r['peak_gib']:.1f} GiB",
            flush=True,
        )
    if "hf" in results:
        print(f"hf + sdpa: {results['hf']['median_tok_s']:,.0f} tok/s, peak {results['hf']['peak_gib']:.1f} GiB")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
