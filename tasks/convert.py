"""Stage 2: HF -> Megatron torch_dist, skipped when the target holds a conversion of the same source hash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.context import TaskRunContext

from tasks.common import RETRY_DELAYS, TIMEOUTS, artifact_key, is_transient, markdown
from vime_core.checkpoint import convert_hf_to_torch_dist, is_converted


def converted_dir(output_dir: str, content_hash: str, dtype: str) -> Path:
    return Path(output_dir) / "converted" / f"{content_hash}-{dtype}"


def _cache_key(context: TaskRunContext, params: dict[str, Any]) -> str | None:
    """Reuse a cached result only while the converted checkpoint it points to is still there and intact."""
    model, dtype = params["model"], params["dtype"]
    if is_converted(converted_dir(params["output_dir"], model["content_hash"], dtype), model["content_hash"], dtype):
        return f"convert-{model['content_hash']}-{dtype}-{params['output_dir']}"
    return None


@task(
    name="convert-checkpoint",
    retries=1,
    retry_delay_seconds=RETRY_DELAYS,
    cache_key_fn=_cache_key,
    persist_result=True,
    retry_condition_fn=is_transient,
    timeout_seconds=TIMEOUTS["convert"],
)
def convert_checkpoint(model: dict[str, Any], output_dir: str, dtype: str) -> str:
    """HF checkpoint -> torch_dist (what the trainer starts from). Returns the checkpoint directory."""
    out = converted_dir(output_dir, model["content_hash"], dtype)
    skipped = is_converted(out, model["content_hash"], dtype)
    get_run_logger().info(
        f"conversion HF -> torch_dist of {model['source']}: "
        + ("already done (same source hash)" if skipped else f"converting into {out}")
    )
    convert_hf_to_torch_dist(model["path"], out, dtype=dtype, source_hash=model["content_hash"], show_progress=False)
    markdown(
        "Conversion HF -> torch_dist",
        {"source": model["source"], "target": str(out), "skipped (same source hash)": skipped},
        artifact_key("convert", model["content_hash"]),
    )
    return str(out)
