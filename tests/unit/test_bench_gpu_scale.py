"""bench/gpu_scale.py and gpu_scale_report.py: the pure helpers (FLOPs, MFU, medians, packing, overrides, summary) and its CPU dry run."""

import importlib.util
import json
from pathlib import Path

import pytest

from vime_core.config import load_config

REPO = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gs():
    """The CLI: argument parsing, config overrides, the dry run."""
    return load_bench("gpu_scale")


@pytest.fixture(scope="module")
def gc():
    """The loop phase's config overrides."""
    return load_bench("gpu_scale_config")


@pytest.fixture(scope="module")
def rp():
    """The pure report helpers: shapes, FLOPs, MFU, medians, packing, summary and merge."""
    return load_bench("gpu_scale_report")


@pytest.mark.parametrize("shape,billions", [("1.7b", 1.7), ("4b", 4.0), ("8b", 8.2)])
def test_param_count_matches_public_model_sizes(rp, shape, billions):
    assert round(rp.param_count(rp.hf_config(shape)) / 1e9, 1) == billions


def test_step_flops_by_hand(rp):
    c = dict(
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=2,
        intermediate_size=8,
        vocab_size=10,
        tie_word_embeddings=True,
    )
    # layer: q,o 4*2*2*2=32, k,v 4*1*2*2=16, mlp 3*4*8=96, norms 2*4+2*2=12 -> 156; + LM head 10*4 = 196
    assert rp.matmul_params(c) == 196
    one_pass = 2 * 196 * 3 + 2 * 1 * 2 * 2 * 3 * 3  # matmuls + causal attention for a 3-token sequence
    assert rp.step_flops(c, [3], passes=1) == one_pass
    assert rp.step_flops(c, [3, 3]) == 4 * 2 * one_pass


def test_mfu(rp):
    assert rp.mfu(989e12, 2.0) == pytest.approx(0.5)
    assert rp.mfu(1e12, 1.0, peak=2e12) == pytest.approx(0.5)
    assert rp.mfu(1.0, 0.0) is None


def test_median_after_first_skips_the_warm_up_step(rp):
    assert rp.median_after_first([100.0, 1.0, 3.0, 2.0]) == 2.0
    assert rp.median_after_first([100.0, None, 4.0]) == 4.0
    assert rp.median_after_first([5.0]) == 5.0
    assert rp.median_after_first([]) is None


def test_pack_respects_the_token_budget(rp):
    lengths = [4136] * 5 + [1064] * 9 + [10000]
    mbs = rp.pack(lengths, 9216)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= 9216
    assert [14] in mbs  # longer than the budget: alone


def test_filter_overrides_drops_fields_this_config_lacks(gc):
    kept, dropped = gc.filter_overrides(
        [
            "train.lr=2e-6",
            "eval.datasets=[]",
            "output_dir=x",
            "train.no_such_field=1",
            "nosection.x=1",
            "train.lr.deeper=1",
        ]
    )
    assert kept == ["train.lr=2e-6", "eval.datasets=[]", "output_dir=x"]
    assert dropped == ["train.no_such_field=1", "nosection.x=1", "train.lr.deeper=1"]


def test_loop_config_is_valid_and_one_optimizer_step_per_rollout(gs, gc, tmp_path):
    args = gs.parse(
        [
            "--shape",
            "1.7b",
            "--prompts",
            "16",
            "--samples",
            "8",
            "--response-len",
            "4096",
            "--set",
            "train.recompute=full",
        ]
    )
    kept, dropped = gc.filter_overrides(gc.loop_overrides(args, tmp_path / "m", tmp_path / "run"))
    cfg = load_config(None, kept)
    assert cfg.num_steps_per_rollout == 1 and cfg.rollout.max_response_len == 4096
    assert cfg.cluster.colocate and cfg.model.dtype == "bfloat16" and cfg.train.optimizer == "megatron"
    assert ("train.recompute=full" in dropped) != ("recompute" in cfg.train.model_fields)


def test_parse_rejects_unknown_phase(gs):
    with pytest.raises(SystemExit):
        gs.parse(["--only", "loop,train"])


def _doc(steps_loop, steps_vllm, steps_hf, trainer_info=None):
    return {
        "shape": "1.7b",
        "prompts": 16,
        "samples": 8,
        "response_len": 4096,
        "phases": {
            "loop": {"steps": steps_loop, "trainer_info": trainer_info or []},
            "vllm": {"steps": steps_vllm},
            "hf": {"steps": steps_hf},
        },
    }


