"""No credential from a URI is stored or printed: a password in `tracking.uri` (or a token in a query parameter) is
masked in MLflow params and tags, text artifacts, dataset sources and Prefect artifacts. A whole `vime train` against
a password-protected MLflow server: tests/e2e/test_security_credentials.py."""

from __future__ import annotations

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.redact import redact

PASSWORD = "s3cretPW-x9"


@pytest.mark.parametrize(
    "text, masked",
    [
        ("http://alice:s3cretPW@127.0.0.1:5077", "http://alice:***@127.0.0.1:5077"),
        ("https://alice:p@ss@host/x?y=1", "https://alice:***@host/x?y=1"),  # a raw `@` in the password
        (
            "tracking.uri = http://bob:pw@h:1 and https://c:d@e/f",
            "tracking.uri = http://bob:***@h:1 and https://c:***@e/f",
        ),
        ("https://host/api?token=abc123&x=1", "https://host/api?token=***&x=1"),
        (
            "https://host/p?x=1&access_token=abc&password=pw#frag",
            "https://host/p?x=1&access_token=***&password=***#frag",
        ),
        ("https://acct.blob/c?sv=2020&sig=AbC%2F", "https://acct.blob/c?sv=2020&sig=***"),
    ],
)
def test_redact_masks_passwords_and_secret_parameters(text, masked):
    assert redact(text) == masked


@pytest.mark.parametrize(
    "text",
    [
        "http://127.0.0.1:5000",
        "sqlite:////tmp/x/mlflow.db",
        "mlflow://models:/vime-tiny@champion",
        "hf://Qwen/Qwen3-0.6B@main",
        "builtin://arith?split=heldout&size=128",
        "user@example.com: a:b",
    ],
)
def test_redact_keeps_what_holds_no_credential(text):
    assert redact(text) == text


def test_params_tags_and_text_artifacts_are_redacted(tmp_path):
    from vime_core.config import dump_config, flatten
    from vime_core.tracking import safe_params

    cfg = tiny_config(tmp_path, f"tracking.uri=http://alice:{PASSWORD}@127.0.0.1:5077")
    params = safe_params(flatten(cfg))
    assert params["tracking.uri"] == "http://alice:***@127.0.0.1:5077"
    assert not [k for k, v in params.items() if PASSWORD in v]
    assert PASSWORD in dump_config(cfg) and PASSWORD not in redact(dump_config(cfg))


def test_prefect_markdown_artifacts_are_redacted(monkeypatch):
    import tasks.common

    made = []
    monkeypatch.setattr(tasks.common, "create_markdown_artifact", lambda **kw: made.append(kw))
    tasks.common.markdown("model", {"source": f"https://u:{PASSWORD}@hub/m", "n": 1.0}, key="k", note="?token=abc")
    assert len(made) == 1 and "https://u:***@hub/m" in made[0]["markdown"] and "?token=***" in made[0]["markdown"]
    assert PASSWORD not in made[0]["markdown"] and "abc" not in made[0]["markdown"]


def test_an_mlflow_run_stores_no_credential(tmp_path):
    """The MlflowRun sink on a local store: tags at creation and later, text artifacts, dataset sources."""
    from mlflow.tracking import MlflowClient

    from vime_core.tracking import MlflowRun

    secret_uri = f"https://alice:{PASSWORD}@data.example/train.jsonl?token=tok-{PASSWORD}"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = MlflowRun(uri, "creds", tags={"vime.model.source": secret_uri}, artifact_root=tmp_path / "art")
    run.set_tags({"vime.data": secret_uri})
    run.log_text(f"tracking:\n  uri: {secret_uri}\n", "config.yaml")
    run.log_datasets([{"name": "train", "source": secret_uri, "digest": "d1", "context": "training"}])
    got = MlflowClient(uri).get_run(run.run_id)
    assert got.data.tags["vime.model.source"] == "https://alice:***@data.example/train.jsonl?token=***"
    assert got.data.tags["vime.data"] == got.data.tags["vime.model.source"]
    assert [d.dataset.source for d in got.inputs.dataset_inputs] == [got.data.tags["vime.data"]]
    stored = [p for p in (tmp_path / "art").rglob("*") if p.is_file()]
    assert stored and not [p for p in stored if PASSWORD.encode() in p.read_bytes()]
    assert PASSWORD.encode() not in (tmp_path / "mlflow.db").read_bytes()
