"""train.optimizer_cpu_offload (megatron-core's HybridDeviceOptimizer through its distributed optimizer) against the
resident megatron optimizer (both bf16 weights over fp32 masters): the same weights, Adam moments and grad norms after
several steps; and its checkpoint: a resume continues bit-exactly. megatron-core's optimizer is CUDA-only, so these run
where a GPU is (the device machine: `pytest tests/integration/test_optimizer_offload.py`) and are skipped on the CPU
box."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's optimizer needs a GPU")

COMMON = [
    # bf16, as the runs that need it: megatron-core 0.16.1's precision-aware path hands fp32 parameters to
    # HybridDeviceOptimizer as non-leaf views ("can't optimize a non-leaf Tensor"), so fp32 cannot offload at all
    "model.dtype=bfloat16",
    "train.optimizer=megatron",
    "train.lr=1e-3",  # large enough that three steps move every weight well past float noise
    "rollout.n_samples_per_prompt=4",
    "checkpoint.save_optimizer=false",
    "cluster.colocate=true",
    "train.offload_optimizer=true",
]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_host_offloaded_optimizer_matches_the_resident_one(fraction, dense_model_dir):
    from tests.helpers.trainer_ranks import spawn

    resident = spawn("optimizer_run", 1, str(dense_model_dir), COMMON, 3)[0]
    offload = spawn(
        "optimizer_run",
        1,
        str(dense_model_dir),
        [*COMMON, "train.optimizer_cpu_offload=true", f"train.optimizer_offload_fraction={fraction}"],
        3,
    )[0]
    assert offload["optimizer"] == "HybridDeviceOptimizer" and resident["optimizer"] != offload["optimizer"]
    assert resident["moved"] > 1e-4  # the steps changed the weights: equality below is not the initial state's
    # in the order a divergence would show: the same first gradient (same model), the same moments, the same weights
    assert offload["grad_norms"] == pytest.approx(resident["grad_norms"], rel=1e-4)
    assert offload["exp_avg"] == pytest.approx(resident["exp_avg"], rel=1e-4)
    assert offload["exp_avg_sq"] == pytest.approx(resident["exp_avg_sq"], rel=1e-4)
    w0, w1 = torch.tensor(resident["weights"]), torch.tensor(offload["weights"])
    flips = float((w0 != w1).float().mean())
    worst = float(((w0 - w1).abs() / w0.abs().clamp_min(1e-3)).max())
    # both keep fp32 masters (GPU / host) and round them to bf16 alike: rare one-ulp flips from summation order only
    assert flips < 5e-3 and worst <= 2**-7, (flips, worst)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_host_offloaded_optimizer_resumes_bit_exactly(fraction, dense_model_dir, tmp_path):
    """2 steps, a checkpoint (model + the host and device halves of the optimizer state), then 2 more in a fresh
    process that loads it, against 4 steps straight: every weight, fp32 master and moment equal."""
    from tests.helpers.trainer_ranks import spawn

    sets = [*COMMON, "train.optimizer_cpu_offload=true", f"train.optimizer_offload_fraction={fraction}"]
    straight = spawn("optimizer_resume", 1, str(dense_model_dir), sets, str(tmp_path / "unused"), 4, 0)[0]
    ckpt = str(tmp_path / "ckpt")
    first = spawn("optimizer_resume", 1, str(dense_model_dir), sets, ckpt, 2, 0)[0]
    resumed = spawn("optimizer_resume", 1, str(dense_model_dir), sets, ckpt, 0, 2)[0]
    assert first["grad_norms"] == straight["grad_norms"][:2]
    assert resumed["step"] == straight["step"] == 4
    assert resumed["grad_norms"] == straight["grad_norms"][2:]  # the resumed steps saw the same model
    for key in ("weights", "param", "exp_avg", "exp_avg_sq"):
        assert resumed[key] == straight[key], key
