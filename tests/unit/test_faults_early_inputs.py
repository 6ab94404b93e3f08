"""`prepare` (the pipeline's and the evaluation's path, with no CLI check ahead of it) refuses the model, hook and
context problems that `vime train` refuses on its command line (tests/integration/test_faults_early_inputs.py), checks
vLLM argument values at load, and notes a small micro-batch budget or dataset once."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.errors import VimeError


# --------------------------------------------------------------------------------------------------------------------
# `prepare`: the same problems on the pipeline's and the evaluation's path (no CLI check ahead of it)
# --------------------------------------------------------------------------------------------------------------------
def prepare_error(cfg, model_dir=None) -> VimeError:
    import ray

    from vime_core.prepare import prepare

    with pytest.raises(VimeError) as e:
        prepare(cfg, model_dir)
    assert not ray.is_initialized(), "checked before Ray starts"
    return e.value


def test_prepare_refuses_a_reward_that_does_not_import(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "rollout.reward=nosuchmod:f"))
    assert "rollout.reward = 'nosuchmod:f' cannot be loaded" in str(e)


def test_prepare_refuses_the_bad_model_files(tmp_path, bad_models):
    assert "tokenizer.json is not valid JSON" in str(prepare_error(tiny_config(tmp_path), bad_models["tok"]))
    e = prepare_error(tiny_config(tmp_path), bad_models["vocab"])
    assert "says vocab_size = 400" in str(e)


def test_prepare_refuses_a_context_over_the_model(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "rollout.max_response_len=600"))
    assert "664 tokens is above the model's context length 512" in str(e)


def test_prepare_checks_every_tensor_shape_from_the_headers(tmp_path, dense_model_dir, monkeypatch):
    """Beyond vocab_size: a hidden layer size that disagrees with the weights is named from the headers."""
    model = tmp_path / "m"
    shutil.copytree(dense_model_dir, model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "intermediate_size": hf["intermediate_size"] * 2}))
    e = prepare_error(tiny_config(tmp_path / "run"), model)
    assert "mlp.gate_proj.weight has shape" in str(e) and "(safetensors headers)" in str(e)
    assert "config.json does not describe these weights" in str(e)


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.vllm_kwargs.max_num_batched_tokens=-5", "max_num_batched_tokens = -5: vLLM needs an integer >= 1"),
        ("rollout.vllm_kwargs.block_size=true", "block_size = True: vLLM needs an integer >= 1"),
        ("rollout.vllm_kwargs.cpu_offload_gb=-1", "cpu_offload_gb = -1: vLLM needs a number >= 0"),
        ("rollout.vllm_kwargs.kv_cache_memory_bytes='1e9'", "kv_cache_memory_bytes = '1e9'"),
    ],
)
def test_vllm_argument_values_are_checked_at_load(tmp_path, override, named):
    from vime_core.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, override)
    assert named in str(e.value)


def test_valid_vllm_argument_values_pass(tmp_path):
    cfg = tiny_config(tmp_path, "rollout.vllm_kwargs.max_num_seqs=4", "rollout.vllm_kwargs.cpu_offload_gb=0.5")
    assert cfg.rollout.vllm_kwargs == {"max_num_seqs": 4, "cpu_offload_gb": 0.5}


# --------------------------------------------------------------------------------------------------------------------
# notes at start: a sample over the micro-batch budget, a dataset smaller than one rollout batch
# --------------------------------------------------------------------------------------------------------------------
SMALL = ("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16")


NOTES = ("note: train.max_tokens_per_device = 32 is below the longest possible sample", "note: the dataset builtin://")


def test_prepare_notes_a_small_budget_and_a_small_dataset_once(tmp_path, caplog):
    import logging

    from vime_core.prepare import prepare

    cfg = tiny_config(tmp_path, *SMALL, "train.max_tokens_per_device=32", "data.source=builtin://arith?size=3")
    with caplog.at_level(logging.WARNING, logger="vime_core.prepare"):
        prepare(cfg)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note: ")]
    assert len(notes) == 2 and notes[0].startswith(NOTES[0]) and notes[1].startswith(NOTES[1]), notes
    assert "a sample over the budget is trained alone" in notes[0] and "+ rollout.max_response_len 48" in notes[0]
    assert "has 3 prompts, fewer than one rollout batch (4 prompts): every step wraps around" in notes[1]


def test_no_note_for_the_default_run(tmp_path, caplog):
    import logging

    from vime_core.prepare import prepare

    with caplog.at_level(logging.WARNING, logger="vime_core.prepare"):
        prepare(tiny_config(tmp_path))
    assert not [r for r in caplog.records if r.getMessage().startswith("note: ")]


def test_prepare_refuses_routing_replay_where_auto_resolves_to_cpu(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "cluster.platform=auto", "rollout.routing_replay=true"))
    assert "rollout.routing_replay = true needs vLLM's routed experts" in str(e) and "cpu platform" in str(e)


def test_prepare_refuses_the_alltoall_dispatcher_where_auto_resolves_to_cpu(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "cluster.platform=auto", "train.moe_token_dispatcher=alltoall"))
    assert str(e).startswith("train.moe_token_dispatcher = alltoall needs a GPU platform") and "cpu platform" in str(e)
