"""`vime`: the engine's command line (the Prefect pipeline is `vime-pipeline`, in flows/)."""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="vime-flow: GRPO post-training of Qwen3 (megatron-core + vLLM + Ray).")
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
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("vime_core").setLevel(logging.INFO)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")


def _load(config: Optional[Path], overrides: list[str]):
    from vime_core.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as e:
        err.print(f"[red]config error[/red]: {e}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@config_app.command("show")
def config_show(config: Optional[Path] = typer.Argument(None, help="YAML config (defaults when omitted)."), overrides: list[str] = SetOption) -> None:
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
    metrics_out: Optional[Path] = typer.Option(None, "--metrics-out", help="Write one JSON object per rollout step here."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show engine logs."),
) -> None:
    """Run the GRPO loop (rollout -> train -> sync) directly, without Prefect."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from vime_core.config import ConfigError
    from vime_core.loop import run
    from vime_core.tracking import JsonlSink, MemorySink, MultiSink

    _setup_logging(verbose)
    cfg = _load(config, overrides)
    sink = MultiSink(MemorySink(), JsonlSink(metrics_out) if metrics_out else None)
    total = cfg.rollout.num_rollout
    with Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("train", total=total)

        def on_step(i: int, m: dict[str, float]) -> None:
            bar.console.print(_step_line(i, total, m), highlight=False, markup=False, soft_wrap=True)
            bar.update(task, completed=i + 1)

        try:
            result = run(cfg, sink, on_step=on_step)
        except ConfigError as e:
            err.print(f"[red]config error[/red]: {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        finally:
            sink.close()
    for name, value in sorted(result.baseline_eval.items()):
        if "pass@" in name:
            console.print(f"baseline {name} = {value:.3f}  ->  final {result.final_eval.get(name, float('nan')):.3f}", highlight=False)
    if result.trainer_info:
        console.print(f"peak RSS: trainer {max(i['max_rss_gib'] for i in result.trainer_info):.2f} GiB, "
                      f"vLLM engine {max(i['max_rss_gib'] for i in result.engine_info):.2f} GiB", highlight=False)
    if result.steps_done == 0:
        console.print(f"nothing to train: {result.resumed_from} already covers rollout.num_rollout", highlight=False)


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
    """Known conversion failures -> one red line on stderr and exit code 1 (the first line: rank errors add a traceback)."""
    from rich.markup import escape

    from vime_core.checkpoint import ConversionError, ModelFileError
    from vime_core.qwen3_mapping import CheckpointMismatchError, UnsupportedModelError
    from vime_core.sources import SourceError

    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the rank processes' import-time warnings (no apex, no TE)
    try:
        yield
    except (ConversionError, UnsupportedModelError, CheckpointMismatchError, ModelFileError, SourceError) as e:
        err.print(f"[red]{type(e).__name__}[/red]: {escape(str(e).strip().splitlines()[0])}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@convert_app.command("hf-to-megatron")
def convert_hf_to_megatron(
    src: str = typer.Argument(..., help="builtin://<name>, hf://<org>/<name>(@<revision>) or an HF checkpoint directory."),
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
        out = convert_hf_to_torch_dist(model.path, dst, tp=tp, pp=pp, ep=ep, dtype=dtype.value, source_hash=model.content_hash)
    note = " (already converted from the same source: skipped)" if skipped else ""
    console.print(f"torch_dist checkpoint of {src} ({dtype.value}): {out}{note}", highlight=False, soft_wrap=True)


@convert_app.command("megatron-to-hf")
def convert_megatron_to_hf(
    src: Path = typer.Argument(..., help="torch_dist checkpoint directory (a conversion, or a training checkpoint's model/)."),
    dst: Path = typer.Argument(..., help="Output directory for the HF checkpoint (safetensors, config, tokenizer)."),
    hf_config: Optional[Path] = typer.Option(None, "--hf-config", help="HF config/tokenizer directory (default: the copy stored with SRC)."),
    dtype: Optional[Dtype] = typer.Option(None, "--dtype", help="Dtype to export (default: the checkpoint's)."),
) -> None:
    """Megatron torch_dist (any saved layout) -> HF safetensors with config and tokenizer files."""
    from vime_core.checkpoint import convert_torch_dist_to_hf

    with _conversion_errors():
        out = convert_torch_dist_to_hf(src, dst, hf_config_dir=hf_config, dtype=dtype.value if dtype else None)
    console.print(f"HF checkpoint: {out}", highlight=False, soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
