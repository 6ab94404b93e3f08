"""Children die with their parent: after a SIGKILL of `vime train` (the process alone, not its group) no process
it started survives: not Ray's, not the actors', not megatron's checkpoint helper; the watchdog does the same for a
server that a library started (Prefect's temporary server in `vime-pipeline`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.orphans import GRACE_S, descendants, run_dirs, survivors, wait_gone
from tests.helpers.tiny import REPO
from tests.helpers.train_process import start_pipeline

VIME = Path(sys.executable).parent / "vime"


def test_sigkill_of_vime_train_leaves_no_process_behind(tmp_path):
    out = tmp_path / "run"
    args = [
        str(VIME),
        "train",
        "-c",
        "configs/tiny-cpu.yaml",
        "--set",
        f"output_dir={out}",
        "--set",
        "rollout.num_rollout=50",
        "--set",
        "checkpoint.save_interval=1",
        "--set",
        "eval.datasets=[]",
        "--set",
        "tracking.enabled=false",
    ]
    log = tmp_path / "train.log"
    proc = subprocess.Popen(args, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    known: dict = {}
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "latest").exists():  # a save ran: megatron's helper process exists
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            known.update(descendants(proc.pid))
            time.sleep(0.5)
        time.sleep(1.0)
        known.update(descendants(proc.pid))
        dirs = run_dirs(known)
        print(f"{len(known)} descendants before the kill; run dirs {sorted(dirs)}")
        assert any("vime-actors-" in d for d in dirs) and any("/tmp/ray/session_" in d for d in dirs), dirs
        assert any("raylet" in cmd for _, cmd in known.values()) and any(
            "Trainer" in cmd or "default_worker" in cmd for _, cmd in known.values()
        )
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
        proc.wait(timeout=30)
        left = wait_gone(known, GRACE_S)
        assert not left, f"orphans left behind: {left}"
        deadline = time.monotonic() + 10
        while [d for d in dirs if Path(d).exists()] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [d for d in dirs if Path(d).exists()], "the watchdog removes the run's session and temporary dirs"
    finally:
        for line in survivors(known):  # never leave them to the next test (pid and start time checked)
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except OSError:
                pass


def test_sigkill_of_vime_pipeline_takes_its_temporary_prefect_server(tmp_path):
    """Killed once its temporary Prefect server (uvicorn) is up: before the watchdog it ran on indefinitely."""
    log = tmp_path / "pipeline.log"
    proc = start_pipeline(tmp_path / "run", log, ["eval.datasets=[]", "tracking.enabled=false"])
    known: dict = {}
    try:
        deadline = time.monotonic() + 300
        while not any("uvicorn" in cmd for _, cmd in known.values()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            known.update(descendants(proc.pid))
            time.sleep(0.5)
        time.sleep(1.0)
        known.update(descendants(proc.pid))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = wait_gone(known, GRACE_S)
        assert not left, f"orphans left behind: {left}"
    finally:
        for line in survivors(known):
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except OSError:
                pass
