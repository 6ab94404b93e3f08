"""The GRPO pipeline: download -> convert -> train -> export -> evaluate -> register, as retryable Prefect tasks.

    vime-pipeline --config configs/tiny-cpu.yaml [--set section.field=value ...]
    prefect deployment run 'grpo-pipeline/nightly' --watch         (see infra/prefect.yaml, flows/nightly.py)

A re-run (or a retried train task) resumes from the latest checkpoint of the config's output_dir and continues the
same MLflow run; a finished run with a larger `rollout.num_rollout` extends it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import flows  # noqa: F401  (offline variables before Prefect loads)
from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from tasks.common import artifact_key, markdown
from tasks.convert import convert_checkpoint
from tasks.download import download_dataset, download_model
from tasks.evaluate import evaluate, log_evaluation
from tasks.register import export_hf, register_model
from tasks.tracking import finish_tracking, start_tracking, tracking_target
from tasks.train import start_fresh, train_grpo
from vime_core.config import load_config


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(config_path: str = "configs/tiny-cpu.yaml", overrides: list[str] | None = None) -> dict[str, Any]:
    """GRPO post-training of a Qwen3 model, from source checkpoint to a registered, evaluated policy."""
    logger = get_run_logger()
    cfg = load_config(config_path, overrides or [])  # a bad config fails here, before any work
    config = cfg.model_dump(mode="json")

    model = download_model(cfg.model.source, tracking_target(cfg)[0])
    for source in [cfg.data.source, *(d.source for d in cfg.eval.datasets)]:
        download_dataset(source)
    run_id = start_tracking(config, model, flow_run.get_name())
    if cfg.checkpoint.start_fresh:
        config = start_fresh(config)
    converted = convert_checkpoint(model, str(cfg.output_dir), cfg.model.dtype)
    try:
        trained = train_grpo(config, model, converted, run_id)
        if not trained["last_checkpoint"]:
            raise RuntimeError("training produced no checkpoint")
        exported = export_hf(config, trained["last_checkpoint"])
        final, registry = {}, {"registered": False, "reason": "no eval dataset: nothing to compare a champion on"}
        if cfg.eval.datasets:
            final = evaluate(config, exported)
            log_evaluation(config, final, exported, run_id)
            registry = register_model(config, exported, run_id, final)
    except BaseException:
        finish_tracking(config, run_id, {}, status="FAILED")
        raise

    summary = pipeline_summary(cfg, trained, final, registry, exported, run_id)
    finish_tracking(config, run_id, {k: v for k, v in summary.items() if isinstance(v, float)})
    markdown("GRPO pipeline", summary, key=artifact_key(cfg.name, "pipeline"))
    logger.info("pipeline done: %s", summary)
    return summary


def pipeline_summary(cfg, trained: dict, final: dict, registry: dict, exported: str, run_id: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"config": cfg.name, "mlflow_run_id": run_id, "checkpoints": str(cfg.save_dir), "export": exported,
                           "resumed_from": trained.get("resumed_from")}
    for name in (d.name for d in cfg.eval.datasets):
        key = f"eval/{name}/pass@1"
        if key in trained["baseline_eval"]:
            out[f"baseline {key}"] = trained["baseline_eval"][key]
        if key in final:
            out[f"final {key}"] = final[key]
    if trained.get("reward_first") is not None:
        out["rollout/raw_reward first step"] = trained["reward_first"]
        out["rollout/raw_reward last step"] = trained["reward_last"]
    if registry.get("registered"):
        out["registered"] = f"{registry['name']} v{registry['version']}"
        out["champion"] = registry["reason"]
    return out


def main(argv: list[str] | None = None) -> int:
    """`vime-pipeline`: run the pipeline locally (Prefect ephemeral mode, local MLflow) and print its summary."""
    parser = argparse.ArgumentParser(prog="vime-pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--config", "-c", default="configs/tiny-cpu.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    from vime_core.config import ConfigError

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    summary = grpo_pipeline(args.config, args.overrides)
    print("\n=== vime-flow pipeline summary ===")
    for k, v in summary.items():
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    uri = tracking_target(cfg)[0]
    print(f"\nOpen the MLflow UI:  .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    return 0


if __name__ == "__main__":
    sys.exit(main())
