"""Checkpoints: HF safetensors in and out.

(HF <-> Megatron torch_dist conversion and training checkpoints with exact resume build on this module.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from vime_core.errors import VimeError
from vime_core.integrity import check_weights

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class ModelFileError(VimeError, FileNotFoundError):
    """A model directory lacks a file it needs; the message says which and where."""


def weight_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelFileError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise ModelFileError(f"model directory {d} has no config.json")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ModelFileError(f"model directory {d}: shard(s) listed in model.safetensors.index.json are missing: {missing}")
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"model directory {d} has no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def check_model_files(model_dir: str | Path) -> None:
    """Every weights file of `model_dir` is present and as long as its safetensors header says (headers only:
    milliseconds, in `prepare`), so a truncated download fails before any actor starts."""
    check_weights(weight_files(model_dir))


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            out.update(load_file(str(f)))
        except Exception as e:
            raise ModelFileError(f"cannot read weights file {f}: {e}") from e
    return out


def read_hf_config(model_dir: str | Path) -> dict:
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        raise ModelFileError(f"model directory {model_dir} has no config.json")
    try:
        return json.loads(p.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(f"{p} is not valid JSON ({type(e).__name__}: {str(e)[:100]}); download or copy the model again") from None


def save_hf_checkpoint(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], out_dir: str | Path,
                       source_dir: str | Path, max_shard_bytes: int = 4 * 2**30) -> Path:
    """Write safetensors (sharded with an index above `max_shard_bytes`) and copy config/tokenizer files from
    `source_dir`. Written to a temporary sibling and renamed, so `out_dir` is complete or absent."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().to("cpu").contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for _, t in items)
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _copy_hf_side_files(Path(source_dir), tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


# ====================================================================================================================
# HF <-> Megatron torch_dist
# ====================================================================================================================
META_FILE = "vime_meta.json"
HF_CONFIG_DIR = "hf_config"  # config + tokenizer kept next to torch_dist weights, for export without the source


class ConversionError(VimeError, RuntimeError):
    """A conversion failed; the message names the tensor, field or rank that failed."""


def _layout_problems(arch, tp: int, pp: int, ep: int) -> list[str]:
    if min(tp, pp, ep) < 1:
        return [f"tp, pp and ep must be at least 1 (got tp={tp} pp={pp} ep={ep})"]
    problems = []
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        problems.append(f"tp = {tp} must divide the {arch.num_heads} attention heads and {arch.num_kv_heads} KV groups")
    if arch.vocab_size % tp:
        problems.append(f"tp = {tp} must divide the vocabulary size {arch.vocab_size}")
    ffn = arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    if ffn % tp:
        problems.append(f"tp = {tp} must divide the MLP size {ffn}")
    if arch.num_layers % pp:
        problems.append(f"pp = {pp} must divide the {arch.num_layers} layers")
    if ep > 1 and (not arch.is_moe or arch.num_experts % ep):
        problems.append(f"ep = {ep} needs an MoE model whose expert count it divides (model has {arch.num_experts})")
    return problems


def _spawn(fn_name: str, world: int, args: tuple, progress_total: int | None = None, label: str = "") -> None:
    """Run `checkpoint.<fn_name>(rank, world, port, queue, *args)` in `world` fresh processes (gloo on CPU).

    Fresh processes keep megatron's global state and the CPU shims out of the caller (a Prefect flow, a CLI)."""
    import socket

    import torch.multiprocessing as mp
    from rich.progress import Progress

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(fn_name, r, world, port, queue, args), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    errors: list[str] = []
    user_error = False  # whether the first failing rank raised a VimeError (a bad checkpoint, a layout that does not fit)
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
    import traceback
    import warnings

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


def _init_rank(rank: int, world: int, port: int, tp: int, pp: int, ep: int) -> None:
    import torch.distributed as dist

    from vime_core.platform import apply_megatron_cpu_shims, apply_offline_env

    apply_offline_env()
    apply_megatron_cpu_shims()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    from datetime import timedelta

    from vime_core.cluster import tcp_store

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks are local: gloo's sockets on loopback too
    timeout = timedelta(minutes=30)
    dist.init_process_group("gloo", store=tcp_store("127.0.0.1", port, rank, world, timeout), rank=rank, world_size=world,
                            timeout=timeout)  # torch's own store would listen on every interface
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


def _finish_rank() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _hf_to_dist_rank(rank, world, port, queue, hf_dir: str, out_tmp: str, tp: int, pp: int, ep: int, dtype: str) -> None:
    from megatron.core import dist_checkpointing

    from vime_core import megatron_model as mm
    from vime_core.qwen3_mapping import arch_from_hf_config, hf_to_mcore

    _init_rank(rank, world, port, tp, pp, ep)
    arch = arch_from_hf_config(read_hf_config(hf_dir), where=hf_dir)
    hf = load_hf_state_dict(hf_dir)
    if rank == 0:
        queue.put(("progress", 1))
    full = hf_to_mcore(hf, arch)  # validates names and shapes: raises naming the tensor
    del hf
    if rank == 0:
        queue.put(("progress", 2))
    model = mm.build_gpt(arch, mm.transformer_config(arch, dtype, tp=tp, ep=ep, pp=pp))
    mm.load_full_weights(model, full, arch)
    del full
    if rank == 0:
        queue.put(("progress", 3))
    dist_checkpointing.save(model.sharded_state_dict(), out_tmp)
    if rank == 0:
        queue.put(("progress", 4))
    _finish_rank()


def convert_hf_to_torch_dist(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                             dtype: str = "float32", source_hash: str | None = None, show_progress: bool = True) -> Path:
    """HF checkpoint -> Megatron torch_dist at layout (tp, pp, ep) (any layout loads it later: torch_dist reshards).

    Skipped when `out_dir` already holds a conversion of the same source hash and dtype. Written to a temporary
    sibling and renamed."""
    from vime_core.qwen3_mapping import arch_from_hf_config, check_hf_names, check_shapes
    from vime_core.sources import content_hash

    hf_dir, out = Path(hf_dir), Path(out_dir)
    arch = arch_from_hf_config(read_hf_config(hf_dir), where=hf_dir)
    problems = _layout_problems(arch, tp, pp, ep)
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
    check_hf_names(set(shapes), arch, where=str(hf_dir))  # fail fast, before spawning ranks
    check_shapes(shapes, arch, where=str(hf_dir))
    _check_replaceable(out, META_FILE)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _spawn("_hf_to_dist_rank", tp * pp * ep, (str(hf_dir), str(tmp), tp, pp, ep, dtype),
               progress_total=4 if show_progress else None, label=f"HF -> torch_dist (tp={tp} pp={pp} ep={ep})")
        _copy_hf_side_files(hf_dir, tmp / HF_CONFIG_DIR)
        (tmp / META_FILE).write_text(json.dumps({
            "format": "torch_dist", "source": str(hf_dir), "source_hash": source_hash, "dtype": dtype,
            "saved_layout": {"tp": tp, "pp": pp, "ep": ep}, "arch": arch.__dict__,
        }, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_converted(out: str | Path, source_hash: str, dtype: str) -> bool:
    """`out` already holds a conversion of the checkpoint with this content hash, at this dtype."""
    meta = converted_meta(out) or {}
    return meta.get("source_hash") == source_hash and meta.get("dtype") == dtype


def _check_replaceable(out: Path, marker: str) -> None:
    """`out` is replaced by a conversion: refuse unless it is absent, empty, or an earlier output (holds `marker`)."""
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / marker).is_file()):
        raise ConversionError(f"{out} exists and is not an earlier conversion output (no {marker}); remove it or choose another directory")


def converted_meta(ckpt_dir: str | Path) -> dict | None:
    p = Path(ckpt_dir) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def _copy_hf_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _dist_to_hf_rank(rank, world, port, queue, ckpt_dir: str, out_tmp: str, hf_config_dir: str, dtype: str) -> None:
    from megatron.core import dist_checkpointing

    from vime_core import megatron_model as mm
    from vime_core.qwen3_mapping import arch_from_hf_config, mcore_param_to_hf

    _init_rank(rank, world, port, 1, 1, 1)
    arch = arch_from_hf_config(read_hf_config(hf_config_dir))
    model = mm.build_gpt(arch, mm.transformer_config(arch, dtype))
    check_torch_dist_matches(ckpt_dir, model)
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state, strict=False)
    queue.put(("progress", 1))
    tensors = [(k, v.clone()) for name, t in mm.iter_full_weights(model, arch) for k, v in mcore_param_to_hf(name, t, arch)]
    queue.put(("progress", 2))
    save_hf_checkpoint(tensors, out_tmp, hf_config_dir)
    queue.put(("progress", 3))
    _finish_rank()