def test_summarize_ratios_and_done_when(rp):
    loop = [
        {
            "perf/tokens_per_gpu_per_sec": 1.0,
            "perf/actor_train_tok_per_s": 1.0,
            "perf/update_weights_time": 9.0,
            "perf/step_time": 9.0,
            "train/train_rollout_logprob_abs_diff": 1.0,
            "bench/mfu": 0.9,
        }
    ] + [
        {
            "perf/tokens_per_gpu_per_sec": 9600.0,
            "perf/actor_train_tok_per_s": 30000.0,
            "perf/update_weights_time": 0.3,
            "perf/step_time": 60.0,
            "train/train_rollout_logprob_abs_diff": 3e-3,
            "bench/mfu": 0.4,
        }
    ] * 2
    s = rp.summarize(
        _doc(
            loop,
            [{"tok_s": 1.0}, {"tok_s": 10000.0}],
            [{"tok_s": 1.0, "peak_gib": 1.0}, {"tok_s": 20000.0, "peak_gib": 48.0}],
            trainer_info=[{"max_gpu_mem_gib": 70.0}],
        )
    )
    assert s["ratios"]["trainer_vs_hf_sdpa"] == pytest.approx(1.5)
    assert s["ratios"]["rollout_vs_raw_vllm"] == pytest.approx(0.96)
    assert s["sync_s"] == 0.3 and s["mfu"] == 0.4 and s["trainer_peak_gib"] == 70.0
    assert s["done_when"] == {
        "trainer_tok_s >= 1.2 x hf_sdpa_tok_s": True,
        "trainer_peak_gib <= 60": False,
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s": True,
        "sync_s <= 0.5": True,
    }


def test_summarize_prefers_a_per_step_trainer_peak_and_tolerates_missing_phases(rp):
    loop = [
        {"perf/trainer_peak_gib": 90.0, "perf/trainer_logprobs_peak_gib": 20.0},
        {
            "perf/trainer_peak_gib": 40.0,
            "perf/trainer_logprobs_peak_gib": 55.0,
            "perf/trainer_resident_after_offload_gib": 70.0,
        },
    ]
    s = rp.summarize(_doc(loop, [], [], trainer_info=[{"max_gpu_mem_gib": 90.0}]))
    assert s["trainer_peak_gib"] == 55.0  # the step's largest phase peak; the first step and held memory do not count
    assert s["trainer_peak_source"] == "max of perf/trainer_logprobs_peak_gib, perf/trainer_peak_gib"
    assert s["raw_vllm_tok_s"] is None and s["ratios"]["rollout_vs_raw_vllm"] is None
    assert s["done_when"]["trainer_peak_gib <= 60"] is True and s["done_when"]["sync_s <= 0.5"] is None


def test_merge_phase_keeps_other_phases_of_the_same_batch_only(rp):
    hdr = {"shape": "1.7b", "prompts": 16, "samples": 8, "response_len": 4096}
    doc = rp.merge_phase(None, hdr, "vllm", {"steps": [{"tok_s": 5.0}]})
    doc = rp.merge_phase(doc, hdr, "hf", {"steps": [{"tok_s": 4.0, "peak_gib": 1.0}]})
    assert set(doc["phases"]) == {"vllm", "hf"} and doc["raw_vllm_tok_s"] == 5.0
    doc = rp.merge_phase(doc, {**hdr, "prompts": 32}, "hf", {"steps": [{"tok_s": 4.0, "peak_gib": 1.0}]})
    assert set(doc["phases"]) == {"hf"} and doc["raw_vllm_tok_s"] is None
    assert set(rp.summarize(doc)) <= rp.SUMMARY_KEYS  # every summary key is recomputed on a merge


