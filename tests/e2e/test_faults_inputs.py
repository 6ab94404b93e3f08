"""A reward function that raises mid-run (after the engines generated) ends `vime train` in one line naming it, exit
2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.tiny import REPO

VIME = Path(sys.executable).parent / "vime"


def test_a_reward_that_raises_is_one_line_naming_it_and_exit_2(tmp_path):
    """User code failing mid-run (after the engines generated): the function, the prompt and the exception in one
    line, exit 2, no traceback (that is under --debug)."""
    r = subprocess.run(
        [str(VIME), "train", "-c", str(REPO / "configs/tiny-cpu.yaml")]
        + ["--set", f"output_dir={tmp_path / 'out'}", "--set", "tracking.enabled=false", "--set", "eval.datasets=[]"]
        + ["--set", "rollout.reward=tests.helpers.custom_rewards:raises_on_long"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**os.environ, "VIME_DEBUG": "", "PYTHONPATH": str(REPO)},
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("RewardCallError: ")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "reward function tests.helpers.custom_rewards:raises_on_long raised KeyError: " in errors[0]
    assert "on the sample of prompt " in errors[0] and "fix the function" in errors[0]
