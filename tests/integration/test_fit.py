"""The memory fit check's static estimate (vime_core.fit) against the tensors of a real trainer in spawned gloo
ranks, dense and MoE, at world 1 and 2."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "model,world,sets",
    [("dense", 1, ["grpo.kl_loss_coef=0.05"]), ("moe", 1, []), ("dense", 2, ["train.tensor_parallel_size=2"])],
)
def test_static_estimate_is_within_10_percent_of_the_real_trainer(model, world, sets, dense_model_dir, moe_model_dir):
    """The real Trainer on CPU (torch AdamW, fp32) after one step: parameters, gradients and Adam state as built by
    megatron-core, against the estimate for the same config (two model sizes, TP = 2, a reference model)."""
    from tests.helpers.trainer_ranks import spawn

    model_dir = dense_model_dir if model == "dense" else moe_model_dir
    for r in spawn("static_memory", world, str(model_dir), ["rollout.n_samples_per_prompt=4", *sets]):
        assert r["counted"] == r["params"]  # the per-rank parameter count is exact
        assert r["estimate"] == pytest.approx(r["measured"], rel=0.10)
