"""Ctrl-C and SIGTERM during `vime train`: the run stops through its cleanup, prints one line naming what was saved
(the last checkpoint and its step, or that there is none) and exits 128 + the signal (130, 143)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.helpers.tiny import tiny_config
from tests.helpers.train_process import start_train, wait_for


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
    assert "Traceback" not in text and "Aborted" not in text
    from vime_core.tracking import ERROR_TAG, mlflow_client, resolve_tracking_uri

    cfg = tiny_config(tmp_path / "out")  # the run's MLflow store (tracking on, as users run it)
    client = mlflow_client(resolve_tracking_uri(cfg))
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])
    assert run.info.status == "KILLED" and run.data.tags[ERROR_TAG].startswith("KeyboardInterrupt: "), (
        run.info.status,
        run.data.tags.get(ERROR_TAG),
    )


def test_the_line_says_when_nothing_was_saved(tmp_path):
    from vime_core.cli import saved_line

    cfg = tiny_config(tmp_path)
    assert saved_line(cfg, signal.SIGTERM) == (
        f"stopped by SIGTERM: no checkpoint saved yet in {cfg.save_dir}; a rerun starts from step 1"
    )
