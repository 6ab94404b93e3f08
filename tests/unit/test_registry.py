"""The model registry and MLflow runs as the nightly pipeline uses them, on a real MLflow sqlite store (no engines):
full-precision champion comparison, versions that own their files, the candidate a night trains from, the
experiment kind, changed params of a continued run, dataset inputs and one child run per evaluation."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.helpers.tiny import tiny_config

METRIC = "eval/arith-heldout/pass@1"


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One sqlite store for the module (creating one takes ~5 s); each test uses its own model/experiment names."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def store(shared_store, tmp_path, monkeypatch):
    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path / "cache"))
    return shared_store


def file_hashes(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


def fake_export(d: Path, weights: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def register(
    uri: str, tmp_path: Path, export: Path, value: float, name: str = "vime-test", promote: bool = True
) -> dict:
    from vime_core.policy_model import register_policy
    from vime_core.sources import weights_digest
    from vime_core.tracking import MlflowRun

    run = MlflowRun(uri, "registry-test", run_name="r", artifact_root=tmp_path / "artifacts")
    return register_policy(uri, name, run.run_id, export, weights_digest(export), METRIC, value, promote=promote)


def test_a_tie_never_promotes_and_scores_are_compared_at_full_precision(store, tmp_path):
    from mlflow.tracking import MlflowClient

    export = fake_export(tmp_path / "export" / "iter_0000019", b"w1")
    v1 = register(store, tmp_path, export, 0.427734375, name="vime-tie")
    tie = register(store, tmp_path, export, 0.427734375, name="vime-tie")
    # 0.4277 when rounded to 4 places, as the old tag stored it: a rounded comparison would call this a tie or a win
    above = register(store, tmp_path, export, 0.42773437500000006, name="vime-tie")
    assert [v1["promoted"], tie["promoted"], above["promoted"]] == [True, False, True]
    assert "ties champion version 1 (0.427734375); alias unchanged" in tie["reason"]
    client = MlflowClient(tracking_uri=store, registry_uri=store)
    assert client.get_model_version("vime-tie", "1").tags["eval/arith-heldout/pass_at_1"] == "0.427734375"
    assert client.get_model_version("vime-tie", "2").tags["vime.promotion"] == tie["reason"]
    assert str(client.get_model_version_by_alias("vime-tie", "champion").version) == "3"


def test_promote_false_never_moves_the_champion_and_names_the_challenger(store, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store, registry_uri=store)

    def alias(a: str) -> str:
        return str(client.get_model_version_by_alias("vime-adhoc", a).version)

    export = fake_export(tmp_path / "export" / "iter_0000001", b"w")
    probe = register(store, tmp_path, export, 0.9, name="vime-adhoc", promote=False)  # no champion yet: still none
    assert not probe["promoted"] and alias("challenger") == "1"
    assert not [a for mv in client.search_model_versions("name = 'vime-adhoc'") for a in mv.aliases if a == "champion"]
    assert register(store, tmp_path, export, 0.5, name="vime-adhoc")["promoted"] and alias("champion") == "2"
    better = register(store, tmp_path, export, 0.7, name="vime-adhoc", promote=False)
    assert not better["promoted"] and (alias("champion"), alias("challenger")) == ("2", "3")
    assert better["reason"].startswith("promote=false: champion unchanged, version 3 is challenger; ")
    assert "beats champion version 2 (0.5)" in client.get_model_version("vime-adhoc", "3").tags["vime.promotion"]
    worse = register(store, tmp_path, export, 0.4, name="vime-adhoc")  # a scheduled night that loses
    assert not worse["promoted"] and (alias("champion"), alias("challenger")) == ("2", "4")


def test_each_version_owns_its_files(store, tmp_path):
    """v2 registered from the same run dir (an extended run re-exports iter_N) must not change what v1 downloads."""
    from vime_core.sources import download_registered_model

    export = fake_export(tmp_path / "export" / "iter_0000003", b"first weights")
    register(store, tmp_path, export, 0.3, name="vime-own")
    v1_files = file_hashes(download_registered_model("models:/vime-own/1", store))
    (export / "model.safetensors").write_bytes(b"second weights")  # same path, new weights
    register(store, tmp_path, export, 0.4, name="vime-own")
    shutil.rmtree(tmp_path / "cache")  # download again from the store, not from the local copy
    assert file_hashes(download_registered_model("models:/vime-own/1", store)) == v1_files
    v2 = download_registered_model("models:/vime-own/2", store)
    assert (v2 / "model.safetensors").read_bytes() == b"second weights"


def test_two_stores_with_the_same_version_number_do_not_share_a_download(tmp_path, monkeypatch):
    from vime_core.sources import download_registered_model

    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path / "cache"))
    got = []
    for i in (1, 2):
        uri = f"sqlite:///{tmp_path / f'store{i}.db'}"
        register(
            uri, tmp_path / f"s{i}", fake_export(tmp_path / f"e{i}" / "iter_0000001", f"weights {i}".encode()), 0.5
        )
        got.append((download_registered_model("models:/vime-test/1", uri) / "model.safetensors").read_bytes())
    assert got == [b"weights 1", b"weights 2"]


def test_a_night_starts_from_the_champion_version_and_a_retry_from_the_same_one(store, tmp_path):
    from tasks.nightly import candidate_config, flow_run_key

    cfg = tiny_config(tmp_path / "runs" / "tiny-cpu", f"tracking.uri={store}")
    first = candidate_config(cfg, "0a1b2c3d-flow-run-1", None)
    assert first.model.source == cfg.model.source  # no champion yet: the base model
    assert first.output_dir.parent == cfg.output_dir / "nightly"
    assert first.output_dir.name.endswith(f"-{flow_run_key('0a1b2c3d-flow-run-1')}")
    assert first.tracking.uri == store
    register(store, tmp_path, fake_export(tmp_path / "e" / "iter_0000001", b"w"), 0.5, name="vime-tiny-cpu")
    second = candidate_config(cfg, "99887766-flow-run-2", None)
    assert second.model.source == "mlflow://models:/vime-tiny-cpu/1"
    assert second.output_dir != first.output_dir
    # a retry of the first flow run keeps the model it started from, although a champion exists now
    retry = candidate_config(cfg, "0a1b2c3d-flow-run-1", None)
    assert retry.model.source == cfg.model.source and retry.output_dir == first.output_dir


def test_runs_are_model_training_runs_with_changes_and_inputs_recorded(store):
    from mlflow.tracking import MlflowClient

    from vime_core.tracking import MlflowRun

    run = MlflowRun(store, "kind-test", run_name="r")
    run.log_params({"rollout.num_rollout": "20", "seed": "1"})
    run.log_datasets([{"name": "train", "source": "builtin://arith", "digest": "abc", "context": "training"}])
    again = MlflowRun(store, "kind-test", run_id=run.run_id)
    assert again.log_params({"rollout.num_rollout": "40", "seed": "1"}) == ["rollout.num_rollout: 20 -> 40"]
    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("kind-test")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    got = client.get_run(run.run_id)
    assert got.data.tags["vime.params_changed"] == "rollout.num_rollout: 20 -> 40"
    inputs = got.inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest, i.tags[0].value) for i in inputs] == [("train", "abc", "training")]


def test_a_run_continued_after_it_ended_leaves_the_pause_out_of_its_duration(store, monkeypatch):
    """A 4-minute night re-run 30 minutes after it ended showed a 34-minute duration: MLflow's duration is end_time -
    start_time. The continued run's end_time leaves the pause out; the real end is a tag."""
    from mlflow.tracking import MlflowClient

    from vime_core import tracking

    minute = 60_000
    clock = {"ms": 1_800_000_000_000}
    monkeypatch.setattr(tracking, "now_ms", lambda: clock["ms"])
    run = tracking.MlflowRun(store, "duration-test", run_name="night")
    clock["ms"] += 4 * minute
    run.end()
    clock["ms"] += 30 * minute  # stood FINISHED
    again = tracking.MlflowRun(store, "duration-test", run_id=run.run_id)
    clock["ms"] += minute // 10  # the re-run's own work: 6 s
    again.end()
    info = MlflowClient(tracking_uri=store).get_run(run.run_id)
    assert info.info.status == "FINISHED"
    assert info.info.end_time - info.info.start_time == 4 * minute + minute // 10
    assert info.data.tags[tracking.PAUSED_TAG] == str(30 * minute)
    assert info.data.tags[tracking.ENDED_AT_TAG] == "2027-01-15T08:34:06Z"  # the wall clock: 34 min 6 s after start


