"""Prefect tasks: one pipeline stage each, thin wrappers over vime_core functions (retries, cache keys, artifacts)."""

from vime_core.platform import apply_offline_env

apply_offline_env()  # before Prefect or MLflow are imported anywhere below
