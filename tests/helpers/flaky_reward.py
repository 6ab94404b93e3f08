"""A math reward that fails exactly once, after the run has written its first checkpoint: it makes the train task
crash mid-run so that tests can watch Prefect retry it and the retry resume from that checkpoint.

Configure with VIME_TEST_FLAKY_DIR=<dir>: it fires when a run under <dir> (<dir> itself or any output dir below it,
such as a nightly candidate's) has a checkpoints/latest and <dir>/flaky.fired does not exist."""

from __future__ import annotations

import os
from pathlib import Path

from vime_core.rewards import math_reward


def reward(sample) -> float:
    base = Path(os.environ["VIME_TEST_FLAKY_DIR"])
    marker = base / "flaky.fired"
    if not marker.exists() and any(base.glob("**/checkpoints/latest")):
        marker.write_text("fired")
        raise RuntimeError("injected reward failure (tests.helpers.flaky_reward)")
    return math_reward(sample.response, sample.label, finish_reason=sample.finish_reason)
