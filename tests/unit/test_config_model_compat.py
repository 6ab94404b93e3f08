"""Unit tests of the config-vs-model checks: `vime_core.models.check_model_compat` (tensor / pipeline / expert parallel
against heads, KV groups, layers, MLP size and experts), the HF-config -> arch parsing and the shared layout check
(config loading and validation: test_config.py)."""

from __future__ import annotations

import pytest

from vime_core.config import ConfigError, load_config
from vime_core.models import Qwen3Arch, UnsupportedModelError, arch_from_hf_config, check_model_compat


# the tiny builtin Qwen3's config.json facts: 4 heads, 2 KV heads, 2 layers, vocab 384, MLP 384, dense
TINY_HF = {
    "model_type": "qwen3",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "vocab_size": 384,
    "rope_theta": 1e4,
}


@pytest.fixture
def arch() -> Qwen3Arch:
    return arch_from_hf_config(TINY_HF)


def moe_arch(experts: int, moe_intermediate_size: int = 384) -> Qwen3Arch:
    return arch_from_hf_config(
        {
            **TINY_HF,
            "model_type": "qwen3_moe",
            "num_experts": experts,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": moe_intermediate_size,
        }
    )


# --------------------------------------------------------------------------------------------------------------------
# model compatibility
# --------------------------------------------------------------------------------------------------------------------
def test_model_compat_tp4_fails_on_kv_groups(arch):
    cfg = load_config(None, ["train.num_devices=4", "train.tensor_parallel_size=4"])
    with pytest.raises(ConfigError) as ei:
        check_model_compat(cfg, arch)
    msg = str(ei.value)
    # 4 heads / TP 4 is fine, 2 KV heads / TP 4 is not
    assert "attention heads" not in msg
    assert "train.tensor_parallel_size = 4" in msg
    assert "KV groups" in msg and "num_key_value_heads" in msg
    assert "rollout.engine_tensor_parallel_size" not in msg


def test_model_compat_engine_tp(arch):
    cfg = load_config(None, ["rollout.engine_tensor_parallel_size=3"])
    with pytest.raises(
        ConfigError, match=r"rollout.engine_tensor_parallel_size = 3 does not divide the model's 4 attention heads"
    ):
        check_model_compat(cfg, arch)