def test_a_run_that_never_ended_keeps_its_duration_as_measured(store, monkeypatch):
    """Continued while RUNNING (the pipeline's tasks hand the run on; a SIGKILL leaves it so): no pause is known."""
    from mlflow.tracking import MlflowClient

    from vime_core import tracking

    clock = {"ms": 1_800_000_000_000}
    monkeypatch.setattr(tracking, "now_ms", lambda: clock["ms"])
    run = tracking.MlflowRun(store, "duration-test", run_name="night")
    clock["ms"] += 300_000
    tracking.MlflowRun(store, "duration-test", run_id=run.run_id).end()
    info = MlflowClient(tracking_uri=store).get_run(run.run_id)
    assert info.info.end_time - info.info.start_time == 300_000
    assert tracking.PAUSED_TAG not in info.data.tags and tracking.ENDED_AT_TAG not in info.data.tags


def test_every_evaluation_row_becomes_a_child_run_at_its_step(store):
    from mlflow.tracking import MlflowClient

    from vime_core.tracking import EvalChildRuns, MlflowRun

    parent = MlflowRun(store, "eval-test", run_name="p")
    sink = EvalChildRuns(parent, "eval-test", store)
    sink.log_metrics(0, {"eval/a/pass@1": 0.2})
    sink.log_metrics(1, {"rollout/raw_reward": 0.5})  # a training row: no child
    sink.log_metrics(3, {"eval/a/pass@1": 0.3, "perf/eval_time/a": 1.5})
    client = MlflowClient(tracking_uri=store)
    exp = client.get_experiment_by_name("eval-test")
    children = client.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}'")
    steps = sorted(
        (c.info.run_name, m.step, m.value)
        for c in children
        for m in client.get_metric_history(c.info.run_id, "eval/a/pass_at_1")
    )
    assert steps == [("eval-step-0", 0, 0.2), ("eval-step-3", 3, 0.3)]


