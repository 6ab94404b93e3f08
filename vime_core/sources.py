"""Resolve model and dataset sources to local paths, with a content hash.

Sources:
- `builtin://<name>`: built locally on first use (see builtin.py);
- a local path;
- `hf://org/name[@revision]` (models) and `hf://datasets/org/name[@revision]` (datasets), through huggingface_hub's
  `snapshot_download` (honours HF_ENDPOINT, HF_HUB_OFFLINE, HF_TOKEN and reuses the hub cache); models fetch only
  weights, config and tokenizer files;
- `mlflow://models:/<name>@<alias>` or `mlflow://models:/<name>/<version>`: a model registered by an earlier run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from vime_core.builtin import builtin_model_path, cache_dir
from vime_core.errors import TransientError, VimeError
from vime_core.redact import redact
from vime_core.policy_model import hf_dir_of
from vime_core.tracking import mlflow_client

MODEL_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "*.model",
]


class SourceError(VimeError, ValueError):
    """A source cannot be resolved; the message says what to fix."""


class HubUnavailableError(TransientError, SourceError):
    """The Hugging Face hub did not answer (no connection while online, HTTP 5xx or 429): retried by the pipeline."""


@dataclass(frozen=True)
class Resolved:
    source: str
    path: Path
    content_hash: str


def content_hash(path: Path) -> str:
    """sha256 over (relative name, size, first and last MiB) of every file: cheap for multi-GB checkpoints, and
    changes whenever a file is replaced."""
    h = hashlib.sha256()
    files = (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
    )
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(2**20))
            if st.st_size > 2**20:
                fh.seek(max(2**20, st.st_size - 2**20))
                h.update(fh.read(2**20))
    return h.hexdigest()[:16]


def weights_digest(path: Path) -> str:
    """Full sha256 over (relative name, bytes) of every file of a checkpoint directory: the identity of registered
    and evaluated weights (content_hash above samples only the ends of each file)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file() and not p.name.endswith(".lock")):
        h.update(f"{f.relative_to(path)}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(2**24):
                h.update(chunk)
    return h.hexdigest()


def _split_revision(spec: str) -> tuple[str, str | None]:
    if "@" in spec:
        repo, rev = spec.rsplit("@", 1)
        return repo, rev or None
    return spec, None


def resolve_model(source: str, tracking_uri: str | None = None) -> Resolved:
    """A model source -> local HF checkpoint directory and content hash. `tracking_uri`: the MLflow registry that
    mlflow:// sources are looked up in (default: MLFLOW_TRACKING_URI)."""
    if source.startswith("builtin://"):
        try:
            path = builtin_model_path(source.removeprefix("builtin://"))
        except ValueError as e:
            raise SourceError(str(e)) from None
    elif source.startswith("hf://"):
        repo, rev = _split_revision(source.removeprefix("hf://"))
        path = _hf_snapshot(repo, rev, "model", MODEL_PATTERNS)
    elif source.startswith("mlflow://"):
        path = _mlflow_model(source.removeprefix("mlflow://"), tracking_uri)
    elif "://" in source:
        raise SourceError(
            f"unknown model source scheme in {source!r}; use builtin://, hf://, mlflow:// or a local path"
        )
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise SourceError(
                f"model path {path} does not exist; give an HF checkpoint directory (config.json + *.safetensors)"
            )
    if not (path / "config.json").is_file():
        raise SourceError(f"model source {source} resolved to {path}, which has no config.json (not an HF checkpoint)")
    return Resolved(source, path, content_hash(path))


def resolve_dataset(source: str) -> Resolved:
    """Datasets: builtin ones stay as they are (read by data.py); hf:// ones are downloaded; paths are checked."""
    if source.startswith("builtin://"):
        return Resolved(source, Path(source), hashlib.sha256(source.encode()).hexdigest()[:16])
    path = dataset_path(source)
    return Resolved(source, path, content_hash(path))


def dataset_path(source: str) -> Path:
    """Where a non-builtin dataset source is on disk (hf:// ones downloaded, or found in the hub cache)."""
    if source.startswith("hf://"):
        spec = source.removeprefix("hf://")
        if not spec.startswith("datasets/"):
            raise SourceError(f"dataset source {source!r}: use hf://datasets/<org>/<name>[@revision]")
        repo, rev = _split_revision(spec.removeprefix("datasets/"))
        return _hf_snapshot(repo, rev, "dataset", ["*.jsonl", "*.parquet", "*.json"])
    if "://" in source:
        raise SourceError(
            f"unknown dataset source scheme in {source!r}; use builtin://, hf://datasets/... or a local path"
        )
    path = Path(source).expanduser()
    if not path.exists():
        raise SourceError(f"dataset path {path} does not exist")
    return path


def _hf_snapshot(repo: str, revision: str | None, repo_type: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if repo.count("/") != 1:
        raise SourceError(f"hf://{repo}: expected <org>/<name>")
    try:
        return Path(
            snapshot_download(
                repo_id=repo,
                revision=revision,
                repo_type=repo_type,
                allow_patterns=patterns,
                token=os.environ.get("HF_TOKEN"),
            )
        )
    except LocalEntryNotFoundError as e:
        from huggingface_hub import constants

        # offline on purpose: only the cache counts, a retry cannot help; online: the hub did not answer (network
        # down, a timeout), which a retry a minute later often gets past
        error = SourceError if constants.HF_HUB_OFFLINE else HubUnavailableError
        raise error(
            f"hf://{repo}{'@' + revision if revision else ''} is not in the local hub cache and the hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}, HF_ENDPOINT={os.environ.get('HF_ENDPOINT', 'default')}); "
            "download it on a connected machine or point HF_HOME at a cache that has it"
        ) from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None and (status == 429 or status >= 500):  # rate limit, hub outage: retryable
            raise HubUnavailableError(
                f"hf://{repo}: the hub answered HTTP {status} ({str(e)[:200]}); try again later"
            ) from e
        raise SourceError(
            f"hf://{repo}: the hub refused the download ({e}); check the name, revision and HF_TOKEN"
        ) from e


def _mlflow_model(uri: str, tracking_uri: str | None) -> Path:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> local copy of the registered HF checkpoint."""
    if not uri.startswith("models:/"):
        raise SourceError(
            f"mlflow://{uri}: expected mlflow://models:/<name>@<alias> or mlflow://models:/<name>/<version>"
        )
    return download_registered_model(uri, tracking_uri)


def download_registered_model(uri_or_spec: str, tracking_uri: str | None = None) -> Path:
    """`models:/<name>@<alias>` or `models:/<name>/<version>` -> local HF checkpoint directory."""
    import mlflow
    from mlflow.exceptions import MlflowException

    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise SourceError(f"{uri_or_spec}: set MLFLOW_TRACKING_URI (or tracking.uri) to the registry that holds it")
    client = mlflow_client(tracking_uri)
    spec = uri_or_spec.removeprefix("models:/")
    try:
        if "@" in spec:
            name, alias = spec.split("@", 1)
            mv = client.get_model_version_by_alias(name, alias)
        else:
            name, version = spec.rsplit("/", 1)
            mv = client.get_model_version(name, version)
    except MlflowException as e:
        raise SourceError(
            redact(f"registry {tracking_uri} has no model {uri_or_spec}: {e.message.splitlines()[0]}")
        ) from None
    # keyed by store + version source too: two registries (or a re-created one) both have a "name v1"
    key = hashlib.sha256(f"{tracking_uri}|{mv.source}|{mv.run_id}".encode()).hexdigest()[:12]
    target = cache_dir() / "mlflow-models" / f"{name}-v{mv.version}-{key}"
    if (target / "config.json").is_file():
        return target
    local = Path(
        mlflow.artifacts.download_artifacts(
            artifact_uri=mv.source, dst_path=str(target.parent / (target.name + ".dl")), tracking_uri=tracking_uri
        )
    )
    weights = hf_dir_of(local)
    if not weights.is_relative_to(local):  # a large export logged by reference: the directory that trained it
        return weights
    if not target.exists():
        os.replace(weights, target)
    shutil.rmtree(target.parent / (target.name + ".dl"), ignore_errors=True)  # the model's MLmodel, code, envs
    return target
