"""bench/gpu_scale.py and gpu_scale_report.py: the pure helpers (FLOPs, MFU, medians, packing, overrides, summary) and its CPU dry run.
The MoE shapes' part: tests/unit/test_bench_gpu_scale_moe.py."""

import json
from pathlib import Path

import pytest

from tests.helpers.bench import load_bench, result_doc
from vime_core.config import load_config

REPO = Path(__file__).resolve().parents[2]


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
    assert rp.step_flops(c, [3, 3], passes=4) == 4 * 2 * one_pass


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
        result_doc(
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
    s = rp.summarize(result_doc(loop, [], [], trainer_info=[{"max_gpu_mem_gib": 90.0}]))
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
    # the step without the no-grad old-log-prob forward: its MFU counts the 3 passes it ran, not the hf phase's 4
    detached = doc["phases"]["hf_detached"]
    assert detached["old_logprobs"] == "detached" and doc["phases"]["hf"]["old_logprobs"] == "forward"
    assert len(detached["steps"]) == 2 and doc["hf_detached_tok_s"] == detached["steps"][1]["tok_s"] > 0
    for a, b in zip(detached["steps"], doc["phases"]["hf"]["steps"]):  # the same sequences (one seed): FLOPs 3 : 4
        assert a["tokens"] == b["tokens"] and a["mfu"] * a["seconds"] == pytest.approx(0.75 * b["mfu"] * b["seconds"])


def test_the_detached_hf_step_makes_the_same_update_as_the_one_with_an_old_forward(tmp_path):
    """At one optimizer step per rollout the weights are the old policy's: the training forward's own (detached)
    log-probs give the same loss and so the same AdamW update as a separate no-grad forward."""
    torch = pytest.importorskip("torch")
    ph = load_bench("gpu_scale_phases")
    model_dir = tmp_path / "tiny"
    ph.build_checkpoint("tiny", model_dir, "cpu")
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 11, 12, 13, 14]]
    flat = lambda model: torch.cat([p.detach().flatten() for p in model.parameters()])  # noqa: E731
    before = flat(ph.hf_model(model_dir, torch.device("cpu"))[0])
    params = []
    for old_forward in (True, False):
        model, opt = ph.hf_model(model_dir, torch.device("cpu"))
        ph.hf_step(model, opt, seqs, [2, 2], [1.0, -1.0], 64, torch.device("cpu"), old_forward)
        params.append(flat(model))
    assert (params[0] - before).abs().max() > 0  # the step changed the weights, so equal updates say something
    torch.testing.assert_close(params[0], params[1])


def test_rollout_and_trainer_compare_the_steps_both_phases_ran(rp):
    loop = [{"perf/tokens_per_gpu_per_sec": t, "perf/actor_train_tok_per_s": 10.0} for t in (110.0, 90.0, 90.0)]
    vllm = [{"tok_s": 100.0}]  # the baseline's step 1 hit the watchdog: compare step 0 with step 0
    s = rp.summarize(result_doc(loop, vllm, []))
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


def test_each_rollout_phase_reports_its_vllm_model_runner(rp):
    ph = {
        "loop": {"engine_info": [{"model_runner": "v1"}, {"model_runner": "v1"}]},
        "vllm": {"model_runner": "v2"},
    }
    assert rp.model_runners(ph) == {"loop_engine": "v1", "raw_vllm": "v2", "raw_vllm_sleep_mode": None}
    mixed = {"loop": {"engine_info": [{"model_runner": "v2"}, {"model_runner": "v1"}]}}
    assert rp.model_runners(mixed)["loop_engine"] == ["v1", "v2"]
    assert rp.model_runners({})["loop_engine"] is None


def test_the_sleep_mode_diagnostic_is_compared_with_plain_raw_vllm_only(rp):
    loop = [{"perf/tokens_per_gpu_per_sec": 80.0}] * 3
    doc = result_doc(loop, [{"tok_s": 100.0}] * 3, [])
    doc["phases"]["vllm_sleep"] = {"steps": [{"tok_s": 120.0}, {"tok_s": 90.0}, {"tok_s": 90.0}]}
    s = rp.summarize(doc)
    assert s["raw_vllm_sleep_mode_tok_s"] == 90.0 and s["ratios"]["raw_vllm_sleep_mode_vs_raw_vllm"] == 0.9
    assert s["raw_vllm_tok_s"] == 100.0 and s["ratios"]["rollout_vs_raw_vllm"] == 0.8  # the check keeps plain vLLM
    assert rp.summarize(result_doc(loop, [], []))["raw_vllm_sleep_mode_tok_s"] is None


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
    doc = {**result_doc(loop, [{"tok_s": 7200.0}] * 3, []), "shape": "8b"}
    doc["phases"]["loop"]["host_used_peak_gib"] = 104.0
    s = rp.summarize(doc)
    assert s["optimizer_step_s"] == 8.0 and s["offload_s"] == 0.5 and s["host_peak_gib"] == 104.0
    assert s["done_when"] == {
        "rollout_tok_per_gpu_s >= 4100 (vime, 2 x MI355X)": True,
        "rollout_tok_per_gpu_s >= 0.95 x raw_vllm_tok_s": True,
        "trainer_tok_s >= 1.0 x hf_sdpa_tok_s": None,  # the HF baseline did not run (or did not fit)
        "host_peak_gib < 110": True,
        "sync_s <= 1.5": True,
        "loop_steps_run >= 3": True,
    }
    doc["phases"]["loop"].update(steps=loop[:2], error="phase loop hit the watchdog after 600 s")
    s = rp.summarize(doc)
    assert s["loop_steps_run"] == 2 and "watchdog" in s["loop_error"]
    assert s["done_when"]["loop_steps_run >= 3"] is False


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


@pytest.mark.parametrize(
    "level,calls",
    [
        (1, [("sleep", 1), ("wake_up", None)]),
        (2, [("sleep", 2), ("wake_up", ["weights"]), ("rpc", "reload_weights"), ("wake_up", ["kv_cache"])]),
    ],
)
def test_the_sleep_diagnostic_wakes_raw_vllm_as_the_loop_wakes_its_engine(level, calls):
    """Level 2 drops the weights: waking the KV cache before they are back, or not reloading them, would time an
    engine unlike the loop's (and sample from freed memory)."""
    seen = []

    class FakeLLM:
        def sleep(self, level):
            seen.append(("sleep", level))

        def wake_up(self, tags=None):
            seen.append(("wake_up", tags))

        def collective_rpc(self, method):
            seen.append(("rpc", method))

    load_bench("gpu_scale_phases").sleep_and_wake(FakeLLM(), level)
    assert seen == calls


def test_a_dry_run_without_out_keeps_its_files_out_of_the_committed_results(gs, tmp_path):
    before = sorted(p.name for p in gs.RESULTS.glob("*"))
    argv = ["--dry-run", "--prompts", "1", "--samples", "2", "--response-len", "4", "--steps", "1"]
    assert gs.main([*argv, "--cache", str(tmp_path / "cache")]) == 0
    assert (tmp_path / "cache" / "dry-run" / "tiny-4.json").is_file()
    assert sorted(p.name for p in gs.RESULTS.glob("*")) == before
