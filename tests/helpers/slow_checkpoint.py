"""`python -m tests.helpers.slow_checkpoint <vime args>`: the `vime` CLI with every checkpoint commit delayed by
VIME_SLOW_COMMIT_S seconds (default 4), so that a crash test can kill the run inside a checkpoint write. The delay
lives here, not in the production code."""

from __future__ import annotations

import os
import time

from vime_core.cli import app
from vime_core.resume import Checkpointer

_commit = Checkpointer.commit


def slow_commit(self, *args, **kwargs):
    time.sleep(float(os.environ.get("VIME_SLOW_COMMIT_S", "4")))
    return _commit(self, *args, **kwargs)


if __name__ == "__main__":
    Checkpointer.commit = slow_commit
    app(prog_name="vime")
