"""The GRPO pipeline: download -> convert -> train -> export -> evaluate -> register, as retryable Prefect tasks.

    vime-pipeline --config configs/tiny-cpu.yaml [--set section.field=value ...]
    prefect deployment run 'grpo-pipeline/nightly' --watch         (see infra/prefect.yaml, flows/nightly.py)

Two modes (the `nightly` parameter):
- nightly=False (`vime-pipeline`): the config's output_dir as it is. A re-run (or a retried train task) resumes from
  its latest checkpoint and continues the same MLflow run; a larger `rollout.num_rollout` extends it.
- nightly=True (the deployment's default): a new candidate from the current champion, in its own output dir and
  MLflow run, keyed by the flow run (tasks/nightly.py); a retry of that flow run resumes it.
`promote` (true for the deployment's schedule, false for its ad-hoc runs: infra/prefect.yaml; true for
`vime-pipeline`): false registers the policy as `challenger` and never moves `champion`.
A run with nothing new to train or register ends Completed under the name `NothingTrained`, with the reason as its
message and a "Nothing trained" artifact, and registers nothing. The output dir is locked for the whole run.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import flows  # noqa: F401  (offline variables before Prefect loads)
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from flows.cli import run_flow_locally
from tasks.common import artifact_key, cfg_of, markdown, tracking_retries, train_timeout
from tasks.convert import convert_checkpoint
from tasks.download import download_dataset, download_model
from tasks.evaluate import evaluate, log_evaluation
from tasks.nightly import choose_candidate, continuation_config, run_label
from tasks.register import export_hf, register_model
from tasks.tracking import finish_tracking, start_tracking, tracking_target
from tasks.train import start_fresh, train_grpo
from vime_core.config import ConfigError, RunConfig, load_config
from vime_core.errors import VimeError, one_line, user_error
from vime_core.redact import redact
from vime_core.runlock import output_dir_lock
from vime_core.stage_times import StageTimes, times_file
from vime_core.stop import saved_line, stop_reason, stop_signal

NOTHING_TRAINED = "NothingTrained"  # the Prefect state name (type COMPLETED) of a run that trained nothing new


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(
    config_path: str = "configs/tiny-cpu.yaml",
    overrides: list[str] | None = None,
    nightly: bool = False,
    promote: bool = True,
):
    """GRPO post-training of a Qwen3 model, from source checkpoint to a registered, evaluated policy. `promote`:
    whether the registered version may take `champion` (false: it becomes `challenger` whatever its score)."""
    from vime_core.logs import quiet_prefect
    from vime_core.orphans import start_watchdog

    # here too, not only in main(): a deployment's worker runs this body without main(), and a SIGKILLed flow run
    # must still take Ray and the actors with it (idempotent: main() may have started it already)
    start_watchdog()
    quiet_prefect()
    logger = get_run_logger()
    try:
        cfg = load_pipeline_config(config_path, overrides or [])  # a bad config fails here, before any work
    except VimeError as e:
        return refused(Path(config_path).stem, e)
    flow_run_id = flow_run.get_id()
    try:
        if nightly:
            cfg = choose_candidate(cfg, flow_run_id, flow_run.get_scheduled_start_time())
            logger.info(f"nightly candidate from {cfg.model.source} in {cfg.output_dir}")
        else:  # a nightly dir continues from the night's own config
            cfg = continuation_config(cfg, overrides or [])
        with output_dir_lock(cfg.output_dir, flow_run_id):
            summary = run_stages(cfg, flow_run_id, promote)
    except Exception as e:
        if user_error(e) is None:
            report_failure(cfg.name, e)
            raise  # not the user's: Prefect logs the traceback, as a bug report needs
        return refused(cfg.name, e)
    if summary.get("nothing_trained"):
        markdown(
            "Nothing trained",
            {"why": summary["nothing_trained"], "registered": "nothing"},
            key=artifact_key(cfg.name, "pipeline"),
        )
        logger.warning(f"nothing trained: {summary['nothing_trained']}")
        flush_logs()
        return Completed(name=NOTHING_TRAINED, message=summary["nothing_trained"], data=summary)
    markdown("GRPO pipeline", summary, key=artifact_key(cfg.name, "pipeline"))
    logger.info("pipeline done: %s", summary)
    return summary


def load_pipeline_config(config_path: str, overrides: list[str]) -> RunConfig:
    """`load_config`, and what only the pipeline refuses: vime-pipeline checks it before Prefect starts, a
    deployment's flow body before the nightly lookup or the output_dir lock."""
    cfg = load_config(config_path, overrides)
    if not cfg.checkpoint.save_at_end:  # evaluation, export and registration read that save
        raise ConfigError(
            "checkpoint.save_at_end = false: the pipeline evaluates, exports and registers the final checkpoint; "
            "set checkpoint.save_at_end=true (false is for `vime train` runs whose weights nobody keeps)"
        )
    return cfg


