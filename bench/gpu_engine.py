"""GPU validation and measurements of the GRPO engine (run on the lent H200 machine; see bench/README.md).

    python bench/gpu_engine.py OUT_DIR CASE [CASE ...]

Cases (each a full `vime_core.loop.run` with real vLLM (CUDA), megatron-core and Ray):
  ipc-fp32          colocated on 1 GPU, CUDA-IPC sync, float32, torch AdamW       (train/rollout log-prob diff)
  ipc-bf16          colocated on 1 GPU, CUDA-IPC sync, bfloat16, megatron optimizer
  moe-ipc-bf16      the MoE builtin, same as ipc-bf16
  nccl-bf16         disaggregated on 2 GPUs (trainer GPU0, engine GPU1), NCCL broadcast sync
  tp2-colocate      vime's Qwen3-8B layout on the tiny model, float32: 2 GPUs shared, trainer TP=2 (megatron
                    optimizer), one TP=2 vLLM engine, CUDA-IPC sync (each trainer rank hands its GPU's handle to the
                    engine worker on the same device UUID); its first step should match ipc-fp32's (TP is a layout)
  dp2-colocate      2 GPUs shared, trainer DP=2 (megatron optimizer, replicated state), two engines, CUDA-IPC;
                    checkpoints (with optimizer state) at the end
  resume-bf16       ipc-bf16 stopped after 2 steps and resumed to 4 from its checkpoint (megatron optimizer state):
                    steps 2-3 should repeat ipc-bf16's
  perf-0.6b         a Qwen3-0.6B-shaped random model (tied embeddings), colocated, CUDA-IPC in 512 MiB buckets
  perf-0.6b-pertensor  the same with 1 MiB buckets (about one tensor a bucket: the per-tensor baseline); with
                    both in one invocation the script prints the sync-time ratio
  perf-0.6b-nccl    the same model disaggregated on 2 GPUs
Writes OUT_DIR/<case>.json and prints one summary line per case.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BASE = [
    "cluster.platform=cuda",
    "tracking.enabled=false",
    "rollout.enforce_eager=true",
    "rollout.gpu_memory_utilization=0.3",
    'eval.datasets=[{name: arith-heldout, source: "builtin://arith?split=heldout&size=64"}]',
]
CASES: dict[str, list[str]] = {
    "ipc-fp32": ["cluster.colocate=true", "model.dtype=float32", "train.optimizer=adamw", "rollout.num_rollout=4"],
    "ipc-bf16": [
        "cluster.colocate=true",
        "model.dtype=bfloat16",
        "train.optimizer=megatron",
        "rollout.num_rollout=4",
        "train.lr=2e-5",
    ],
    "moe-ipc-bf16": [
        "model.source=builtin://tiny-qwen3moe-arith",
        "cluster.colocate=true",
        "model.dtype=bfloat16",
        "train.optimizer=megatron",
        "rollout.num_rollout=3",
        "train.lr=2e-5",
    ],
    "nccl-bf16": [
        "cluster.colocate=false",
        "model.dtype=bfloat16",
        "train.optimizer=megatron",
        "rollout.num_rollout=4",
        "train.lr=2e-5",
    ],
    "tp2-colocate": [
        "cluster.colocate=true",
        "model.dtype=float32",
        "train.optimizer=megatron",
        "rollout.num_rollout=4",
        "train.num_devices=2",
        "train.tensor_parallel_size=2",
        "rollout.engine_tensor_parallel_size=2",
    ],
    "dp2-colocate": [
        "cluster.colocate=true",
        "model.dtype=bfloat16",
        "train.optimizer=megatron",
        "rollout.num_rollout=4",
        "train.lr=2e-5",
        "train.num_devices=2",
        "rollout.num_engines=2",
    ],
}
CASES["resume-bf16"] = CASES["ipc-bf16"]
STOP_AFTER = {"resume-bf16": 2}  # cases run in two parts: stop after this many steps, then resume to the end
PERF = [
    "model.dtype=bfloat16",
    "train.optimizer=megatron",
    "rollout.num_rollout=3",
    "rollout.rollout_batch_size=32",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_response_len=512",
    "train.global_batch_size=256",
    "train.max_tokens_per_device=8192",
    "train.lr=1e-6",
    "eval.datasets=[]",
    "rollout.enforce_eager=false",
    "rollout.gpu_memory_utilization=0.35",
    "data.max_prompt_len=128",
]
CASES["perf-0.6b"] = PERF + ["cluster.colocate=true"]
CASES["perf-0.6b-pertensor"] = PERF + [
    "cluster.colocate=true",
    "sync.bucket_size_mb=1",
]  # baseline: ~one tensor a bucket
CASES["perf-0.6b-nccl"] = PERF + ["cluster.colocate=false"]


def qwen3_06b_random(out: Path) -> Path:
    """A Qwen3-0.6B-shaped checkpoint (public config.json values) with random weights and the builtin tokenizer."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from vime_core.builtin import builtin_model_path

    if (out / "config.json").is_file():
        return out
    tok_src = builtin_model_path("tiny-qwen3-arith")
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tok_src / f).is_file():
            shutil.copy2(tok_src / f, out / f)
    return out


