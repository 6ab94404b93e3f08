"""Optimizer state placement after a load (vime_core.trainer.optim.place_beside_params): megatron-core's hybrid
optimizer leaves its GPU half's moments on the host when both halves are torch AdamW. The `meta` device stands in for
the GPU here (the real path runs in tests/integration/test_optimizer_offload.py on the device machine)."""

from __future__ import annotations

import torch

from vime_core.trainer.optim import fuse_adam, place_beside_params


def loaded_on_host(device: str, **group):
    """A torch AdamW whose parameter lives on `device` and whose state a loader left on the host."""
    p = torch.nn.Parameter(torch.empty(4, device=device))
    opt = torch.optim.AdamW([{"params": [p], **group}])
    opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": torch.ones(4), "exp_avg_sq": torch.ones(4)}
    return p, opt


def test_moments_move_to_their_parameter_and_a_fused_step_follows():
    p, opt = loaded_on_host("meta", fused=True)
    shared = opt.state[p]  # the hybrid optimizer holds this same dict: it must see the move too
    place_beside_params([opt])
    assert {k: v.device.type for k, v in shared.items()} == {"step": "meta", "exp_avg": "meta", "exp_avg_sq": "meta"}


def test_an_unfused_step_stays_on_the_host_where_torch_keeps_it():
    p, opt = loaded_on_host("meta")
    place_beside_params([opt])
    assert opt.state[p]["step"].device.type == "cpu"
    assert opt.state[p]["exp_avg"].device.type == "meta"


def test_host_state_of_a_host_parameter_is_left_as_it_is():
    p, opt = loaded_on_host("cpu")
    before = dict(opt.state[p])
    place_beside_params([opt])
    assert all(opt.state[p][k] is v for k, v in before.items())


def adamw_pair():
    """Two torch AdamW (foreach, as megatron-core builds it without TE/Apex) over equal parameters, and an SGD."""
    torch.manual_seed(0)
    f32 = dict(dtype=torch.float32)  # megatron's masters; explicit, whatever default dtype another test left
    ps = [torch.nn.Parameter(torch.randn(64, 32, **f32)), torch.nn.Parameter(torch.randn(32, **f32))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=1e-2, weight_decay=0.1, foreach=True)
    return ps, qs, torch.optim.AdamW(ps, **kw), torch.optim.AdamW(qs, **kw)


def test_fuse_adam_switches_to_the_fused_kernel_with_the_same_updates():
    ps, qs, foreach, fused = adamw_pair()
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    fuse_adam([fused, sgd], device_type="cpu")  # the CPU has a fused AdamW too: the switch itself is what is tested
    assert fused.param_groups[0]["fused"] is True and fused.param_groups[0]["foreach"] is False
    assert "fused" not in sgd.param_groups[0] or not sgd.param_groups[0]["fused"]
    for _ in range(3):
        grads = [torch.randn(p.shape, dtype=torch.float32) for p in ps]
        for opt, params in ((foreach, ps), (fused, qs)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
    assert fused.state[qs[0]]["step"].item() == 3.0


def test_fuse_adam_leaves_groups_on_another_device_alone():
    _, _, _, opt = adamw_pair()
    fuse_adam([opt])  # CPU parameters, CUDA asked for
    assert not opt.param_groups[0]["fused"] and opt.param_groups[0]["foreach"] is True


def test_fuse_adam_leaves_the_state_of_other_optimizers_where_it_is():
    """A hybrid optimizer's own view keeps the host half's state on the host beside device parameters: untouched."""
    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    other = torch.optim.SGD([p], lr=0.1)
    other.state[p] = {"momentum_buffer": torch.ones(4)}
    fuse_adam([other], device_type="meta")
    assert other.state[p]["momentum_buffer"].device.type == "cpu"
