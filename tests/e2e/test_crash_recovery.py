"""Crash recovery: `vime train` is SIGKILLed (its whole process group, as a preempted pod would be) at a random
moment, then again in the middle of writing a checkpoint; the next attempt resumes from the last complete
checkpoint and finishes. The data ledger proves that no prompt batch is skipped, and that the only batches trained
twice are the steps after the checkpoint an attempt resumed from, redone with the same prompts."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

from tests.helpers.train_process import kill_group, ledger, resumed_at, wait_for
from tests.helpers.train_process import start_train as start_vime_train


STEPS, BATCH, SAVE_EVERY = 6, 16, 2


def start_train(out: Path, log: Path, slow_commit: bool = False) -> subprocess.Popen:
    overrides = [
        f"rollout.num_rollout={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "checkpoint.keep_last=10",
        "eval.datasets=[]",
    ]
    return start_vime_train(out, log, overrides, slow_commit)


def expected_batches() -> list[list[int]]:
    """The prompt order an uninterrupted run serves (the buffer depends only on the seed and the dataset size)."""
    from vime_core.builtin import problems
    from vime_core.data import DataBuffer, Prompt, PromptSet

    n = len(problems("train"))
    buf = DataBuffer(PromptSet("builtin://arith", [Prompt(i, [], "", None) for i in range(n)]), seed=1234)
    return [[p.index for p in buf.next_batch(BATCH)] for _ in range(STEPS)]


def test_sigkill_anywhere_then_resume(tmp_path, dense_model_dir):
    from vime_core.checkpoint import Checkpointer, iter_name

    out = tmp_path / "run"
    save_dir = out / "checkpoints"
    seed = random.Random().randrange(10**6)
    rng = random.Random(seed)
    print(f"kill-time seed {seed}")
    logs = [tmp_path / f"attempt{i}.log" for i in (1, 2, 3)]
    n1 = kill_at_a_random_step(out, logs[0], rng)
    kill_inside_a_checkpoint_write(out, logs[1], rng)
    p = start_train(out, logs[2])  # attempt 3: runs to the end
    assert p.wait(timeout=900) == 0, logs[2].read_text()[-3000:]

    ckpt = Checkpointer(save_dir)
    assert ckpt.latest() == save_dir / iter_name(STEPS - 1)
    assert not any(save_dir.glob("iter_*.tmp-*")), "the next save cleans torn checkpoints up"
    assert all((c / "state.json").is_file() for c in ckpt.complete())
    entries = ledger(out)
    attempts = split_attempts(entries)
    starts = [a[0]["rollout_id"] for a in attempts]
    resumes = [resumed_at(log) for log in logs]
    print(f"attempt starts {starts}, resumed at {resumes}, attempt-1 steps {n1}")
    assert starts[0] == 0
    assert resumes[2] is not None and resumes[2] > 0, "attempt 3 must resume from a complete checkpoint"
    for prev, nxt in zip(attempts, attempts[1:]):
        # each attempt restarts right after the last complete checkpoint of the previous ones, never later
        assert nxt[0]["rollout_id"] <= prev[-1]["rollout_id"] + 1
        assert nxt[0]["rollout_id"] % SAVE_EVERY == 0  # i.e. just after a checkpoint at save_interval
    want = expected_batches()
    seen: dict[int, list[int]] = {}
    for e in entries:
        assert e["prompts"] == want[e["rollout_id"]], f"step {e['rollout_id']} trained other prompts than it should"
        seen.setdefault(e["rollout_id"], e["prompts"])
    assert sorted(seen) == list(range(STEPS)), "a step was skipped"
    # --metrics-out is appended across attempts: nothing of an earlier attempt is lost, every step is there, and
    # the final attempt's rows continue where it resumed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[-1]["step"] == STEPS - 1
    assert sorted({r["step"] for r in rows}) == list(range(STEPS))
    assert [r["step"] for r in rows][-(STEPS - resumes[2]) :] == list(range(resumes[2], STEPS))
    assert all(not Checkpointer.problems(c) for c in ckpt.complete())  # every checkpoint left is intact


def kill_at_a_random_step(out: Path, log: Path, rng: random.Random) -> int:
    """Attempt 1: killed at a random step (never the last two, so the kill lands before the run ends: steps take
    ~0.5 s on 2 cores, a fixed 0-6 s delay outlived the whole run once) and a random moment inside it, a checkpoint
    write included. -> the steps it recorded."""
    p = start_train(out, log)
    kill_step = rng.randrange(1, STEPS - 1)
    wait_for(lambda: len(ledger(out)) >= kill_step, 600, p, log)
    time.sleep(rng.uniform(0.0, 0.4))
    kill_group(p)
    return len(ledger(out))


def kill_inside_a_checkpoint_write(out: Path, log: Path, rng: random.Random) -> None:
    """Attempt 2: killed while writing a checkpoint that follows a complete one (the write is slowed down to widen
    the window), so that the next attempt has to skip the torn one and resume from the complete one."""
    from vime_core.checkpoint import Checkpointer

    save_dir = out / "checkpoints"
    ckpt = Checkpointer(save_dir)
    stale = set(save_dir.glob("iter_*.tmp-*"))  # attempt 1 may itself have died inside a write

    def writing_after_a_complete_one() -> bool:
        latest = ckpt.latest()
        return latest is not None and any(
            d not in stale and (d / "model").exists() and d.name > latest.name for d in save_dir.glob("iter_*.tmp-*")
        )

    p = start_train(out, log, slow_commit=True)
    wait_for(writing_after_a_complete_one, 600, p, log)
    time.sleep(rng.uniform(0.5, 3.0))
    torn = next(d for d in save_dir.glob("iter_*.tmp-*") if d not in stale)
    kill_group(p)
    assert torn.exists(), "the kill was meant to land inside the checkpoint write"


def split_attempts(entries: list[dict]) -> list[list[dict]]:
    """The ledger's entries, attempt by attempt: a new attempt starts where the rollout id stops increasing."""
    attempts: list[list[dict]] = [[]]
    for e in entries:
        if attempts[-1] and e["rollout_id"] <= attempts[-1][-1]["rollout_id"]:
            attempts.append([])
        attempts[-1].append(e)
    return attempts
