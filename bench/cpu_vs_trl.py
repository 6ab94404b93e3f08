"""The embedded CPU default against TRL's GRPOTrainer on the same task (issue 14), run by hand (not in CI):

    .venv/bin/python bench/cpu_vs_trl.py [--repeats 3] [--steps 10] [--only trl,sync,async] [--out FILE]

Runs, `--repeats` times each, one after another on this box:
- `trl`:   TRL's `GRPOTrainer` (plain `generate`), in its own venv (made by this script on first use:
           /tmp/vime-trl-venv, `pip install trl==1.16.* transformers accelerate math-verify` beside the local
           torch 2.13.0+cpu; `--trl-venv` to choose another), a fresh process per repeat;
- `sync`:  the command users run, `vime train --config configs/tiny-cpu.yaml --set rollout.num_rollout=STEPS --set
           eval.datasets=[]`, as it is: from a fresh directory holding configs/tiny-cpu.yaml (so runs/tiny-cpu and the
           MLflow store runs/mlflow.db are new), no --metrics-out, tracking on (MLflow, the default), the checkpoint
           at the end (checkpoint.save_interval 10), rollout.max_staleness 0;
- `async`: the same with `--set rollout.max_staleness=1` (recorded as failed, not fatal, when this tree cannot run it).

Prints per-step medians (rollout / train / sync / step / interval) and the whole-command wall time of each, and the
ratios ours/TRL and async/sync; writes every raw figure to bench/results/cpu-vs-trl.json. Tests never assert on time.

Parameter mapping (ours -> TRL 1.16 `GRPOConfig`):

| ours (configs/tiny-cpu.yaml)                      | TRL                                                         |
|---------------------------------------------------|-------------------------------------------------------------|
| model builtin://tiny-qwen3-arith, float32         | the same HF directory, `bf16=False`, `use_cpu=True`         |
| data builtin://arith, DataBuffer(seed 1234) order | the same prompt texts (chat template applied), in our order, `shuffle_dataset=False` |
| rollout_batch_size 16, n_samples_per_prompt 8     | `num_generations=8` (generation batch 64 x 2 = 128 = 16 x 8) |
| global_batch_size 64 (2 optimizer steps/rollout)  | `per_device_train_batch_size=64`, `steps_per_generation=2`, `gradient_accumulation_steps=1` |
| num_rollout STEPS                                 | `max_steps=2*STEPS` (optimizer steps), `num_iterations=1`   |
| max_response_len 48, temperature 1, top_p 1, top_k -1 | `max_completion_length=48`, `temperature=1.0`, `top_p=1.0`, `top_k=0` |
| reward math (vime_core.rewards.math_reward)       | a reward function calling the same `math_reward` on the completion text and label |
| grpo.normalize_std true                           | `scale_rewards="group"`                                     |
| eps_clip 0.2 / eps_clip_high 0.28, kl_loss_coef 0 | `epsilon=0.2`, `epsilon_high=0.28`, `beta=0.0`, `loss_type="grpo"` |
| lr 1e-4 constant, weight_decay 0, clip_grad 1.0   | `learning_rate=1e-4`, `lr_scheduler_type="constant"`, `weight_decay=0.0`, `max_grad_norm=1.0` |
| adam_beta2 0.98, adam_eps 1e-8                    | `adam_beta2=0.98`, `adam_epsilon=1e-8`                      |
| no activation recompute                           | `gradient_checkpointing=False`                              |
| MLflow on, no eval, checkpoint at the end         | `report_to="none"`, `save_strategy="no"` (TRL does less: ours pays for them) |

Per-step figures: ours from the run's MLflow store (`perf/rollout_time`, `perf/train_time`, `perf/update_weights_time`,
`perf/step_time`; `interval` = the time between two steps' MLflow rows, i.e. all a step costs the command: logging,
the progress line and saves too); TRL's round of 2 optimizer steps is one step: rollout = its
`_generate_and_score_completions` call, step = from the first optimizer step's begin to the second one's end, train =
step - rollout, no sync, interval = one round's end to the next one's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TRL_PINS = ["trl==1.16.*", "transformers>=5.16,<5.20", "accelerate", "math-verify==0.9.0", "torch==2.13.0"]
KINDS = ("trl", "sync", "async")
FIGURES = ("step", "rollout", "train", "sync", "interval")  # per-step figures; each run's median, then the median


# --------------------------------------------------------------------------------------------------------------------
# TRL: its venv, the task written for it, and the worker that runs inside that venv
# --------------------------------------------------------------------------------------------------------------------
def ensure_trl_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.is_file() and subprocess.run([str(py), "-c", "import trl"], capture_output=True).returncode == 0:
        return py
    print(f"creating {venv} (pip install {' '.join(TRL_PINS)}; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    return py


def write_task(steps: int, path: Path) -> dict:
    """The prompts our loop samples in its first `steps` rollouts (same DataBuffer, same seed), with labels."""
    from vime_core.config import load_config
    from vime_core.data import DataBuffer
    from vime_core.prepare import prepare

    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [f"rollout.num_rollout={steps}", "eval.datasets=[]"])
    p = prepare(cfg)
    buffer = DataBuffer(p.prompts, cfg.seed, cfg.data.shuffle)
    rows = [
        {"prompt": q.prompt, "label": q.label, "prompt_ids": q.prompt_ids}
        for _ in range(steps)
        for q in buffer.next_batch(cfg.rollout.rollout_batch_size)
    ]
    ro, tr, g = cfg.rollout, cfg.train, cfg.grpo
    task = {
        "model_dir": str(p.model_dir),
        "rows": rows,
        "steps": steps,
        "seed": cfg.seed,
        "num_generations": ro.n_samples_per_prompt,
        "prompts_per_step": ro.rollout_batch_size,
        "max_completion_length": ro.max_response_len,
        "temperature": ro.temperature,
        "batch": tr.global_batch_size,
        "lr": tr.lr,
        "weight_decay": tr.weight_decay,
        "clip_grad": tr.clip_grad,
        "adam_beta2": tr.adam_beta2,
        "adam_eps": tr.adam_eps,
        "eps_clip": g.eps_clip,
        "eps_clip_high": g.eps_clip_high,
        "strict": ro.strict_format,
    }
    path.write_text(json.dumps(task))
    return task


def trl_reward(task: dict, tok):
    """Our math reward as a TRL reward function (a response cut at max_completion_length is `length`-finished)."""
    from vime_core.rewards import math_reward

    max_len = task["max_completion_length"]

    def reward(prompts, completions, label, completion_ids=None, **_):
        ids = completion_ids or [None] * len(completions)
        return [
            math_reward(
                c,
                lab,
                task["strict"],
                "length" if i is not None and len(i) >= max_len and i[-1] != tok.eos_token_id else "stop",
            )
            for c, lab, i in zip(completions, label, ids)
        ]

    return reward


def trl_config(task: dict, steps_per_gen: int):
    """GRPOConfig with our run's settings (the mapping in the module docstring)."""
    from trl import GRPOConfig

    n, max_len = task["num_generations"], task["max_completion_length"]
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-out-"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=task["seed"],
        shuffle_dataset=False,
        num_generations=n,  # generation batch = 64 x 2 steps = 128 = 16 prompts x 8
        per_device_train_batch_size=task["batch"],
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_gen,
        num_iterations=1,
        max_steps=task["steps"] * steps_per_gen,
        max_completion_length=max_len,
        temperature=task["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=task["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=task["weight_decay"],
        max_grad_norm=task["clip_grad"],
        adam_beta2=task["adam_beta2"],
        adam_epsilon=task["adam_eps"],
        epsilon=task["eps_clip"],
        epsilon_high=task["eps_clip_high"],
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        gradient_checkpointing=False,
        use_vllm=False,
        dataloader_num_workers=0,
    )


