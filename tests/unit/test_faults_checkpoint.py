"""Checkpoint faults without engines: damaged checkpoints (truncated shard, optimizer file, state.json, missing rng/,
a garbage `latest`), a kill in the middle of pruning, fsync before the rename, and a full disk."""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import warnings
from collections import namedtuple
from pathlib import Path

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.checkpoint import Checkpointer, ResumeError, iter_name
from vime_core.errors import DiskSpaceError
from vime_core.integrity import MANIFEST


def fake_save(ckpt: Checkpointer, rollout_id: int, size: int = 4096) -> Path:
    """What a real save leaves: model/, optimizer/ and rng/ files, then state.json and the manifest (via commit)."""
    tmp = ckpt.begin(rollout_id)
    for rel in ("model/__0_0.distcp", "model/.metadata", "optimizer/rank_00000.pt", "rng/rank_00000.pt"):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(os.urandom(size))
    return ckpt.commit(tmp, rollout_id, {"fingerprint_fields": {}, "data_buffer": {}})


@pytest.fixture
def two_checkpoints(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=5)
    fake_save(ckpt, 1)
    fake_save(ckpt, 3)
    return ckpt


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:100])


def fake_checkpoint(save_dir: Path, rollout_id: int, state: dict | None = None) -> Path:
    """A committed checkpoint of one model file, model/w.distcp."""
    ckpt = Checkpointer(save_dir, keep_last=5)
    tmp = ckpt.begin(rollout_id)
    (tmp / "model").mkdir()
    (tmp / "model" / "w.distcp").write_bytes(os.urandom(4096))
    return ckpt.commit(tmp, rollout_id, {"fingerprint_fields": {}, "data_buffer": {}, **(state or {})})


def flip_a_byte(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: truncate(d / "model" / "__0_0.distcp"), "model/__0_0.distcp has 100 bytes, 4,096 were written"),
        (lambda d: truncate(d / "optimizer" / "rank_00000.pt"), "optimizer/rank_00000.pt has 100 bytes"),
        (
            lambda d: flip_a_byte(d / "optimizer" / "rank_00000.pt"),
            "optimizer/rank_00000.pt is damaged (checksum mismatch)",
        ),
        (
            lambda d: (d / "state.json").write_text('{"rollout_id": 3, "data_bu'),
            "state.json is unreadable (JSONDecodeError)",
        ),
        (
            lambda d: (d / "state.json").write_bytes(b"\xff\xfe\x00garbage"),
            "state.json is unreadable (UnicodeDecodeError)",
        ),
        (lambda d: [p.unlink() for p in (d / "rng").iterdir()] and (d / "rng").rmdir(), "rng/rank_00000.pt is missing"),
        (lambda d: (d / MANIFEST).write_text("{not json"), "manifest.json is unreadable"),
    ],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_intact_one(two_checkpoints, caplog, damage, named):
    ckpt = two_checkpoints
    damage(ckpt.dir / iter_name(3))
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest() == ckpt.dir / iter_name(1)
    assert named in caplog.text and iter_name(3) in caplog.text
    kept = [p.name for p in ckpt.dir.iterdir() if ".damaged-" in p.name]
    assert len(kept) == 1 and kept[0].startswith(iter_name(3)), "the damaged checkpoint is kept, renamed"
    assert [p.name for p in ckpt.complete()] == [iter_name(1)]


def test_an_intact_checkpoint_is_used_as_is(two_checkpoints, caplog):
    with caplog.at_level(logging.WARNING):
        assert two_checkpoints.latest() == two_checkpoints.dir / iter_name(3)
    assert "damaged" not in caplog.text


def test_a_garbage_latest_pointer_is_named_and_ignored(two_checkpoints, caplog):
    (two_checkpoints.dir / "latest").write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    with caplog.at_level(logging.WARNING):
        assert two_checkpoints.latest() == two_checkpoints.dir / iter_name(3)
    assert str(two_checkpoints.dir / "latest") in caplog.text and "unreadable" in caplog.text


