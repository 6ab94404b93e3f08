"""A night on a team's MLflow tracking server, and a teammate who loads its champion on another machine.

A real `mlflow server --artifacts-destination <folder>` on 127.0.0.1, down for 30 s when the night starts and 30 s
during its training (a team's server restart): the night completes anyway. The worker runs the nightly pipeline from
its own directory; every artifact must reach the server's folder (nothing beside the worker's run). The "teammate" is
another working directory with an empty vime cache and only the server's URI: it loads `models:/<name>@champion` with
`mlflow.pyfunc.load_model` (the version's signature says what to send) and evaluates it with `flows.evaluate`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from subprocess import STDOUT

import pytest

from tests.helpers.mlflow_server import restartable_port, start_server, stop_server
from tests.helpers.tiny import REPO

BIN = Path(sys.executable).parent
MODEL = "vime-tiny-cpu"  # registered_name of configs/tiny-cpu.yaml
OUTAGE_S = 30  # each outage: longer than the 2 + 4 + 8 s of the first retries, so the 10 s rechecks run too
EVAL = '[{name: arith-heldout, source: "builtin://arith?split=heldout&size=16"}]'


def run(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def night(tmp_path_factory):
    """The server, and one nightly run (a night) of the worker against it, through two 30 s outages: the server is
    down when the night starts (its champion lookup retries) and again once training has started (the train task
    keeps the rows the server did not take and sends them when it is back). One night serves every test here: a
    second, outage-free night would only repeat the ~100 s of a pipeline run."""
    tmp = tmp_path_factory.mktemp("team")
    root, port = tmp / "server", restartable_port()
    root.mkdir()
    uri = f"http://127.0.0.1:{port}"
    stop_server(start_server(root, port))  # an empty store, then down at 02:00
    worker = tmp / "worker"
    worker.mkdir()
    out = worker / "runs" / "tiny-cpu"
    sets = [f"output_dir={out}", f"tracking.uri={uri}", "rollout.num_rollout=8", f"eval.datasets={EVAL}"]
    sets += ["eval.before_train=false", "tracking.outage_s=300"]
    code = (
        "from flows.grpo_pipeline import grpo_pipeline\n"
        f"summary = grpo_pipeline({str(REPO / 'configs/tiny-cpu.yaml')!r}, {sets!r}, nightly=True, promote=True)\n"
        "print('REGISTERED', summary.get('registered'), flush=True)\n"
    )
    log = tmp / "night.log"
    env = {**os.environ, "VIME_DEBUG": "", "PREFECT_HOME": str(tmp / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    # the worker's own directory: nothing of the night may be written beside it (test_every_artifact_...)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=worker, env=env, stdout=open(log, "w"), stderr=STDOUT)
    server = None
    try:
        wait_for(lambda: "Retry 1/" in log.read_text(), proc, log)  # the champion lookup's first failed attempt
        time.sleep(OUTAGE_S)
        server = start_server(root, port)
        wait_for(lambda: any(p.stat().st_size for p in out.glob("nightly/*/metrics.jsonl")), proc, log)
        stop_server(server)  # training has started: its rows are kept meanwhile
        time.sleep(OUTAGE_S)
        server = start_server(root, port)
        assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
        yield {"uri": uri, "root": root, "worker": worker, "tmp": tmp, "log": log.read_text()}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            stop_server(server)


def test_a_night_completes_through_two_30_s_outages(night):
    """The night registered, its train task kept rows during the second outage, and its MLflow run has every step."""
    from mlflow.tracking import MlflowClient

    assert f"REGISTERED {MODEL} v1" in night["log"], night["log"][-3000:]
    assert "metric row(s) kept to send when it answers" in night["log"], "the second outage fell inside the train task"
    client = MlflowClient(night["uri"], night["uri"])
    run = client.get_run(client.get_model_version_by_alias(MODEL, "champion").run_id)  # the night's own run
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "rollout/raw_reward")) == list(range(8))


def test_every_artifact_of_the_night_is_in_the_servers_store(night):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(night["uri"], night["uri"])
    experiment = client.get_experiment_by_name("tiny-cpu")
    assert experiment.artifact_location.startswith("mlflow-artifacts:/"), experiment.artifact_location
    runs = client.search_runs([experiment.experiment_id])
    assert runs and all(r.info.artifact_uri.startswith("mlflow-artifacts:/") for r in runs)
    stored = [p for p in (night["root"] / "art").rglob("*") if p.is_file()]
    assert [p for p in stored if p.name == "MLmodel"], "the registered policy model is in the server's folder"
    assert [p for p in stored if p.name == "model.safetensors"], "with its weights"
    local = [p for p in night["worker"].rglob("*") if {"mlartifacts", "mlruns"} & set(p.parts) or p.name == "MLmodel"]
    assert not local, f"artifacts written beside the worker's run: {local[:5]}"


def test_the_version_has_a_signature_and_loads_as_a_pyfunc_elsewhere(night):
    """The teammate's machine: its own directory and empty cache, the server's URI, nothing of the worker's disk."""
    teammate = night["tmp"] / "teammate"
    teammate.mkdir()
    env = {**os.environ, "MLFLOW_TRACKING_URI": night["uri"], "VIME_CACHE_DIR": str(teammate / "cache")}
    code = textwrap.dedent(
        f"""
        import json, mlflow
        model = mlflow.pyfunc.load_model("models:/{MODEL}@champion")
        out = model.predict([{{"prompt": "What is 2 + 3?"}}], params={{"max_new_tokens": 8}})
        meta = model.metadata
        print(json.dumps({{"inputs": meta.get_input_schema().input_names(), "params":
            [p.name for p in meta.get_params_schema().params], "out": out}}))
        """
    )
    got = json.loads(run([sys.executable, "-c", code], teammate, env).stdout.strip().splitlines()[-1])
    assert got["inputs"] == ["prompt"] and got["params"] == ["max_new_tokens"], got
    assert len(got["out"]) == 1 and isinstance(got["out"][0], str), got


def test_a_teammate_evaluates_the_champion_from_the_server(night):
    from mlflow.tracking import MlflowClient

    from vime_core.sources import weights_digest
    from vime_core.tracking import WEIGHTS_TAG

    teammate = night["tmp"] / "teammate-eval"
    teammate.mkdir()
    env = {**os.environ, "VIME_CACHE_DIR": str(teammate / "cache"), "PREFECT_HOME": str(teammate / "prefect")}
    env["VIME_DEBUG"] = ""
    sets = [f"output_dir={teammate / 'eval'}", f"tracking.uri={night['uri']}", f"eval.datasets={EVAL}"]
    done = run(
        [sys.executable, "-m", "flows.evaluate", "--model", f"mlflow://models:/{MODEL}@champion"]
        + ["--config", str(REPO / "configs/tiny-cpu.yaml")]
        + [a for s in sets for a in ("--set", s)],
        teammate,
        env,
    )
    # the flow prints its scores into Prefect's log (log_prints), on stderr
    assert "eval/arith-heldout/pass@1 = " in done.stderr, done.stderr[-3000:]
    (downloaded,) = [p for p in (teammate / "cache" / "mlflow-models").glob(f"{MODEL}-v*") if p.suffix != ".dl"]
    champion = MlflowClient(night["uri"], night["uri"]).get_model_version_by_alias(MODEL, "champion")
    assert weights_digest(downloaded) == champion.tags[WEIGHTS_TAG], "the teammate scored the registered weights"


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