def test_a_night_trained_from_the_champion_is_continued_from_its_own_config(store, tmp_path):
    """infra/README's recipe (nightly=false, the night's dir, more steps) on a night that started from a champion:
    the base config (model.source builtin://..., no tracking.uri) was refused by the checkpoint after the engines
    started; the night's recorded config with the recipe's overrides resumes it, and the check runs first."""
    from tasks.nightly import candidate_config, continuation_config
    from vime_core.checkpoint import Checkpointer
    from vime_core.prepare import check_resume
    from vime_core.resume import ResumeError

    base = tmp_path / "runs" / "tiny-cpu"
    register(store, tmp_path, fake_export(tmp_path / "e" / "iter_0000001", b"w"), 0.5, name="vime-tiny-cpu")
    night = candidate_config(tiny_config(base, f"tracking.uri={store}"), "0a1b2c3d-night", None)
    assert night.model.source == "mlflow://models:/vime-tiny-cpu/1"
    ckpt = Checkpointer(night.save_dir)
    ckpt.commit(ckpt.begin(2), 2, {"fingerprint_fields": night.fingerprint_fields()})
    recipe = [f"output_dir={night.output_dir}", "rollout.num_rollout=40"]
    as_given = tiny_config(base, *recipe)
    with pytest.raises(ResumeError, match="model.source: 'mlflow://models:/vime-tiny-cpu/1' -> 'builtin://"):
        check_resume(as_given)  # what the recipe did before: now refused before any engine starts
    continued = continuation_config(as_given, recipe)
    check_resume(continued)
    assert (continued.model.source, continued.tracking.uri) == (night.model.source, store)
    assert continued.rollout.num_rollout == 40 and continued.output_dir == night.output_dir
    # a dir that is not a night's: the config as given
    assert continuation_config(tiny_config(tmp_path / "plain"), []).model.source == as_given.model.source


