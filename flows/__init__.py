"""Prefect flows: what users deploy and run (the GRPO pipeline, on-demand evaluation, the nightly deployment)."""

import os
from pathlib import Path

from vime_core.platform import apply_offline_env

apply_offline_env()
# Prefect creates only the last level of PREFECT_HOME; a nested fresh path makes its SQLite store fail to open
Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser().mkdir(parents=True, exist_ok=True)