def run_stages(cfg: RunConfig, flow_run_id: str | None, promote: bool = True) -> dict[str, Any]:
    from vime_core.prepare import check_resume

    check_resume(cfg)  # a refused resume fails here: before the MLflow run it would continue is touched
    config = cfg.model_dump(mode="json")
    retry = tracking_retries(cfg.tracking.outage_s)  # every task that talks to MLflow outlasts a server restart
    finish = finish_tracking.with_options(**retry)
    clock = StageTimes(times_file(cfg.output_dir), get_run_logger().info)
    with clock.stage("download"):
        model = download_model(cfg.model.source, tracking_target(cfg)[0])
        sources = dict.fromkeys([cfg.data.source, *(d.source for d in cfg.eval.datasets)])
        datasets = [download_dataset(s) for s in sources]
    run_name = (
        f"{cfg.name}-{cfg.output_dir.name}"
        if cfg.output_dir.parent.name == "nightly"
        else run_label(cfg, flow_run_id, None)
    )
    run_id = start_tracking.with_options(**retry)(config, model, run_name, flow_run_id, datasets)
    try:
        return train_and_register(cfg, config, model, run_id, flow_run_id, promote, clock)
    except BaseException as e:
        fail_tracking(config, run_id, e, finish)
        if (signum := stop_signal(e)) is not None:  # Ctrl-C, or SIGTERM (a worker cancelling the run)
            get_run_logger().warning(saved_line(cfg, signum))
            flush_logs()
        raise


def fail_tracking(config: dict[str, Any], run_id: str | None, e: BaseException, finish=finish_tracking) -> None:
    """The pipeline's MLflow run ends FAILED with the error's one line in the tag ERROR_TAG (KILLED, naming the
    signal, for Ctrl-C and SIGTERM). MLflow may be what failed: then the original error is the one reported."""
    from vime_core.errors import one_line
    from vime_core.tracking import ERROR_TAG

    reason = stop_reason(e)
    status = "FAILED" if reason is None else "KILLED"
    try:
        finish(config, run_id, {}, status=status, tags={ERROR_TAG: (reason or one_line(e))[:5000]})
    except Exception as again:  # noqa: BLE001 - reported below, the original error propagates
        print(f"could not mark MLflow run {run_id} {status}: {type(again).__name__}: {str(again)[:200]}")


def train_and_register(
    cfg: RunConfig,
    config: dict[str, Any],
    model: dict[str, Any],
    run_id: str | None,
    flow_run_id: str | None,
    promote: bool,
    clock: StageTimes,
) -> dict[str, Any]:
    retry = tracking_retries(cfg.tracking.outage_s)
    finish = finish_tracking.with_options(**retry)
    if cfg.checkpoint.start_fresh:
        config = start_fresh(config)
    elif not cfg.checkpoint.resume:  # refused beside old checkpoints; else a retried train task must resume its own
        from vime_core.resume import check_resume_setting

        check_resume_setting(cfg)
        config = {**config, "checkpoint": {**config["checkpoint"], "resume": True}}
    with engines_started_early(cfg_of(config), model):
        with clock.stage("convert"):
            converted = convert_checkpoint(model, str(cfg.output_dir), cfg.model.dtype)
        train = train_grpo.with_options(timeout_seconds=train_timeout(cfg.rollout.num_rollout))
        with clock.stage("train"):  # its steps log their own ETA; this one covers engine start and evaluations too
            trained = train(config, model, converted, run_id, flow_run_id)
        if not trained["last_checkpoint"]:
            raise RuntimeError("training produced no checkpoint")
        step = trained["last_rollout_id"] + 1
        if trained["nothing_trained"] and already_registered(cfg, run_id, trained["last_checkpoint"]):
            reason = f"{trained['nothing_trained']}; its policy is already registered"
            url = finish(config, run_id, {}, step=step, tags={"vime.last_attempt": f"nothing trained: {reason}"[:5000]})
            return {
                "config": cfg.name,
                "mlflow_run_id": run_id,
                "mlflow run page": url,
                "checkpoints": str(cfg.save_dir),
                "nothing_trained": reason,
            }
        with clock.stage("export"):
            exported = export_hf(config, trained["last_checkpoint"])
        final, registry = {}, {"registered": False, "reason": "no eval dataset: nothing to compare a champion on"}
        if cfg.eval.datasets:
            with clock.stage("evaluate"):
                final = evaluate(config, exported)
                log_evaluation(config, final, exported, run_id, step=step)
            with clock.stage("register"):
                register = register_model.with_options(**retry)
                registry = register(config, exported, run_id, final, trained["last_checkpoint"], promote)
    summary = pipeline_summary(cfg, trained, final, registry, exported, run_id)
    url = finish(config, run_id, {k: v for k, v in summary.items() if isinstance(v, float)}, step=step)
    return {**summary, **({"mlflow run page": url} if url else {})}


