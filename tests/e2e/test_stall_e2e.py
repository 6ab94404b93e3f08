"""A hung engine or trainer rank is reported from its progress (rollout.stall_timeout_s, train.stall_timeout_s), not
after the call's timeout: `vime train` on the CPU default with an actor made to hang by a test-only wrapper of the
CLI (tests/helpers/hang_actor.py), a short window, and the timeouts at their defaults (1,800 s and 3,600 s)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.tiny import REPO


def hung_train(tmp_path: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    sets = [
        f"output_dir={tmp_path / 'out'}",
        "rollout.num_rollout=3",
        "eval.datasets=[]",
        "tracking.enabled=false",
        *overrides,
    ]
    args = [sys.executable, "-m", "tests.helpers.hang_actor", "train", "--config", "configs/tiny-cpu.yaml"]
    args += [arg for o in sets for arg in ("--set", o)]
    return subprocess.run(
        args, cwd=REPO, env=os.environ | env, capture_output=True, text=True, timeout=900, start_new_session=True
    )


def test_a_hung_engine_is_reported_from_its_progress_and_a_slow_one_is_not(tmp_path):
    steps = tmp_path / "steps.log"
    # every engine step 0.6 s longer: rollout 0 lasts longer than the window in all, but never goes 8 s without a
    # step (the first step of an engine's first call took ~3 s on the loaded 2-core box)
    env = {"VIME_HANG": "engine", "VIME_HANG_AT": "1", "VIME_STEP_DELAY_S": "0.6", "VIME_STEP_LOG": str(steps)}
    done = hung_train(tmp_path, env, "rollout.stall_timeout_s=8")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 1/3 " in done.stdout  # the slow but progressing rollout 0 was no false alarm
    assert int(steps.read_text().split()[0]) * 0.6 > 8  # ... although it lasted longer than the window
    assert "step 2/3 " not in done.stdout
    assert re.search(
        r"^ActorStallError: vLLM engine 0 stalled in generate \(16 prompt groups\): no engine step finished \(no "
        r"token produced\) for \d+ s \(the window is rollout.stall_timeout_s = 8 s\); the actor is hung: see its log "
        r"above, or raise rollout.stall_timeout_s \(0 turns the check off\)  \(--debug shows the traceback\)$",
        done.stderr,
        re.M,
    ), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_a_hung_trainer_rank_is_reported_from_its_progress(tmp_path):
    done = hung_train(tmp_path, {"VIME_HANG": "trainer", "VIME_HANG_AT": "1"}, "train.stall_timeout_s=5")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "step 1/3 " in done.stdout and "step 2/3 " not in done.stdout
    assert re.search(
        r"^ActorStallError: trainer rank 0 stalled in train \(rollout 1\): no micro-batch or optimizer step "
        r"finished for \d+ s \(the window is train.stall_timeout_s = 5 s\)",
        done.stderr,
        re.M,
    ), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
