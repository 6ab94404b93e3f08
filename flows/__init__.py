"""Prefect flows: what users deploy and run (the GRPO pipeline, on-demand evaluation, the nightly deployment)."""

import logging
import os
from pathlib import Path

from vime_core.platform import apply_offline_env

apply_offline_env()
_home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
# Prefect creates only the last level of PREFECT_HOME; a nested fresh path makes its SQLite store fail to open
_home.mkdir(parents=True, exist_ok=True)
# Prefect 3.7.7 puts task results in ~/.prefect/storage whatever PREFECT_HOME says (its default ignores it): say it
# explicitly. Only where this runs before Prefect is imported (vime-pipeline); a worker's flow runs need it in the
# worker's environment (infra/README.md)
os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(_home / "storage"))
# the project's own log lines (vime_core: resume, engines, evaluation, start_fresh) in the flow-run logs of the UI
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "vime_core")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
logging.getLogger("vime_core").setLevel(logging.INFO)
