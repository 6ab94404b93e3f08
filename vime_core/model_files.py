"""An HF model directory's files, checked without torch: its weights files (which, and their safetensors headers),
config.json and the tokenizer's JSON files, and the embedding's rows against `vocab_size`. `vime train` runs
`check_light` on a local or builtin model before it takes the output_dir lock or imports torch (torch and
transformers take ~5 s of import on the 2-core box), so these errors print within about a second of the start.

(Re-exported by vime_core.checkpoint.hf, where the weights are read and written.)
"""

from __future__ import annotations

import json
from pathlib import Path

from vime_core.errors import VimeError
from vime_core.integrity import check_weights, safetensors_shapes


class ModelFileError(VimeError, FileNotFoundError):
    """A model directory lacks a file it needs, or one is corrupt; the message says which and where."""


# the JSON files a model directory may carry besides config.json; a corrupt one failed in transformers' loader with a
# bare `JSONDecodeError ... line 312` naming no file (tokenizer.json of Qwen3: 11 MB, ~0.1 s to parse)
JSON_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "added_tokens.json",
    "generation_config.json",
)
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")


def weight_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelFileError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise ModelFileError(f"model directory {d} has no config.json")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ModelFileError(
                f"model directory {d}: shard(s) listed in model.safetensors.index.json are missing: {missing}"
            )
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelFileError(
            f"model directory {d} has no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    return files


def read_json(path: Path):
    """A model file's JSON; ModelFileError naming the file when it does not parse."""
    try:
        return json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(
            f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:100]}); download or copy the model again"
        ) from None


def read_hf_config(model_dir: str | Path) -> dict:
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        raise ModelFileError(f"model directory {model_dir} has no config.json")
    return read_json(p)


def check_light(model_dir: str | Path) -> dict:
    """The checks of a model directory that need no torch (milliseconds): every weights file present and as long as
    its header says, config.json and the tokenizer's JSON files parse, the embedding (and lm_head) has `vocab_size`
    rows. Returns config.json."""
    d = Path(model_dir)
    files = weight_files(d)
    check_weights(files)
    hf = read_hf_config(d)
    for name in JSON_SIDE_FILES:
        if (d / name).is_file():
            read_json(d / name)
    shapes = safetensors_shapes(files)
    vocab = hf.get("vocab_size")
    for name in EMBEDDINGS:
        rows = shapes.get(name, (vocab,))[0]
        if isinstance(vocab, int) and rows != vocab:
            raise ModelFileError(
                f"{d / 'config.json'} says vocab_size = {vocab}, but the weights' {name} has {rows} rows (shape "
                f"{list(shapes[name])}); restore the config.json these weights were saved with, or download the "
                "model again"
            )
    return hf
