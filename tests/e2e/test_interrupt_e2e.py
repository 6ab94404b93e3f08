"""Ctrl-C and SIGTERM during `vime train`, and Ctrl-C during `vime-pipeline` (`make run`): the run stops through its
cleanup, prints one line naming what was saved (the last checkpoint and its step, or that there is none) and exits
128 + the signal (130, 143); the MLflow run ends KILLED. Ctrl-C during `python -m flows.evaluate`: one line, 130."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.tiny import tiny_config
from tests.helpers.train_process import start_flow_cli, start_pipeline, start_train, wait_for


SAVED = r"^stopped by {sig}: last checkpoint (\S+) \(after rollout step (\d+)/40\); a rerun resumes from it$"


def interrupt_after_a_checkpoint(tmp_path: Path, sig: int, whole_group: bool) -> tuple[int, str]:
    out, log = tmp_path / "out", tmp_path / "train.log"
    proc = start_train(out, log, ["rollout.num_rollout=40", "checkpoint.save_interval=1", "eval.datasets=[]"])
    try:
        wait_for(lambda: (out / "checkpoints" / "latest").exists(), 600, proc, log)
        if whole_group:  # Ctrl-C reaches the terminal's whole process group (Ray's processes too)
            os.killpg(proc.pid, sig)
        else:  # `kill PID`: the driver alone
            os.kill(proc.pid, sig)
        return proc.wait(timeout=300), log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig, whole_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_signal_says_what_was_saved_and_exits_128_plus_it(tmp_path, sig, whole_group):
    code, text = interrupt_after_a_checkpoint(tmp_path, sig, whole_group)
    assert code == 128 + sig, f"exit {code}:\n{text[-3000:]}"
    found = re.search(SAVED.format(sig=signal.Signals(sig).name), text, re.M)
    assert found, text[-3000:]
    state = json.loads((Path(found.group(1)) / "state.json").read_text())
    assert state["rollout_id"] + 1 == int(found.group(2))
    tb = text.find("Traceback")  # on failure, show the traceback itself: which process printed it, and where
    assert tb < 0 and "Aborted" not in text, text[max(0, tb - 1000) : tb + 3000] if tb >= 0 else text[-3000:]
    from vime_core.tracking import ERROR_TAG, mlflow_client, resolve_tracking_uri

    cfg = tiny_config(tmp_path / "out")  # the run's MLflow store (tracking on, as users run it)
    client = mlflow_client(resolve_tracking_uri(cfg))
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])
    assert run.info.status == "KILLED" and run.data.tags[ERROR_TAG].endswith(f": stopped by {sig.name}"), (
        run.info.status,
        run.data.tags.get(ERROR_TAG),
    )


def test_the_line_says_when_nothing_was_saved(tmp_path):
    from vime_core.stop import saved_line

    cfg = tiny_config(tmp_path)
    assert saved_line(cfg, signal.SIGTERM) == (
        f"stopped by SIGTERM: no checkpoint saved yet in {cfg.save_dir}; a rerun starts from step 1"
    )


def test_ctrl_c_stops_vime_pipeline_without_a_retry_or_a_traceback(tmp_path):
    """The terminal's Ctrl-C reaches the whole process group, the temporary Prefect server too: before it was shielded
    the train task was retried against the dead server and the process exited 1 after ~140 s of tracebacks."""
    out, log = tmp_path / "out", tmp_path / "pipeline.log"
    proc = start_pipeline(out, log, ["rollout.num_rollout=40", "checkpoint.save_interval=1", "eval.datasets=[]"])
    try:
        wait_for(lambda: (out / "checkpoints" / "latest").exists(), 600, proc, log)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=300)
        text = log.read_text()
        assert code == 130, f"exit {code}:\n{text[-3000:]}"
        found = re.search(SAVED.format(sig="SIGINT").strip("^$"), text, re.M)
        assert found, text[-3000:]
        assert "Traceback" not in text and "Retry" not in text, text[-3000:]
        assert gone(proc.pid, 60), "a process of the pipeline's group outlived it (its Prefect server?)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    cfg = tiny_config(out)
    from vime_core.tracking import ERROR_TAG, mlflow_client, resolve_tracking_uri

    client = mlflow_client(resolve_tracking_uri(cfg))
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])
    # "KeyboardInterrupt: ...", or the error of an actor that the same Ctrl-C stopped first
    assert run.info.status == "KILLED" and run.data.tags[ERROR_TAG].endswith(": stopped by SIGINT"), (
        run.info.status,
        run.data.tags.get(ERROR_TAG),
    )


def test_ctrl_c_stops_an_evaluation_in_one_line(tmp_path):
    """Before, the evaluation's Prefect server died of the same Ctrl-C: 147 s of connection retries, exit 1."""
    out, log = tmp_path / "out", tmp_path / "evaluate.log"
    model = "builtin://tiny-qwen3-arith"
    proc = start_flow_cli(
        [sys.executable, "-m", "flows.evaluate", "--model", model, "--set", f"output_dir={out}"], out, log
    )
    try:
        wait_for(lambda: "evaluating " in log.read_text(), 300, proc, log)  # the engine is starting or running
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=300)
        text = log.read_text()
        assert code == 130, f"exit {code}:\n{text[-3000:]}"
        assert f"stopped by SIGINT: the evaluation of {model} did not finish; rerun it" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert gone(proc.pid, 60), "a process of the evaluation's group outlived it (its Prefect server? Ray?)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def gone(pgid: int, timeout: float) -> bool:
    """Whether the process group `pgid` empties within `timeout` seconds (the orphan watchdog stays to reap first)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False
