"""An exported policy as an MLflow logged model: the pyfunc of vime_core/policy_pyfunc.py with a signature, its
weights as the model's artifact, one logged model per distinct weights digest.

Why a logged model and not a directory of run artifacts: the registry's version page then shows a signature, the
version loads with `mlflow.pyfunc.load_model` on any machine that reaches the tracking server, and the files live in
the server's artifact store (`mlflow-artifacts:/`) instead of on the worker's disk.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import tempfile
import warnings
from pathlib import Path

from vime_core.tracking import WEIGHTS_TAG, is_server, mlflow_client, register_model

POLICY_CODE = Path(__file__).with_name("policy_pyfunc.py")
POLICY_NAME = "policy"
# a larger export in a store on this machine is logged as a reference to its directory, not copied a second time on
# the same disk; a tracking server always gets the files (a teammate's machine must be able to download them)
INLINE_LIMIT = 256 * 2**20


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", 64)]),
    )


def pip_requirements() -> list[str]:
    """Pinned to what trained it; a local build tag (`2.13.0+cpu`) is dropped so that pip can resolve it."""
    return [f"{name}=={md.version(name).split('+')[0]}" for name in ("mlflow", "torch", "transformers", "pandas")]


def find_logged_model(client, experiment_id: str, digest: str) -> str | None:
    """The READY policy model of this experiment holding these weights (content-addressed: a retried or repeated
    registration of the same files reuses it instead of uploading them again), or None."""
    from mlflow.entities import LoggedModelStatus

    # the status is checked here: the stores' filter grammar does not take it (MLflow 3.17)
    found = client.search_logged_models([experiment_id], filter_string=f"tags.`{WEIGHTS_TAG}` = '{digest}'")
    ready = [m.model_id for m in found if m.status == LoggedModelStatus.READY]
    return ready[0] if ready else None


def log_policy_model(client, run_id: str, export_dir: Path, digest: str, reference_bytes: int | None = None) -> str:
    """Log `export_dir` (an HF checkpoint) as a pyfunc policy model of run `run_id`; return its model id.
    `reference_bytes` (the export's size, for a large export in a store on this machine): the model holds a
    reference to the directory instead of a copy of its files."""
    import mlflow
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    run = client.get_run(run_id)
    experiment_id = run.info.experiment_id
    model_id = find_logged_model(client, experiment_id, digest)
    if model_id is None:
        logged = client.create_logged_model(
            experiment_id, name=POLICY_NAME, source_run_id=run_id, tags={WEIGHTS_TAG: digest}, model_type="policy"
        )
        model_id = logged.model_id
        with tempfile.TemporaryDirectory() as tmp:
            if reference_bytes is None:
                artifacts = {"weights": str(export_dir)}
            else:
                ref = Path(tmp) / "weights.ref.json"
                ref.write_text(json.dumps({"path": str(export_dir.resolve()), "bytes": reference_bytes}, indent=2))
                artifacts = {"weights_ref": str(ref)}
            local = Path(tmp) / "model"
            meta = Model(artifact_path=logged.artifact_location, run_id=run_id, model_id=model_id)
            with warnings.catch_warnings():
                # MLflow asks for an input example: validating one would load the weights (16 GB for 8B) once more
                warnings.filterwarnings("ignore", message=".*input example.*", category=UserWarning)
                mlflow.pyfunc.save_model(
                    str(local),
                    python_model=str(POLICY_CODE),
                    artifacts=artifacts,
                    signature=signature(),
                    pip_requirements=pip_requirements(),
                    mlflow_model=meta,
                )
            client.log_model_artifacts(model_id, str(local))
        client.finalize_logged_model(model_id, LoggedModelStatus.READY)
    if model_id not in {o.model_id for o in (run.outputs.model_outputs if run.outputs else [])}:
        client.log_outputs(run_id, models=[LoggedModelOutput(model_id, step=0)])  # the run page lists it
    return model_id


def hf_dir_of(model_dir: Path) -> Path:
    """The HF checkpoint inside a downloaded registered version: a policy model's `weights` artifact (or the
    directory its `weights_ref` names), or the version's files themselves (versions registered before policy
    models were logged)."""
    import yaml

    if not (model_dir / "MLmodel").is_file():
        return model_dir
    # the layout policy_pyfunc.weights_dir reads at load time (not imported: that file registers its model when
    # imported, as MLflow's models-from-code requires)
    artifacts = yaml.safe_load((model_dir / "MLmodel").read_text())["flavors"]["python_function"]["artifacts"]
    if "weights" in artifacts:
        return model_dir / artifacts["weights"]["path"]
    return Path(json.loads((model_dir / artifacts["weights_ref"]["path"]).read_text())["path"])


def register_policy(
    uri: str,
    name: str,
    run_id: str,
    export_dir: Path,
    digest: str,
    metric: str,
    value: float,
    tags: dict[str, str] | None = None,
    promote: bool = True,
) -> dict:
    """Log `export_dir` (weights sha256 `digest`) as run `run_id`'s policy model and register it as a version of
    `name` (tracking.register_model's champion rule). A retry reuses the logged model and the version."""
    size = sum(f.stat().st_size for f in export_dir.rglob("*") if f.is_file())
    by_reference = not is_server(uri) and size > INLINE_LIMIT
    model_id = log_policy_model(mlflow_client(uri), run_id, export_dir, digest, size if by_reference else None)
    tags = {WEIGHTS_TAG: digest, **(tags or {})}
    info = register_model(uri, name, run_id, model_id, metric, value, tags=tags, reuse_tag=WEIGHTS_TAG, promote=promote)
    return {"model_id": model_id, **info}
