"""Trainer micro-batching: packing by a token budget (what the trainer does) vs fixed-size micro-batches in rollout
order, each padded to its longest sample (the usual collator baseline); same samples, same megatron-core model,
forward + backward.

    .venv/bin/python bench/micro_batching.py [--samples 128] [--budget 4096] [--fixed 16] [--repeats 3]

Samples have rollout-like lengths (prompt 20-40 tokens, response 5-200 tokens: a long tail as in real RL).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from vime_core.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--fixed", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from vime_core import megatron_model as mm
    from vime_core.builtin import builtin_model_path
    from vime_core.checkpoint import init_rank, load_hf_state_dict, read_hf_config
    from vime_core.models import arch_from_hf_config, spec_of
    from vime_core.trainer import pack_micro_batches

    port = free_port()
    init_rank(0, 1, port, 1, 1, 1)
    model_dir = builtin_model_path("tiny-qwen3-arith")
    arch = arch_from_hf_config(read_hf_config(model_dir))
    model = mm.build_gpt(arch, mm.transformer_config(arch, "float32"))
    mm.load_full_weights(model, spec_of(arch).mapping().hf_to_mcore(load_hf_state_dict(model_dir), arch), arch)
    rng = random.Random(0)
    lengths = [rng.randint(20, 40) + min(200, int(rng.expovariate(1 / 40)) + 5) for _ in range(args.samples)]
    seqs = [torch.randint(0, arch.vocab_size, (n,)) for n in lengths]

    def run(batches: list[list[int]]) -> tuple[float, int]:
        t0 = time.perf_counter()
        padded = 0
        for mb in batches:
            width = max(lengths[i] for i in mb)
            ids = torch.zeros(len(mb), width, dtype=torch.long)
            for r, i in enumerate(mb):
                ids[r, : lengths[i]] = seqs[i]
            pos = torch.arange(width).unsqueeze(0).expand(len(mb), width)
            mask = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)[None, None]
            logits = model(input_ids=ids, position_ids=pos, attention_mask=mask)
            logits.float().logsumexp(-1).mean().backward()
            padded += len(mb) * width
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, padded

    packed = pack_micro_batches(lengths, args.budget)
    fixed = [list(range(i, min(i + args.fixed, args.samples))) for i in range(0, args.samples, args.fixed)]
    real = sum(lengths)
    out = {}
    for name, batches in (("token-budget packing", packed), (f"fixed micro-batches of {args.fixed}", fixed)):
        run(batches)
        times = []
        for _ in range(args.repeats):
            dt, padded = run(batches)
            times.append(dt)
        out[name] = statistics.median(times)
        print(
            f"{name:>28}: {len(batches):3d} micro-batches, {padded:,} padded tokens for {real:,} real "
            f"({real / padded:.0%} useful), {out[name]:.2f} s fwd+bwd ({real / out[name]:,.0f} real tok/s)"
        )
    a, b = out.values()
    print(f"packing speed-up over the fixed baseline: {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
