"""HF <-> Megatron torch_dist conversion, both directions, each in fresh gloo ranks spawned on CPU.

A conversion is skipped when its output already holds one of the same source hash and dtype, and is written to a
temporary sibling and renamed, so the output is complete or absent.
"""

from __future__ import annotations

import os
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch

from vime_core.checkpoint.hf import (
    ModelFileError,
    copy_hf_side_files,
    load_hf_state_dict,
    read_hf_config,
    save_hf_checkpoint,
    weight_files,
)
from vime_core.checkpoint.torch_dist import (
    HF_CONFIG_DIR,
    META_FILE,
    ConversionError,
    converted_meta,
    is_converted,
    load_torch_dist,
    save_torch_dist,
    write_torch_dist_meta,
)
from vime_core.errors import VimeError
from vime_core.fsutil import replacing_dir
from vime_core.ports import free_port, tcp_store


def _spawn(fn_name: str, world: int, args: tuple, progress_total: int | None = None, label: str = "") -> None:
    """Run `<this module>.<fn_name>(rank, world, port, queue, *args)` in `world` fresh processes (gloo on CPU).

    Fresh processes keep megatron's global state and the CPU shims out of the caller (a Prefect flow, a CLI)."""
    import torch.multiprocessing as mp
    from rich.progress import Progress

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_entry, args=(fn_name, r, world, port, queue, args), daemon=False) for r in range(world)
    ]
    for p in procs:
        p.start()
    errors: list[str] = []
    user_error = (
        False  # whether the first failing rank raised a VimeError (a bad checkpoint, a layout that does not fit)
    )
    with Progress(transient=True, disable=progress_total is None) as bar:
        task = bar.add_task(label, total=progress_total or 1)
        finished = 0
        while finished < world:
            try:
                kind, payload = queue.get(timeout=5)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs) and not errors:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    errors.append(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                    break
                continue
            if kind == "progress":
                bar.update(task, completed=payload)
            elif kind == "done":
                finished += 1
            elif kind == "error":
                text, user_error = payload
                errors.append(text)
                break
    for p in procs:
        p.join(timeout=60 if not errors else 5)
        if p.is_alive():
            p.kill()
    if errors:
        # only a user error inside a rank is a ConversionError (exit 2, never retried); a dead rank (OOM kill) or a
        # bug is a RuntimeError that keeps the rank's traceback text, and a pipeline task retries it
        raise (ConversionError if user_error else RuntimeError)(errors[0])


def _rank_entry(fn_name: str, rank: int, world: int, port: int, queue, args: tuple) -> None:
    from vime_core.orphans import die_with_parent

    die_with_parent()  # a killed `vime convert` / conversion task takes its ranks with it
    for category in (UserWarning, FutureWarning, DeprecationWarning):  # library noise about absent optional packages
        warnings.simplefilter("ignore", category)
    try:
        globals()[fn_name](rank, world, port, queue, *args)
        queue.put(("done", rank))
    except Exception as e:  # reported to the parent with the rank and the reason
        text = f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
        queue.put(("error", (text, isinstance(e, VimeError))))


def init_rank(rank: int, world: int, port: int, tp: int, pp: int, ep: int) -> None:
    """Set up one local gloo rank of `world` with megatron's model-parallel groups (converter ranks, tests, benches)."""
    import torch.distributed as dist

    from vime_core.platform import apply_megatron_cpu_shims, apply_offline_env

    apply_offline_env()
    apply_megatron_cpu_shims()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks are local: gloo's sockets on loopback too
    timeout = timedelta(minutes=30)
    dist.init_process_group(
        "gloo", store=tcp_store("127.0.0.1", port, rank, world, timeout), rank=rank, world_size=world, timeout=timeout
    )  # torch's own store would listen on every interface
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


def finish_rank() -> None:
    """Undo `init_rank` after a barrier."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _hf_to_dist_rank(
    rank, world, port, queue, hf_dir: str, out_tmp: str, tp: int, pp: int, ep: int, dtype: str
) -> None:
    from vime_core import megatron_model as mm
    from vime_core.models import arch_from_hf_config, spec_of

    init_rank(rank, world, port, tp, pp, ep)
    arch = arch_from_hf_config(read_hf_config(hf_dir), where=hf_dir)
    hf = load_hf_state_dict(hf_dir)
    if rank == 0:
        queue.put(("progress", 1))
    full = spec_of(arch).mapping().hf_to_mcore(hf, arch)  # validates names and shapes: raises naming the tensor
    del hf
    if rank == 0:
        queue.put(("progress", 2))
    model = mm.build_gpt(arch, mm.transformer_config(arch, dtype, tp=tp, ep=ep, pp=pp))
    mm.load_full_weights(model, full, arch)
    del full
    if rank == 0:
        queue.put(("progress", 3))
    save_torch_dist(model.sharded_state_dict(), out_tmp)
    if rank == 0:
        queue.put(("progress", 4))
    finish_rank()


def convert_hf_to_torch_dist(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: str = "float32",
    source_hash: str | None = None,
    show_progress: bool = True,
) -> Path:
    """HF checkpoint -> Megatron torch_dist at layout (tp, pp, ep) (any layout loads it later: torch_dist reshards).

    Skipped when `out_dir` already holds a conversion of the same source hash and dtype. Written to a temporary
    sibling and renamed."""
    from vime_core.models import Layout, arch_from_hf_config, layout_problems, spec_of
    from vime_core.sources import content_hash

    hf_dir, out = Path(hf_dir), Path(out_dir)
    arch = arch_from_hf_config(read_hf_config(hf_dir), where=hf_dir)
    problems = layout_problems(arch, Layout(tp=tp, pp=pp, ep=ep))  # the config-time check's, with these names
    if problems:
        raise ConversionError(f"layout tp={tp} pp={pp} ep={ep} does not fit {hf_dir}: " + "; ".join(problems))
    source_hash = source_hash or content_hash(hf_dir)
    if is_converted(out, source_hash, dtype):
        return out
    from safetensors import safe_open

    shapes: dict[str, tuple] = {}
    for f in weight_files(hf_dir):
        try:
            with safe_open(str(f), "pt") as fh:
                shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
        except Exception as e:
            raise ModelFileError(f"cannot read weights file {f}: {e}") from e
    mapping = spec_of(arch).mapping()
    mapping.check_hf_names(set(shapes), arch, where=str(hf_dir))  # fail fast, before spawning ranks
    mapping.check_shapes(shapes, arch, where=str(hf_dir))
    _check_replaceable(out, META_FILE)
    with replacing_dir(out) as tmp:
        _spawn(
            "_hf_to_dist_rank",
            tp * pp * ep,
            (str(hf_dir), str(tmp), tp, pp, ep, dtype),
            progress_total=4 if show_progress else None,
            label=f"HF -> torch_dist (tp={tp} pp={pp} ep={ep})",
        )
        copy_hf_side_files(hf_dir, tmp / HF_CONFIG_DIR)
        write_torch_dist_meta(
            tmp, dtype=dtype, source=hf_dir, layout=(tp, pp, ep), source_hash=source_hash, arch=arch.__dict__
        )
    return out


def _check_replaceable(out: Path, marker: str) -> None:
    """`out` is replaced by a conversion: refuse unless it is absent, empty, or an earlier output (holds `marker`)."""
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / marker).is_file()):
        raise ConversionError(
            f"{out} exists and is not an earlier conversion output (no {marker}); remove it or choose another directory"
        )


def _dist_to_hf_rank(rank, world, port, queue, ckpt_dir: str, out_tmp: str, hf_config_dir: str, dtype: str) -> None:
    from vime_core import megatron_model as mm
    from vime_core.models import arch_from_hf_config, spec_of

    init_rank(rank, world, port, 1, 1, 1)
    arch = arch_from_hf_config(read_hf_config(hf_config_dir))
    model = mm.build_gpt(arch, mm.transformer_config(arch, dtype))
    load_torch_dist(model, ckpt_dir)
    queue.put(("progress", 1))
    to_hf = spec_of(arch).mapping().mcore_param_to_hf
    tensors = [(k, v.clone()) for name, t in mm.iter_full_weights(model, arch) for k, v in to_hf(name, t, arch)]
    queue.put(("progress", 2))
    save_hf_checkpoint(tensors, out_tmp, hf_config_dir)
    queue.put(("progress", 3))
    finish_rank()


def convert_torch_dist_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    hf_config_dir: str | Path | None = None,
    dtype: str | None = None,
    show_progress: bool = True,
) -> Path:
    """Megatron torch_dist (any saved layout) -> HF safetensors with config and tokenizer files.

    `hf_config_dir` defaults to the config/tokenizer copy stored with the conversion or training checkpoint."""
    ckpt = Path(ckpt_dir)
    if not (ckpt / "metadata.json").is_file() and not (ckpt / ".metadata").is_file():
        raise ConversionError(f"{ckpt} is not a torch_dist checkpoint (no .metadata / metadata.json)")
    cfg_dir = Path(hf_config_dir) if hf_config_dir else _find_hf_config(ckpt)
    from vime_core.models import arch_from_hf_config

    arch_from_hf_config(read_hf_config(cfg_dir), where=cfg_dir)  # fail fast on a missing or unsupported config
    meta = converted_meta(ckpt) or converted_meta(ckpt.parent) or {}
    dtype = dtype or meta.get("dtype", "float32")
    out = Path(out_dir)
    _check_replaceable(out, "config.json")
    _spawn(
        "_dist_to_hf_rank",
        1,
        (str(ckpt), str(out), str(cfg_dir), dtype),
        progress_total=3 if show_progress else None,
        label="torch_dist -> HF",
    )
    return out


def _find_hf_config(ckpt: Path) -> Path:
    for cand in (ckpt / HF_CONFIG_DIR, ckpt.parent / HF_CONFIG_DIR):
        if (cand / "config.json").is_file():
            return cand
    raise ConversionError(f"{ckpt}: no {HF_CONFIG_DIR}/config.json next to the weights; pass the HF config directory")
