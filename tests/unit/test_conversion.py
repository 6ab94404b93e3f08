"""HF -> Megatron conversion's refusals: a checkpoint or layout it cannot convert fails before any process is
spawned (`no_spawn` refuses one), naming the tensor or field. The conversions themselves, in spawned gloo ranks, are
tests/integration/test_conversion.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from vime_core.checkpoint import convert as ck_convert
from vime_core.checkpoint import (
    ConversionError,
    ModelFileError,
    convert_hf_to_torch_dist,
    convert_torch_dist_to_hf,
    load_hf_state_dict,
)
from vime_core.models import UnsupportedModelError
from vime_core.models.qwen3_mapping import CheckpointMismatchError


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a process was spawned")

    monkeypatch.setattr(ck_convert, "_spawn", refuse)


def _convert(src, out, **layout) -> Path:
    return convert_hf_to_torch_dist(src, out, show_progress=False, **layout)


def _bad_copy(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_hf_state_dict(dst)
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit, named",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
            "missing 1 tensor(s): model.layers.1.self_attn.k_norm.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
            "unexpected 1 tensor(s): model.layers.0.mlp.extra.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(128, 64)}),
            "model.layers.0.self_attn.o_proj.weight has shape (128, 64)",
        ),
    ],
)
def test_tensors_that_do_not_match_the_config_are_named(tmp_path, dense_model_dir, no_spawn, edit, named):
    src = _bad_copy(dense_model_dir, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointMismatchError) as e:
        _convert(src, tmp_path / "out")
    assert named in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "edit, named",
    [
        (
            lambda c: c.update(
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
            ),
            "rope_scaling.rope_type = 'yarn'",
        ),
        (lambda c: c.update(model_type="llama"), "is not a Qwen3/Qwen3-MoE checkpoint (model_type llama)"),
        (lambda c: c.update(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
        (lambda c: c.pop("hidden_size"), "lacks hidden_size"),
    ],
)
def test_unsupported_configs_are_named(tmp_path, dense_model_dir, no_spawn, edit, named):
    src = _bad_copy(dense_model_dir, tmp_path / "bad", edit_config=edit)
    with pytest.raises(UnsupportedModelError) as e:
        _convert(src, tmp_path / "out")
    assert named in str(e.value)


def test_directory_without_safetensors(tmp_path, dense_model_dir, no_spawn):
    src = tmp_path / "nosafe"
    src.mkdir()
    shutil.copy(dense_model_dir / "config.json", src)
    with pytest.raises(ModelFileError, match=r"no \*\.safetensors"):
        _convert(src, tmp_path / "out")


@pytest.mark.parametrize(
    "model, layout, named",
    [
        ("dense", dict(tp=3), "tp = 3 does not divide the model's 4 attention heads; use a tp that divides 4"),
        ("dense", dict(ep=2), "ep = 2 but the model (qwen3) has no experts"),
        ("moe", dict(ep=3), "ep = 3 does not divide the model's 4 experts"),
        ("dense", dict(tp=4), "tp = 4 does not divide the model's 2 KV groups"),  # the config-time check's too
        ("dense", dict(pp=0), "must be at least 1"),
    ],
)
def test_impossible_layouts_fail_before_spawning(
    tmp_path, dense_model_dir, moe_model_dir, no_spawn, model, layout, named
):
    with pytest.raises(ConversionError) as e:
        _convert(dense_model_dir if model == "dense" else moe_model_dir, tmp_path / "out", **layout)
    assert named in str(e.value)
    assert not (tmp_path / "out").exists()


def test_megatron_to_hf_needs_a_torch_dist_checkpoint(tmp_path, dense_model_dir, no_spawn):
    with pytest.raises(ConversionError, match="is not a torch_dist checkpoint"):
        convert_torch_dist_to_hf(dense_model_dir, tmp_path / "out")
