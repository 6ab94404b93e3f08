"""Serve the GRPO pipeline on a schedule (the `serve` alternative to `prefect deploy` with infra/prefect.yaml).

    python -m flows.nightly --cron "0 2 * * *" --config configs/tiny-cpu.yaml

Runs until stopped. Each scheduled run trains a new candidate from the current champion in its own output dir and
MLflow run (nightly semantics: flows/grpo_pipeline.py, tasks/nightly.py) and competes for the `champion` alias.
The deployment is called `nightly-serve`: `serve` takes over a deployment of the same name, and `nightly` is the
one infra/prefect.yaml creates for a work pool (serving under that name would drop its pool and pull step, and
leave it paused when stopped). One run at a time (`global_limit=1`, as in infra/prefect.yaml).
"""

from __future__ import annotations

import argparse
import sys

import flows  # noqa: F401
from flows.grpo_pipeline import grpo_pipeline
from prefect.schedules import Cron

DEFAULT_CRON = "0 2 * * *"  # 02:00 every night
DEFAULT_NAME = "nightly-serve"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.nightly", description=__doc__.splitlines()[0])
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--name", default=DEFAULT_NAME)
    parser.add_argument("--config", "-c", default="configs/tiny-cpu.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    if args.name == "nightly":
        print(
            "--name nightly would take over the deployment made from infra/prefect.yaml; choose another name",
            file=sys.stderr,
        )
        return 2
    grpo_pipeline.serve(
        name=args.name,
        # as infra/prefect.yaml: the scheduled runs compete for `champion`, ad-hoc runs register a `challenger`
        schedules=[Cron(args.cron, parameters={"promote": True})],
        parameters={"config_path": args.config, "overrides": args.overrides, "nightly": True, "promote": False},
        description="Nightly GRPO post-training: a candidate from the champion, trained, evaluated, registered.",
        tags=["vime-flow", "nightly"],
        limit=1,
        global_limit=1,  # the deployment's concurrency limit, as in infra/prefect.yaml
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
