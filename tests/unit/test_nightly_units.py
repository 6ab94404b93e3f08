"""Pieces of the nightly pipeline that need no engines: what start_fresh moves aside, which errors Prefect retries,
the log helpers, the serve deployment and the schedule (the output-dir lock against a real second process:
tests/integration/test_nightly_units.py)."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect.states import Failed

from tasks.common import is_transient

from tests.helpers.tiny import REPO, tiny_config
from vime_core.errors import TransientError


def test_start_fresh_moves_export_metrics_and_ledger_aside_with_the_checkpoints(tmp_path):
    from vime_core.loop import move_outputs_aside

    cfg = tiny_config(tmp_path / "run")
    (cfg.save_dir / "iter_0000003").mkdir(parents=True)
    (cfg.output_dir / "export" / "iter_0000003").mkdir(parents=True)
    (cfg.output_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (cfg.output_dir / "data_ledger.jsonl").write_text('{"rollout_id": 0}\n')
    moved = move_outputs_aside(cfg)
    assert sorted(p.name.split(".old-")[0] for p in moved) == [
        "checkpoints",
        "data_ledger.jsonl",
        "export",
        "metrics.jsonl",
    ]
    assert len({p.name.split(".old-")[1] for p in moved}) == 1, "one timestamp for everything of the old run"
    assert not cfg.save_dir.exists() and not (cfg.output_dir / "export").exists()
    assert not (cfg.output_dir / "metrics.jsonl").exists() and not (cfg.output_dir / "data_ledger.jsonl").exists()
    assert (cfg.output_dir / moved[1].name).exists()


@pytest.mark.parametrize(
    "error, retried",
    [
        ("vime_core.config:ConfigError", False),
        ("vime_core.data:DatasetError", False),
        ("vime_core.sources:SourceError", False),
        ("vime_core.runlock:RunLockedError", False),
        ("vime_core.errors:ActorTimeoutError", True),
        ("builtins:RuntimeError", True),
        ("builtins:OSError", True),
    ],
)
def test_only_transient_errors_are_retried(error, retried):
    import importlib

    from prefect.states import Failed

    from tasks.common import is_transient

    module, name = error.split(":")
    exc = getattr(importlib.import_module(module), name)("boom")
    assert is_transient(None, None, Failed(data=exc)) is retried


def test_the_harmless_rotary_warning_is_dropped_and_others_kept(caplog):
    from vime_core.logs import quiet_vllm

    quiet_vllm()
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]


def test_only_a_heartbeat_emitted_after_the_events_service_stopped_is_dropped(caplog):
    from vime_core.logs import quiet_prefect

    quiet_prefect()
    quiet_prefect()  # once per flow run: the filter is not stacked
    logger = logging.getLogger("prefect.events.utilities")
    assert sum(type(f).__name__ == "LateHeartbeatFilter" for f in logger.filters) == 1
    stopped = RuntimeError("Cannot put items in a stopped service instance.")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        for event, exc in [
            ("prefect.flow-run.heartbeat", stopped),  # the late heartbeat of a run that ended at once: dropped
            ("prefect.flow-run.heartbeat", OSError("connection refused")),  # a live run's failure: kept
            ("prefect.flow-run.Failed", stopped),  # another event: kept
        ]:
            try:
                raise exc
            except Exception:
                logger.exception("Error emitting event: %s", event)
    assert [(r.getMessage(), str(r.exc_info[1])) for r in caplog.records] == [
        ("Error emitting event: prefect.flow-run.heartbeat", "connection refused"),
        ("Error emitting event: prefect.flow-run.Failed", "Cannot put items in a stopped service instance."),
    ]


def test_step_progress_estimates_the_rest_from_the_steps_done_here(monkeypatch):
    from vime_core import logs

    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    p = logs.StepProgress(total=20, start=10)  # a resumed run: 10 steps were done by an earlier attempt
    now[0] += 10.0
    assert p.text(12) == "step 12/20 (60%) | elapsed 0:10 | eta 0:40"


def test_the_serve_deployment_cannot_take_over_the_yaml_one(capsys):
    import yaml

    from flows.nightly import DEFAULT_NAME, main

    yaml_names = [d["name"] for d in yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["deployments"]]
    assert DEFAULT_NAME not in yaml_names
    assert main(["--name", yaml_names[0]]) == 2
    assert "would take over the deployment made from infra/prefect.yaml" in capsys.readouterr().err


def test_two_flow_runs_whose_ids_share_a_prefix_get_two_dirs_and_run_names(tmp_path):
    """Two ids as Prefect's scheduler made them in one batch (time-ordered, the first 8 characters alike): the
    e2e test (tests/e2e/test_pipeline_e2e.py, second night) runs two such nights through the scheduler."""
    from datetime import datetime, timezone

    from tasks.nightly import candidate_config, run_label

    cfg = tiny_config(tmp_path / "runs" / "tiny-cpu", "tracking.enabled=false")
    day = datetime(2026, 12, 1, 2, 0, tzinfo=timezone.utc)
    ids = "019ad9b4-1c2e-7f00-8a1b-3c4d5e6f7a80", "019ad9b4-1c2e-7f01-9b2c-4d5e6f7a8b91"
    dirs = [candidate_config(cfg, i, day).output_dir for i in ids]
    names = [run_label(cfg, i, day) for i in ids]
    assert dirs[0] != dirs[1] and names[0] != names[1]
    assert [d.name[:9] for d in dirs] == ["20261201-"] * 2 and all(n.startswith("tiny-cpu-20261201-") for n in names)


@pytest.mark.parametrize("outage_s", [0, 12, 180, 1800])
def test_tracking_retries_cover_the_configured_outage(outage_s):
    from tasks.common import tracking_retries

    options = tracking_retries(outage_s)
    delays = options["retry_delay_seconds"] or []
    assert options["retries"] == len(delays) <= 50  # Prefect refuses more than 50 delays
    assert sum(delays) >= outage_s and (not delays or sum(delays) - delays[-1] < outage_s)
    # a returning server is seen within 10 s (within outage_s / 40 of it for long outages)
    assert all(b == min(2 * a, max(10, -(-outage_s // 40))) for a, b in zip(delays, delays[1:]))
    assert delays[:4] == [2, 4, 8, 10][: len(delays)] or outage_s > 400


def test_the_schedule_promotes_and_ad_hoc_runs_of_the_deployment_do_not():
    import yaml

    (dep,) = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["deployments"]
    assert dep["parameters"]["promote"] is False  # `prefect deployment run` without --param promote=true
    assert [s["parameters"]["promote"] for s in dep["schedules"]] == [True]


# ---- transient vs user vs bug -------------------------------------------------------------------------------------
def retried(exc: BaseException) -> bool:
    return is_transient(None, None, Failed(data=exc))


def test_transient_service_errors_are_retried_and_user_errors_not():
    from vime_core.sources import HubUnavailableError, SourceError
    from vime_core.tracking import TrackingError, TrackingUnreachableError

    assert retried(TransientError("hub down"))
    assert retried(HubUnavailableError("503")) and isinstance(HubUnavailableError("x"), SourceError)
    assert retried(TrackingUnreachableError("down")) and isinstance(TrackingUnreachableError("x"), TrackingError)
    assert not retried(SourceError("bad name"))
    assert not retried(TrackingError("deleted run"))


def hub_http_error(status: int):
    from huggingface_hub.errors import HfHubHTTPError

    return HfHubHTTPError(f"HTTP {status}", response=SimpleNamespace(headers={}, request=None, status_code=status))


@pytest.mark.parametrize(
    "make, offline, transient",
    [
        (lambda: hub_http_error(503), False, True),
        (lambda: hub_http_error(429), False, True),
        (lambda: hub_http_error(404), False, False),
        ("local-entry", False, True),  # online, and the hub did not answer
        ("local-entry", True, False),  # offline on purpose: the cache is all there is
    ],
)
def test_hub_failures_are_transient_only_when_a_retry_can_help(monkeypatch, make, offline, transient):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vime_core.sources import SourceError, resolve_model

    exc = LocalEntryNotFoundError("not cached") if make == "local-entry" else make()

    def fail(**kw):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(SourceError) as e:
        resolve_model("hf://org/model")
    assert isinstance(e.value, TransientError) is transient
    assert retried(e.value) is transient


def test_an_unreachable_tracking_store_is_transient(tmp_path):
    from vime_core.tracking import TrackingUnreachableError, check_reachable

    with pytest.raises(TrackingUnreachableError) as e:
        check_reachable("http://127.0.0.1:9")  # port 9 (discard): nothing listens
    assert retried(e.value)


# ---- the flow body starts the watchdog ----------------------------------------------------------------------------
def test_the_flow_body_starts_the_watchdog_first(monkeypatch):
    import vime_core.orphans as orphans
    from flows.grpo_pipeline import grpo_pipeline

    class Started(Exception):
        pass

    def start():
        raise Started

    monkeypatch.setattr(orphans, "start_watchdog", start)
    with pytest.raises(Started):
        grpo_pipeline.fn("no-such-config.yaml")  # before the config is read: a worker never runs main()


# ---- the run lock is always released --------------------------------------------------------------------------------
def test_the_lock_is_released_when_the_holder_file_cannot_be_written(tmp_path):
    from vime_core.runlock import HOLDER_FILE, output_dir_lock

    (tmp_path / HOLDER_FILE).mkdir()  # writing the holder file fails (IsADirectoryError)
    with pytest.raises(IsADirectoryError):
        with output_dir_lock(tmp_path):
            pass
    (tmp_path / HOLDER_FILE).rmdir()
    with output_dir_lock(tmp_path):  # an unreleased OS lock would refuse this (flock is per open file)
        assert (tmp_path / HOLDER_FILE).is_file()


def test_the_lock_is_released_when_the_holder_file_cannot_be_removed(tmp_path, monkeypatch):
    from vime_core.runlock import HOLDER_FILE, output_dir_lock

    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name == HOLDER_FILE:
            raise PermissionError(errno.EACCES, "denied", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(PermissionError):
        with output_dir_lock(tmp_path):
            pass
    monkeypatch.setattr(Path, "unlink", real_unlink)
    with output_dir_lock(tmp_path):
        pass


# ---- nightly candidate ----------------------------------------------------------------------------------------------
def test_a_nightly_candidate_always_resumes_and_its_choice_is_written_whole(tmp_path):
    from tasks.nightly import CANDIDATE_FILE, NIGHT_CONFIG, candidate_config

    cfg = tiny_config(tmp_path, "tracking.enabled=false", "checkpoint.resume=false")
    cand = candidate_config(cfg, "0123456789abcdef", None)
    assert cand.checkpoint.resume is True and cand.checkpoint.start_fresh is False
    files = [p.name for p in cand.output_dir.iterdir()]
    assert sorted(files) == sorted([CANDIDATE_FILE, NIGHT_CONFIG]), files  # no temporary left behind
    assert json.loads((cand.output_dir / CANDIDATE_FILE).read_text())["model_source"] == cfg.model.source
