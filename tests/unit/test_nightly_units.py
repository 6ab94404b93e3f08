"""Pieces of the nightly pipeline that need no engines: the output-dir lock (with a real second process), what
start_fresh moves aside, which errors Prefect retries, and the log helpers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.tiny import REPO, tiny_config

HOLD = textwrap.dedent("""
    import sys, time
    from vime_core.runlock import output_dir_lock
    with output_dir_lock(sys.argv[1], "flow-run-1234"):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def held_dir(tmp_path):
    """`tmp_path/run` held by another process, as a running flow would hold it."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_run_on_a_held_output_dir_is_refused_naming_the_holder(held_dir):
    from vime_core.runlock import RunLockedError, output_dir_lock

    out, proc = held_dir
    with pytest.raises(RunLockedError) as e:
        with output_dir_lock(out):
            pass
    msg = str(e.value)
    assert f"pid {proc.pid} on " in msg and "flow run flow-run-1234" in msg and str(out) in msg
    assert "\n" not in msg


def test_the_lock_is_reentrant_in_a_process_and_freed_when_its_holder_dies(held_dir):
    from vime_core.runlock import HOLDER_FILE, output_dir_lock

    out, proc = held_dir
    proc.kill()
    proc.wait()
    with output_dir_lock(out, "mine"):
        with output_dir_lock(out):  # the loop inside the flow takes it again
            assert '"flow_run": "mine"' in (out / HOLDER_FILE).read_text()
        assert (out / HOLDER_FILE).exists(), "the inner block must not release the outer one"
    assert not (out / HOLDER_FILE).exists()


def test_vime_train_on_a_held_output_dir_exits_2_with_one_line(held_dir):
    out, proc = held_dir
    r = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "vime"),
            "train",
            "--config",
            "configs/tiny-cpu.yaml",
            "--set",
            f"output_dir={out}",
            "--set",
            "tracking.enabled=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "RunLockedError" in line]
    assert len(lines) == 1 and f"pid {proc.pid}" in lines[0] and "flow-run-1234" in lines[0], r.stderr[-2000:]


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
    e2e test (tests/test_pipeline_e2e.py, second night) runs two such nights through the scheduler."""
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
    assert all(b == min(2 * a, 60) for a, b in zip(delays, delays[1:]))


def test_the_schedule_promotes_and_ad_hoc_runs_of_the_deployment_do_not():
    import yaml

    (dep,) = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())["deployments"]
    assert dep["parameters"]["promote"] is False  # `prefect deployment run` without --param promote=true
    assert [s["parameters"]["promote"] for s in dep["schedules"]] == [True]
