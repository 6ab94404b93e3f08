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


class ModelFileError(FileNotFoundError):
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
    return json.loads(p.read_text())


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
    for name in HF_SIDE_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
