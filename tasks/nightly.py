"""Nightly semantics: every scheduled run trains a new candidate from the current champion.

- the model is `mlflow://models:/<registered name>/<version of @champion>` (the base `model.source` of the config
  while there is no champion yet); the version, not the alias, so that a retry starts from the same weights even
  if the alias moved meanwhile;
- the run's own output dir, `<output_dir>/nightly/<scheduled date>-<flow run key>` (`flow_run_key`: a hash of the
  whole flow run id): a retry of the same flow run (Prefect `retries`, or a rerun from the UI) finds its
  checkpoints there and resumes; another night never does;
- its own MLflow run (named after that dir, tagged `prefect.flow_run_id`); the MLflow store stays the one the base
  config names (a nested output dir would otherwise move the default sqlite store).

The choice is written to `<run dir>/candidate.json` on the first attempt and read back by every later one; the
night's whole config to `<run dir>/config.yaml`, what a continuation of the dir starts from (`continuation_config`,
infra/README's "extend a run on purpose"). The champion lookup is a task of its own (`choose_candidate`), retried
like every tracking call (`tracking.outage_s`): outside a task, a tracking server down at 02:00 failed the night
in 3 s.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any

from prefect import task

from tasks.common import TIMEOUTS, cfg_of, tracking_retries
from vime_core.config import RunConfig, config_from_dict, dump_config, load_config
from vime_core.fsutil import atomic_write_text
from vime_core.tracking import alias_version, resolve_tracking_uri

CANDIDATE_FILE = "candidate.json"
NIGHT_CONFIG = "config.yaml"  # the night's whole config, as its first attempt ran it


def registered_name(cfg: RunConfig) -> str:
    return cfg.tracking.registered_model or f"vime-{cfg.name}"


def flow_run_key(flow_run_id: str | None) -> str:
    """12 hex digits of the sha256 of the whole flow run id. Not a prefix of the id: Prefect's scheduler inserts a
    deployment's runs in one batch with time-ordered ids, and two runs of one day shared their first 8 characters
    (issue 26: the second night resumed the first one's dir and MLflow run). 48 bits: two runs of one date collide
    with a chance of 1 in 2.8e14."""
    if not flow_run_id:
        return "local"
    return hashlib.sha256(flow_run_id.encode()).hexdigest()[:12]


def run_label(cfg: RunConfig, flow_run_id: str | None, when: datetime | None) -> str:
    """`<config>-<YYYYmmdd>-<flow run key>`: the MLflow run name and (without the config) the nightly dir name."""
    day = (when or datetime.now(timezone.utc)).strftime("%Y%m%d")
    return f"{cfg.name}-{day}-{flow_run_key(flow_run_id)}"


@task(name="nightly-candidate", timeout_seconds=TIMEOUTS["tracking"])
def nightly_candidate(config: dict[str, Any], flow_run_id: str | None, scheduled: datetime | None) -> dict[str, Any]:
    """The candidate's config (as a dict: task results are serialised), champion looked up from the registry."""
    return candidate_config(cfg_of(config), flow_run_id, scheduled).model_dump(mode="json")


def choose_candidate(cfg: RunConfig, flow_run_id: str | None, scheduled: datetime | None) -> RunConfig:
    """`candidate_config` inside a Prefect task that retries an unreachable tracking server for
    `tracking.outage_s` (call it from a flow)."""
    lookup = nightly_candidate.with_options(**tracking_retries(cfg.tracking.outage_s))
    return cfg_of(lookup(cfg.model_dump(mode="json"), flow_run_id, scheduled))


def candidate_config(cfg: RunConfig, flow_run_id: str | None, scheduled: datetime | None) -> RunConfig:
    """The config of tonight's candidate (see the module docstring)."""
    uri = resolve_tracking_uri(cfg)
    run_dir = cfg.output_dir / "nightly" / run_label(cfg, flow_run_id, scheduled).removeprefix(f"{cfg.name}-")
    choice = run_dir / CANDIDATE_FILE
    if choice.is_file():
        source = json.loads(choice.read_text())["model_source"]
    else:
        source = champion_source(cfg, uri)
        run_dir.mkdir(parents=True, exist_ok=True)
        # a kill mid-write must not leave a torn file that every retry then fails to parse
        atomic_write_text(
            choice,
            json.dumps(
                {"model_source": source, "base_model_source": cfg.model.source, "flow_run_id": flow_run_id}, indent=2
            ),
        )
    data = cfg.model_dump(mode="json")
    data["output_dir"] = str(run_dir)
    data["model"]["source"] = source
    data["tracking"]["uri"] = uri
    data["checkpoint"]["start_fresh"] = False  # a fresh dir; a retry must resume it
    data["checkpoint"]["resume"] = True  # (resume = false would refuse the first attempt's checkpoints on a retry)
    night = config_from_dict(data)
    atomic_write_text(run_dir / NIGHT_CONFIG, dump_config(night))
    return night


def continuation_config(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """`nightly=false` on a nightly dir: the night's own config (`<dir>/config.yaml`) with this run's overrides on
    top. The base config it was given differs from the night's in model.source (the champion the night started from:
    the checkpoint refuses the resume) and tracking.uri (unset, a nested output_dir moves the sqlite store). Any other
    output_dir: `cfg` as it is. A night recorded before config.yaml existed gets its candidate.json's model source."""
    recorded, choice = cfg.output_dir / NIGHT_CONFIG, cfg.output_dir / CANDIDATE_FILE
    if not choice.is_file():
        return cfg
    if recorded.is_file():
        return load_config(recorded, [*overrides, f"output_dir={cfg.output_dir}"])
    data = cfg.model_dump(mode="json")
    data["model"]["source"] = json.loads(choice.read_text())["model_source"]
    return config_from_dict(data)


def champion_source(cfg: RunConfig, uri: str) -> str:
    if not cfg.tracking.enabled:
        return cfg.model.source
    version = alias_version(uri, registered_name(cfg), "champion")
    return f"mlflow://models:/{registered_name(cfg)}/{version}" if version else cfg.model.source