def test_read_state_names_the_file(tmp_path):
    d = tmp_path / iter_name(2)
    d.mkdir()
    (d / "state.json").write_text("{")
    with pytest.raises(ResumeError) as e:
        Checkpointer.read_state(d)
    assert str(d / "state.json") in str(e.value) and "start_fresh" in str(e.value)


def test_resume_point_skips_a_damaged_checkpoint(tmp_path, caplog):
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path)
    ckpt = Checkpointer(cfg.save_dir, keep_last=5)
    for i in (1, 3):
        tmp = ckpt.begin(i)
        (tmp / "model").mkdir()
        (tmp / "model" / "w.distcp").write_bytes(b"x" * 1000)
        ckpt.commit(tmp, i, {"fingerprint_fields": cfg.fingerprint_fields(), "data_buffer": {}})
    truncate(cfg.save_dir / iter_name(3) / "model" / "w.distcp")
    with caplog.at_level(logging.WARNING):
        path, state = resume_point(cfg)
    assert path.name == iter_name(1) and state["rollout_id"] == 1
    assert "model/w.distcp has 100 bytes" in caplog.text


def test_a_kill_during_pruning_never_leaves_a_dir_that_counts(tmp_path, monkeypatch):
    import shutil

    import vime_core.resume as resume

    ckpt = Checkpointer(tmp_path / "c", keep_last=1)
    fake_save(ckpt, 0)
    real_rmtree = shutil.rmtree

    def killed(path, *a, **k):  # the process dies in the middle of deleting the old checkpoint
        victim = Path(path)
        next(victim.rglob("*.distcp")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(resume.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        fake_save(ckpt, 1)
    monkeypatch.setattr(resume.shutil, "rmtree", real_rmtree)
    assert [p.name for p in ckpt.complete()] == [iter_name(1)], "the half-deleted iter_0 must not count as complete"
    assert ckpt.latest() == ckpt.dir / iter_name(1)
    assert list(ckpt.dir.glob(".deleting-*")), "the half-deleted dir was renamed before the deletion started"
    fake_save(ckpt, 2)
    assert not list(ckpt.dir.glob(".deleting-*")), "the next save removes the leftover"


def test_every_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    import vime_core.integrity as integrity
    import vime_core.resume as resume

    synced: set[str] = set()
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src, dst):
        if Path(src).is_dir() and ".tmp-" in Path(src).name:
            files = [str(p.resolve()) for p in Path(src).rglob("*") if p.is_file()]
            events.append("rename")
            assert files and all(f in synced for f in files), sorted(set(files) - synced)
            assert str(Path(src).resolve()) in synced, "the directory itself is fsynced"
        real_replace(src, dst)

    monkeypatch.setattr(integrity.os, "fsync", fsync)
    monkeypatch.setattr(resume.os, "replace", replace)
    ckpt = Checkpointer(tmp_path / "c")
    final = fake_save(ckpt, 0)
    assert events == ["rename"]
    assert str(ckpt.dir.resolve()) in synced, "the save dir is fsynced after the rename"
    assert set(json.loads((final / MANIFEST).read_text())["files"]) == {
        "model/__0_0.distcp",
        "model/.metadata",
        "optimizer/rank_00000.pt",
        "rng/rank_00000.pt",
        "state.json",
    }


# --------------------------------------------------------------------------------------------------------------------
# a full disk
# --------------------------------------------------------------------------------------------------------------------
Usage = namedtuple("Usage", "total used free")


def fake_free(monkeypatch, free_of):
    import vime_core.integrity as integrity

    monkeypatch.setattr(integrity.shutil, "disk_usage", lambda path: Usage(10**12, 0, free_of()))


def test_a_full_disk_is_refused_before_the_save_with_what_is_needed_and_where(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path / "c", keep_last=1)
    fake_save(ckpt, 0, size=2**20)
    fake_free(monkeypatch, lambda: 2**20)  # 1 MiB free, the last checkpoint is ~4 MiB
    with pytest.raises(DiskSpaceError) as e:
        ckpt.begin(1)
    msg = str(e.value)
    assert str(ckpt.dir) in msg and "needs ~4.4 MiB" in msg and "1.0 MiB are free" in msg and "keep_last" in msg
    assert f"the size of {iter_name(0)}" in msg
    assert ckpt.latest() == ckpt.dir / iter_name(0), "keep_last = 1: the newest checkpoint is never pruned early"


def test_a_full_disk_prunes_first_what_keep_last_would_prune(tmp_path, monkeypatch, caplog):
    ckpt = Checkpointer(tmp_path / "c", keep_last=2)
    for i in range(2):
        fake_save(ckpt, i, size=2**20)
    free = {"bytes": 2**20}

    def free_of():
        return free["bytes"] + (0 if (ckpt.dir / iter_name(0)).exists() else 5 * 2**20)  # pruning frees its size

    fake_free(monkeypatch, free_of)
    with caplog.at_level(logging.WARNING):
        tmp = ckpt.begin(2)
    assert not (ckpt.dir / iter_name(0)).exists() and (ckpt.dir / iter_name(1)).exists()
    assert f"pruning {iter_name(0)} now" in caplog.text
    assert tmp.is_dir()


def test_torch_unexpected_pos_becomes_no_space_left_with_the_path(tmp_path):
    ckpt = Checkpointer(tmp_path / "c")
    fake_save(ckpt, 0)
    tmp = ckpt.begin(1)
    with pytest.raises(DiskSpaceError) as e:
        with ckpt.writing(tmp):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 1100")
    msg = str(e.value)
    assert (
        msg.startswith("No space left on device")
        and str(ckpt.dir) in msg
        and "MiB (the size of the last checkpoint)" in msg
    )
    assert not tmp.exists(), "the torn save is removed to give the space back"
    assert ckpt.latest() == ckpt.dir / iter_name(0)


def test_other_save_errors_pass_through(tmp_path):
    ckpt = Checkpointer(tmp_path / "c")
    tmp = ckpt.begin(0)
    with pytest.raises(ValueError, match="not a disk problem"):
        with ckpt.writing(tmp):
            raise ValueError("not a disk problem")


# --------------------------------------------------------------------------------------------------------------------
# checkpoints without a manifest (written before manifests, or the manifest lost): their files' own formats
# --------------------------------------------------------------------------------------------------------------------
def real_save(ckpt: Checkpointer, rollout_id: int, manifest: bool = True, fingerprint: dict | None = None) -> Path:
    """The formats a trainer save writes: model/ by torch.distributed.checkpoint (`.distcp` shards + `.metadata`),
    optimizer/ and rng/ by torch.save, hf_config/config.json; then state.json and the manifest (removed unless
    `manifest`)."""
    import torch
    import torch.distributed.checkpoint as dcp

    tmp = ckpt.begin(rollout_id)
    torch.manual_seed(rollout_id)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: assuming ... a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, checkpoint_id=str(tmp / "model"), no_dist=True)
    for sub in ("optimizer", "rng"):
        (tmp / sub).mkdir()
        torch.save({"x": torch.randn(32)}, tmp / sub / "rank_00000.pt")
    (tmp / "hf_config").mkdir()
    (tmp / "hf_config" / "config.json").write_text('{"vocab_size": 384}')
    final = ckpt.commit(tmp, rollout_id, {"fingerprint_fields": fingerprint or {}, "data_buffer": {}})
    if not manifest:
        (final / MANIFEST).unlink()
    return final


