"""Grouped expert GEMMs (vime_core.grouped_experts: megatron's GroupedMLP on torch._grouped_mm) against the loop over
experts (SequentialMLP): the gmm adapter, the weight-layout conversion, train.moe_grouped_gemm's check, and on the
builtin tiny MoE in fp32: log-probs, gradients, exported weights and checkpoints at EP = 2, then the real Trainer's
step, weight-sync export and checkpoint read back by a SequentialMLP model."""

from __future__ import annotations


from tests.helpers.grouped_ranks import spawn


def test_grouped_experts_equal_sequential_at_ep2(moe_model_dir, tmp_path):
    for r in spawn("compare", 2, str(moe_model_dir), str(tmp_path / "ckpt")):
        assert r["experts_module"] == "TorchGroupedMLP"
        assert r["logp_scale"] > 1.0
        assert r["logp_diff"] < 1e-5
        assert r["grad_names_differ"] == []
        assert r["expert_grads"] == 8 and r["expert_grad_scale"] > 1e-3  # 2 layers x 2 local experts x fc1/fc2
        assert r["grad_rel_diff"] < 1e-5
        assert r["full_names_differ"] == [] and r["full_diff"] == 0.0
        assert r["ckpt_logp_diff"] < 1e-5  # the grouped model's torch_dist checkpoint loads into SequentialMLP


def test_trainer_step_export_and_checkpoint_with_grouped_experts(moe_model_dir, tmp_path):
    (r,) = spawn("train_and_export", 1, str(moe_model_dir), str(tmp_path / "ckpt"))
    assert r["experts_module"] == "TorchGroupedMLP"  # auto is on for the tiny MoE
    assert r["metrics_finite"]
    assert r["export_names_differ"] == []
    assert r["expert_weights_moved"] > 1e-6  # the step trained the experts that the export carries
    assert r["sequential_is_sequential"] == "SequentialMLP"
    assert r["export_logp_diff"] < 1e-5
    assert r["ckpt_logp_diff"] < 1e-5
