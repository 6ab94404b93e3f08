"""Review fixes without engines: only MLflow "not found" means "no champion", transient service errors are retried
and bugs are not user errors, the run lock is always released, resume refuses what would lose or mix a run, and
the eval timeout bound. MLflow runs on a real sqlite store; fakes stand in only for failures we cannot provoke."""

from __future__ import annotations

import builtins
import errno
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from prefect.states import Failed

from tasks.common import is_transient
from tests.helpers.tiny import tiny_config
from vime_core.checkpoint import Checkpointer, ResumeError, iter_name
from vime_core.errors import TransientError, VimeError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def fake_checkpoint(save_dir: Path, rollout_id: int, state: dict | None = None) -> Path:
    ckpt = Checkpointer(save_dir, keep_last=5)
    tmp = ckpt.begin(rollout_id)
    (tmp / "model").mkdir()
    (tmp / "model" / "w.distcp").write_bytes(os.urandom(4096))
    return ckpt.commit(tmp, rollout_id, {"fingerprint_fields": {}, "data_buffer": {}, **(state or {})})


def flip_a_byte(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


# ---- 1. registry: only "not found" is "no champion" ----------------------------------------------------------------
def test_a_missing_model_or_alias_on_sqlite_is_no_champion(store):
    from mlflow.tracking import MlflowClient

    from vime_core.tracking import alias_version

    assert alias_version(store, "never-registered") is None
    MlflowClient(tracking_uri=store, registry_uri=store).create_registered_model("registered-no-alias")
    assert alias_version(store, "registered-no-alias") is None


def test_any_other_registry_error_is_raised_not_read_as_no_champion(store, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    import vime_core.tracking as tracking

    class Broken(MlflowClient):
        def get_model_version_by_alias(self, name, alias):
            raise MlflowException("database is locked", error_code="INTERNAL_ERROR")

    monkeypatch.setattr(tracking, "mlflow_client", lambda uri: Broken(tracking_uri=uri, registry_uri=uri))
    with pytest.raises(MlflowException, match="database is locked"):
        tracking.alias_version(store, "any")
    with pytest.raises(MlflowException, match="database is locked"):
        tracking.register_model(store, "broken-store", "run", "model", "eval/x/pass@1", 0.5)
    assert not MlflowClient(tracking_uri=store, registry_uri=store).search_model_versions("name = 'broken-store'"), (
        "no version is created when the champion could not be read"
    )


def test_a_retried_registration_reuses_the_version_of_the_same_weights(store, tmp_path):
    from mlflow.tracking import MlflowClient

    from vime_core.tracking import MlflowRun, register_model

    run = MlflowRun(store, "review-fixes", run_name="r", artifact_root=tmp_path / "artifacts")
    args = (store, "vime-retry", run.run_id, "model/x", "eval/x/pass@1", 0.5)
    first = register_model(*args, tags={"vime.weights_sha256": "aa"}, reuse_tag="vime.weights_sha256")
    again = register_model(*args, tags={"vime.weights_sha256": "aa"}, reuse_tag="vime.weights_sha256")
    other = register_model(*args, tags={"vime.weights_sha256": "bb"}, reuse_tag="vime.weights_sha256")
    assert first["version"] == again["version"] == 1 and again["promoted"], again
    assert other["version"] == 2
    versions = MlflowClient(tracking_uri=store, registry_uri=store).search_model_versions("name = 'vime-retry'")
    assert sorted(int(v.version) for v in versions) == [1, 2]


# ---- 2. transient vs user vs bug -------------------------------------------------------------------------------------
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

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(get=get))
    trainers = [SimpleNamespace(start=Call(f"trainer {i}")) for i in range(2)]
    engines = [SimpleNamespace(ready=Call(f"engine {i}")) for i in range(2)]
    wait_ready(trainers, engines, None, engines_first=True, before_trainers=lambda: events.append("engines sleep"))
    last_engine = max(events.index(f"got engine {i}") for i in range(2))
    # sleeping engines go to sleep between their start and the trainers' (Qwen3-8B: the trainer's build needs it)
    assert last_engine < events.index("engines sleep") < min(events.index(f"call trainer {i}") for i in range(2))
    events.clear()
    wait_ready(trainers, engines, None, before_trainers=lambda: events.append("engines sleep"))
    assert max(events.index(f"call trainer {i}") for i in range(2)) < events.index("got engine 0"), events
    assert "engines sleep" not in events  # apart (not colocated), nothing waits and nothing sleeps


@pytest.mark.parametrize("sleep", [True, False])
def test_colocated_engines_sleep_unless_cluster_engines_sleep_is_false(tmp_path, sleep):
    """cluster.engines_sleep=false: no vLLM sleep mode and no optimizer offload, but the engines still start first
    (their KV sizing must not see the trainers' allocations either way)."""
    from vime_core.cluster import Placement, engine_specs
    from vime_core.memory import offload_enabled

    cfg = tiny_config(tmp_path, "cluster.colocate=true", "train.num_devices=1", f"cluster.engines_sleep={sleep}")
    p = Placement(None, [0], [[0]], True, True, ["0"], cfg.cluster.engines_sleep)
    assert p.colocated_gpu and p.engines_sleep is sleep
    assert engine_specs(cfg, p, "cuda", "/m")[0][0].sleep_mode is sleep
    assert offload_enabled(cfg.train.offload_optimizer, cfg.cluster.sleeping_engines, "cuda") is sleep
    cpu = Placement(None, [0], [[0]], False, True, [""], True)
    assert not cpu.colocated_gpu and not cpu.engines_sleep


def test_a_deferred_trainer_builds_nothing_until_start(dense_model_dir):
    from tests.helpers.trainer_ranks import spawn

    (r,) = spawn("deferred_start", 1, str(dense_model_dir))
    assert r["before"] == {"model": False, "process_group": False}
    assert r["model"] and r["first"]["params"] > 0 and r["first"]["step"] == 0
    assert r["again"]["params"] == r["first"]["params"]  # a second start() only answers


# ---- 3. the flow body starts the watchdog ----------------------------------------------------------------------------
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


# ---- 4. the run lock is always released --------------------------------------------------------------------------------
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


# ---- 5. nightly candidate ----------------------------------------------------------------------------------------------
def test_a_nightly_candidate_always_resumes_and_its_choice_is_written_whole(tmp_path):
    from tasks.nightly import CANDIDATE_FILE, NIGHT_CONFIG, candidate_config

    cfg = tiny_config(tmp_path, "tracking.enabled=false", "checkpoint.resume=false")
    cand = candidate_config(cfg, "0123456789abcdef", None)
    assert cand.checkpoint.resume is True and cand.checkpoint.start_fresh is False
    files = [p.name for p in cand.output_dir.iterdir()]
    assert sorted(files) == sorted([CANDIDATE_FILE, NIGHT_CONFIG]), files  # no temporary left behind
    assert json.loads((cand.output_dir / CANDIDATE_FILE).read_text())["model_source"] == cfg.model.source


# ---- 6. resume = false beside checkpoints ------------------------------------------------------------------------------
def test_resume_false_beside_old_checkpoints_is_refused(tmp_path):
    from vime_core.cli import resume_state
    from vime_core.loop import resume_point

    cfg = tiny_config(tmp_path, "checkpoint.resume=false")
    fake_checkpoint(cfg.save_dir, 4)
    for call in (resume_point, resume_state):
        with pytest.raises(ResumeError) as e:
            call(cfg)
        assert f"checkpoint.resume = false but {cfg.save_dir} holds checkpoints up to {iter_name(4)}" in str(
            e.value
        ) and "checkpoint.start_fresh=true" in str(e.value)
    assert resume_point(tiny_config(tmp_path / "empty", "checkpoint.resume=false")) == (None, None)


# ---- 7. damaged vs unreadable, none intact, the cheap look -------------------------------------------------------------
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


# ---- 8. eval timeout ---------------------------------------------------------------------------------------------------
def test_eval_generate_calls_are_bounded_by_eval_timeout_s(tmp_path, monkeypatch):
    import vime_core.rollout as rollout
    from vime_core.rollout import RolloutRouter

    cfg = tiny_config(tmp_path, "eval.timeout_s=123")
    assert tiny_config(tmp_path).eval.timeout_s == 7200
    seen = []
    monkeypatch.setattr(
        rollout, "gather", lambda refs, who, doing, timeout_s, setting, stall: seen.append((timeout_s, setting)) or []
    )
    engine = SimpleNamespace(generate=SimpleNamespace(remote=lambda reqs, spec: None))
    router = RolloutRouter([engine], cfg.rollout.timeout_s)
    request = SimpleNamespace(template=SimpleNamespace(prompt_ids=[1, 2]))
    spec = SimpleNamespace(n=1)
    router.generate([request], spec)
    router.generate([request], spec, cfg.eval.timeout_s, "eval.timeout_s")
    assert seen == [(cfg.rollout.timeout_s, "rollout.timeout_s"), (123, "eval.timeout_s")]


def test_evaluate_passes_eval_timeout_s_to_the_router(tmp_path):
    from vime_core.data import PromptSet
    from vime_core.evaluation import evaluate
    from vime_core.sample import Sample

    cfg = tiny_config(tmp_path, "eval.timeout_s=321")
    seen = []

    class Router:
        def generate(self, requests, spec, timeout_s=None, setting="rollout.timeout_s"):
            seen.append((timeout_s, setting))
            return [
                [Sample(group_id=0, prompt_ids=[1], response_ids=[2], finish_reason="stop", reward=1.0)]
                for _ in requests
            ]

    prompt = SimpleNamespace(index=0, template=lambda group_id: SimpleNamespace(prompt_ids=[1]))
    metrics = evaluate(Router(), {"held": PromptSet("x", [prompt])}, cfg, SimpleNamespace(score=lambda groups: None))
    assert seen == [(321, "eval.timeout_s")] and metrics["eval/held/num_prompts"] == 1.0