def test_dry_run_writes_a_result_with_the_hf_steps(gs, rp, tmp_path):
    out = tmp_path / "out"
    assert (
        gs.main(
            [
                "--dry-run",
                "--prompts",
                "2",
                "--samples",
                "2",
                "--response-len",
                "8",
                "--steps",
                "2",
                "--out",
                str(out),
                "--cache",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    doc = json.loads((out / "tiny-8.json").read_text())
    hf = doc["phases"]["hf"]["steps"]
    assert len(hf) == 2 and doc["hf_sdpa_tok_s"] == hf[1]["tok_s"] > 0
    assert all(s["tokens"] > 2 * 2 * 8 for s in hf)  # prompt tokens + 8 response tokens per sample
    assert doc["phases"]["loop"]["skipped"] == "dry run" and doc["params"] == rp.param_count(rp.hf_config("tiny"))


def test_rollout_and_trainer_compare_the_steps_both_phases_ran(rp):
    loop = [{"perf/tokens_per_gpu_per_sec": t, "perf/actor_train_tok_per_s": 10.0} for t in (110.0, 90.0, 90.0)]
    vllm = [{"tok_s": 100.0}]  # the baseline's step 1 hit the watchdog: compare step 0 with step 0
    s = rp.summarize(_doc(loop, vllm, []))
    assert s["rollout_tok_per_gpu_s"] == 110.0
    assert s["ratios"]["rollout_vs_raw_vllm"] == 1.1
    assert s["trainer_tok_s"] == 10.0  # no HF phase: the loop's steps after the first, all of them


def test_kv_cache_capacity_is_reported_beside_the_full_length_demand(rp):
    doc = {
        "prompts": 16,
        "samples": 8,
        "response_len": 4096,
        "phases": {
            "loop": {"engine_info": [{"kv_cache_tokens": 420_000}, {"kv_cache_tokens": 560_000}]},
            "vllm": {"kv_cache_tokens": 575_000},
            "vllm_sleep": {"kv_cache_tokens": 570_000},
        },
    }
    assert rp.kv_cache_tokens(doc) == {
        "loop_engine": 420_000,
        "raw_vllm": 575_000,
        "raw_vllm_sleep_mode": 570_000,
        "full_length_responses": 524_288,
    }
    assert rp.kv_cache_tokens({"phases": {"loop": {"engine_info": [{"kv_cache_tokens": None}]}}}) == {
        "loop_engine": None,
        "raw_vllm": None,
        "raw_vllm_sleep_mode": None,
        "full_length_responses": None,
    }


def test_the_sleep_mode_diagnostic_is_compared_with_plain_raw_vllm_only(rp):
    loop = [{"perf/tokens_per_gpu_per_sec": 80.0}] * 3
    doc = _doc(loop, [{"tok_s": 100.0}] * 3, [])
    doc["phases"]["vllm_sleep"] = {"steps": [{"tok_s": 120.0}, {"tok_s": 90.0}, {"tok_s": 90.0}]}
    s = rp.summarize(doc)
    assert s["raw_vllm_sleep_mode_tok_s"] == 90.0 and s["ratios"]["raw_vllm_sleep_mode_vs_raw_vllm"] == 0.9
    assert s["raw_vllm_tok_s"] == 100.0 and s["ratios"]["rollout_vs_raw_vllm"] == 0.8  # the check keeps plain vLLM
    assert rp.summarize(_doc(loop, [], []))["raw_vllm_sleep_mode_tok_s"] is None


@pytest.fixture(scope="module")
def mon():
    """The device/host monitor's windowing (its sampling needs nvidia-smi and a process tree)."""
    return load_bench("gpu_monitor")


def sample(t, sm, procs=None):
    return {
        "t": t,
        "used_gib": 70.0,
        "sm_mhz": sm,
        "mem_mhz": 3201.0,
        "power_w": 400.0,
        "temp_c": 50.0,
        "util_pct": 100.0,
        "throttle": "0x0" if sm > 1900 else "0x4",
        "host_cpu_pct": 10.0,
        "procs": procs or {},
    }


def test_window_stats_takes_only_the_step_samples(mon):
    samples = [
        sample(t, 1980.0 if t < 10 else 1500.0, {"VLLM::EngineCore": 100, "ray::Trainer": 30 * (t >= 10)})
        for t in range(20)
    ]
    early, late = mon.window_stats(samples, 2, 8), mon.window_stats(samples, 12, 18)
    assert (early["sm_mhz"], early["samples"], early["throttle"]) == (1980.0, 7, ["0x0"])
    assert (late["sm_mhz"], late["throttle"]) == (1500.0, ["0x4"])
    assert early["procs"] == {"VLLM::EngineCore": 100}
    assert late["procs"] == {"VLLM::EngineCore": 100, "ray::Trainer": 30}
    assert mon.window_stats(samples, 30, 40) is None


def test_annotate_steps_finds_raw_and_loop_rollout_windows(mon):
    samples = [sample(t, 1000.0 + t) for t in range(100)]
    raw = {"steps": [{"start_epoch": 10, "end_epoch": 20}]}
    # a loop step starts with its rollout: 50 s step ending at 90 -> rollout from 40 to 52
    loop = {"steps": [{"bench/end_epoch": 90, "perf/step_time": 50, "perf/rollout_time": 12}, {"no": "times"}]}
    mon.annotate_steps(raw, samples)
    mon.annotate_steps(loop, samples)
    assert raw["steps"][0]["bench/rollout_device"]["sm_mhz"] == 1015.0
    assert loop["steps"][0]["bench/rollout_device"]["sm_mhz"] == 1046.0
    assert "bench/rollout_device" not in loop["steps"][1]


def test_mfu_counts_only_the_passes_the_loop_ran(rp):
    assert rp.loop_passes("auto", 1) == 3.0  # one optimizer step per rollout: its own forward gives the old log-probs
    assert rp.loop_passes("auto", 4) == pytest.approx(3.75)  # the no-grad pass covers the later 3 of 4 steps
    assert rp.loop_passes("forward", 1) == 4.0
    arch = {**rp.QWEN3, **rp.SHAPES["1.7b"]}
    assert rp.step_flops(arch, [1000.0], 3) / rp.step_flops(arch, [1000.0], 4) == pytest.approx(0.75)


def test_8b_rows_are_checked_against_vime_and_the_host_budget(rp):
    loop = [
        {
            "perf/tokens_per_gpu_per_sec": 7000.0,
            "perf/actor_train_tok_per_s": 6000.0,
            "perf/update_weights_time": 1.0,
            "perf/optimizer_step_time": 8.0,
            "perf/optimizer_offload_time": 0.5,
        }
    ] * 3
    doc = {**_doc(loop, [{"tok_s": 7200.0}] * 3, []), "shape": "8b"}
    doc["phases"]["loop"]["host_used_peak_gib"] = 104.0
    s = rp.summarize(doc)
    assert s["optimizer_step_s"] == 8.0 and s["offload_s"] == 0.5 and s["host_peak_gib"] == 104.0
    assert s["done_when"] == {
        "rollout_tok_per_gpu_s >= 4100 (vime, 2 x MI355X)": True,
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s": True,
        "trainer_tok_s >= 1.0 x hf_sdpa_tok_s": None,  # the HF baseline did not run (or did not fit)
        "host_peak_gib < 110": True,
        "sync_s <= 1.5": True,
    }


def test_the_8b_bench_runs_the_shipped_config_under_the_bench_shape(gs, gc, tmp_path):
    """--config: the shipped file's settings (host-side optimizer, sleep level, vLLM's share) with the bench's model,
    data and batch shape on top."""
    args = gs.parse(["--shape", "8b", "--config", str(REPO / "configs" / "qwen3-8b-cuda-1gpu.yaml")])
    kept, _ = gc.filter_overrides(gc.loop_overrides(args, tmp_path / "m", tmp_path / "run"))
    cfg = load_config(args.config, kept)
    assert cfg.train.optimizer_cpu_offload and cfg.cluster.engine_sleep_level == 2
    assert cfg.rollout.gpu_memory_utilization == 0.55 and cfg.model.source == str(tmp_path / "m")
    assert cfg.eval.datasets == [] and cfg.num_steps_per_rollout == 1


# --- the MoE shapes (issue 25): Qwen3-30B-A3B's layers at full width on one GPU ----------------------------------------
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


def test_r3_adds_its_routing_agreement_forward_to_the_passes(rp):
    assert rp.loop_passes("auto", 1, routing_replay=True) == 4.0
    assert rp.loop_passes("forward", 1, routing_replay=True) == 5.0
    assert rp.loop_passes("auto", 1) == 3.0


def test_routing_metric_names_are_the_trainers():
    from vime_core.metrics import ROUTING_METRICS

    rp = load_bench("gpu_scale_report")
    assert (rp.ROUTING_AGREEMENT, rp.LOGPROB_DIFF_NO_REPLAY) == ROUTING_METRICS


def _moe_doc(r3_diff=1e-3, sequential=4000.0, hf=7000.0):
    """Three steps of each phase; the first (warm-up) is off by a factor that any median including it would show."""
    steps = lambda rows: [{k: 100 * v for k, v in rows.items()}] + [rows] * 2  # noqa: E731
    loop = {
        "perf/tokens_per_gpu_per_sec": 9500.0,
        "perf/actor_train_tok_per_s": 9000.0,
        "train/train_rollout_logprob_abs_diff": 4e-3,
        "bench/mfu": 0.2,
    }
    doc = _doc(steps(loop), steps({"tok_s": 10000.0}), steps({"tok_s": hf, "peak_gib": 50.0}))
    doc["shape"] = "30b-a3b-11l"
    doc["phases"]["hf"]["experts_implementation"] = "grouped_mm"
    doc["phases"]["hf_eager"] = {"steps": steps({"tok_s": 1000.0})}
    doc["phases"]["loop_sequential"] = {"steps": steps({"perf/actor_train_tok_per_s": sequential})}
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
    assert s["done_when"] == {
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s": True,
        "trainer_tok_s >= 2 x sequential_mlp_tok_s": True,
        "trainer_tok_s >= 1.0 x hf_tok_s": True,
        "logprob_abs_diff_r3 < logprob_abs_diff_no_r3": True,
    }
    assert set(s) <= rp.SUMMARY_KEYS  # a merge recomputes every MoE key too


def test_moe_done_when_fails_where_the_numbers_do(rp):
    s = rp.summarize(_moe_doc(r3_diff=4e-3, sequential=4600.0, hf=9500.0))
    assert s["done_when"] == {
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s": True,
        "trainer_tok_s >= 2 x sequential_mlp_tok_s": False,
        "trainer_tok_s >= 1.0 x hf_tok_s": False,
        "logprob_abs_diff_r3 < logprob_abs_diff_no_r3": False,  # equal is not smaller
    }
    doc = _moe_doc()
    del doc["phases"]["loop_r3"], doc["phases"]["loop_sequential"]
    s = rp.summarize(doc)
    assert s["routing_agreement"] is None and s["sequential_mlp_tok_s"] is None
    assert s["done_when"]["logprob_abs_diff_r3 < logprob_abs_diff_no_r3"] is None
    assert s["done_when"]["trainer_tok_s >= 2 x sequential_mlp_tok_s"] is None


def test_dense_summaries_have_no_moe_keys(rp):
    s = rp.summarize(_doc([{"perf/actor_train_tok_per_s": 1.0}], [], []))
    assert "sequential_mlp_tok_s" not in s and "mfu_active" not in s
    assert list(s["done_when"]) == [label for label, *_ in rp.DONE_WHEN]


def _moe_cfg(gs, gc, tmp_path, phase, extra=()):
    args = gs.parse(["--shape", "30b-a3b-11l", *extra])
    kept, dropped = gc.filter_overrides(gc.loop_overrides(args, tmp_path / "m", tmp_path / "run", phase))
    assert dropped == []
    return load_config(args.config, kept)


@pytest.mark.parametrize(
    "phase,grouped,replay", [("loop", True, False), ("loop_sequential", False, False), ("loop_r3", True, True)]
)
def test_each_moe_loop_phase_means_one_thing(gs, gc, tmp_path, phase, grouped, replay):
    # --set cannot turn a phase into another: the phase's own settings come last
    cfg = _moe_cfg(gs, gc, tmp_path, phase, ["--set", f"train.moe_grouped_gemm={str(not grouped).lower()}"])
    assert cfg.train.moe_grouped_gemm is grouped and cfg.rollout.routing_replay is replay
    assert cfg.train.num_devices == 1 and cfg.cluster.colocate and cfg.rollout.gpu_memory_utilization == 0.5
    assert cfg.cluster.engine_sleep_level == 2 and not cfg.train.optimizer_cpu_offload


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
    assert best >= 6  # the issue's floor


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


def test_history_keeps_one_row_per_run_and_one_header(tmp_path):
    append_history = load_bench("gpu_scale_history").append_history
    path = tmp_path / "history.csv"
    doc = {
        "shape": "8b",
        "response_len": 4096,
        "prompts": 16,
        "samples": 8,
        "phases": {"loop": {"started_at": "2026-12-03T08:55:23Z"}},
        "trainer_tok_s": 8762.06,
        "mfu": None,
    }
    assert append_history(path, doc) is True
    assert append_history(path, doc) is False  # the same run merged again
    later = {**doc, "phases": {"loop": {"started_at": "2026-12-04T01:00:00Z"}}, "trainer_tok_s": 9000.0}
    assert append_history(path, later) is True
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("shape,response_len")
    assert ",8762.06," in lines[1] and ",9000.0," in lines[2]
