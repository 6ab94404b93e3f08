"""bench/gpu_scale.py's MoE shapes (Qwen3-30B-A3B's layers at full width, tiny-moe): shape parsing, parameter and
FLOP counts against transformers, the MoE summary keys and Done-when checks, each loop phase's config, the fit."""

import json
from pathlib import Path

import pytest

from tests.helpers.bench import load_bench, result_doc
from vime_core.config import load_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape,layers", [("30b-a3b-6l", 6), ("30b-a3b-48l", 48), ("tiny-moe", 2)])
def test_moe_shapes_parse(gs, rp, shape, layers):
    assert gs.parse(["--shape", shape]).shape == shape
    c = rp.hf_config(shape)
    assert c["num_hidden_layers"] == layers and c["model_type"] == "qwen3_moe"
    assert c["architectures"] == ["Qwen3MoeForCausalLM"] and rp.is_moe_shape(shape)


@pytest.mark.parametrize("shape", ["30b-a3b-0l", "30b-a3b-49l", "30b-a3b-06l", "30b-a3b-6", "30b-a3b", "32b-6l", "moe"])
def test_a_bad_shape_is_refused_in_one_line(gs, capsys, shape):
    with pytest.raises(SystemExit):
        gs.parse(["--shape", shape])
    err = capsys.readouterr().err.strip().splitlines()
    assert f"unknown shape '{shape}'" in err[-1] and "30b-a3b-<L>l" in err[-1]


