"""flows/alerts.py against a Prefect server without the deployment (ephemeral mode): one line naming the
deployment and the fix, exit 2, nothing saved. The automation posting a failed night: tests/e2e/test_pipeline_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.tiny import REPO


def test_an_unknown_deployment_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    args = ["--webhook-url", "http://127.0.0.1:9/hook", "--deployment", "grpo-pipeline/nope"]
    r = subprocess.run(
        [sys.executable, "-m", "flows.alerts", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stderr[-3000:]
    ours = [line for line in r.stderr.splitlines() if line.startswith("AlertsError: ")]
    assert len(ours) == 1 and "--deployment grpo-pipeline/nope: no such deployment on " in ours[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr
