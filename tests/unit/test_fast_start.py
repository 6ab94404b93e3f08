"""The start-up shortcuts of `vime train` (issue 14 item 5) keep their guarantees: a Ray started in the background
reports its failure where the loop waits for it, prestarted actors are used only when made from equal inputs, and a
run with nothing to train starts no engines. Shutdown on real processes: tests/integration/test_fast_start.py."""

from __future__ import annotations

import json
import sys
import threading
from types import SimpleNamespace

import pytest

from tests.helpers.tiny import tiny_config
from tests.unit.test_nightly_units import retried
from vime_core import cluster
from vime_core.early_ray import EarlyStart, start_ray_early
from vime_core.errors import VimeError


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


class FakeRef:
    def __init__(self, error):
        self.error = error


class FakeActor:
    def __init__(self, error):
        self.start = SimpleNamespace(remote=lambda: FakeRef(error))


@pytest.mark.parametrize("cause, user", [(ValueError("weights file truncated"), True), (MemoryError("oom"), False)])
def test_an_actor_start_failure_is_a_user_error_only_when_its_cause_is_one(monkeypatch, cause, user):
    from vime_core.errors import ClusterError
    from vime_core.rpc import wait_ready
    from vime_core.integrity import WeightsFileError

    cause = WeightsFileError(str(cause)) if user else cause

    class ActorDied(Exception):  # what ray.get raises: the actor's exception as `.cause`
        def __init__(self, c):
            super().__init__(f"actor died: {c}")
            self.cause = c

    def get(ref):
        raise ActorDied(ref.error)

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(get=get))
    with pytest.raises(Exception) as e:
        wait_ready([FakeActor(cause)], [], None)
    assert isinstance(e.value, ClusterError) is user and isinstance(e.value, VimeError) is user
    assert "trainer rank 0 failed to start" in str(e.value) and isinstance(e.value.__cause__, ActorDied)
    assert retried(e.value) is not user


def test_colocated_trainers_start_only_once_the_engines_are_up(monkeypatch):
    """wait_ready(engines_first=True): every engine's ready() is read before any trainer's start() is called (vLLM
    sizes its KV cache from the device's memory change while it starts); without it both are asked at once."""
    from vime_core.rpc import wait_ready

    events: list[str] = []

    class Call:
        def __init__(self, name):
            self.name = name

        def remote(self):  # a ref: any hashable object
            events.append(f"call {self.name}")
            return type("Ref", (), {"name": self.name})()

    def get(ref):
        events.append(f"got {ref.name}")
        return {"engine 0": 3.0, "engine 1": 4.25}.get(ref.name, {"rank": 0})  # ready(): LLM()'s s; start(): info

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(get=get))
    trainers = [SimpleNamespace(start=Call(f"trainer {i}")) for i in range(2)]
    engines = [SimpleNamespace(ready=Call(f"engine {i}")) for i in range(2)]
    parts = wait_ready(trainers, engines, None, True, before_trainers=lambda: events.append("engines sleep"))
    assert [p.split(" at ")[0] for p in parts.split(", ")] == ["engines up", "asleep", "all up"], parts
    assert parts.endswith("; vLLM's LLM() 4.2 s"), parts  # the slowest engine's
    last_engine = max(events.index(f"got engine {i}") for i in range(2))
    # sleeping engines go to sleep between their start and the trainers' (Qwen3-8B: the trainer's build needs it)
    assert last_engine < events.index("engines sleep") < min(events.index(f"call trainer {i}") for i in range(2))
    events.clear()
    assert wait_ready(trainers, engines, None, before_trainers=lambda: events.append("engines sleep")).startswith(
        "all up"
    )
    assert max(events.index(f"call trainer {i}") for i in range(2)) < events.index("got engine 0"), events
    assert "engines sleep" not in events  # apart (not colocated), nothing waits and nothing sleeps


def test_the_start_parts_name_each_mark_and_the_slowest_engines_llm_init():
    from vime_core.rpc import start_parts

    marks = [("engines up", 80.06), ("asleep", 81.3), ("all up", 139.0)]
    assert start_parts(marks, 61.04) == "engines up at 80.1 s, asleep at 81.3 s, all up at 139.0 s; vLLM's LLM() 61.0 s"
    assert start_parts(marks[2:], None) == "all up at 139.0 s"
