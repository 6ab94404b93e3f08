"""Optimizer state placement after a load (vime_core.trainer.optim.place_beside_params): megatron-core's hybrid
optimizer leaves its GPU half's moments on the host when both halves are torch AdamW. The `meta` device stands in for
the GPU here (the real path runs in tests/integration/test_optimizer_offload.py on the device machine)."""

from __future__ import annotations

import torch

from vime_core.trainer.optim import place_beside_params


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
