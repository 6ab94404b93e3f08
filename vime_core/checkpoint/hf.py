"""HF checkpoints: safetensors weights in and out, with their config and tokenizer files.

(HF <-> Megatron torch_dist conversion (convert.py) and training checkpoints with exact resume (vime_core/resume.py)
build on this module.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from vime_core.fsutil import replacing_dir
from vime_core.model_files import ModelFileError, check_light, weight_files
from vime_core.model_files import read_hf_config as read_hf_config  # re-exported: callers import it from here

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


def check_model_files(model_dir: str | Path) -> None:
    """`model_files.check_light` (weights headers and sizes, the JSON files, the embedding against vocab_size), then
    every tensor's name and shape against config.json, from the safetensors headers (no weights read). Milliseconds,
    in `prepare`, so a truncated download or a hand-edited config fails before any actor starts."""
    from vime_core.integrity import safetensors_shapes
    from vime_core.models import arch_from_hf_config, spec_of

    hf = check_light(model_dir)
    arch = arch_from_hf_config(hf, where=model_dir)
    mapping, shapes = spec_of(arch).mapping(), safetensors_shapes(weight_files(model_dir))
    where = f"the weights of {model_dir} (safetensors headers)"
    mapping.check_hf_names(set(shapes), arch, where=where)
    mapping.check_shapes(shapes, arch, where=where)


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        try:
            out.update(load_file(str(f)))
        except Exception as e:
            raise ModelFileError(f"cannot read weights file {f}: {e}") from e
    return out


def save_hf_checkpoint(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    source_dir: str | Path,
    max_shard_bytes: int = 4 * 2**30,
) -> Path:
    """Write safetensors (sharded with an index above `max_shard_bytes`) and copy config/tokenizer files from
    `source_dir`. Written to a temporary sibling and renamed, so `out_dir` is complete or absent."""
    out = Path(out_dir)
    with replacing_dir(out) as tmp:
        _write_safetensors(tensors, tmp, max_shard_bytes)
        copy_hf_side_files(Path(source_dir), tmp)
    return out


def _write_safetensors(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], tmp: Path, max_shard_bytes: int
) -> None:
    from safetensors.torch import save_file

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
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )


def copy_hf_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
