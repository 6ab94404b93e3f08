"""What every task shares: config (de)serialisation, retry policy, timeouts, artifact helpers."""

from __future__ import annotations

import re
from typing import Any

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.tasks import exponential_backoff

from vime_core.config import RunConfig, config_from_dict
from vime_core.outage import retry_delays
from vime_core.redact import redact

RETRY_DELAYS = exponential_backoff(backoff_factor=5)  # 5 s, 10 s, 20 s, ...

# Hang guards, not estimates: a task past these is stuck (a dead NCCL peer, an engine that stopped answering).
# The slowest real stages seen: converting a 30B checkpoint and the 30B config's GRPO step take minutes, not hours.
HOUR = 3600
TIMEOUTS = {
    "download": 6 * HOUR,
    "convert": 4 * HOUR,
    "export": 4 * HOUR,
    "evaluate": 4 * HOUR,
    "register": 2 * HOUR,
    "tracking": 600,
}
TRAIN_TIMEOUT_PER_STEP = HOUR  # the train task gets 1 h + 1 h per rollout step


def tracking_retries(outage_s: float) -> dict[str, Any]:
    """Prefect `with_options` for a task that talks to MLflow: retried `retry_delays(outage_s)` apart
    (`tracking.outage_s`), long enough to outlast a tracking server's restart (~40 s measured), and only for errors
    a retry can fix (`is_transient`)."""
    delays = retry_delays(outage_s)
    return {"retries": len(delays), "retry_delay_seconds": delays or 0, "retry_condition_fn": is_transient}


def train_timeout(num_rollout: int) -> int:
    return HOUR + TRAIN_TIMEOUT_PER_STEP * num_rollout


def is_transient(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry crashes, lost actors, timeouts and I/O errors; never the errors a user has
    to fix (VimeError: a bad config, dataset, model source or checkpoint, a busy output dir), which fail at once.
    An actor timeout is a VimeError too, but a retry on a fresh cluster may get past it; so may a TransientError (a
    hub or MLflow server that did not answer). Nothing is retried once a Ctrl-C stopped the run (an actor that the
    same Ctrl-C killed may fail first, with an error that would be retried)."""
    from vime_core.errors import ActorTimeoutError, TransientError, VimeError
    from vime_core.stop import stop_signal

    if stop_signal() is not None:
        return False
    try:
        state.result()
    except (ActorTimeoutError, TransientError):
        return True
    except VimeError:
        return False
    except BaseException:  # noqa: BLE001 - anything else may be transient (a preempted node, a lost actor)
        return True
    return True


def cfg_of(config: dict[str, Any]) -> RunConfig:
    return config_from_dict(config)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def markdown(title: str, rows: dict[str, Any], key: str, note: str = "") -> None:
    """A Prefect markdown artifact of `rows`; a credential in any value (a URI's password) is masked."""
    lines = [f"## {title}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows.items()]
    if note:
        lines += ["", note]
    create_markdown_artifact(markdown=redact("\n".join(lines)), key=key, description=redact(title))


def link(title: str, url: str, key: str) -> None:
    """A Prefect link artifact (the flow run's Artifacts tab opens it in one click); credentials masked."""
    create_link_artifact(link=redact(url), link_text=title, key=key, description=redact(title))


def table(title: str, rows: list[dict[str, Any]], key: str) -> None:
    """A Prefect table artifact, one row per item (sortable in the UI; the latest per key compares across runs)."""
    create_table_artifact(
        table=[{k: redact(v) if isinstance(v, str) else v for k, v in r.items()} for r in rows],
        key=key,
        description=title,
    )
