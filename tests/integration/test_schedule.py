"""The CLI refuses an asynchronous schedule on colocated GPUs with one line and exit 2 (the schedule itself:
tests/unit/test_schedule.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.tiny import REPO


def test_colocated_staleness_is_refused_by_the_cli_with_exit_2(tmp_path):
    vime = Path(sys.executable).parent / "vime"
    proc = subprocess.run(
        [
            str(vime),
            "train",
            "-c",
            "configs/tiny-cpu.yaml",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "cluster.colocate=true",
            "--set",
            "rollout.max_staleness=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "rollout.max_staleness = 1 needs cluster.colocate = false" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
