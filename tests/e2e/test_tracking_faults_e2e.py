"""`vime-pipeline` and MLflow when something fails early (Prefect ephemeral mode, the tiny config; no engine starts):
with its server down the run ends in one clear line (exit 2) after the tracking task's retries, not in MLflow's raw
MlflowException; an input error after the MLflow run was opened leaves that run FAILED with the error's line in the
tag vime.error, not RUNNING forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.tiny import REPO
from vime_core.ports import free_port


def pipeline(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "vime-pipeline"), "-c", "configs/tiny-cpu.yaml"]
        + [arg for s in [f"output_dir={tmp_path / 'out'}", "eval.datasets=[]", *sets] for arg in ("--set", s)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**os.environ, "VIME_DEBUG": "", "PREFECT_HOME": str(tmp_path / "prefect")},
    )


def test_the_pipeline_with_an_unreachable_mlflow_server_ends_in_one_clear_line(tmp_path):
    port = free_port()  # nothing listens there
    # 6 s of retries (2 + 4) instead of the default 180: the retry policy has its own unit test, this one is about the
    # line the user sees once the retries are spent
    done = pipeline(tmp_path, f"tracking.uri=http://127.0.0.1:{port}", "tracking.outage_s=6")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-3000:]
    # the CLI's line (Prefect's "Stopping temporary server" log line may follow it)
    (ours,) = [line for line in lines if line.startswith("TrackingUnreachableError: ")]
    assert ours.startswith(f"TrackingUnreachableError: MLflow tracking store http://127.0.0.1:{port} cannot be "), ours
    assert ours.endswith("or set tracking.enabled=false  (--debug shows the traceback)"), ours
    assert not any(line.startswith("mlflow.exceptions.MlflowException") for line in lines), done.stderr[-3000:]


def test_a_refused_resume_fails_before_the_pipeline_opens_a_run(tmp_path):
    """checkpoint.resume=false beside an earlier checkpoint is an input error the pipeline checks before its MLflow
    run opens (prepare.check_resume): one line, exit 2, and no run left behind to mark (errors after the run opened
    end it FAILED with vime.error: tests/unit/test_faults_cli.py)."""
    from tests.helpers.tiny import tiny_config
    from vime_core.checkpoint import Checkpointer
    from vime_core.tracking import mlflow_client, resolve_tracking_uri

    cfg = tiny_config(tmp_path / "out", "eval.datasets=[]")
    ckpt = Checkpointer(cfg.save_dir)  # an earlier run's checkpoint: checkpoint.resume=false is refused beside it
    ckpt.commit(ckpt.begin(0), 0, {"fingerprint_fields": cfg.fingerprint_fields(), "data_buffer": {}})
    done = pipeline(tmp_path, "checkpoint.resume=false")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "ResumeError: checkpoint.resume = false but " in done.stderr + done.stdout, done.stderr[-3000:]
    experiment = mlflow_client(resolve_tracking_uri(cfg)).get_experiment_by_name(cfg.name)
    runs = mlflow_client(resolve_tracking_uri(cfg)).search_runs([experiment.experiment_id]) if experiment else []
    assert runs == [], [(r.info.run_name, r.info.status) for r in runs]
