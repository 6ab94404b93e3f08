"""Stage 1: resolve the model and datasets to local paths (huggingface_hub, MLflow registry, builtin, local)."""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.common import RETRY_DELAYS, TIMEOUTS, artifact_key, is_transient, markdown
from vime_core.sources import resolve_dataset, resolve_model


@task(
    name="download-model",
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["download"],
)
def download_model(source: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """-> {source, path, content_hash}. huggingface_hub's cache (and the builtin cache) make repeats cheap.
    `tracking_uri`: the MLflow registry of mlflow:// sources."""
    r = resolve_model(source, tracking_uri)
    markdown(
        "Model",
        {"source": source, "path": str(r.path), "content hash": r.content_hash},
        artifact_key("model", r.content_hash),
    )
    return {"source": source, "path": str(r.path), "content_hash": r.content_hash}


@task(
    name="download-dataset",
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["download"],
)
def download_dataset(source: str) -> dict[str, Any]:
    r = resolve_dataset(source)
    return {"source": source, "path": str(r.path), "content_hash": r.content_hash}


__all__ = ["download_model", "download_dataset"]
