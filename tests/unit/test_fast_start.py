"""The start-up and shutdown shortcuts of `vime train` (issue 14 item 5) keep their guarantees: a Ray started in the
background reports its failure where the loop waits for it; shutdown stops Ray's processes only; the fast exit still
runs atexit handlers and keeps the exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.helpers.tiny import REPO, tiny_config
from vime_core import cluster
from vime_core.early_ray import EarlyStart, start_ray_early


def test_background_ray_start_failure_is_raised_by_init_ray(tmp_path, monkeypatch):
    def failing_start(cfg, platform):
        raise cluster.ClusterError("Ray could not start: test")

    monkeypatch.setattr(cluster, "init_ray_now", failing_start)
    cfg = tiny_config(tmp_path)
    start_ray_early(cfg)
    with pytest.raises(cluster.ClusterError, match="Ray could not start: test"):
        cluster.init_ray(cfg, "cpu")
    assert cluster.early_start is None  # a later init_ray starts afresh instead of re-raising


def test_a_model_that_fails_its_checks_starts_nothing_early(tmp_path, monkeypatch):
    """A truncated weights file: no Ray line may precede prepare's one-line error, so the early start stands down
    and init_ray (if the run got that far) starts Ray itself."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(cluster, "init_ray_now", lambda cfg, platform: calls.append(threading.current_thread().name))
    cfg = tiny_config(tmp_path / "out", f"model.source={model}")
    start_ray_early(cfg)
    cluster.init_ray(cfg, "cpu")
    assert calls == ["MainThread"]  # once, from init_ray: the background thread started nothing
    assert cluster.early_start is None


def _early(objects: dict) -> tuple[EarlyStart, list]:
    early = EarlyStart.__new__(EarlyStart)
    early.thread, early.started, early.skipped = None, threading.Event(), False
    early.started.set()
    dropped = []
    early._drop = lambda kind, obj: dropped.append((kind, obj))
    early.objects = objects
    return early, dropped


def _changed(cfg, section: str, field: str, value) -> dict:
    data = cfg.model_dump(mode="json")
    data[section][field] = value
    return data


def test_prestarted_actors_are_used_only_when_made_from_equal_inputs(tmp_path):
    """What the background start made is handed out once to a caller whose inputs are equal, not the same objects
    (vime-pipeline's train task rebuilds its config from JSON, with checkpoint.resume set); a mismatch is stopped."""
    from vime_core.config import config_from_dict

    cfg = tiny_config(tmp_path)
    rebuilt = config_from_dict(_changed(cfg, "checkpoint", "resume", not cfg.checkpoint.resume))
    assert rebuilt is not cfg and rebuilt.checkpoint.resume != cfg.checkpoint.resume
    key = EarlyStart.key
    early, dropped = _early(
        {
            "placement": (key("placement", cfg, "cpu", False), "pg"),
            "trainers": (key("trainers", cfg, "pg", "model", None), ["t0"]),
            "engines": (key("engines", "pg", [("opts-0", {"OMP_NUM_THREADS": "2"}, [0])]), ["e0"]),
        }
    )
    assert early.take("placement", rebuilt, "cpu", False) == "pg"  # the checkpoint section is not the placement's
    assert early.take("placement", rebuilt, "cpu", False) is None  # once
    # every rank receives the whole config: another value of any field is another trainer
    assert early.take("trainers", rebuilt, "pg", "model", None) is None
    assert early.take("engines", "pg", [("opts-0", {"OMP_NUM_THREADS": "1"}, [0])]) is None
    assert dropped == [("trainers", ["t0"]), ("engines", ["e0"])]

    other = config_from_dict(_changed(cfg, "rollout", "num_engines", 2))
    early, dropped = _early({"placement": (key("placement", cfg, "cpu", False), "pg")})
    assert early.take("placement", other, "cpu", False) is None and dropped == [("placement", "pg")]
    early, _ = _early({"trainers": (key("trainers", cfg, "pg", "model", None), ["t0"])})
    assert early.take("trainers", tiny_config(tmp_path), "pg", "model", None) == ["t0"]  # equal, not the same


def test_shutdown_stops_ray_programs_only(monkeypatch):
    """Children running the ray package's files (and their children) are Ray's; a math-verify worker is not."""
    import ray

    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    ray_like = subprocess.Popen([sys.executable, "-c", sleeper, f"{ray.__path__[0]}/fake_raylet"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vime_core.verify_pool"])
    monkeypatch.setattr(cluster._local, "preexisting", frozenset())
    try:
        deadline = time.time() + 20
        while not psutil.Process(ray_like.pid).children() and time.time() < deadline:
            time.sleep(0.1)
        grandchildren = {c.pid for c in psutil.Process(ray_like.pid).children()}
        pids = {p.pid for p in cluster._ray_descendants()}
        assert ray_like.pid in pids
        assert grandchildren and grandchildren <= pids  # a Ray program's children (workers, actors) count too
        assert other.pid not in pids
    finally:
        for proc in (ray_like, other):
            proc.kill()
            proc.wait()


def test_exit_now_runs_atexit_and_keeps_the_code():
    code = (
        "import atexit, threading, time\n"
        "from vime_core.cli import exit_now\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout.splitlines() == ["thread done", "atexit ran"]


def test_the_pipeline_starts_no_engines_for_a_run_with_nothing_to_train(tmp_path):
    """vime-pipeline's early start peeks at the checkpoints' state files only (no verification, nothing moved)."""
    from flows.grpo_pipeline import nothing_to_train

    cfg = tiny_config(tmp_path, "rollout.num_rollout=20")
    assert not nothing_to_train(cfg)  # no checkpoints
    (cfg.save_dir / "iter_0000009").mkdir(parents=True)
    (cfg.save_dir / "iter_0000009" / "state.json").write_text(json.dumps({"rollout_id": 9}))
    (cfg.save_dir / "iter_0000019").mkdir()
    (cfg.save_dir / "iter_0000019" / "state.json").write_text("{truncated")
    assert not nothing_to_train(cfg)  # steps 10-19 left (the damaged one is the train task's to judge)
    (cfg.save_dir / "iter_0000019" / "state.json").write_text(json.dumps({"rollout_id": 19}))
    assert nothing_to_train(cfg)
    assert not nothing_to_train(tiny_config(tmp_path, "rollout.num_rollout=30"))
    assert sorted(p.name for p in cfg.save_dir.iterdir()) == ["iter_0000009", "iter_0000019"]