def test_the_30b_a3b_shape_has_the_public_config_values(rp):
    c = rp.hf_config("30b-a3b-6l")
    want = dict(
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
        tie_word_embeddings=False,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    assert {k: c[k] for k in want} == want
    assert not rp.is_moe_shape("8b") and not rp.is_moe(rp.hf_config("8b"))


def test_moe_phases_are_refused_for_a_dense_shape(gs, capsys):
    with pytest.raises(SystemExit):
        gs.parse(["--shape", "1.7b", "--only", "loop,loop_r3"])
    assert "shape 1.7b is dense" in capsys.readouterr().err
    assert gs.parse(["--shape", "30b-a3b-6l", "--only", "loop_sequential,loop_r3,hf_eager"]).only == [
        "loop_sequential",
        "loop_r3",
        "hf_eager",
    ]


def test_moe_param_count_matches_transformers(rp):
    """The total against a tiny transformers Qwen3MoeForCausalLM built from the bench's own config values."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    values = rp.hf_config("tiny-moe")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**values))
    assert rp.param_count(values) == sum(p.numel() for p in model.parameters())
    # what transformers writes to config.json (num_local_experts for num_experts) counts the same
    saved = {k: v for k, v in values.items() if k != "num_experts"} | {"num_local_experts": values["num_experts"]}
    assert rp.param_count(saved) == rp.param_count(values) and rp.active_params(saved) == rp.active_params(values)


def test_moe_counts_match_the_public_model_size(rp):
    c = rp.hf_config("30b-a3b-48l")
    assert round(rp.param_count(c) / 1e9, 1) == 30.5  # Qwen3-30B-A3B: 30.5B in total
    # 3.3B activated: every parameter but the 120 of 128 experts a token skips (the embedding counted, 3.35B)
    assert 3.3e9 <= rp.active_params(c) + c["vocab_size"] * c["hidden_size"] < 3.4e9
    assert rp.flop_params(c) == rp.active_params(c) < rp.matmul_params(c)


def test_active_params_and_moe_flops_by_hand(rp):
    c = dict(
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=3,
        vocab_size=10,
        tie_word_embeddings=False,
    )
    # attention q,o 4*2*2*2=32, k,v 4*1*2*2=16; router 4*4=16; top-2 experts 2*3*4*3=72 -> 136; + LM head 10*4 = 176
    assert rp.active_params(c) == 176
    # every expert: 48 + 4*(3*4*3 + 4) = 208, norms 2*4 + 2*2 = 12 -> 220; + LM head 40 = 260
    assert rp.matmul_params(c) == 260
    one_pass = 2 * 176 * 3 + 2 * 1 * 2 * 2 * 3 * 3  # active matmuls + causal attention for a 3-token sequence
    assert rp.step_flops(c, [3], passes=1) == one_pass
    assert rp.step_flops(c, [3], passes=3) == 3 * one_pass


def test_r3_adds_its_routing_agreement_forward_to_the_passes_of_the_rollouts_it_measures(rp):
    from vime_core.trainer.routing import measures_routing

    assert rp.loop_passes("auto", 1, routing_measured=True) == 4.0
    assert rp.loop_passes("forward", 1, routing_measured=True) == 5.0
    assert rp.loop_passes("auto", 1) == 3.0
    # every 2: rollouts 0 and 2 run the measuring forward, 1 does not (as run on an H100, 2026-12-06)
    sets = ["rollout.routing_replay=true", "rollout.routing_metrics_every=2"]
    cfg = load_config(str(REPO / "configs/qwen3-30b-a3b.yaml"), sets)
    passes = [rp.loop_passes("auto", 1, measures_routing(cfg.rollout, i)) for i in range(3)]
    assert passes == [4.0, 3.0, 4.0]


def test_routing_metric_names_are_the_trainers():
    from vime_core.metrics import ROUTING_METRICS

    rp = load_bench("gpu_scale_report")
    assert (rp.ROUTING_AGREEMENT, rp.LOGPROB_DIFF_NO_REPLAY) == ROUTING_METRICS


PAIRED, PAIRED_LEN = "bench/paired_raw_vllm_tok_s", "bench/paired_raw_vllm_response_len_mean"


def _moe_doc(r3_diff=1e-3, sequential=4000.0, hf=7000.0, paired=(9800.0, 10200.0)):
    """Three steps of each phase; the first (warm-up) is off by a factor that any median including it would show."""
    steps = lambda rows: [{k: 100 * v for k, v in rows.items()}] + [rows] * 2  # noqa: E731
    loop = {
        "perf/tokens_per_gpu_per_sec": 9500.0,
        "perf/actor_train_tok_per_s": 9000.0,
        "train/train_rollout_logprob_abs_diff": 4e-3,
        "bench/mfu": 0.2,
    }
    doc = result_doc(steps(loop), steps({"tok_s": 10000.0}), steps({"tok_s": hf, "peak_gib": 50.0}))
    for i, row in enumerate(doc["phases"]["loop"]["steps"][1:], 1):  # the paired baseline: before rollouts 1 and 2
        doc["phases"]["loop"]["steps"][i] = dict(row, **{PAIRED: paired[i - 1], PAIRED_LEN: 4000.0})
    doc["shape"] = "30b-a3b-11l"
    doc["phases"]["hf"]["experts_implementation"] = "grouped_mm"
    doc["phases"]["hf_eager"] = {"steps": steps({"tok_s": 1000.0})}
    doc["phases"]["loop_sequential"] = {"steps": steps({"perf/actor_train_tok_per_s": sequential})}
    alltoall = {"perf/actor_train_tok_per_s": 9900.0, "train/train_rollout_logprob_abs_diff": 4.5e-3}
    doc["phases"]["loop_alltoall"] = {"steps": steps(alltoall)}
    r3 = {
        "perf/actor_train_tok_per_s": 8000.0,
        "train/train_rollout_logprob_abs_diff": r3_diff,
        "train/train_rollout_logprob_abs_diff_no_replay": 5e-3,
        "train/routing_agreement": 0.9,
    }
    doc["phases"]["loop_r3"] = {"steps": steps(r3)}
    return doc


def test_summarize_moe_keys_and_done_when(rp):
    s = rp.summarize(_moe_doc())
    assert s["sequential_mlp_tok_s"] == 4000.0 and s["hf_tok_s"] == 7000.0 and s["hf_eager_tok_s"] == 1000.0
    assert s["mfu_active"] == 0.2 and s["hf_experts_implementation"] == "grouped_mm"
    assert (s["logprob_abs_diff_r3"], s["logprob_abs_diff_no_r3"]) == (1e-3, 4e-3)
    assert s["logprob_abs_diff_no_r3_same_samples"] == 5e-3 and s["routing_agreement"] == 0.9
    assert s["ratios"]["trainer_vs_sequential_mlp"] == 2.25 and s["ratios"]["hf_vs_hf_eager"] == 7.0
    assert (s["alltoall_tok_s"], s["logprob_abs_diff_alltoall"]) == (9900.0, 4.5e-3)
    assert s["ratios"]["alltoall_vs_allgather"] == 1.1  # against `loop`, the allgather dispatcher
    # the paired baseline has no warm-up step to drop: the median of both pairs, 9,500 / 10,000 passes at 0.95
    assert (s["raw_vllm_paired_tok_s"], s["raw_vllm_paired_response_len_mean"]) == (10000.0, 4000.0)
    assert s["ratios"]["rollout_vs_raw_vllm_paired"] == 0.95 and s["ratios"]["rollout_vs_raw_vllm"] == 0.95
    assert s["done_when"] == {
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_paired_tok_s": True,
        "trainer_tok_s >= 2 x sequential_mlp_tok_s": True,
        "trainer_tok_s >= 1.0 x hf_tok_s": True,
        "logprob_abs_diff_r3 < logprob_abs_diff_no_r3": True,
    }
    assert set(s) <= rp.SUMMARY_KEYS  # a merge recomputes every MoE key too


def test_the_moe_rollout_check_is_against_the_paired_baseline(rp):
    s = rp.summarize(_moe_doc(paired=(11000.0, 11000.0)))  # raw vLLM in its own process stays at 10,000
    assert s["done_when"]["rollout_tok_per_gpu_s >= 0.95 x raw_vllm_paired_tok_s"] is False
    assert s["ratios"]["rollout_vs_raw_vllm"] == 0.95  # reported beside it
    doc = _moe_doc()
    for row in doc["phases"]["loop"]["steps"]:
        row.pop(PAIRED, None)
    assert rp.summarize(doc)["done_when"]["rollout_tok_per_gpu_s >= 0.95 x raw_vllm_paired_tok_s"] is None


def test_moe_done_when_fails_where_the_numbers_do(rp):
    s = rp.summarize(_moe_doc(r3_diff=4e-3, sequential=4600.0, hf=9500.0))
    assert s["done_when"] == {
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_paired_tok_s": True,
        "trainer_tok_s >= 2 x sequential_mlp_tok_s": False,
        "trainer_tok_s >= 1.0 x hf_tok_s": False,
        "logprob_abs_diff_r3 < logprob_abs_diff_no_r3": False,  # equal is not smaller
    }
    doc = _moe_doc()
    del doc["phases"]["loop_r3"], doc["phases"]["loop_sequential"], doc["phases"]["loop_alltoall"]
    s = rp.summarize(doc)
    assert s["routing_agreement"] is None and s["sequential_mlp_tok_s"] is None
    assert s["alltoall_tok_s"] is None and s["ratios"]["alltoall_vs_allgather"] is None
    assert s["done_when"]["logprob_abs_diff_r3 < logprob_abs_diff_no_r3"] is None
    assert s["done_when"]["trainer_tok_s >= 2 x sequential_mlp_tok_s"] is None


def test_dense_summaries_have_no_moe_keys(rp):
    s = rp.summarize(result_doc([{"perf/actor_train_tok_per_s": 1.0}], [], []))
    assert "sequential_mlp_tok_s" not in s and "mfu_active" not in s
    assert list(s["done_when"]) == [label for label, *_ in rp.DONE_WHEN]


def _moe_cfg(gs, gc, tmp_path, phase, extra=()):
    args = gs.parse(["--shape", "30b-a3b-11l", *extra])
    kept, dropped = gc.filter_overrides(gc.loop_overrides(args, tmp_path / "m", tmp_path / "run", phase))
    assert dropped == []
    return load_config(args.config, kept)


@pytest.mark.parametrize(
    "phase,grouped,replay,dispatcher,saves",
    [
        ("loop", True, False, "allgather", True),
        ("loop_sequential", False, False, "allgather", False),
        ("loop_r3", True, True, "allgather", False),
        ("loop_alltoall", True, False, "alltoall", False),
    ],
)
def test_each_moe_loop_phase_means_one_thing(gs, gc, tmp_path, phase, grouped, replay, dispatcher, saves):
    # --set cannot turn a phase into another: the phase's own settings come last
    other = "allgather" if dispatcher == "alltoall" else "alltoall"
    sets = [
        "--set",
        f"train.moe_grouped_gemm={str(not grouped).lower()}",
        "--set",
        f"train.moe_token_dispatcher={other}",
    ]
    cfg = _moe_cfg(gs, gc, tmp_path, phase, sets)
    assert cfg.train.moe_grouped_gemm is grouped and cfg.rollout.routing_replay is replay
    assert cfg.train.moe_token_dispatcher == dispatcher
    assert cfg.train.num_devices == 1 and cfg.cluster.colocate and cfg.rollout.gpu_memory_utilization == 0.5
    assert cfg.cluster.engine_sleep_level == 2 and not cfg.train.optimizer_cpu_offload
    assert cfg.checkpoint.save_at_end is saves  # the loop's final save is measured; the variants' is not wanted


def test_the_shipped_moe_config_runs_on_one_gpu_under_the_bench(gs, gc, tmp_path):
    """--config configs/qwen3-30b-a3b.yaml (8 GPUs, EP 8, two TP-4 engines) with the bench's one-GPU settings on top."""
    from vime_core.models import arch_from_hf_config, check_model_compat

    rp = load_bench("gpu_scale_report")
    cfg = _moe_cfg(gs, gc, tmp_path, "loop", ["--config", str(REPO / "configs" / "qwen3-30b-a3b.yaml")])
    t, r = cfg.train, cfg.rollout
    assert (t.num_devices, t.tensor_parallel_size, t.expert_parallel_size) == (1, 1, 1)
    assert (r.num_engines, r.engine_tensor_parallel_size, r.gpu_memory_utilization) == (1, 1, 0.5)
    assert t.global_batch_size == 128 and cfg.eval.datasets == []
    check_model_compat(cfg, arch_from_hf_config(rp.hf_config("30b-a3b-11l")))


def test_the_documented_moe_shape_is_the_largest_the_fit_check_accepts(gs):
    """bench/README.md runs 30b-a3b-11l: the fit check (vime_core/fit.py) accepts 11 layers on an H200 (139.8 GiB)
    with 125 GiB of host memory at 16 x 8 x 4,096, and refuses 12 (trainer and host)."""
    fit = load_bench("gpu_scale_fit")
    best, plans = fit.largest_moe_layers(gs.parse(["--shape", "30b-a3b-6l"]))
    assert best == 11
    by_shape = {(p["shape"], p["phase"]): p for p in plans}
    assert all(by_shape[("30b-a3b-11l", ph)]["fits"] for ph in ("loop", "loop_sequential", "loop_r3"))
    refused = by_shape[("30b-a3b-12l", "loop")]
    assert not refused["fits"] and "trainer needs" in refused["problem"] and "host memory" in refused["problem"]
    assert best >= 6  # the floor


def test_dry_run_of_an_moe_shape_runs_both_transformers_baselines(gs, rp, tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = ["--dry-run", "--shape", "30b-a3b-6l", "--prompts", "2", "--samples", "2", "--response-len", "8"]
    assert gs.main(argv + ["--steps", "2", "--out", str(out), "--cache", str(cache)]) == 0
    doc = json.loads((out / "tiny-moe-8.json").read_text())
    hf, eager = doc["phases"]["hf"], doc["phases"]["hf_eager"]
    assert len(hf["steps"]) == len(eager["steps"]) == 2 and doc["hf_tok_s"] == hf["steps"][1]["tok_s"] > 0
    assert (hf["experts_implementation"], eager["experts_implementation"]) == ("grouped_mm", "eager")
    built = json.loads((cache / "models" / "qwen3-tiny-moe-random" / "vime_bench_model.json").read_text())
    assert doc["params"] == built["params"] and doc["active_params"] == rp.active_params(rp.hf_config("tiny-moe"))
    assert "train.moe_grouped_gemm=true" in doc["phases"]["loop"]["overrides"]