def shard_of(d: Path) -> Path:
    (shard,) = (d / "model").glob("*.distcp")
    return shard


def test_an_intact_checkpoint_without_manifest_is_used(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=5)
    real_save(ckpt, 1, manifest=False)
    newest = real_save(ckpt, 3, manifest=False)
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest() == newest
    assert "damaged" not in caplog.text


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda d: truncate(shard_of(d)), "model/__0_0.distcp has 100 bytes, its .metadata needs "),
        (lambda d: shard_of(d).unlink(), "model/__0_0.distcp is missing"),
        (lambda d: truncate(d / "model" / ".metadata"), "model/.metadata is unreadable"),
        (lambda d: truncate(d / "optimizer" / "rank_00000.pt"), "optimizer/rank_00000.pt is truncated or corrupt"),
        (lambda d: (d / "hf_config" / "config.json").write_text('{"vocab'), "hf_config/config.json is unreadable"),
    ],
)
@pytest.mark.parametrize("previous_has_manifest", [True, False])
def test_a_damaged_checkpoint_without_manifest_falls_back(tmp_path, caplog, damage, named, previous_has_manifest):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=5)
    previous = real_save(ckpt, 1, manifest=previous_has_manifest)
    damage(real_save(ckpt, 3, manifest=False))
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest() == previous
    assert named in caplog.text and iter_name(3) in caplog.text
    kept = [p.name for p in ckpt.dir.iterdir() if ".damaged-" in p.name]
    assert len(kept) == 1 and kept[0].startswith(iter_name(3)), "set aside, renamed, as a damaged one is"


