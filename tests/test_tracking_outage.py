"""An MLflow tracking server that is down when a night starts: the champion lookup retries until it is back.

A real `mlflow server` on 127.0.0.1 holds a champion; it is stopped, the lookup flow (tests/helpers/champion_lookup.py,
Prefect ephemeral mode in its own process) starts, and the server is started again 20 s after the lookup's first
failed attempt: longer than the 12 s the tracking tasks retried for before issue 26, shorter than the 60 s of the
issue's scenario to keep the test under ~2 minutes on the 2-core box.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO
from vime_core.ports import free_port

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
OUTAGE_AFTER_FIRST_FAILURE_S = 20
MODEL = "vime-tiny-cpu"  # registered_name of configs/tiny-cpu.yaml


def start_server(root: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DO_NOT_TRACK": "true"}
    args = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    log = open(root / "server.log", "a")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    raise TimeoutError((root / "server.log").read_text()[-3000:])


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def server_with_a_champion(tmp_path):
    """A tracking server whose registry holds MODEL v1 as champion; yields (root, port, process holder)."""
    from vime_core.tracking import MlflowRun, register_model

    root, port = tmp_path / "server", free_port()
    root.mkdir()
    procs = [start_server(root, port)]
    uri = f"http://127.0.0.1:{port}"
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "qwen3"}')
    run = MlflowRun(uri, "outage-test", run_name="champion")
    path = run.log_dir(export, "model/iter_0000001")
    assert register_model(uri, MODEL, run.run_id, path, "eval/x/pass@1", 0.5)["promoted"]
    try:
        yield root, port, procs
    finally:
        stop_server(procs[-1])


def test_the_champion_lookup_outlasts_a_tracking_server_restart(server_with_a_champion, tmp_path):
    root, port, procs = server_with_a_champion
    stop_server(procs[0])
    home = tmp_path / "prefect"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_HOME": str(home),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
    }
    log = tmp_path / "lookup.log"
    args = [sys.executable, "-m", "tests.helpers.champion_lookup", str(tmp_path / "runs" / "tiny-cpu")]
    lookup = subprocess.Popen(
        [*args, f"http://127.0.0.1:{port}", "120"], cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300
        while "Retry 1/" not in log.read_text():  # Prefect's line for the first failed attempt
            assert lookup.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(OUTAGE_AFTER_FIRST_FAILURE_S)
        assert lookup.poll() is None, "the lookup gave up during the outage:\n" + log.read_text()[-3000:]
        procs.append(start_server(root, port))
        assert lookup.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if lookup.poll() is None:
            lookup.kill()
            lookup.wait()
    text = log.read_text()
    assert f"model source: mlflow://models:/{MODEL}/1" in text, text[-3000:]
    assert "Retry 2/" in text, "a single retry 2 s later would have failed too: the server was down for 20 s"
