"""train.moe_token_dispatcher: megatron's alltoall dispatcher trains the builtin tiny MoE as the allgather one does
(the same grad norms and weights after a few steps, grouped experts, bf16). megatron-core builds a CUDA stream for
alltoall, so this runs where a GPU is (the device machine: `pytest tests/integration/test_token_dispatcher.py`) and is
skipped on the CPU box, where the config check refuses alltoall (tests/unit/test_config.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron's alltoall dispatcher needs a GPU")

COMMON = [
    "model.dtype=bfloat16",  # torch's grouped GEMM on CUDA takes bf16
    "train.optimizer=megatron",
    "train.moe_grouped_gemm=true",
    "train.lr=1e-3",  # large enough that three steps move every weight well past float noise
    "rollout.n_samples_per_prompt=4",
    "checkpoint.save_optimizer=false",
    "cluster.colocate=true",
]


def test_the_alltoall_dispatcher_trains_as_the_allgather_one(moe_model_dir):
    from tests.helpers.trainer_ranks import spawn

    runs = {
        d: spawn("optimizer_run", 1, str(moe_model_dir), [*COMMON, f"train.moe_token_dispatcher={d}"], 3)[0]
        for d in ("allgather", "alltoall")
    }
    gather, a2a = runs["allgather"], runs["alltoall"]
    assert gather["moved"] > 1e-4  # the steps changed the weights: equality below is not the initial state's
    assert a2a["grad_norms"] == pytest.approx(gather["grad_norms"], rel=1e-3)
    w0, w1 = torch.tensor(gather["weights"]), torch.tensor(a2a["weights"])
    flips = float((w0 != w1).float().mean())
    worst = float(((w0 - w1).abs() / w0.abs().clamp_min(1e-3)).max())
    # the same routing and expert GEMMs; only the order in which the top-k outputs are summed back may differ, so at
    # most rare one-ulp bf16 flips
    assert flips < 5e-3 and worst <= 2**-7, (flips, worst)