def convert_torch_dist_to_hf(ckpt_dir: str | Path, out_dir: str | Path, hf_config_dir: str | Path | None = None,
                             dtype: str | None = None, show_progress: bool = True) -> Path:
    """Megatron torch_dist (any saved layout) -> HF safetensors with config and tokenizer files.

    `hf_config_dir` defaults to the config/tokenizer copy stored with the conversion or training checkpoint."""
    ckpt = Path(ckpt_dir)
    if not (ckpt / "metadata.json").is_file() and not (ckpt / ".metadata").is_file():
        raise ConversionError(f"{ckpt} is not a torch_dist checkpoint (no .metadata / metadata.json)")
    cfg_dir = Path(hf_config_dir) if hf_config_dir else _find_hf_config(ckpt)
    from vime_core.qwen3_mapping import arch_from_hf_config

    arch_from_hf_config(read_hf_config(cfg_dir), where=cfg_dir)  # fail fast on a missing or unsupported config
    meta = converted_meta(ckpt) or converted_meta(ckpt.parent) or {}
    dtype = dtype or meta.get("dtype", "float32")
    out = Path(out_dir)
    _check_replaceable(out, "config.json")
    _spawn("_dist_to_hf_rank", 1, (str(ckpt), str(out), str(cfg_dir), dtype),
           progress_total=3 if show_progress else None, label="torch_dist -> HF")
    return out