def run_case(name: str, out: Path) -> dict:
    from vime_core.config import load_config
    from vime_core.loop import run
    from vime_core.metrics import MemorySink

    overrides = BASE + CASES[name] + [f"output_dir={out / name}"]
    if name.startswith("perf-0.6b"):
        overrides.append(f"model.source={qwen3_06b_random(out / 'qwen3-0.6b-random')}")
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
    sink = MemorySink()
    t0 = time.time()
    progress = lambda i, m: print(f"[{name}] step {i} done at {time.time() - t0:.1f}s", flush=True)  # noqa: E731
    if name in STOP_AFTER:
        run(
            load_config(REPO / "configs" / "tiny-cpu.yaml", overrides + [f"rollout.num_rollout={STOP_AFTER[name]}"]),
            sink,
            on_step=progress,
        )
    result = run(cfg, sink, on_step=progress)
    rows = [r for r in sink.rows if "rollout/raw_reward" in r]
    col = lambda k: [round(r[k], 6) for r in rows]  # noqa: E731
    summary = {
        "case": name,
        "wall_s": round(time.time() - t0, 1),
        "logprob_abs_diff": col("train/train_rollout_logprob_abs_diff"),
        "update_weights_time_s": col("perf/update_weights_time"),
        "rollout_time_s": col("perf/rollout_time"),
        "train_time_s": col("perf/train_time"),
        "step_time_s": col("perf/step_time"),
        "tokens_per_gpu_per_sec": col("perf/tokens_per_gpu_per_sec"),
        "actor_train_tok_per_s": col("perf/actor_train_tok_per_s"),
        "response_len_mean": col("rollout/response_len/mean"),
        "raw_reward": col("rollout/raw_reward"),
        "grad_norm": col("train/grad_norm"),
        "loss": col("train/loss"),
        "baseline_eval": result.baseline_eval,
        "final_eval": result.final_eval,
        "trainer": result.trainer_info,
        "weights_checksum": result.weights_checksum,
        "resumed_from": str(result.resumed_from) if result.resumed_from else None,
    }
    return summary


def main() -> int:
    if os.environ.get("VIME_BENCH_WATCHDOG_S"):  # a hung case shows where the driver waits (which actor call)
        import faulthandler

        faulthandler.dump_traceback_later(int(os.environ["VIME_BENCH_WATCHDOG_S"]), exit=False)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[2:]:
        try:
            s = run_case(name, out)
        except Exception as e:  # record and go on to the next case: device time is scarce
            import traceback

            s = {"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        (out / f"{name}.json").write_text(json.dumps(s, indent=2, default=str))
        if "error" in s:
            print(f"[{name}] FAILED {s['error']}", flush=True)
            continue
        med = lambda xs: statistics.median(xs[1:] or xs)  # noqa: E731  (first step includes warm-up)
        print(
            f"[{name}] wall {s['wall_s']}s | logprob diff max {max(s['logprob_abs_diff']):.2e} | "
            f"sync {med(s['update_weights_time_s']):.3f}s | rollout {med(s['rollout_time_s']):.2f}s | "
            f"train {med(s['train_time_s']):.2f}s | {med(s['tokens_per_gpu_per_sec']):,.0f} rollout tok/s/GPU | "
            f"{med(s['actor_train_tok_per_s']):,.0f} train tok/s | eval {s['baseline_eval']} -> {s['final_eval']}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
