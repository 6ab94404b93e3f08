"""Expert parallelism in the real trainer (tiny MoE, gloo, DP = 2): the experts split over two EP ranks train exactly
as replicated ones, with the routers choosing and with R3 replaying an engine's routing. Token-budget packing gives the ranks different micro-batch counts and sizes; megatron's allgather
dispatcher exchanges each MoE layer's tokens in equal pieces, so the trainer pads every EP rank's micro-batches to
the same count and sizes (vime_core.trainer.batching.lockstep_pads). Without that a rank aborts in gloo ("Received
data size doesn't match expected size"); under R3 the padding routes to fixed experts, or its micro-batch cannot be
replayed."""

from __future__ import annotations

import pytest

from tests.helpers.trainer_ranks import spawn
from vime_core.metrics import ROUTING_METRICS

# micro-batches of at most 24 tokens (samples are 4-12): several per rank and step, unequal over the ranks; the KL
# term adds the reference model's no-grad forward, and two optimizer steps per rollout the old log-probs' one
OVERRIDES = ["train.max_tokens_per_device=24", "grpo.kl_loss_coef=0.01", "train.global_batch_size=64"]


@pytest.mark.parametrize("replay", [False, True], ids=["routers-choose", "routing-replay"])
def test_experts_split_over_two_ranks_train_as_replicated_ones(moe_model_dir, replay):
    overrides = [*OVERRIDES, f"rollout.routing_replay={str(replay).lower()}"]
    runs = {
        ep: spawn("expert_parallel_run", 2, str(moe_model_dir), [*overrides, f"train.expert_parallel_size={ep}"], 2)
        for ep in (1, 2)
    }
    if replay:  # R3's metrics are among those compared below
        assert set(ROUTING_METRICS) <= set(runs[2][0]["metrics"][0])
        assert runs[1][0]["metrics"][0]["train/routing_agreement"] < 0.9  # random routings: the routers disagree
    assert sum(r["pad_tokens"] for r in runs[1]) == 0, "EP 1 pads nothing"
    assert sum(r["pad_tokens"] for r in runs[2]) > 0, "the ranks packed unequal micro-batches: some were padded"
    assert runs[2][0]["micro_batches"] == runs[2][1]["micro_batches"], "every EP rank ran the same micro-batches"
    for step_1, step_2 in zip(runs[1][0]["metrics"], runs[2][0]["metrics"], strict=True):
        assert step_2 == pytest.approx(step_1, rel=1e-5, abs=1e-6)  # ppo_kl: a mean of near-cancelling terms
    w1, w2 = runs[1][0]["weights"], runs[2][0]["weights"]
    assert sorted(w1) == sorted(w2) and runs[2][1]["weights"].keys() == w2.keys()
    worst = max(max(abs(a - b) for a, b in zip(w1[k], w2[k])) for k in w1)
    # a tenth of one Adam step (lr 1e-4): EP 2 sums each expert's weight gradient over both ranks' tokens in one
    # GEMM, EP 1 per rank and then over DP, and Adam divides by sqrt(v), so a gradient near zero carries that fp32
    # summation-order noise into its weight at full size (measured worst 2.6e-7 to 1.4e-6). A routing, padding or
    # expert-placement error moves weights by whole steps.
    assert worst <= 1e-5, worst
