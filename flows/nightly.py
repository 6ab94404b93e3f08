"""Serve the GRPO pipeline on a schedule (the `serve` alternative to `prefect deploy` with infra/prefect.yaml).

    python -m flows.nightly --cron "0 2 * * *" --config configs/tiny-cpu.yaml

Runs until stopped; each scheduled run resumes/extends the config's run (same output_dir, same MLflow run) or, with
`--set checkpoint.start_fresh=true`, starts a fresh one and competes for the `champion` alias.
"""

from __future__ import annotations

import argparse
import sys

import flows  # noqa: F401
from flows.grpo_pipeline import grpo_pipeline

DEFAULT_CRON = "0 2 * * *"  # 02:00 every night


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.nightly", description=__doc__.splitlines()[0])
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--name", default="nightly")
    parser.add_argument("--config", "-c", default="configs/tiny-cpu.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    grpo_pipeline.serve(
        name=args.name,
        cron=args.cron,
        parameters={"config_path": args.config, "overrides": args.overrides},
        description="Nightly GRPO post-training: download, convert, train, evaluate, register.",
        tags=["vime-flow", "nightly"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
