"""Grouped expert GEMMs (vime_core.grouped_experts: megatron's GroupedMLP on torch._grouped_mm) against the loop over
experts (SequentialMLP): the gmm adapter, the weight-layout conversion, train.moe_grouped_gemm's check, and on the
builtin tiny MoE in fp32: log-probs, gradients, exported weights and checkpoints at EP = 2, then the real Trainer's
step, weight-sync export and checkpoint read back by a SequentialMLP model."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_config_model_compat import moe_arch
from vime_core.config import ConfigError, load_config
from vime_core.models import check_model_compat, resolve_grouped_gemm


def _loop(a, b, sizes, trans_b):
    rows, start = [], 0
    for e, n in enumerate(sizes.tolist()):
        w = b[e].t() if trans_b else b[e]
        rows.append(a[start : start + n] @ w)
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_equals_a_loop_over_experts_with_an_empty_one(trans_b):
    from vime_core.grouped_experts import gmm

    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 0, 5, 2], dtype=torch.int64)  # grouped_gemm's contract: int64 on the host
    a = torch.randn(10, 8, generator=g, requires_grad=True)
    b = torch.randn(4, *((16, 8) if trans_b else (8, 16)), generator=g, requires_grad=True)
    got, want = gmm(a, b, sizes, trans_b=trans_b), _loop(a, b, sizes, trans_b)
    assert got.shape == (10, 16)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    grad = torch.randn(10, 16, generator=g)
    ga, gb = torch.autograd.grad(got, (a, b), grad)
    wa, wb = torch.autograd.grad(want, (a, b), grad)
    assert torch.allclose(ga, wa, atol=1e-6, rtol=0) and torch.allclose(gb, wb, atol=1e-6, rtol=0)
    assert float(gb[1].abs().max()) == 0.0  # the expert without tokens gets a zero gradient, not garbage


def test_grouped_layout_round_trips_sequential_names():
    from vime_core.grouped_experts import group_experts, is_grouped, ungroup_experts

    H, F, E, p = 8, 4, 3, "decoder.layers.1.mlp.experts."
    local = {"decoder.layers.1.mlp.router.weight": torch.randn(E, H)}
    for e in range(E):
        local[f"{p}local_experts.{e}.linear_fc1.weight"] = torch.randn(2 * F, H)
        local[f"{p}local_experts.{e}.linear_fc2.weight"] = torch.randn(H, F)
    grouped = group_experts(local)
    assert sorted(grouped) == [
        "decoder.layers.1.mlp.experts.weight1",
        "decoder.layers.1.mlp.experts.weight2",
        "decoder.layers.1.mlp.router.weight",
    ]
    assert is_grouped(grouped) and not is_grouped(local)
    # megatron's GroupedMLP reads weight1 as [E, H, 2F] and weight2 as [E, F, H]: expert e's weights transposed
    assert grouped[p + "weight1"].shape == (H, E * 2 * F)
    assert torch.equal(grouped[p + "weight1"].view(E, H, -1)[2], local[f"{p}local_experts.2.linear_fc1.weight"].t())
    assert torch.equal(grouped[p + "weight2"].view(E, -1, H)[1], local[f"{p}local_experts.1.linear_fc2.weight"].t())
    back = dict(kv for name, t in grouped.items() for kv in ungroup_experts(name, t, E))
    assert back.keys() == local.keys()
    assert all(torch.equal(back[k], local[k]) for k in local)


def test_grouped_gemm_setting_resolves_and_refuses_misaligned_experts():
    aligned, odd = moe_arch(4, 384), moe_arch(4, 6)  # 6 fp32 = 24-byte rows: torch's grouped GEMM refuses them
    assert resolve_grouped_gemm("auto", aligned, "float32", 1)
    assert not resolve_grouped_gemm("auto", odd, "float32", 1)
    assert not resolve_grouped_gemm(False, aligned, "float32", 1)
    check_model_compat(load_config(None, ["train.moe_grouped_gemm=true"]), aligned)
    with pytest.raises(ConfigError, match=r"train\.moe_grouped_gemm = true .*moe_intermediate_size 6.*set it to auto"):
        check_model_compat(load_config(None, ["train.moe_grouped_gemm=true"]), odd)
