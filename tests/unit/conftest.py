"""Fixtures of the unit tier: the bench modules, loaded by path (tests/helpers/bench.py)."""

import pytest

from tests.helpers.bench import load_bench


@pytest.fixture(scope="module")
def gs():
    """The CLI: argument parsing, config overrides, the dry run."""
    return load_bench("gpu_scale")


@pytest.fixture(scope="module")
def gc():
    """The loop phase's config overrides."""
    return load_bench("gpu_scale_config")


@pytest.fixture(scope="module")
def rp():
    """The pure report helpers: shapes, FLOPs, MFU, medians, packing, summary and merge."""
    return load_bench("gpu_scale_report")