def test_mlflow_links_open_the_model_training_view():
    from vime_core.tracking import run_url

    server = run_url("http://127.0.0.1:5000/", "3", "abc")
    assert server == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    # a local store is opened with `mlflow ui` (vime-pipeline prints the command) on its default address
    assert run_url("sqlite:////tmp/runs/mlflow.db", "1", "r").startswith(
        "http://127.0.0.1:5000/#/experiments/1/runs/r?"
    )


# ---- registry: only "not found" is "no champion" ----------------------------------------------------------------
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

    from vime_core.policy_model import register_policy
    from vime_core.tracking import MlflowRun

    run = MlflowRun(store, "review-fixes", run_name="r", artifact_root=tmp_path / "artifacts")
    export = fake_export(tmp_path / "export", b"w")
    args = (store, "vime-retry", run.run_id, export)
    first = register_policy(*args, "aa", "eval/x/pass@1", 0.5)
    again = register_policy(*args, "aa", "eval/x/pass@1", 0.5)
    other = register_policy(*args, "bb", "eval/x/pass@1", 0.5)
    assert first["version"] == again["version"] == 1 and again["promoted"], again
    assert first["model_id"] == again["model_id"] != other["model_id"], "one logged model per weights digest"
    assert other["version"] == 2
    versions = MlflowClient(tracking_uri=store, registry_uri=store).search_model_versions("name = 'vime-retry'")
    assert sorted(int(v.version) for v in versions) == [1, 2]


def test_a_resumed_run_keeps_one_point_per_step(store):
    """A crash after step 2 was logged, resumed from the checkpoint of step 1: step 2 is trained and logged again
    (bit-exactly the same values); the run keeps one point per step, and an evaluation the crash cut off (eval at
    step 2, never logged) still gets its point."""
    from mlflow.tracking import MlflowClient

    from vime_core.tracking import MlflowRun

    first = MlflowRun(store, "resume-points", run_name="night")
    for step in range(3):
        first.log_metrics(step, {"rollout/raw_reward": step / 10})
    resumed = MlflowRun(store, "resume-points", run_id=first.run_id)
    resumed.log_metrics(2, {"rollout/raw_reward": 0.2})
    resumed.log_metrics(2, {"eval/arith/pass@1": 0.5})
    resumed.log_metrics(3, {"rollout/raw_reward": 0.3})
    client = MlflowClient(tracking_uri=store)
    reward = client.get_metric_history(first.run_id, "rollout/raw_reward")
    assert sorted((m.step, m.value) for m in reward) == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "eval/arith/pass_at_1")] == [(2, 0.5)]


def test_a_model_version_link_opens_its_page_on_the_server_or_the_local_ui():
    from vime_core.tracking import model_version_url

    assert (
        model_version_url("http://127.0.0.1:5077/", "policy", 3) == "http://127.0.0.1:5077/#/models/policy/versions/3"
    )
    assert model_version_url("sqlite:////tmp/m.db", "p", "1") == "http://127.0.0.1:5000/#/models/p/versions/1"


def test_evaluation_metrics_become_one_table_row_per_dataset():
    from vime_core.evaluation import eval_rows

    metrics = {
        "eval/aime/pass@1": 0.25,
        "perf/eval_time/aime": 3.0,
        "eval/aime/response_len/mean": 40.0,
        "eval/arith/pass@1": 0.5,
    }
    assert eval_rows(metrics) == [
        {"dataset": "aime", "pass@1": 0.25, "response_len/mean": 40.0},
        {"dataset": "arith", "pass@1": 0.5},
    ]
