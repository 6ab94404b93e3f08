"""Resume decisions without engines: which checkpoint is picked, when a run refuses to resume, when there is nothing
left to train, and that starting fresh keeps the old checkpoints."""

from __future__ import annotations

import json

import pytest

from tests.helpers.tiny import REPO, tiny_config
from vime_core.checkpoint import Checkpointer, ResumeError, iter_name


def fake_checkpoint(cfg, rollout_id: int, **fields) -> None:
    """What Checkpointer.commit leaves behind, minus the tensors (resume decisions only read state.json)."""
    ckpt = Checkpointer(cfg.save_dir)
    tmp = ckpt.begin(rollout_id)
    state = {"fingerprint_fields": cfg.fingerprint_fields(), "data_buffer": {}, "baseline_eval": {"eval/x/pass@1": 0.2}}
    state.update(fields)
    ckpt.commit(tmp, rollout_id, state)


def test_nothing_to_train_when_the_checkpoint_covers_num_rollout(tmp_path, caplog):
    import ray

    from vime_core.loop import run
    from vime_core.metrics import MemorySink

    cfg = tiny_config(tmp_path, "rollout.num_rollout=5")
    fake_checkpoint(cfg, 4)
    result = run(cfg, MemorySink())
    assert result.steps_done == 0 and result.resumed_from.name == iter_name(4)
    assert "already covers rollout.num_rollout = 5" in caplog.text
    assert not ray.is_initialized()


def test_extending_a_run_resumes_after_its_last_checkpoint(tmp_path):
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path, "rollout.num_rollout=5")
    fake_checkpoint(cfg, 4)
    longer = tiny_config(tmp_path, "rollout.num_rollout=8")  # num_rollout is not part of the fingerprint
    path, state = resume_point(longer)
    assert path.name == iter_name(4) and state["rollout_id"] + 1 == 5


def test_changed_settings_refuse_to_resume_and_name_the_differences(tmp_path):
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path)
    fake_checkpoint(cfg, 1)
    changed = tiny_config(tmp_path, "grpo.eps_clip=0.1", "train.lr=3e-4")
    with pytest.raises(ResumeError) as e:
        resume_point(changed)
    msg = str(e.value)
    assert "grpo.eps_clip: 0.2 -> 0.1" in msg and "train.lr: 0.0001 -> 0.0003" in msg
    assert "checkpoint.start_fresh=true" in msg


def test_start_fresh_moves_old_checkpoints_aside(tmp_path):
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path)
    fake_checkpoint(cfg, 1)
    fresh = tiny_config(tmp_path, "checkpoint.start_fresh=true", "grpo.eps_clip=0.1")
    assert resume_point(fresh) == (None, None)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.old-")]
    assert len(aside) == 1 and (aside[0] / iter_name(1) / "state.json").is_file()


def test_latest_skips_torn_saves_and_a_stale_pointer(tmp_path):
    cfg = tiny_config(tmp_path)
    for i in (1, 3):
        fake_checkpoint(cfg, i)
    ckpt = Checkpointer(cfg.save_dir)
    torn = cfg.save_dir / f"{iter_name(5)}.tmp-1234"
    torn.mkdir()
    (torn / "model").mkdir()
    assert ckpt.latest().name == iter_name(3)
    (cfg.save_dir / "latest").write_text(iter_name(7))  # points at something that never completed
    assert ckpt.latest().name == iter_name(3)
    ckpt.begin(5)  # the next save cleans torn temporaries up
    assert not torn.exists()


def test_keep_last_prunes_old_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path)
    ckpt = Checkpointer(cfg.save_dir, keep_last=2)
    for i in range(4):
        ckpt.commit(ckpt.begin(i), i, {"fingerprint_fields": {}})
    assert [p.name for p in ckpt.complete()] == [iter_name(2), iter_name(3)]
    assert json.loads((cfg.save_dir / iter_name(3) / "state.json").read_text())["rollout_id"] == 3


def test_pipeline_start_fresh_happens_once_so_a_retried_train_task_resumes(tmp_path):
    """The pipeline moves old checkpoints aside before the train task; the task gets a resuming config, so a retry
    continues the checkpoints of its own first attempt instead of moving them aside and restarting at step 0."""
    from tasks.train import start_fresh
    from vime_core.loop import resume_point

    old = tiny_config(tmp_path, "checkpoint.start_fresh=true")
    fake_checkpoint(old, 3)  # left by an earlier pipeline run
    config = start_fresh(old.model_dump(mode="json"))
    assert not config["checkpoint"]["start_fresh"]
    assert [p.name for p in tmp_path.glob("checkpoints.old-*")], "the old checkpoints are kept, renamed"
    cfg = old.model_validate(config)
    assert resume_point(cfg) == (None, None)  # the first attempt starts fresh
    fake_checkpoint(cfg, 1)  # ... writes a checkpoint, then crashes
    latest, state = resume_point(cfg)  # the retry
    assert latest == cfg.save_dir / iter_name(1) and state["rollout_id"] == 1


# ---- resume = false beside checkpoints ------------------------------------------------------------------------------
def test_resume_false_beside_old_checkpoints_is_refused(tmp_path):
    from vime_core.cli import resume_state
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path, "checkpoint.resume=false")
    fake_checkpoint(cfg, 4)
    for call in (resume_point, resume_state):
        with pytest.raises(ResumeError) as e:
            call(cfg)
        assert f"checkpoint.resume = false but {cfg.save_dir} holds checkpoints up to {iter_name(4)}" in str(
            e.value
        ) and "checkpoint.start_fresh=true" in str(e.value)
    assert resume_point(tiny_config(tmp_path / "empty", "checkpoint.resume=false")) == (None, None)


@pytest.mark.parametrize(
    ("interval", "at_end", "saved_after"),
    [(None, True, [5]), (2, True, [2, 4, 5]), (None, False, []), (2, False, [2, 4])],
)
def test_checkpoints_fall_due_every_interval_and_at_the_end_unless_turned_off(interval, at_end, saved_after):
    from vime_core.loop import due

    assert [done for done in range(1, 6) if due(done, interval, 5, at_end)] == saved_after


def test_the_pipeline_refuses_a_run_without_its_final_checkpoint(tmp_path):
    from flows.grpo_pipeline import load_pipeline_config
    from vime_core.errors import VimeError, user_error

    overrides = [f"output_dir={tmp_path}", "checkpoint.save_at_end=false"]
    with pytest.raises(VimeError, match=r"checkpoint\.save_at_end = false.*set checkpoint\.save_at_end=true") as e:
        load_pipeline_config(str(REPO / "configs" / "tiny-cpu.yaml"), overrides)  # vime-pipeline's and the flow's
    assert user_error(e.value) is e.value
    assert not any(tmp_path.iterdir())  # refused with the config: before the lock, the download or the MLflow run
