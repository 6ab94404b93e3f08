"""A flow that does only what grpo_pipeline does first in nightly mode: choose tonight's candidate (the champion
lookup in its retried task). tests/integration/test_tracking_outage.py runs it while the MLflow server is down.

    python -m tests.helpers.champion_lookup <output_dir> <tracking uri> <tracking.outage_s>
"""

from __future__ import annotations

import sys

import flows  # noqa: F401  (offline variables before Prefect loads)
from prefect import flow

from tasks.nightly import choose_candidate
from tests.helpers.tiny import tiny_config


@flow(name="champion-lookup")
def lookup(output_dir: str, uri: str, outage_s: float) -> str:
    cfg = tiny_config(output_dir, f"tracking.uri={uri}", f"tracking.outage_s={outage_s}")
    return choose_candidate(cfg, "flow-run-during-an-outage", None).model.source


if __name__ == "__main__":
    print(f"model source: {lookup(sys.argv[1], sys.argv[2], float(sys.argv[3]))}", flush=True)