def _find_hf_config(ckpt: Path) -> Path:
    for cand in (ckpt / HF_CONFIG_DIR, ckpt.parent / HF_CONFIG_DIR):
        if (cand / "config.json").is_file():
            return cand
    raise ConversionError(f"{ckpt}: no {HF_CONFIG_DIR}/config.json next to the weights; pass the HF config directory")


def check_torch_dist_matches(ckpt_dir: str | Path, model) -> None:
    """Compare the checkpoint's tensors (names, global shapes) with what `model` expects; raise naming them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    saved = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    expected: dict[str, tuple] = {}
    sharded, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())

    def walk(x):
        if isinstance(x, ShardedTensor):
            expected[x.key] = tuple(x.global_shape)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "build"):  # ShardedTensorFactory: its key is what the checkpoint holds
            expected.setdefault(x.key, None)

    walk(sharded)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different tensors: use the union
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, expected)
        for view in views:
            for k, shape in view.items():
                if expected.get(k) is None:
                    expected[k] = shape
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    wrong = [f"{k}: checkpoint {tuple(saved[k].global_shape)} vs model {expected[k]}" for k in expected
             if k in saved and expected[k] is not None and tuple(saved[k].global_shape) != expected[k]]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing tensors: {missing[:6]}")
        if unexpected:
            parts.append(f"unexpected tensors: {unexpected[:6]}")
        if wrong:
            parts.append(f"shape mismatch: {wrong[:4]}")
        raise ConversionError(f"torch_dist checkpoint {ckpt_dir} does not match the model: " + "; ".join(parts))


# ====================================================================================================================
# training checkpoints: see vime_core/resume.py
# ====================================================================================================================
from vime_core.resume import (  # noqa: E402,F401  (re-exported: callers import them from here)
    LATEST,
    STATE_FILE,
    Checkpointer,
    ResumeError,
    check_resumable,
    fingerprint_differences,
    iter_name,
)


def read_torch_dist_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, unsharded, without a process group (for inspection and tests)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "all.pt"
        dcp_to_torch_save(str(ckpt_dir), str(out))
        blob = torch.load(out, weights_only=False)
    return {k: v for k, v in blob.items() if isinstance(v, torch.Tensor)}
