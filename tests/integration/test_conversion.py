"""HF <-> Megatron torch_dist conversion on the builtin tiny models (dense, and MoE with 4 experts top-2).

Conversions spawn gloo processes (~10-20 s each on two cores), so module-scoped fixtures do each once: the dense model
at TP=1, TP=2 (through the `vime convert` CLI) and PP=2, the MoE at EP=2; back to HF once each. Megatron models at
other layouts load those checkpoints in two spawned jobs (tests/helpers/megatron_ranks.py) and their logits are
compared with transformers'. Inputs refused before any process is spawned: tests/unit/test_conversion.py.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers.megatron_ranks import spawn
from vime_core import checkpoint as ck
from vime_core.checkpoint import convert as ck_convert
from vime_core.checkpoint import (
    ConversionError,
    convert_hf_to_torch_dist,
    convert_torch_dist_to_hf,
    load_hf_state_dict,
    read_torch_dist_tensors,
)

VIME = str(Path(sys.executable).parent / "vime")
TOKEN_IDS = [[(7 + 37 * i + 101 * b) % 384 for i in range(16)] for b in range(2)]  # two fixed sequences, vocab 384
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _convert(src, out, **layout) -> Path:
    return convert_hf_to_torch_dist(src, out, show_progress=False, **layout)


def _vime(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([VIME, "convert", *map(str, args)], capture_output=True, text=True, timeout=300)


def _side_by_side(background, foreground) -> tuple:
    """Two single-process jobs at once (one from a thread), one on each of the two cores."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(background)
        fg = foreground()
        return future.result(), fg


# --------------------------------------------------------------------------------------------------------------------
# shared conversions
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("conversion")


@pytest.fixture(scope="module")
def tp1_and_logits(work, dense_model_dir, moe_model_dir) -> tuple[Path, dict[str, torch.Tensor]]:
    """The dense model at TP=1 (one rank process) while this process computes transformers' fp32 logits."""

    def logits() -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        out = {}
        for name, path in (("dense", dense_model_dir), ("moe", moe_model_dir)):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with torch.no_grad():
                out[name] = model(torch.tensor(TOKEN_IDS)).logits
        return out

    return _side_by_side(lambda: _convert(dense_model_dir, work / "dense_tp1"), logits)


@pytest.fixture(scope="module")
def dense_tp1(tp1_and_logits) -> Path:
    return tp1_and_logits[0]


@pytest.fixture(scope="module")
def hf_logits(tp1_and_logits) -> dict[str, torch.Tensor]:
    return tp1_and_logits[1]


@pytest.fixture(scope="module")
def cli_tp2(work) -> tuple[subprocess.CompletedProcess, Path]:
    dst = work / "dense_tp2"
    return _vime("hf-to-megatron", "builtin://tiny-qwen3-arith", dst, "--tp", "2"), dst


@pytest.fixture(scope="module")
def dense_tp2(cli_tp2) -> Path:
    proc, dst = cli_tp2
    assert proc.returncode == 0, proc.stderr
    return dst


@pytest.fixture(scope="module")
def backs(work, dense_tp2, moe_ep2) -> tuple[Path, tuple[subprocess.CompletedProcess, Path]]:
    """Back to HF, side by side: the MoE through the API, the dense model through `vime convert megatron-to-hf`."""
    moe = lambda: convert_torch_dist_to_hf(moe_ep2, work / "moe_back", show_progress=False)  # noqa: E731
    return _side_by_side(moe, lambda: (_vime("megatron-to-hf", dense_tp2, work / "dense_back"), work / "dense_back"))


@pytest.fixture(scope="module")
def cli_back(backs) -> tuple[subprocess.CompletedProcess, Path]:
    return backs[1]


@pytest.fixture(scope="module")
def dense_pp2(work, dense_model_dir) -> Path:
    return _convert(dense_model_dir, work / "dense_pp2", pp=2)


@pytest.fixture(scope="module")
def moe_ep2(work, moe_model_dir) -> Path:
    return _convert(moe_model_dir, work / "moe_ep2", ep=2)


@pytest.fixture(scope="module")
def moe_back(backs) -> Path:
    return backs[0]


@pytest.fixture(scope="module")
def ranks(dense_model_dir, moe_model_dir, dense_tp1, dense_tp2, dense_pp2, moe_ep2) -> list[dict]:
    """One spawn of two gloo processes (a spawn costs ~10 s of imports) that re-lay the model parallel groups per job.
    TP=1 jobs run as two data-parallel replicas: each rank is a whole TP=1 model."""
    dense, moe = str(dense_model_dir), str(moe_model_dir)
    jobs = [
        dict(name="tp2_from_tp1", hf_dir=dense, ckpt=str(dense_tp1), tp=2),
        dict(name="pp2_from_tp2", hf_dir=dense, ckpt=str(dense_tp2), pp=2),
        dict(name="tp1_from_tp2", hf_dir=dense, ckpt=str(dense_tp2)),
        dict(name="tp1_from_pp2", hf_dir=dense, ckpt=str(dense_pp2)),
        dict(name="moe_ep2", hf_dir=moe, ckpt=str(moe_ep2), ep=2),
        dict(name="moe_from_dense", hf_dir=moe, ckpt=str(dense_tp1)),
    ]
    return spawn("load_and_forward", 2, jobs, TOKEN_IDS)


def assert_same_hf(got_dir: Path, src_dir: Path) -> None:
    got, src = load_hf_state_dict(got_dir), load_hf_state_dict(src_dir)
    assert sorted(got) == sorted(src)
    for k, t in src.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    for name in SIDE_FILES:
        assert (got_dir / name).read_bytes() == (src_dir / name).read_bytes(), name


