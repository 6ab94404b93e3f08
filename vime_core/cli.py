"""`vime`: the engine's command line (the Prefect pipeline is `vime-pipeline`, in flows/)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console


class _VimeTyper(typer.Typer):
    """The `vime` app: a project error (`VimeError`) anywhere below prints one line and exits 2; `--debug` (anywhere
    on the command line) or VIME_DEBUG=1 shows its traceback instead."""

    def __call__(self, *args, **kwargs):
        from vime_core.errors import debug_requested

        debug = debug_requested(sys.argv)
        sys.argv[:] = [a for a in sys.argv if a != "--debug"]
        try:
            try:
                return super().__call__(*args, **kwargs)
            except Exception as e:
                code = user_error_exit(e, debug)
                if code is None:
                    raise
                sys.exit(code)
        except SystemExit as e:
            exit_now(e.code)


def exit_now(code) -> None:
    """End the process as Python would, minus the interpreter's teardown: after `vime train` that teardown (freeing
    torch, Ray, MLflow and transformers modules object by object) took 2.0-2.1 s of a 33 s command. Non-daemon
    threads are joined and atexit handlers run first (ray.shutdown, the math-verify pool, MLflow), then stdout and
    stderr are flushed."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing left to write to
            pass
    os._exit(code or 0)


def user_error_exit(e: BaseException, debug: bool) -> int | None:
    """Print a project error (also one raised inside a Ray actor) as one red line on stderr and return its exit code;
    None when `e` is not a project error or `debug` asks for the traceback."""
    from rich.markup import escape

    from vime_core.errors import VimeError, one_line

    cause = getattr(e, "cause", None)  # ray.exceptions.RayTaskError carries the actor's exception
    user = cause if isinstance(cause, VimeError) else e
    if debug or not isinstance(user, VimeError):
        return None
    name, _, text = one_line(user).partition(": ")
    err.print(f"[red]{name}[/red]: {escape(text)}  (--debug shows the traceback)", highlight=False, soft_wrap=True)
    return user.exit_code


