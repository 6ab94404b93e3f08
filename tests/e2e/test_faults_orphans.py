"""Children die with their parent: after a SIGKILL of `vime train` (the process alone, not its group) no process
it started survives: not Ray's, not the actors', not megatron's checkpoint helper; the watchdog does the same for a
server that a library started (Prefect's temporary server in `vime-pipeline`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO

VIME = Path(sys.executable).parent / "vime"
GRACE_S = 20  # the watchdog polls every 0.5 s and gives SIGTERM 3 s before SIGKILL


def descendants(pid: int) -> dict[int, tuple[float, str]]:
    import psutil

    try:
        return {p.pid: (p.create_time(), " ".join(p.cmdline())) for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {}


def run_dirs(known: dict[int, tuple[float, str]]) -> set[str]:
    """The Ray session dir and the actors' TMPDIR of the processes in `known` (from command lines and environments)."""
    import re

    import psutil

    dirs = set()
    for pid, (_, cmd) in known.items():
        dirs.update(re.findall(r"/tmp/ray/session_[0-9_-]+", cmd))
        try:
            tmp = psutil.Process(pid).environ().get("TMPDIR", "")
        except psutil.Error:
            continue
        if "vime-actors-" in tmp:
            dirs.add(tmp)
    return dirs


def survivors(known: dict[int, tuple[float, str]]) -> list[str]:
    import psutil

    alive = []
    for pid, (started, cmd) in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {cmd[:120]}")
        except psutil.Error:
            pass
    return alive


def wait_gone(known: dict, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := survivors(known)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_the_watchdog_takes_a_library_started_server_with_it(tmp_path):
    """A parent starts a 'server' it cannot give a preexec_fn (as Prefect does) and the watchdog; SIGKILL the parent."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import subprocess, sys, time
        from vime_core.orphans import start_watchdog
        start_watchdog()
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print("up", flush=True)
        time.sleep(600)
    """),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout.readline().strip() == "up"
    time.sleep(1.5)  # the watchdog's first snapshot
    known = descendants(parent.pid)
    assert any("time.sleep(600)" in cmd for _, cmd in known.values()), known
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    left = wait_gone(known, GRACE_S)
    assert not left, f"orphans left behind: {left}"


def test_die_with_parent_sets_pdeathsig():
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import ctypes, signal
        from vime_core.orphans import die_with_parent
        assert die_with_parent(signal.SIGTERM)
        sig = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(sig.value)
    """),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) == signal.SIGTERM


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_sigkill_of_vime_pipeline_takes_its_temporary_prefect_server(tmp_path):
    """Killed once its temporary Prefect server (uvicorn) is up: before the watchdog it ran on indefinitely."""
    home = tmp_path / "prefect"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage")}
    args = [
        str(Path(sys.executable).parent / "vime-pipeline"),
        "-c",
        "configs/tiny-cpu.yaml",
        "--set",
        f"output_dir={tmp_path / 'run'}",
        "--set",
        "eval.datasets=[]",
        "--set",
        "tracking.enabled=false",
    ]
    log = tmp_path / "pipeline.log"
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
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
