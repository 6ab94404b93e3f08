"""`vime train` against a real MLflow server behind basic auth: the run logs in with the password in
`tracking.uri`, and the password is in no MLflow param or tag, checkpoint file, log line, nor MLflow's "View run at"
line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.auth_proxy import mlflow_behind_basic_auth
from tests.helpers.tiny import REPO
from tests.unit.test_security_credentials import PASSWORD


def test_a_password_in_tracking_uri_is_stored_and_printed_nowhere(tmp_path):
    """`vime train` against a real MLflow server behind basic auth: the run logs in (every request the proxy saw
    carried the credentials; the run has its metrics), and the password is in no param, tag, file under output_dir
    (checkpoints' state.json among them), nor on stdout or stderr."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    with mlflow_behind_basic_auth(tmp_path / "mlflow", "alice", PASSWORD) as (uri, plain_uri, seen):
        r = subprocess.run(
            [
                str(Path(sys.executable).parent / "vime"),
                "train",
                "-c",
                str(REPO / "configs/tiny-cpu.yaml"),
                *("--set", f"output_dir={out}", "--set", f"tracking.uri={uri}", "--set", "rollout.num_rollout=2"),
                *("--set", "checkpoint.save_interval=1", "--set", "eval.datasets=[]"),
                *("--set", "tracking.experiment=creds"),
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=900,
            env={**os.environ, "VIME_DEBUG": ""},
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert seen and all(seen), "every request logged in with the URI's credentials"
        client = MlflowClient(plain_uri)
        (run,) = client.search_runs([client.get_experiment_by_name("creds").experiment_id])
        assert run.data.metrics["rollout/raw_reward"] >= 0.0, "the run logged through the password-protected server"
        assert run.data.params["tracking.uri"] == uri.replace(PASSWORD, "***")
        leaked = [k for k, v in {**run.data.params, **run.data.tags}.items() if PASSWORD in v]
        assert not leaked, f"password in params/tags {leaked}"
    assert f"in {uri.replace(PASSWORD, '***')}" in r.stdout, "our 'MLflow run ... in <uri>' line, masked"
    assert PASSWORD not in r.stdout and PASSWORD not in r.stderr
    states = list(out.rglob("state.json"))
    assert len(states) >= 2, "checkpoints were written"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert not [p for p in files if PASSWORD.encode() in p.read_bytes()], "password in a file under output_dir"