def test_resume_point_skips_a_manifestless_checkpoint_with_a_cut_shard(tmp_path, caplog):
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path)
    ckpt = Checkpointer(cfg.save_dir, keep_last=5)
    real_save(ckpt, 1, fingerprint=cfg.fingerprint_fields())
    newest = real_save(ckpt, 3, manifest=False, fingerprint=cfg.fingerprint_fields())
    truncate(shard_of(newest))
    with caplog.at_level(logging.WARNING):
        path, state = resume_point(cfg)
    assert path.name == iter_name(1) and state["rollout_id"] == 1


# ---- damaged vs unreadable, none intact, the cheap look -------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_an_io_error_is_raised_and_the_checkpoint_is_not_set_aside(tmp_path, monkeypatch, code):
    from vime_core.resume import CheckpointReadError

    save = tmp_path / "checkpoints"
    fake_checkpoint(save, 1)
    fake_checkpoint(save, 3)
    real_open = builtins.open

    def failing_open(file, *a, **k):
        if str(file).endswith(f"{iter_name(3)}/model/w.distcp"):
            raise OSError(code, os.strerror(code), str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", failing_open)
    with pytest.raises(CheckpointReadError) as e:
        Checkpointer(save).latest()
    assert "w.distcp" in str(e.value) and os.strerror(code) in str(e.value)
    monkeypatch.setattr(builtins, "open", real_open)
    assert not list(save.glob("*.damaged-*")) and Checkpointer(save).latest() == save / iter_name(3)


def test_checkpoints_that_are_all_damaged_are_an_error_not_a_restart(tmp_path):
    save = tmp_path / "checkpoints"
    flip_a_byte(fake_checkpoint(save, 2) / "model" / "w.distcp")
    for _ in range(2):  # the next attempt, which finds only the renamed dirs, too
        with pytest.raises(ResumeError) as e:
            Checkpointer(save).latest()
        assert str(save) in str(e.value) and "start_fresh" in str(e.value) and iter_name(2) in str(e.value)


def test_the_run_id_is_read_without_a_checksum_pass(tmp_path):
    from tasks.tracking import run_id_to_continue

    cfg = tiny_config(tmp_path)
    last = fake_checkpoint(cfg.save_dir, 2, {"run_state": {"mlflow_run_id": "run-abc"}})
    flip_a_byte(last / "model" / "w.distcp")  # same size: only a checksum pass would notice
    assert run_id_to_continue(cfg) == "run-abc"
    assert not list(cfg.save_dir.glob("*.damaged-*")), "the cheap look sets nothing aside (the loop verifies)"
