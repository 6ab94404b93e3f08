"""What every task shares: config (de)serialisation, retry policy, artifact helpers."""

from __future__ import annotations

import re
from typing import Any

from prefect.artifacts import create_markdown_artifact
from prefect.tasks import exponential_backoff

from vime_core.config import RunConfig, config_from_dict

RETRY_DELAYS = exponential_backoff(backoff_factor=5)  # 5 s, 10 s, 20 s, ...


def cfg_of(config: dict[str, Any]) -> RunConfig:
    return config_from_dict(config)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def markdown(title: str, rows: dict[str, Any], key: str, note: str = "") -> None:
    lines = [f"## {title}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows.items()]
    if note:
        lines += ["", note]
    create_markdown_artifact(markdown="\n".join(lines), key=key, description=title)
