"""LeanRMSNorm against torch RMSNorm, and the few graphs torch.compile makes of it for every norm of a layer. Fused
core attention against megatron's unfused one needs megatron's parallel state: tests/integration/test_attention.py."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_lean_rmsnorm_matches_torch_rmsnorm(dtype, tol):
    from types import SimpleNamespace

    from vime_core.megatron_model import LeanRMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 64, generator=g, dtype=torch.float32) * 3).to(dtype).requires_grad_(True)
    upstream = torch.randn(7, 3, 64, generator=g, dtype=torch.float32).to(dtype)
    lean = LeanRMSNorm(SimpleNamespace(normalization="RMSNorm", params_dtype=dtype), 64, eps=1e-6)
    ref = torch.nn.RMSNorm(64, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        w = torch.rand(64, generator=g, dtype=torch.float32).to(dtype) + 0.5
        lean.weight.copy_(w)
        ref.weight.copy_(w)
    y, y_ref = lean(x), ref(x)
    assert torch.equal(y, y_ref)  # the same values, bit for bit
    gx, gw = torch.autograd.grad((y * upstream).sum(), (x, lean.weight))
    gx_ref, gw_ref = torch.autograd.grad((y_ref * upstream).sum(), (x, ref.weight))
    assert torch.allclose(gx.float(), gx_ref.float(), atol=tol, rtol=tol)
    assert torch.allclose(gw.float(), gw_ref.float(), atol=tol * 10, rtol=tol)


@pytest.fixture
def eager_compiled_norms(monkeypatch):
    """LeanRMSNorm's kernels through `fused` as on CUDA (torch.compile, dynamic), with the eager backend, which needs
    no compiler, counting the graphs dynamo compiles."""
    import functools

    from torch._dynamo.utils import counters

    from vime_core import megatron_model as mm

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(mm, "kernel", lambda fn, x: mm.fused(fn))
    monkeypatch.setattr(mm, "_FUSED", {})
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_lean_rmsnorm_compiles_few_graphs_for_every_norm_of_a_layer(eager_compiled_norms):
    """One compiled kernel serves the layer norms [t, 1, h] and the q/k norms [t, 1, heads, head_dim] (strided views of
    the QKV output), with and without grad, at any token count: given the tensors as they came, dynamo compiled a
    graph per variant and per layout of a view's base, and hit its recompile limit (8) on an H200 run. Values and
    gradients stay torch's."""
    from types import SimpleNamespace

    from vime_core.megatron_model import LeanRMSNorm

    cfg = SimpleNamespace(normalization="RMSNorm", params_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    layer, head = LeanRMSNorm(cfg, 64, eps=1e-6), LeanRMSNorm(cfg, 16, eps=1e-6)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5, generator=g)
        head.weight.uniform_(0.5, 1.5, generator=g)
    ref_layer, ref_head = torch.nn.RMSNorm(64, eps=1e-6), torch.nn.RMSNorm(16, eps=1e-6)
    ref_layer.weight.data.copy_(layer.weight)
    ref_head.weight.data.copy_(head.weight)
    for t in (9, 17, 33, 65):
        # megatron's layouts: QKV out [t, 1, groups x (q heads + k + v) x 16] viewed per group, split; q reshaped (a
        # copy: its heads are not adjacent), k a strided view; the layer norm's input a view of a flat base
        qkv = torch.randn(t, 1, 2 * 4 * 16, generator=g).requires_grad_(True)  # 2 groups of (2 q heads, k, v)
        q, k, _ = torch.split(qkv.view(t, 1, 2, 4 * 16), [32, 16, 16], dim=3)
        hidden = torch.randn(t * 64, generator=g).requires_grad_(True)
        for x, leaf in ((hidden.view(t, 1, 64), hidden), (q.reshape(t, 1, -1, 16), qkv), (k, qkv)):
            norm, ref = (layer, ref_layer) if x.size(-1) == 64 else (head, ref_head)
            y, y_ref = norm(x), ref(x)
            assert torch.allclose(y, y_ref, atol=1e-6, rtol=1e-6)
            up = torch.randn(y.shape, generator=g)
            gx, gw = torch.autograd.grad((y * up).sum(), (leaf, norm.weight))
            gx_ref, gw_ref = torch.autograd.grad((y_ref * up).sum(), (leaf, ref.weight))
            assert torch.allclose(gx, gx_ref, atol=1e-5, rtol=1e-5) and torch.allclose(gw, gw_ref, atol=1e-4, rtol=1e-5)
            with torch.no_grad():
                assert torch.allclose(norm(x.detach()), y_ref, atol=1e-6, rtol=1e-6)
    # forward and backward: one graph for contiguous rows, one for strided rows (the k/q views) each
    assert 2 <= eager_compiled_norms["stats"]["unique_graphs"] <= 4, dict(eager_compiled_norms["stats"])
