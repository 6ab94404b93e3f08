"""`vime train` and `vime-pipeline` as separate process groups for the crash and signal tests
(tests/e2e/test_crash_recovery.py, test_async_e2e.py, test_interrupt_e2e.py, test_faults_orphans.py): start one on
the tiny config, wait for a condition, signal or SIGKILL the group, read what it left."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.tiny import REPO

VIME = Path(sys.executable).parent / "vime"


def start_train(out: Path, log: Path, overrides: list[str], slow_commit: bool = False) -> subprocess.Popen:
    """`vime train --config configs/tiny-cpu.yaml` into `out` with `--set` `overrides`, in its own process group;
    `slow_commit`: each checkpoint commit waits 4 s first (a test-only wrapper of the CLI,
    tests/helpers/slow_checkpoint.py), which widens the window for a kill inside a write."""
    cli = [sys.executable, "-m", "tests.helpers.slow_checkpoint"] if slow_commit else [str(VIME)]
    sets = [arg for o in [f"output_dir={out}", *overrides] for arg in ("--set", o)]
    args = [*cli, "train", "--config", "configs/tiny-cpu.yaml", "--metrics-out", str(out / "metrics.jsonl"), *sets]
    return subprocess.Popen(
        args, cwd=REPO, env=os.environ.copy(), stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def start_pipeline(out: Path, log: Path, overrides: list[str]) -> subprocess.Popen:
    """`vime-pipeline --config configs/tiny-cpu.yaml` into `out` with `--set` `overrides` (start_flow_cli)."""
    sets = [arg for o in [f"output_dir={out}", *overrides] for arg in ("--set", o)]
    return start_flow_cli([str(VIME.parent / "vime-pipeline"), "--config", "configs/tiny-cpu.yaml", *sets], out, log)


def start_flow_cli(args: list[str], out: Path, log: Path) -> subprocess.Popen:
    """A flow's command line (vime-pipeline, python -m flows.evaluate) in its own process group, with its Prefect
    home (and task results, so no cached result of another test is reused) beside `out`."""
    home = out.parent / "prefect"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage")}
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def ledger(out: Path) -> list[dict]:
    path = out / "data_ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def wait_for(cond, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"train exited early ({proc.returncode}):\n{log.read_text()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError(f"timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def resumed_at(log: Path) -> int | None:
    m = re.search(r"resuming from \S+ at rollout (\d+)", log.read_text())
    return int(m.group(1)) if m else None
