"""`vime train` outputs across a resume: --metrics-out appends (nothing of the earlier attempt is lost), and
tracking.* is honoured (the resumed run continues its MLflow run; an unreachable store fails up front)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.checkpoint import Checkpointer
from vime_core.cli import metrics_file_sink, tracking_sink


def fake_checkpoint(cfg, rollout_id: int, run_state: dict | None = None) -> None:
    ckpt = Checkpointer(cfg.save_dir)
    ckpt.commit(
        ckpt.begin(rollout_id),
        rollout_id,
        {"fingerprint_fields": cfg.fingerprint_fields(), "data_buffer": {}, "run_state": run_state or {}},
    )


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_out_appends_on_resume(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    out = tmp_path / "metrics.jsonl"
    first = metrics_file_sink(cfg, out)
    for step in range(3):
        first.log_metrics(step, {"loss": float(step)})
    first.close()
    fake_checkpoint(cfg, 1)  # the attempt was killed after step 2, its last checkpoint is step 1
    second = metrics_file_sink(cfg, out)
    for step in (2, 3):
        second.log_metrics(step, {"loss": 10.0 + step})
    second.close()
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 2, 3], "earlier rows are kept; the redone step appears again"
    assert rows(out)[-2]["loss"] == 12.0


def test_metrics_out_of_a_fresh_start_keeps_the_old_file(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "run")
    out = tmp_path / "metrics.jsonl"
    out.write_text('{"step": 0, "loss": 1.0}\n')
    sink = metrics_file_sink(cfg, out)
    sink.log_metrics(0, {"loss": 2.0})
    sink.close()
    assert rows(out) == [{"step": 0, "loss": 2.0}]
    old = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.old-")]
    assert len(old) == 1 and rows(old[0]) == [{"step": 0, "loss": 1.0}]
    assert str(old[0]) in capsys.readouterr().err


def test_tracking_disabled_means_no_run(tmp_path):
    assert tracking_sink(tiny_config(tmp_path, "tracking.enabled=false")) == (None, None)


def test_tracking_is_honoured_and_a_resume_continues_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(tmp_path / "run", f"tracking.uri={uri}", "tracking.experiment=faults")
    run, state = tracking_sink(cfg)
    run.log_metrics(0, {"rollout/raw_reward": 0.5})
    run.end("KILLED")
    assert state == {"mlflow_run_id": run.run_id, "tracking_uri": uri}
    fake_checkpoint(cfg, 0, state)
    again, state2 = tracking_sink(cfg)
    assert again.run_id == run.run_id and state2 == state
    got = again.client.get_run(run.run_id)
    assert got.data.params["rollout.temperature"] == "1.0" and got.data.metrics["rollout/raw_reward"] == 0.5


def test_an_unreachable_tracking_store_fails_up_front(tmp_path):
    from vime_core.tracking import TrackingError

    cfg = tiny_config(tmp_path, "tracking.uri=http://127.0.0.1:9")  # port 9 (discard): nothing listens
    with pytest.raises(TrackingError) as e:
        tracking_sink(cfg)
    assert "http://127.0.0.1:9" in str(e.value) and "tracking.enabled=false" in str(e.value)


def test_an_actor_error_is_printed_as_its_cause_in_one_line(capsys):
    """Ray wraps an actor's exception (RayTaskError with .cause and the remote traceback in its text)."""
    from vime_core.cli import user_error_exit
    from vime_core.errors import DiskSpaceError
    from vime_core.integrity import is_disk_full

    class RayTaskErrorLike(RuntimeError):
        def __init__(self, cause):
            super().__init__(
                f"ray::Trainer.save_checkpoint() (pid=1, ip=127.0.0.1)\nTraceback (most recent call last):\n  ...\n{cause}"
            )
            self.cause = cause

    wrapped = RayTaskErrorLike(
        DiskSpaceError("No space left on device while saving a checkpoint in /x: ...\nsecond line")
    )
    assert user_error_exit(wrapped, debug=False) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "DiskSpaceError: No space left on device while saving a checkpoint in /x"
    )
    assert user_error_exit(wrapped, debug=True) is None, "--debug: the traceback instead"
    assert user_error_exit(RuntimeError("a bug"), debug=False) is None, "not a project error: the traceback"
    assert is_disk_full(RayTaskErrorLike(OSError(28, "No space left on device")))
    assert not is_disk_full(RayTaskErrorLike(ValueError("shape mismatch")))


def test_an_early_error_marks_its_mlflow_run_failed_with_the_error(tmp_path):
    from vime_core.cli import train_locked
    from vime_core.errors import VimeError
    from vime_core.tracking import ERROR_TAG, mlflow_client, resolve_tracking_uri

    missing = tmp_path / "none.jsonl"
    cfg = tiny_config(tmp_path / "out", f"data.source={missing}", "eval.datasets=[]")
    with pytest.raises(VimeError) as e:
        train_locked(cfg, None)  # fails in prepare, after the run was opened and before any actor
    client = mlflow_client(resolve_tracking_uri(cfg))
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags[ERROR_TAG] == f"{type(e.value).__name__}: {e.value}" and str(missing) in str(e.value)


def test_the_pipeline_reports_an_unreachable_store_before_looking_up_a_run_to_continue(tmp_path):
    from tasks.tracking import start_tracking
    from vime_core.ports import free_port
    from vime_core.tracking import TrackingUnreachableError

    port = free_port()  # nothing listens there
    cfg = tiny_config(tmp_path, f"tracking.uri=http://127.0.0.1:{port}")
    model = {"source": "builtin://x", "content_hash": "h"}
    # a flow run id: the run to continue is looked up by its tag (MLflow's raw MlflowException before)
    with pytest.raises(TrackingUnreachableError, match=rf"^MLflow tracking store http://127\.0\.0\.1:{port} cannot"):
        start_tracking.fn(cfg.model_dump(mode="json"), model, "run", "flow-run-1")
