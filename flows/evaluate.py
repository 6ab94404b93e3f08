"""On-demand evaluation of any policy: a registered model, an HF checkpoint, or a training checkpoint.

python -m flows.evaluate --model mlflow://models:/vime-tiny-cpu@champion --config configs/tiny-cpu.yaml
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import flows  # noqa: F401
from prefect import flow, get_run_logger
from prefect.states import Failed

from flows.cli import run_flow_locally
from tasks.download import download_model
from tasks.evaluate import evaluate, log_evaluation
from tasks.register import export_hf
from vime_core.checkpoint import STATE_FILE
from vime_core.tracking import resolve_tracking_uri
from vime_core.config import load_config
from vime_core.errors import one_line, user_error


@flow(name="evaluate-checkpoint", log_prints=True)
def evaluate_checkpoint(
    model: str, config_path: str = "configs/tiny-cpu.yaml", overrides: list[str] | None = None
) -> dict[str, float]:
    """`model`: a model source (builtin://, hf://, mlflow://models:/..., an HF directory) or a training checkpoint
    directory (iter_XXXXXXX, exported to HF first). Eval datasets and sampling come from the config."""
    try:
        cfg = load_config(config_path, overrides or [])
        config = cfg.model_dump(mode="json")
        if (Path(model) / STATE_FILE).is_file():
            model_dir = export_hf(config, model)
        else:
            model_dir = download_model(model, resolve_tracking_uri(cfg))["path"]
        metrics = evaluate(config, model_dir)
        log_evaluation(config, metrics, model_dir, None, label=Path(str(model)).name or "model")
    except Exception as e:
        if (user := user_error(e)) is None:
            raise  # not the user's: Prefect logs the traceback, as a bug report needs
        # a user error ends the run Failed with its one line (no traceback); calling the flow still raises it
        get_run_logger().error(f"evaluation failed: {one_line(user)}")
        return Failed(message=one_line(user), data=user)
    for k, v in sorted(metrics.items()):
        if "pass@" in k:
            print(f"{k} = {v:.4f}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", "-c", default="configs/tiny-cpu.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--debug", action="store_true", help="Show the traceback of an error (also VIME_DEBUG=1).")
    args = parser.parse_args(argv)
    code = run_flow_locally(
        lambda: load_config(args.config, args.overrides),
        lambda cfg: evaluate_checkpoint(args.model, args.config, args.overrides),
        debug=args.debug,
    )
    if code > 128:
        name = signal.Signals(code - 128).name
        print(f"stopped by {name}: the evaluation of {args.model} did not finish; rerun it", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