def test_model_compat_pipeline_vs_layers(arch):
    # 2 layers cannot be split in 4 stages... but 4 devices / PP 4 is fine for the config itself
    cfg = load_config(None, ["train.num_devices=4", "train.pipeline_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"train.pipeline_parallel_size = 4 does not divide the model's 2 layers"):
        check_model_compat(cfg, arch)


def test_model_compat_expert_parallel_on_dense_model(arch):
    cfg = load_config(None, ["train.num_devices=2", "train.expert_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"train.expert_parallel_size = 2 but the model \(qwen3\) has no experts"):
        check_model_compat(cfg, arch)


def test_model_compat_expert_parallel_not_dividing_experts(arch):
    moe = moe_arch(6)
    cfg = load_config(None, ["train.num_devices=4", "train.expert_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"train.expert_parallel_size = 4 does not divide the model's 6 experts"):
        check_model_compat(cfg, moe)


def test_expert_parallel_training_fits_with_and_without_routing_replay(arch):
    """EP 2 over 6 experts trains (the trainer pads the EP ranks' micro-batches to lockstep), R3 beside it too (the
    padding routes to fixed experts): neither is refused; a dense model with R3 still is."""
    moe = moe_arch(6)
    check_model_compat(load_config(None, ["train.num_devices=4", "train.expert_parallel_size=2"]), moe)
    cfg = load_config(
        None,
        ["train.num_devices=4", "train.expert_parallel_size=2", "rollout.routing_replay=true", "cluster.platform=cuda"],
    )
    check_model_compat(cfg, moe)
    with pytest.raises(ConfigError, match=r"rollout.routing_replay = true needs an MoE model"):
        check_model_compat(load_config(None, ["rollout.routing_replay=true", "cluster.platform=cuda"]), arch)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["train.num_devices=2", "train.tensor_parallel_size=2"],
        ["train.num_devices=4", "train.tensor_parallel_size=2", "train.pipeline_parallel_size=2"],
        ["rollout.engine_tensor_parallel_size=2"],
    ],
)
def test_model_compat_valid_layouts(arch, overrides):
    check_model_compat(load_config(None, overrides), arch)  # no exception


def test_model_arch_from_hf_config():
    a = arch_from_hf_config({k: v for k, v in TINY_HF.items() if k != "num_key_value_heads"})
    assert a.num_kv_heads == 4  # defaults to the number of heads (MHA)
    assert a.num_experts == 0 and not a.is_moe
    b = moe_arch(4)
    assert (b.num_kv_heads, b.num_experts, b.moe_ffn_hidden_size) == (2, 4, 384)
    with pytest.raises(UnsupportedModelError, match=r"is not a Qwen3/Qwen3-MoE checkpoint \(model_type gpt2\)"):
        arch_from_hf_config({**TINY_HF, "model_type": "gpt2"}, where="/m")


def test_model_compat_checks_the_mlp_size_on_both_sides():
    """The config-time check and the conversion share one layout check: the MLP size (which only the conversion
    checked before) fails at config time too, for the trainer's TP and vLLM's."""
    odd_mlp = arch_from_hf_config({**TINY_HF, "intermediate_size": 390})  # 390 = 2 * 3 * 5 * 13: not divisible by 4
    trainer = load_config(
        None, ["train.num_devices=4", "train.tensor_parallel_size=4", "rollout.engine_tensor_parallel_size=1"]
    )
    with pytest.raises(
        ConfigError,
        match=r"train.tensor_parallel_size = 4 does not divide the model's MLP size 390 "
        r"\(intermediate_size\); use a train.tensor_parallel_size that divides 390",
    ):
        check_model_compat(trainer, odd_mlp)
    with pytest.raises(
        ConfigError, match=r"rollout.engine_tensor_parallel_size = 4 does not divide the model's MLP size 390"
    ):
        check_model_compat(load_config(None, ["rollout.engine_tensor_parallel_size=4"]), odd_mlp)
    with pytest.raises(
        ConfigError,
        match=r"train.tensor_parallel_size = 4 does not divide the model's MLP size 6 "
        r"\(moe_intermediate_size\)",
    ):
        check_model_compat(trainer, moe_arch(4, moe_intermediate_size=6))
    check_model_compat(load_config(None, ["train.num_devices=2", "train.tensor_parallel_size=2"]), odd_mlp)  # 390 / 2


def test_the_qwen3_spec_serves_the_arch_the_layout_check_and_the_mapping(arch):
    from vime_core.models import spec_for, spec_of

    spec = spec_for(TINY_HF)
    assert spec is spec_of(arch) and spec.model_types == ("qwen3", "qwen3_moe") and isinstance(arch, spec.arch_type)
    assert "model.layers.1.mlp.down_proj.weight" in spec.mapping().hf_names(arch)
    with pytest.raises(TypeError):
        spec_of(object())


def test_conversion_layouts_use_the_same_check_with_its_own_names(arch):
    """A conversion has no engine and trains nothing: its problems name tp/pp/ep, and MoE under TP is allowed."""
    from vime_core.models import Layout, layout_problems

    assert (
        layout_problems(arch, Layout(tp=3))
        == [
            "tp = 3 does not divide the model's 4 attention heads; use a tp that divides 4",
            "tp = 3 does not divide the model's 2 KV groups (num_key_value_heads); use a tp that divides 2",
        ]
        == layout_problems(arch, Layout(tp=3, trains=True))
    )
    assert layout_problems(arch, Layout(tp=5))[2:] == [
        "tp = 5 does not divide the model's vocabulary size 384 (vocab_size); use a tp that divides 384",
        "tp = 5 does not divide the model's MLP size 384 (intermediate_size); use a tp that divides 384",
    ]
    assert layout_problems(moe_arch(4), Layout(tp=2, ep=2)) == []
    assert "with a MoE model" in layout_problems(moe_arch(4), Layout(tp=2, ep=2, trains=True))[0]
    assert layout_problems(arch, Layout(pp=0)) == ["tp, pp and ep must be at least 1 (got tp=1 pp=0 ep=1)"]


def test_model_compat_moe_under_tensor_parallel(arch):
    """megatron-core raises mid-training for MoE + TP without sequence parallel; we say so before any actor starts."""
    moe = moe_arch(4)
    cfg = load_config(None, ["train.num_devices=2", "train.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"train.tensor_parallel_size = 2 with a MoE model.*; set "):
        check_model_compat(cfg, moe)
    check_model_compat(cfg, arch)  # the dense model is fine at TP 2


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_megatron_takes_either_token_dispatcher_with_the_trainers_moe_settings(dispatcher):
    """megatron's TransformerConfig validates its MoE fields when built (no CUDA needed for that): either dispatcher
    passes with everything else the trainer sets, and reaches the config that builds the MoE layers."""
    from vime_core import megatron_model as mm

    config = mm.transformer_config(moe_arch(8), "float32", grouped_gemm=True, dispatcher=dispatcher)
    assert config.moe_token_dispatcher_type == dispatcher and config.num_moe_experts == 8
