"""Stage 4 and 6: export the final policy as an HF checkpoint; register it and move `champion` only if it wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.common import RETRY_DELAYS, TIMEOUTS, artifact_key, cfg_of, is_transient, link, markdown
from tasks.nightly import registered_name
from tasks.tracking import tracking_target
from vime_core.checkpoint import convert_torch_dist_to_hf
from vime_core.sources import weights_digest
from vime_core.policy_model import register_policy
from vime_core.tracking import CHALLENGER, MlflowRun, model_version_url


@task(
    name="export-hf",
    retries=1,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["export"],
)
def export_hf(config: dict[str, Any], checkpoint_dir: str) -> str:
    """Final training checkpoint (torch_dist) -> HF safetensors + config + tokenizer under output_dir/export.
    An existing export of the same checkpoint is reused (start_fresh moves export/ aside with the checkpoints)."""
    cfg = cfg_of(config)
    out = cfg.output_dir / "export" / Path(checkpoint_dir).name
    if not (out / "config.json").is_file():
        get_run_logger().info(f"exporting {checkpoint_dir} to HF safetensors in {out}")
        convert_torch_dist_to_hf(Path(checkpoint_dir) / "model", out, show_progress=False)
    return str(out)


@task(
    name="register-model",
    retries=2,
    retry_delay_seconds=RETRY_DELAYS,
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["register"],
)
def register_model(
    config: dict[str, Any],
    export_dir: str,
    run_id: str | None,
    metrics: dict[str, float],
    checkpoint: str | None = None,
    promote: bool = True,
) -> dict[str, Any]:
    """A new model version: `export_dir` logged as a pyfunc policy model with a signature (vime_core.policy_model),
    in the tracking server's artifact store when there is one; `champion` moves only on a strictly better score and only
    when `promote` (the flow's parameter); a version that does not take it becomes `challenger`. The run's tag
    vime.registered_checkpoint lets a re-run see that this checkpoint's policy is registered already."""
    cfg = cfg_of(config)
    if not run_id:
        return {"registered": False, "reason": "tracking disabled"}
    metric = f"eval/{cfg.eval.datasets[0].name}/pass@1"
    uri, experiment = tracking_target(cfg)
    run = MlflowRun(uri, experiment, run_id=run_id)
    digest = weights_digest(Path(export_dir))
    name = registered_name(cfg)
    info = register_policy(
        uri,
        name,
        run_id,
        Path(export_dir),
        digest,
        metric,
        metrics[metric],
        {"vime.export_dir": str(export_dir)},
        promote,
    )  # a retry reuses the logged model and the version
    run.set_tags(
        {
            "vime.registered_model": name,
            "vime.registered_version": str(info["version"]),
            "vime.promotion": info["reason"],
            "vime.registered_checkpoint": str(checkpoint or export_dir),
        }
    )
    markdown(
        "Model registry",
        {
            "model": name,
            "version": info["version"],
            "champion moved": info["promoted"],
            "alias": "champion" if info["promoted"] else CHALLENGER,
            "why": info["reason"],
            "weights sha256": digest,
        },
        artifact_key(cfg.name, "register"),
    )
    link(
        f"{name} v{info['version']} in the MLflow registry",
        model_version_url(uri, name, info["version"]),
        artifact_key(cfg.name, "model-version"),
    )
    get_run_logger().info(f"registered {name} v{info['version']}: {info['reason']}")
    return {"registered": True, "name": name, "weights_sha256": digest, **info}