def trl_worker(task_path: str, out_path: str) -> None:
    """Inside the TRL venv: GRPOTrainer on the task; writes per-round timings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    task = json.loads(Path(task_path).read_text())
    tok = AutoTokenizer.from_pretrained(task["model_dir"])
    for r in task["rows"][:4]:  # the texts tokenize to our prompt ids: TRL sees the same prompts
        assert tok(r["prompt"], add_special_tokens=False)["input_ids"] == r["prompt_ids"], "prompt text/ids differ"
    ds = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in task["rows"]])
    reward = trl_reward(task, tok)
    steps_per_gen = task["prompts_per_step"] * task["num_generations"] // task["batch"]
    args = trl_config(task, steps_per_gen)
    model = AutoModelForCausalLM.from_pretrained(task["model_dir"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=ds, reward_funcs=reward, processing_class=tok)
    gen_times: list[float] = []
    inner = trainer._generate_and_score_completions  # TRL's rollout of one generation batch

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            gen_times.append(time.perf_counter() - t)

    trainer._generate_and_score_completions = timed
    marks: list[tuple[str, float]] = []

    class Marks(TrainerCallback):
        def on_step_begin(self, *a, **k):
            marks.append(("begin", time.perf_counter()))

        def on_step_end(self, *a, **k):
            marks.append(("end", time.perf_counter()))

    trainer.add_callback(Marks())
    trainer.train()
    begins = [t for k, t in marks if k == "begin"][::steps_per_gen]
    ends = [t for k, t in marks if k == "end"][steps_per_gen - 1 :: steps_per_gen]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    step = [e - b for b, e in zip(begins, ends)]
    Path(out_path).write_text(
        json.dumps(
            {
                "step": step,
                "rollout": gen_times[: len(step)],
                "train": [s - g for s, g in zip(step, gen_times)],
                "sync": [0.0] * len(step),
                "interval": [b - a for a, b in zip(ends, ends[1:])],  # one round's end to the next one's
                "reward": rewards,
            }
        )
    )


# --------------------------------------------------------------------------------------------------------------------
# one measured run of each kind
# --------------------------------------------------------------------------------------------------------------------
def run_trl(py: Path, task_path: Path, work: Path) -> dict:
    out = work / "trl.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONWARNINGS": "ignore",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(py), __file__, "--trl-worker", str(task_path), str(out)], env=env, cwd=REPO, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        return {"status": "failed", "wall_s": wall, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return {"status": "ok", "wall_s": wall, **json.loads(out.read_text())}


VIME_COMMAND = [
    "train",
    "--config",
    "configs/tiny-cpu.yaml",
    "--set",
    "rollout.num_rollout={steps}",
    "--set",
    "eval.datasets=[]",
]


def run_ours(staleness: int, steps: int, work: Path) -> dict:
    """The command users run, from a fresh directory holding configs/tiny-cpu.yaml (so `output_dir` runs/tiny-cpu
    and the MLflow store runs/mlflow.db are fresh, as on a first run): no --metrics-out, tracking as configured
    (MLflow on). Per-step figures come from the MLflow store it wrote."""
    (work / "configs").mkdir(parents=True)
    (work / "configs" / "tiny-cpu.yaml").write_text((REPO / "configs" / "tiny-cpu.yaml").read_text())
    cmd = [str(Path(sys.executable).parent / "vime"), *(a.format(steps=steps) for a in VIME_COMMAND)]
    if staleness:
        cmd += ["--set", f"rollout.max_staleness={staleness}"]
    # this tree's code, also where the interpreter's environment has another checkout installed (a worktree)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "failed", "wall_s": wall, "exit": proc.returncode, "error": tail}
    return {"status": "ok", "wall_s": wall, **mlflow_steps(work / "runs" / "mlflow.db")}


def mlflow_steps(db: Path) -> dict:
    """Every step's perf/* times from the run's MLflow store, and `interval`: the time between two steps' metric
    rows (their MLflow timestamps), which is what a step costs the command, logging and saving included."""
    import sqlite3

    con = sqlite3.connect(db)
    try:

        def col(key: str, field: str = "value") -> list[float]:
            q = f"SELECT {field} FROM metrics WHERE key = ? ORDER BY step"  # one run in a fresh store
            return [float(v) for (v,) in con.execute(q, (key,))]

        stamps = col("perf/step_time", "timestamp")
        return {
            "step": col("perf/step_time"),
            "rollout": col("perf/rollout_time"),
            "train": col("perf/train_time"),
            "sync": col("perf/update_weights_time"),
            "interval": [(b - a) / 1000 for a, b in zip(stamps, stamps[1:])],
            "save_s": sum(col("perf/save_time")),
            "reward": col("rollout/raw_reward"),
            "staleness_max": max(col("rollout/staleness/max") or [0.0]),
        }
    finally:
        con.close()


# --------------------------------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------------------------------
def summarise(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return {"status": "failed", "error": runs[-1].get("error") if runs else "not run"}
    med = {k: statistics.median(statistics.median(r[k]) for r in ok) for k in FIGURES}
    return {
        "status": "ok",
        "repeats": len(ok),
        **{f"{k}_median_s": v for k, v in med.items()},
        "wall_median_s": statistics.median(r["wall_s"] for r in ok),
        "walls_s": [r["wall_s"] for r in ok],
    }


def ratios(s: dict) -> dict:
    out = {}
    for a, b in (("sync", "trl"), ("async", "trl"), ("async", "sync")):
        if s.get(a, {}).get("status") == "ok" and s.get(b, {}).get("status") == "ok":
            out[f"{a}/{b}"] = {
                "step": s[a]["step_median_s"] / s[b]["step_median_s"],
                "interval": s[a]["interval_median_s"] / s[b]["interval_median_s"],
                "wall": s[a]["wall_median_s"] / s[b]["wall_median_s"],
            }
    return out


def print_table(s: dict, r: dict) -> None:
    print(f"{'':6} {'step':>7} {'rollout':>8} {'train':>7} {'sync':>6} {'interval':>8} {'command':>8}  (medians, s)")
    for k in KINDS:
        v = s.get(k, {})
        if v.get("status") != "ok":
            print(f"{k:6} not available: {v.get('error')}")
            continue
        print(
            f"{k:6} {v['step_median_s']:7.3f} {v['rollout_median_s']:8.3f} {v['train_median_s']:7.3f} "
            f"{v['sync_median_s']:6.3f} {v['interval_median_s']:8.3f} {v['wall_median_s']:8.1f}  x{v['repeats']}"
        )
    for name, v in r.items():
        print(f"{name:12} step {v['step']:.2f}x  interval {v['interval']:.2f}x  command {v['wall']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", default=",".join(KINDS), help="comma-separated subset of trl,sync,async")
    ap.add_argument("--trl-venv", type=Path, default=Path("/tmp/vime-trl-venv"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu-vs-trl.json")
    ap.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return 0
    kinds = [k for k in args.only.split(",") if k]
    work = Path(tempfile.mkdtemp(prefix="vime-bench-trl-"))
    task_path = work / "task.json"
    write_task(args.steps, task_path)
    py = ensure_trl_venv(args.trl_venv) if "trl" in kinds else None
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for i in range(args.repeats):  # interleaved, so that a slow minute of the shared box hits every kind
        for k in kinds:
            d = work / f"{k}-{i}"
            d.mkdir()
            res = run_trl(py, task_path, d) if k == "trl" else run_ours(0 if k == "sync" else 1, args.steps, d)
            runs[k].append(res)
            print(
                f"{k} repeat {i + 1}: {res['status']}, command {res['wall_s']:.1f} s"
                + (
                    f", median step {statistics.median(res['step']):.3f} s"
                    if res["status"] == "ok"
                    else f": {res.get('error')}"
                ),
                flush=True,
            )
    summary = {k: summarise(v) for k, v in runs.items()}
    rat = ratios(summary)
    print_table(summary, rat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    old_summary, old_runs = old.get("summary", {}), old.get("runs", {})
    old_summary.update(summary)
    old_runs.update(runs)
    args.out.write_text(
        json.dumps(
            {
                "measured": time.strftime("%Y-%m-%d %H:%M"),
                "steps": args.steps,
                "cores": os.cpu_count(),
                "summary": old_summary,
                "ratios": ratios(old_summary),
                "runs": old_runs,
            },
            indent=1,
        )
    )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