def max_diff(logits, ref: torch.Tensor) -> float:
    got = torch.as_tensor(logits)
    assert got.shape == ref.shape
    return (got - ref).abs().max().item()


# --------------------------------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------------------------------
def test_dense_torch_dist_is_the_same_at_every_saved_layout(dense_tp1, dense_tp2, dense_pp2):
    ref = read_torch_dist_tensors(dense_tp1)
    assert "decoder.layers.self_attention.linear_qkv.weight" in ref and "output_layer.weight" in ref
    for ckpt, layout in (
        (dense_tp1, dict(tp=1, pp=1, ep=1)),
        (dense_tp2, dict(tp=2, pp=1, ep=1)),
        (dense_pp2, dict(tp=1, pp=2, ep=1)),
    ):
        got = read_torch_dist_tensors(ckpt)
        assert sorted(got) == sorted(ref), ckpt.name
        assert all(torch.equal(got[k], ref[k]) for k in ref), ckpt.name
        meta = ck.converted_meta(ckpt)
        assert meta["saved_layout"] == layout and meta["dtype"] == "float32"
        assert (ckpt / ck.HF_CONFIG_DIR / "config.json").is_file() and (
            ckpt / ck.HF_CONFIG_DIR / "tokenizer.json"
        ).is_file()


def test_dense_back_to_hf_is_exact(cli_back, dense_model_dir):
    proc, out = cli_back
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    assert_same_hf(out, dense_model_dir)


def test_moe_ep2_back_to_hf_is_exact(moe_back, moe_model_dir, moe_ep2):
    assert ck.converted_meta(moe_ep2)["saved_layout"] == {"tp": 1, "pp": 1, "ep": 2}
    experts = read_torch_dist_tensors(moe_ep2)["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert experts.shape == (2, 4, 2 * 384, 128)  # layers, all 4 experts, [gate; up], hidden
    assert_same_hf(moe_back, moe_model_dir)


# --------------------------------------------------------------------------------------------------------------------
# resharded loads: megatron logits == transformers logits
# --------------------------------------------------------------------------------------------------------------------
def test_tp1_checkpoint_loads_at_tp2(ranks, hf_logits):
    for rank in ranks:
        assert max_diff(rank["tp2_from_tp1"], hf_logits["dense"]) <= 1e-4


def test_tp2_checkpoint_loads_at_tp1(ranks, hf_logits):
    for rank in ranks:
        assert max_diff(rank["tp1_from_tp2"], hf_logits["dense"]) <= 1e-4


def test_pp_checkpoints_reshard(ranks, hf_logits):
    for rank in ranks:
        assert max_diff(rank["tp1_from_pp2"], hf_logits["dense"]) <= 1e-4
    last_stage = [r["pp2_from_tp2"] for r in ranks if "pp2_from_tp2" in r]
    assert len(last_stage) == 1 and not isinstance(last_stage[0], str), last_stage
    assert max_diff(last_stage[0], hf_logits["dense"]) <= 1e-4


def test_moe_checkpoint_loads_at_ep2(ranks, hf_logits):
    for rank in ranks:
        assert max_diff(rank["moe_ep2"], hf_logits["moe"]) <= 1e-4


def test_checkpoint_of_another_shape_is_refused_naming_tensors(ranks):
    for rank in ranks:
        msg = rank["moe_from_dense"]
        assert isinstance(msg, str) and msg.startswith("ConversionError"), msg
        assert "decoder.layers.mlp.router.weight" in msg and "decoder.layers.mlp.linear_fc1.weight" in msg


# --------------------------------------------------------------------------------------------------------------------
# skip, and destinations that are not ours (before any process is spawned)
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a process was spawned")

    monkeypatch.setattr(ck_convert, "_spawn", refuse)


def test_same_source_twice_is_skipped(dense_tp1, dense_model_dir, no_spawn):
    before = (dense_tp1 / ck.META_FILE).stat().st_mtime_ns
    assert _convert(dense_model_dir, dense_tp1, tp=2) == dense_tp1  # any layout: torch_dist reshards on load
    assert (dense_tp1 / ck.META_FILE).stat().st_mtime_ns == before


def test_an_unrelated_destination_is_not_replaced(tmp_path, dense_model_dir, dense_tp1, no_spawn):
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(ConversionError, match="is not an earlier conversion output"):
        _convert(dense_model_dir, dst)
    with pytest.raises(ConversionError, match="is not an earlier conversion output"):
        convert_torch_dist_to_hf(dense_tp1, dst)
    assert (dst / "notes.txt").read_text() == "keep me"


# --------------------------------------------------------------------------------------------------------------------
# the CLI
# --------------------------------------------------------------------------------------------------------------------
def test_cli_hf_to_megatron(cli_tp2):
    proc, dst = cli_tp2
    assert proc.returncode == 0, proc.stderr
    assert str(dst) in proc.stdout
    assert (dst / ".metadata").is_file() and (dst / "__1_0.distcp").is_file()  # two ranks wrote shards
    assert ck.converted_meta(dst)["saved_layout"] == {"tp": 2, "pp": 1, "ep": 1}


def test_cli_errors_are_one_line(tmp_path):
    cases = {  # run side by side: each CLI start costs ~4 s of imports
        "/nonexistent": ("hf-to-megatron", "/nonexistent", "X"),
        "tp = 3 does not divide": ("hf-to-megatron", "builtin://tiny-qwen3-arith", "X", "--tp", "3"),
    }
    procs = {
        named: subprocess.Popen(
            [VIME, "convert", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
        )
        for named, args in cases.items()
    }
    for named, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and named in lines[0], stderr
    assert not (tmp_path / "X").exists()