app = _VimeTyper(
    add_completion=False,
    no_args_is_help=True,
    help="vime-flow: GRPO post-training of Qwen3 (megatron-core + vLLM + Ray). "
    "Add --debug anywhere to see the traceback of an error.",
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect configurations.")
builtin_app = typer.Typer(no_args_is_help=True, help="The embedded default model and data.")
app.add_typer(config_app, name="config")
app.add_typer(builtin_app, name="builtin")
convert_app = typer.Typer(no_args_is_help=True, help="Convert checkpoints: HF safetensors <-> Megatron torch_dist.")
app.add_typer(convert_app, name="convert")

console = Console(stderr=False)
err = Console(stderr=True)

SetOption = typer.Option([], "--set", "-s", help="Override a field: section.field=value (repeatable).")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("vime_core").setLevel(logging.INFO)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")


def _load(config: Optional[Path], overrides: list[str]):
    from vime_core.config import load_config

    return load_config(config, overrides)  # a ConfigError is printed by _VimeTyper: one line, exit 2


@config_app.command("show")
def config_show(
    config: Optional[Path] = typer.Argument(None, help="YAML config (defaults when omitted)."),
    overrides: list[str] = SetOption,
) -> None:
    """Print the merged, validated config as YAML."""
    from vime_core.config import dump_config

    cfg = _load(config, overrides)
    console.print(dump_config(cfg), highlight=False, markup=False, end="")


def _step_line(i: int, total: int, m: dict[str, float]) -> str:
    return (
        f"step {i + 1}/{total} | reward {m['rollout/raw_reward']:.3f} | len {m['rollout/response_len/mean']:.1f} | "
        f"logprob_diff {m['train/train_rollout_logprob_abs_diff']:.1e} | loss {m['train/loss']:+.4f} | "
        f"grad_norm {m['train/grad_norm']:.3f} | clipfrac {m['train/pg_clipfrac']:.3f} | "
        f"rollout {m['perf/rollout_time']:.2f}s train {m['perf/train_time']:.2f}s sync {m['perf/update_weights_time']:.2f}s | "
        f"{m['perf/tokens_per_gpu_per_sec']:,.0f} tok/s/dev"
    )


@app.command()
def train(
    config: Path = typer.Option(Path("configs/tiny-cpu.yaml"), "--config", "-c", help="YAML config."),
    overrides: list[str] = SetOption,
    metrics_out: Optional[Path] = typer.Option(
        None,
        "--metrics-out",
        help="Write one JSON object per rollout step here; a "
        "resumed run appends (a step redone after a crash appears again: the last row of a step wins).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show engine logs."),
) -> None:
    """Run the GRPO loop (rollout -> train -> sync) directly, without Prefect."""
    from vime_core.orphans import start_watchdog
    from vime_core.prepare import check_before_start
    from vime_core.runlock import output_dir_lock
    from vime_core.stop import saved_line, stop_on_signal

    _setup_logging(verbose)
    cfg = _load(config, overrides)
    check_before_start(cfg, metrics_out)
    start_watchdog()  # a SIGKILLed `vime train` takes Ray's processes and the actors' helpers with it
    with stop_on_signal() as stopped:
        try:
            # the lock before the sinks: a second `vime train` on a busy output_dir must fail before it opens an
            # MLflow run or moves the running one's --metrics-out file aside (the loop takes the lock again)
            with output_dir_lock(cfg.output_dir):
                from vime_core.cluster import shutdown_ray
                from vime_core.early_ray import start_ray_early

                start_ray_early(cfg)  # Ray and the actors start while MLflow opens and `prepare` checks the data
                try:
                    train_locked(cfg, metrics_out)
                finally:
                    shutdown_ray()  # a no-op after the loop's own; stops a Ray the loop never reached
        except BaseException:
            if not stopped:
                raise
            # whatever the signal interrupted (an actor killed by the same Ctrl-C may fail first), say what is kept
            err.print(saved_line(cfg, stopped[0]), highlight=False, markup=False, soft_wrap=True)
            sys.exit(128 + stopped[0])


def train_locked(cfg, metrics_out: Optional[Path]) -> None:
    """`vime train`'s run once output_dir is locked: the MLflow run and metric sinks, the loop with its progress
    bar and step lines, the summary. A failure ends the MLflow run FAILED with the error in the tag vime.error."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from vime_core.loop import run
    from vime_core.metrics import MemorySink, MultiSink

    mlflow_run, run_state = tracking_sink(cfg)
    sink = MultiSink(MemorySink(), metrics_file_sink(cfg, metrics_out) if metrics_out else None, mlflow_run)
    total = cfg.rollout.num_rollout
    with Progress(
        TextColumn("[bold]GRPO"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("train", total=total)

        def on_step(i: int, m: dict[str, float]) -> None:
            bar.console.print(_step_line(i, total, m), highlight=False, markup=False, soft_wrap=True)
            bar.update(task, completed=i + 1)

        try:
            result = run(cfg, sink, on_step=on_step, run_state=run_state)
        except BaseException as e:
            if mlflow_run:
                mlflow_run.end_with_error(e)  # FAILED (KILLED), the error's line in the tag vime.error
            raise
        finally:
            sink.close()
    if mlflow_run:
        mlflow_run.end("FINISHED")
        console.print(f"MLflow run {mlflow_run.run_id} in {run_state['tracking_uri']}", highlight=False, soft_wrap=True)
    for name, value in sorted(result.baseline_eval.items()):
        if "pass@" in name:
            console.print(
                f"baseline {name} = {value:.3f}  ->  final {result.final_eval.get(name, float('nan')):.3f}",
                highlight=False,
            )
    if result.trainer_info:
        console.print(
            f"peak RSS: trainer {max(i['max_rss_gib'] for i in result.trainer_info):.2f} GiB, "
            f"vLLM engine {max(i['max_rss_gib'] for i in result.engine_info):.2f} GiB",
            highlight=False,
        )
    if result.steps_done == 0:
        console.print(f"nothing to train: {result.resumed_from} already covers rollout.num_rollout", highlight=False)


def resume_state(cfg) -> dict | None:
    """The state of the checkpoint this run will resume from (None for a fresh start). Reads only (a damaged
    checkpoint is set aside by `latest`, as the loop would)."""
    from vime_core.checkpoint import Checkpointer
    from vime_core.resume import check_resume_setting

    check_resume_setting(cfg)  # fail before the sinks move --metrics-out aside or open an MLflow run
    if cfg.checkpoint.start_fresh or not cfg.checkpoint.resume:
        return None
    ckpt = Checkpointer(cfg.save_dir)
    latest = ckpt.latest()
    return ckpt.read_state(latest) if latest else None


def metrics_file_sink(cfg, path: Path):
    """--metrics-out: a resumed run appends to the file; a fresh start keeps an older non-empty file, renamed."""
    from vime_core.metrics import JsonlSink

    if resume_state(cfg) is None and path.is_file() and path.stat().st_size:
        aside = path.with_name(path.name + time.strftime(".old-%Y%m%d-%H%M%S"))
        os.replace(path, aside)
        err.print(
            f"--metrics-out: a fresh start; the earlier {path} is kept as {aside}", highlight=False, soft_wrap=True
        )
    return _OpenOnFirstRow(lambda: JsonlSink(path, append=True))


class _OpenOnFirstRow:
    """A sink opened at its first row: checkpoint.start_fresh may move output_dir/metrics.jsonl aside after the CLI
    made its sink, and the rows must go to the new file, not follow the renamed one."""

    def __init__(self, make):
        self.make, self.sink = make, None

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.sink is None:
            self.sink = self.make()
        self.sink.log_metrics(step, metrics)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def tracking_sink(cfg):
    """tracking.enabled: an MLflow run (the one the resumed checkpoint logged to, else a new one) as a metrics sink,
    and the run state stored in checkpoints; (None, None) when tracking is off. An unreachable store fails here."""
    if not cfg.tracking.enabled:
        return None, None
    from vime_core.config import flatten
    from vime_core.redact import redact
    from vime_core.tracking import MlflowRun, local_artifact_root, resolve_tracking_uri, safe_params

    uri = resolve_tracking_uri(cfg)
    run_id = ((resume_state(cfg) or {}).get("run_state") or {}).get("mlflow_run_id")
    run = MlflowRun(
        uri,
        cfg.tracking.experiment or cfg.name,
        run_name=f"{cfg.name}-train",
        run_id=run_id,
        tags={"vime.config": cfg.name, "vime.entry": "vime train"},
        artifact_root=local_artifact_root(uri, cfg.output_dir),
    )
    run.log_params(safe_params(flatten(cfg)))
    # the URI as shown and stored in every checkpoint: its password masked (a resume reads only the run id)
    return run, {"mlflow_run_id": run.run_id, "tracking_uri": redact(uri)}


@builtin_app.command("build")
def builtin_build(names: list[str] = typer.Argument(None, help="Builtin model names (default: all).")) -> None:
    """Build (or find cached) builtin checkpoints and print their warm-up figures."""
    from vime_core.builtin import RECIPES, builtin_model_path

    _setup_logging(True)
    for name in names or list(RECIPES):
        path = builtin_model_path(name)
        info = json.loads((path / "vime_builtin.json").read_text())
        console.print(
            f"builtin://{name}: {path} | {info['params']:,} params | warm-up steps {info['warmup_steps']} | "
            f"validation sampled accuracy {info['val_sampled_accuracy']:.3f} | built in {info['build_seconds']}s",
            highlight=False,
        )


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@contextmanager
def _conversion_errors():
    """Conversion failures are project errors (one line, exit 2: see _VimeTyper); the rank processes' import-time
    warnings (no apex, no TE) are silenced."""
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    yield


@convert_app.command("hf-to-megatron")
def convert_hf_to_megatron(
    src: str = typer.Argument(
        ..., help="builtin://<name>, hf://<org>/<name>(@<revision>) or an HF checkpoint directory."
    ),
    dst: Path = typer.Argument(..., help="Output directory for the torch_dist checkpoint."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel size to save at (any layout loads it later)."),
    pp: int = typer.Option(1, "--pp", min=1, help="Pipeline-parallel size to save at."),
    ep: int = typer.Option(1, "--ep", min=1, help="Expert-parallel size to save at (MoE only)."),
    dtype: Dtype = typer.Option(Dtype.float32, "--dtype", help="Parameter dtype of the checkpoint."),
) -> None:
    """HF checkpoint -> Megatron torch_dist (skipped when DST already holds a conversion of the same source)."""
    from vime_core.checkpoint import convert_hf_to_torch_dist, is_converted
    from vime_core.sources import resolve_model

    with _conversion_errors():
        model = resolve_model(src)
        skipped = is_converted(dst, model.content_hash, dtype.value)
        out = convert_hf_to_torch_dist(
            model.path, dst, tp=tp, pp=pp, ep=ep, dtype=dtype.value, source_hash=model.content_hash
        )
    note = " (already converted from the same source: skipped)" if skipped else ""
    console.print(f"torch_dist checkpoint of {src} ({dtype.value}): {out}{note}", highlight=False, soft_wrap=True)


@convert_app.command("megatron-to-hf")
def convert_megatron_to_hf(
    src: Path = typer.Argument(
        ..., help="torch_dist checkpoint directory (a conversion, or a training checkpoint's model/)."
    ),
    dst: Path = typer.Argument(..., help="Output directory for the HF checkpoint (safetensors, config, tokenizer)."),
    hf_config: Optional[Path] = typer.Option(
        None, "--hf-config", help="HF config/tokenizer directory (default: the copy stored with SRC)."
    ),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help="Dtype to export (default: the checkpoint's)."),
) -> None:
    """Megatron torch_dist (any saved layout) -> HF safetensors with config and tokenizer files."""
    from vime_core.checkpoint import convert_torch_dist_to_hf

    with _conversion_errors():
        out = convert_torch_dist_to_hf(src, dst, hf_config_dir=hf_config, dtype=dtype.value if dtype else None)
    console.print(f"HF checkpoint: {out}", highlight=False, soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