@contextmanager
def engines_started_early(cfg: RunConfig, model: dict[str, Any]) -> Iterator[None]:
    """Ray and the vLLM engines (which need only the HF model) start in the background while the checkpoint is
    converted; the train task's loop takes them (vime_core/early_ray.py) and stops Ray when it ends. `cfg`: the
    train task's config. Measured on the 2-core box, `make run`: the train task reached "trainer and engines ready"
    17.3 s after it began, behind a 6.6 s conversion. Nothing starts when the latest checkpoint already covers
    rollout.num_rollout (nothing to train)."""
    from vime_core import cluster
    from vime_core.early_ray import start_ray_early

    started = not nothing_to_train(cfg)
    if started:
        start_ray_early(cfg, model_dir=str(Path(model["path"])), trainers=False)
    try:
        yield
    finally:
        if started and cluster.early_start is not None:  # the train task failed before its loop took them
            cluster.shutdown_ray()


def nothing_to_train(cfg: RunConfig) -> bool:
    """Whether the latest checkpoint already covers rollout.num_rollout, by `peek_latest`'s cheap look (nothing
    verified or set aside: the train task does that): a wrong guess only starts the engines for nothing, or late."""
    from vime_core.resume import Checkpointer, ResumeError

    latest = Checkpointer(cfg.save_dir).peek_latest() if cfg.checkpoint.resume else None
    try:
        return latest is not None and Checkpointer.read_state(latest)["rollout_id"] + 1 >= cfg.rollout.num_rollout
    except (ResumeError, KeyError):  # the train task reports what is wrong with it
        return False


def already_registered(cfg: RunConfig, run_id: str | None, checkpoint: str) -> bool:
    """Whether this MLflow run already registered the policy of `checkpoint` (a retry after registration, or a
    re-run of a finished run): then nothing is new. Without tracking, nothing trained means nothing new."""
    if not run_id:
        return True
    from vime_core.tracking import mlflow_client

    # read only: continuing the run (MlflowRun) would mark a finished run RUNNING again just to read its tags
    tags = mlflow_client(tracking_target(cfg)[0]).get_run(run_id).data.tags
    registered = tags.get("vime.registered_checkpoint")
    return registered is not None and Path(registered).resolve() == Path(checkpoint).resolve()


def refused(config_name: str, e: BaseException) -> State:
    """A user error (a config typo, a busy output dir, a bad dataset) ends the run Failed with its one line as the
    state's message: no traceback in the flow-run log or under `--watch`. The state carries the error, so calling the
    flow (vime-pipeline) still raises it."""
    user = user_error(e)
    report_failure(config_name, user)
    return Failed(message=one_line(user), data=user)


def report_failure(config_name: str, e: BaseException) -> None:
    """One line for `--watch` users and the flow-run logs, and a "Pipeline failed" artifact in the UI."""
    line = one_line(e)
    get_run_logger().error(f"pipeline failed: {line}")
    flush_logs()
    try:
        markdown(
            "Pipeline failed",
            {"error": line.replace("|", "/")},
            key=artifact_key(config_name, "pipeline"),
            note="The task that raised it and its traceback are in the flow run's logs.",
        )
    except Exception:  # noqa: BLE001 - the API may be what failed; the log line above is enough then
        pass


def flush_logs() -> None:
    """Send the queued log lines now: `prefect deployment run --watch` stops streaming at the final state, and a
    line still in the 2 s log batch (the reason of a failure) would never reach it."""
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()


def pipeline_summary(
    cfg, trained: dict, final: dict, registry: dict, exported: str, run_id: str | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "config": cfg.name,
        "mlflow_run_id": run_id,
        "checkpoints": str(cfg.save_dir),
        "export": exported,
        "resumed_from": trained.get("resumed_from"),
        "steps trained": trained.get("steps_trained"),
    }
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
    parser.add_argument("--debug", action="store_true", help="Show the traceback of an error (also VIME_DEBUG=1).")
    args = parser.parse_args(argv)
    # non-zero: a user error printed its line, or a stopped flow logged what was saved
    return run_flow_locally(
        lambda: load_pipeline_config(args.config, args.overrides),
        lambda cfg: print_summary(cfg, grpo_pipeline(args.config, args.overrides)),
        debug=args.debug,
    )


def print_summary(cfg: RunConfig, summary: dict[str, Any]) -> None:
    print("\n=== vime-flow pipeline summary ===")
    for k, v in summary.items():
        print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    uri = tracking_target(cfg)[0]
    print(redact(f"\nOpen the MLflow UI:  .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"))


if __name__ == "__main__":
    sys.exit(main())
