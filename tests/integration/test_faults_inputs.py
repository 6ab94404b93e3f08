"""The CLIs print project errors as one line and exit 2 (a traceback only with --debug): `vime train` on a truncated
weights file, `vime-pipeline` on bad config values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.tiny import REPO

VIME = Path(sys.executable).parent / "vime"


# --------------------------------------------------------------------------------------------------------------------
# the CLIs: one line, exit 2; --debug shows the traceback
# --------------------------------------------------------------------------------------------------------------------
def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "VIME_DEBUG": ""},
    )


def test_vime_train_user_errors_are_one_line_and_exit_2(tmp_path, model_copy):
    w = model_copy / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    args = (
        VIME,
        "train",
        "-c",
        REPO / "configs/tiny-cpu.yaml",
        "--set",
        f"output_dir={tmp_path / 'out'}",
        "--set",
        f"model.source={model_copy}",
        "--set",
        "tracking.enabled=false",
    )
    r = run_cli(*args, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("WeightsFileError: ") and str(w) in lines[0] and "--debug" in lines[0]
    r = run_cli(*args, "--debug", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" in r.stderr and "WeightsFileError" in r.stderr


def test_vime_pipeline_user_errors_are_one_line_and_exit_2(tmp_path):
    r = run_cli(
        Path(sys.executable).parent / "vime-pipeline",
        "-c",
        REPO / "configs/tiny-cpu.yaml",
        "--set",
        "rollout.temperature=-1",
        "--set",
        "train.nonsense=1",
        cwd=tmp_path,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "rollout.temperature" in lines[0] and "train.nonsense: unknown key" in lines[0]


def test_a_deployment_run_with_a_config_typo_ends_failed_in_one_line(tmp_path):
    """A worker runs the flow body without vime-pipeline's early config check: the typo ends the flow run Failed with
    the error's one line as its state message, and no traceback in its log (what `--watch` streams)."""
    code = (
        "from flows.grpo_pipeline import grpo_pipeline\n"
        "state = grpo_pipeline('configs/tiny-cpu.yaml', ['train.nonsense=1'], return_state=True)\n"
        "print('STATE', state.type.value, state.message)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "VIME_DEBUG": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    (state,) = [line for line in r.stdout.splitlines() if line.startswith("STATE ")]
    assert state.startswith("STATE FAILED ConfigError: ") and "train.nonsense: unknown key" in state, state
    assert "pipeline failed: ConfigError: " in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_flows_evaluate_refuses_a_missing_model_in_one_line(tmp_path):
    """The on-demand evaluation meets bad input as vime-pipeline does: before, a missing model printed Prefect's
    tracebacks and exited 1."""
    missing = tmp_path / "no-such-model"
    r = subprocess.run(
        [sys.executable, "-m", "flows.evaluate", "--model", str(missing), "--set", f"output_dir={tmp_path / 'out'}"],
        cwd=REPO,
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "VIME_DEBUG": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = r.stderr.strip().splitlines()[-2:]  # the error's line, then Prefect's "Stopping temporary server"
    assert r.returncode == 2, r.stderr[-3000:]
    assert any(line.startswith("SourceError: ") and str(missing) in line for line in last), r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
