"""Stage 4 and 6: export the final policy as an HF checkpoint; register it and move `champion` only if it wins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from tasks.common import RETRY_DELAYS, artifact_key, cfg_of, markdown
from tasks.tracking import tracking_target
from vime_core.checkpoint import convert_torch_dist_to_hf
from vime_core.tracking import MlflowRun, register_model as register_version


@task(name="export-hf", retries=1, retry_delay_seconds=RETRY_DELAYS)
def export_hf(config: dict[str, Any], checkpoint_dir: str) -> str:
    """Final training checkpoint (torch_dist) -> HF safetensors + config + tokenizer under output_dir/export."""
    cfg = cfg_of(config)
    out = cfg.output_dir / "export" / Path(checkpoint_dir).name
    if not (out / "config.json").is_file():
        convert_torch_dist_to_hf(Path(checkpoint_dir) / "model", out, show_progress=False)
    return str(out)


@task(name="register-model", retries=2, retry_delay_seconds=RETRY_DELAYS)
def register_model(config: dict[str, Any], export_dir: str, run_id: str | None, metrics: dict[str, float]) -> dict[str, Any]:
    cfg = cfg_of(config)
    if not run_id:
        return {"registered": False, "reason": "tracking disabled"}
    metric = f"eval/{cfg.eval.datasets[0].name}/pass@1"
    uri, experiment = tracking_target(cfg)
    run = MlflowRun(uri, experiment, run_id=run_id)
    artifact_path = run.log_dir(Path(export_dir), "model")
    name = cfg.tracking.registered_model or f"vime-{cfg.name}"
    info = register_version(uri, name, run_id, artifact_path, metric, metrics[metric])
    run.set_tags({"vime.registered_model": name, "vime.registered_version": str(info["version"]), "vime.promotion": info["reason"]})
    markdown("Model registry", {"model": name, "version": info["version"], "champion moved": info["promoted"], "why": info["reason"]},
             artifact_key(cfg.name, "register"))
    return {"registered": True, "name": name, **info}
