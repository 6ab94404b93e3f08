"""An MLflow tracking server that is down when a night starts or during its training: the champion lookup
retries until it is back, and the metrics logged meanwhile reach the run when it answers again.

A real `mlflow server` on 127.0.0.1 holds a champion; it is stopped, the lookup flow (tests/helpers/champion_lookup.py,
Prefect ephemeral mode in its own process) starts, and the server is started again 20 s after the lookup's first
failed attempt (longer than the 12 s after which the tracking tasks once gave up). The train task's sinks keep what
they log while the server is down for 20 s and send it when it is back. The 30 s outages of a team server
restarting are the e2e night's (tests/e2e/test_team_server_e2e.py): the retries are the same list either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.mlflow_server import restartable_port, start_server, stop_server
from tests.helpers.tiny import REPO


OUTAGE_S = 20  # each second of it is a second of the suite
MODEL = "vime-tiny-cpu"  # registered_name of configs/tiny-cpu.yaml


@pytest.fixture
def server_with_a_champion(tmp_path):
    """A tracking server whose registry holds MODEL v1 as champion; yields (root, port, process holder)."""
    from vime_core.policy_model import register_policy
    from vime_core.tracking import MlflowRun

    root, port = tmp_path / "server", restartable_port()
    root.mkdir()
    procs = [start_server(root, port)]
    uri = f"http://127.0.0.1:{port}"
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "qwen3"}')
    run = MlflowRun(uri, "outage-test", run_name="champion")
    assert register_policy(uri, MODEL, run.run_id, export, "ab" * 32, "eval/x/pass@1", 0.5)["promoted"]
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
        [*args, f"http://127.0.0.1:{port}", "300"], cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300
        while "Retry 1/" not in log.read_text():  # Prefect's line for the first failed attempt
            assert lookup.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(OUTAGE_S)
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


def test_metrics_logged_during_an_outage_reach_the_run_when_the_server_is_back(tmp_path):
    """The train task's MLflow sinks (tasks/train.py tracking_sinks) while the server restarts: training rows and an
    evaluation (a child run) logged while it is down are kept, then sent; an error of the store itself still raises."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from vime_core.outage import OutageTolerantSink
    from vime_core.tracking import EvalChildRuns, MlflowRun
    from vime_core.metrics import MultiSink

    root, port = tmp_path / "server", restartable_port()
    root.mkdir()
    uri = f"http://127.0.0.1:{port}"
    procs = [start_server(root, port)]
    try:
        run = MlflowRun(uri, "outage-sink", run_name="night")
        sinks = [OutageTolerantSink(s, uri, 300) for s in (run, EvalChildRuns(run, "outage-sink", uri))]
        sink = MultiSink(*sinks)
        sink.log_metrics(0, {"rollout/raw_reward": 0.1})
        stop_server(procs[0])
        sink.log_metrics(1, {"rollout/raw_reward": 0.2})  # the server is down: kept, training goes on
        sink.log_metrics(2, {"eval/a/pass@1": 0.3})
        assert [len(s.pending) for s in sinks] == [2, 1]
        restart = threading.Thread(target=lambda: (time.sleep(OUTAGE_S), procs.append(start_server(root, port))))
        restart.start()
        sink.close()  # waits for the server, then sends what was kept
        restart.join()
        client = MlflowClient(tracking_uri=uri)
        reward = client.get_metric_history(run.run_id, "rollout/raw_reward")
        assert [(m.step, m.value) for m in reward] == [(0, 0.1), (1, 0.2)]
        exp = client.get_experiment_by_name("outage-sink")
        (child,) = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'eval-step-2'")
        assert child.data.metrics["eval/a/pass_at_1"] == 0.3
        client.delete_run(run.run_id)
        with pytest.raises(MlflowException):  # the server answers: not an outage, never kept
            OutageTolerantSink(run, uri, 120).log_metrics(3, {"rollout/raw_reward": 0.4})
    finally:
        stop_server(procs[-1])
