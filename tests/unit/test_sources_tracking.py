"""Sources (MLflow registry, local, builtin), MLflow tracking and registry rules, and the clear errors of bad inputs;
MLflow runs for real on a local store. The huggingface_hub cache, filled from a local fake hub and read offline in
child processes: tests/integration/test_sources_tracking.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from vime_core.ports import free_port


@pytest.mark.parametrize(
    "source, message",
    [
        ("s3://bucket/model", "unknown model source scheme"),
        ("/nonexistent/model/dir", "does not exist"),
        ("builtin://no-such-model", "unknown builtin model"),
        ("hf://just-a-name", "expected <org>/<name>"),
    ],
)
def test_bad_model_sources_fail_with_a_fix(source, message):
    from vime_core.sources import SourceError, resolve_model

    with pytest.raises(SourceError, match=message):
        resolve_model(source)


def test_local_dir_without_config_is_refused(tmp_path):
    from vime_core.sources import SourceError, resolve_model

    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SourceError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.fixture
def registry(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return uri, tmp_path


def register(uri: str, root: Path, model_dir: Path, metric: str, value: float) -> dict:
    """A new run registering `model_dir` as the pipeline does (a logged policy model)."""
    from vime_core.policy_model import register_policy
    from vime_core.sources import weights_digest
    from vime_core.tracking import MlflowRun

    run = MlflowRun(uri, "registry-test", run_name="r", artifact_root=root / "artifacts")
    return register_policy(uri, "vime-test", run.run_id, model_dir, weights_digest(model_dir), metric, value)


def test_champion_moves_only_when_heldout_improves(registry, dense_model_dir):
    uri, root = registry
    metric = "eval/arith-heldout/pass@1"
    outcomes = []
    for value in (0.30, 0.20, 0.40):
        outcomes.append(register(uri, root, dense_model_dir, metric, value))
    assert [o["version"] for o in outcomes] == [1, 2, 3]
    assert [o["promoted"] for o in outcomes] == [True, False, True]
    assert "does not beat champion version 1" in outcomes[1]["reason"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert str(client.get_model_version_by_alias("vime-test", "champion").version) == "3"
    assert client.get_model_version("vime-test", "2").tags["vime.promotion"] == outcomes[1]["reason"]


def test_mlflow_source_downloads_the_champion_and_names_missing_aliases(
    registry, dense_model_dir, monkeypatch, tmp_path
):
    from vime_core.sources import SourceError, resolve_model

    uri, root = registry
    register(uri, root, dense_model_dir, "eval/x/pass@1", 0.5)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path / "cache"))
    got = resolve_model("mlflow://models:/vime-test@champion")
    assert (got.path / "model.safetensors").read_bytes() == (dense_model_dir / "model.safetensors").read_bytes()
    with pytest.raises(SourceError, match="no model models:/vime-test@nightly-best"):
        resolve_model("mlflow://models:/vime-test@nightly-best")


def test_mlflow_source_uses_the_given_registry_without_env(registry, dense_model_dir, monkeypatch, tmp_path):
    """The pipeline passes its config's tracking URI (e.g. the default sqlite store): no MLFLOW_TRACKING_URI needed."""
    from vime_core.sources import resolve_model

    uri, root = registry
    register(uri, root, dense_model_dir, "eval/x/pass@1", 0.5)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("VIME_CACHE_DIR", str(tmp_path / "cache"))
    got = resolve_model("mlflow://models:/vime-test@champion", tracking_uri=uri)
    assert (got.path / "model.safetensors").read_bytes() == (dense_model_dir / "model.safetensors").read_bytes()


def test_unreachable_tracking_server_fails_up_front_and_touches_nothing(tmp_path):
    from tasks.tracking import start_tracking
    from tests.helpers.tiny import tiny_config
    from vime_core.tracking import TrackingError

    port = free_port()  # nothing listens there
    cfg = tiny_config(tmp_path / "run", f"tracking.uri=http://127.0.0.1:{port}")
    cfg.save_dir.mkdir(parents=True)
    (cfg.save_dir / "latest").write_text("iter_0000003")
    before = sorted(p.name for p in cfg.save_dir.iterdir())
    with pytest.raises(TrackingError, match=rf"127\.0\.0\.1:{port} cannot be reached"):
        start_tracking.fn(cfg.model_dump(mode="json"), {"source": "builtin://x", "content_hash": "h"})
    assert sorted(p.name for p in cfg.save_dir.iterdir()) == before
    assert (cfg.save_dir / "latest").read_text() == "iter_0000003"


def test_params_never_carry_secrets():
    from vime_core.tracking import safe_params

    got = safe_params({"tracking.hf_token": "hf_abc", "tracking.api_key": "k", "train.lr": 1e-6, "model.source": "x"})
    assert got["tracking.hf_token"] == "***" and got["tracking.api_key"] == "***"
    assert got["train.lr"] == "1e-06" and got["model.source"] == "x"


def test_mlflow_metric_names_keep_vime_names_readable():
    from vime_core.tracking import mlflow_key

    assert mlflow_key("eval/arith/pass@1") == "eval/arith/pass_at_1"
    assert mlflow_key("rollout/raw_reward") == "rollout/raw_reward"
