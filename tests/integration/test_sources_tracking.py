"""Model sources from the huggingface_hub cache for real: a local fake hub fills a real hub cache, then child
processes read it offline, and an uncached repo says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO


HF_REPO = "vime-test/tiny-qwen3"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, dense_model_dir):
    """A hub cache written by huggingface_hub's own snapshot_download from a fake hub on 127.0.0.1."""
    from tests.helpers.fake_hub import serve

    hf_home = tmp_path_factory.mktemp("hf-home")
    server, url = serve(HF_REPO, dense_model_dir)
    try:
        script = "import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))"
        env = {
            **os.environ,
            "HF_ENDPOINT": url,
            "HF_HOME": str(hf_home),
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "0",
        }
        r = subprocess.run(
            [sys.executable, "-c", script, HF_REPO], env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
    finally:
        server.shutdown()
    return hf_home


def run_offline(hf_home: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` with the hub unreachable and HF_HUB_OFFLINE=1 (read by huggingface_hub at import)."""
    env = {
        **os.environ,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_download_model_reads_the_hub_cache_offline(hub_cache, dense_model_dir):
    r = run_offline(
        hub_cache,
        f"""
        import json
        from tasks.download import download_model
        print(json.dumps(download_model.fn("hf://{HF_REPO}")))
        print(json.dumps(download_model.fn("hf://{HF_REPO}@main")))
    """,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
    path = Path(first["path"])
    assert path.is_relative_to(hub_cache) and "snapshots" in path.parts
    assert (path / "model.safetensors").read_bytes() == (dense_model_dir / "model.safetensors").read_bytes()
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert second["path"] == first["path"] and second["content_hash"] == first["content_hash"]


def test_download_of_an_uncached_repo_offline_says_what_to_do(hub_cache):
    r = run_offline(
        hub_cache,
        """
        from tasks.download import download_model
        download_model.fn("hf://vime-test/not-there")
    """,
    )
    assert r.returncode != 0
    assert "not in the local hub cache" in r.stderr and "HF_HUB_OFFLINE=1" in r.stderr
