"""The memory fit check (vime_core.fit): the refusal of runs that cannot fit (Qwen3-8B on one H200 without the
host-side optimizer) before any actor starts. Its arithmetic against a real trainer's tensors, in spawned ranks:
tests/integration/test_fit.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vime_core.config import ConfigError, load_config
from vime_core.fit import GIB, MemoryFitError, check_memory_fit, memory_plan
from vime_core.models import arch_from_hf_config

REPO = Path(__file__).resolve().parents[2]
CONFIG_8B = str(REPO / "configs" / "qwen3-8b-cuda-1gpu.yaml")
H200 = 150_754_820_096  # torch's total_memory of an H200 (140.4 GiB)
HOST = 128 * GIB


def qwen3_8b():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_scale_report import hf_config  # the public config.json values of Qwen/Qwen3-8B

    return arch_from_hf_config(hf_config("8b"))


def config_8b(*sets: str):
    return load_config(CONFIG_8B, ["model.source=/tmp/qwen3-8b", *sets])


def test_qwen3_8b_parameter_count_is_the_published_one():
    plan = memory_plan(config_8b(), qwen3_8b(), H200, "cuda")
    assert plan.params == pytest.approx(8.19e9, rel=2e-3)  # ENVIRONMENT.md: a random Qwen3-8B holds 8.19B


def test_the_shipped_8b_config_fits_one_h200_and_its_host():
    plan = check_memory_fit(config_8b(), qwen3_8b(), "cuda", H200, HOST)
    assert plan.train < H200 and plan.rollout < H200
    # 60% of master copy, moments and a gradient copy (16 bytes x 0.6 x 8.19B = 73.2 GiB) on the host, plus a
    # checkpoint save's host copies of its four largest tensors (2.7 GiB)
    assert plan.host == pytest.approx(16 * 0.6 * 8.19e9 + 2.7 * GIB, rel=0.01)
    assert plan.gib("optimizer_gpu") == pytest.approx(0.4 * 12 * 8.19e9 / GIB, rel=0.01)


def test_the_8b_run_ray_killed_while_saving_fits_once_the_save_streams_but_not_on_a_smaller_host():
    # the first GPU run of the shipped shape at 75% offload: Ray's memory monitor killed the trainer at 114 GB of a
    # 125.8 GiB host during its checkpoint save (optimizer state 91.5 GiB + a staging copy of all the weights, 15.3
    # GiB). A save that copies tensor by tensor holds 2.7 GiB: 94.2 GiB against the 105.5 GiB line
    cfg = config_8b("train.optimizer_offload_fraction=0.75", "rollout.gpu_memory_utilization=0.6")
    assert check_memory_fit(cfg, qwen3_8b(), "cuda", H200, 125.8 * GIB).gib("checkpoint_staging") == pytest.approx(
        2.7, abs=0.05
    )
    with pytest.raises(MemoryFitError, match="staging copy") as e:
        check_memory_fit(cfg, qwen3_8b(), "cuda", H200, 110 * GIB)  # 0.95 x 110 - 14 = 90.5 GiB
    assert "engine_sleep_level" not in str(e.value)  # already 2: not a knob left to name


def test_8b_without_offload_is_refused_naming_the_numbers_and_the_knob():
    cfg = config_8b("train.optimizer_cpu_offload=false", "checkpoint.save_optimizer=true")
    with pytest.raises(MemoryFitError) as e:
        check_memory_fit(cfg, qwen3_8b(), "cuda", H200, HOST)
    msg = str(e.value)
    assert "\n" not in msg and "train.optimizer_cpu_offload = true" in msg and "140.4 GiB" in msg
    assert "optimizer state 91.5" in msg


def test_host_memory_binds_at_full_offload_and_names_the_fraction():
    cfg = config_8b("train.optimizer_offload_fraction=1.0")
    with pytest.raises(MemoryFitError, match="train.optimizer_offload_fraction"):
        check_memory_fit(cfg, qwen3_8b(), "cuda", H200, HOST)
    check_memory_fit(cfg, qwen3_8b(), "cuda", H200, 256 * GIB)  # the same run on a larger host fits


def test_vllm_share_and_resident_trainer_must_fit_while_generating():
    cfg = config_8b("rollout.gpu_memory_utilization=0.9")
    with pytest.raises(MemoryFitError, match="rollout.gpu_memory_utilization"):
        check_memory_fit(cfg, qwen3_8b(), "cuda", H200, HOST)


def test_sleep_level_one_keeps_the_engine_weights_on_the_host():
    one = memory_plan(config_8b("cluster.engine_sleep_level=1"), qwen3_8b(), H200, "cuda")
    two = memory_plan(config_8b(), qwen3_8b(), H200, "cuda")
    assert one.host - two.host == pytest.approx(2 * 8.19e9, rel=0.01)


def test_host_offload_needs_a_gpu_and_checkpoints_its_state():
    with pytest.raises(ConfigError, match="train.optimizer_cpu_offload"):
        config_8b("cluster.platform=cpu")
    # the host-side optimizer's state is saved and resumes bit-exactly (tests/integration/test_optimizer_offload.py)
    assert config_8b().checkpoint.save_optimizer is True


def test_expert_optimizer_state_shards_over_expert_data_parallel_ranks():
    """Qwen3-30B-A3B over 8 GPUs at EP = 8 with the distributed optimizer: each rank holds 16 experts, and no other
    rank holds them (expert-data-parallel size 1), so their fp32 master and moments stay whole on it; the dense
    parameters' state is split 8 ways."""
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_scale_report import hf_config

    from vime_core.models import Layout, spec_of

    arch = arch_from_hf_config(hf_config("30b-a3b-48l"))
    cfg = load_config(
        str(REPO / "configs" / "qwen3-30b-a3b.yaml"),
        ["model.source=/tmp/q30b", "train.distributed_optimizer=true", "checkpoint.save_optimizer=false"],
    )
    layout = Layout.of_config(cfg)
    params = spec_of(arch).params_per_device(arch, layout)
    experts = spec_of(arch).expert_params_per_device(arch, layout)
    assert experts == 48 * 16 * 3 * 2048 * 768 and 0 < experts < params
    plan = memory_plan(cfg, arch, H200, "cuda")
    assert plan.parts["optimizer_gpu"] == pytest.approx(12 * ((params - experts) / 8 + experts))
    dense = memory_plan(config_8b(), qwen3_8b(), H200, "cuda")  # no experts: the DP rule alone, unchanged
    assert spec_of(qwen3_8b()).expert_params_per_device(qwen3_8b(), Layout.of_config(config_8b())) == 0
    assert dense.parts["optimizer_host"] == pytest.approx(0.6 * 16 * dense.params)


def test_checkpoint_staging_is_the_four_largest_tensors_on_a_gpu_too():
    # the save copies each tensor as it writes it, two files at once (checkpoint.torch_dist.streamed_writes), each
    # holding a tensor and the one before: Qwen3-8B's four largest are its untied embedding and LM head (151,936 x
    # 4,096) and two layers' fc1 ([gate; up], 2 x 12,288 x 4,096), in bf16
    gpu = memory_plan(config_8b(), qwen3_8b(), H200, "cuda")
    cpu = memory_plan(config_8b(), qwen3_8b(), H200, "cpu")
    expected = 2 * (2 * 151936 * 4096 + 2 * 2 * 12288 * 4096)
    assert gpu.parts["checkpoint_staging"] == cpu.parts["checkpoint_staging"] == expected
    assert gpu.parts["checkpoint_staging"] < 0.2 * 2 * gpu.params  # staging every tensor held all 15.3 GiB


def test_moe_tensor_numels_count_every_expert_and_staging_takes_the_largest_four():
    from gpu_scale_report import hf_config

    from vime_core.fit import staging_bytes
    from vime_core.models import Layout, spec_of

    arch = arch_from_hf_config(hf_config("30b-a3b-10l"))  # Qwen3-30B-A3B's first 10 layers, all 128 experts
    numels = spec_of(arch).tensor_numels_per_device(arch, Layout())
    # per layer: 128 experts' fc1 (2 x 768 rows) and fc2 over hidden 2,048; qkv (32 + 2 x 4 heads of 128) and proj;
    # the router (128 x 2,048); q/k norms (128 each); two layer norms; then embedding, output layer, final norm
    per_layer = 128 * 3 * 2048 * 768 + (32 + 2 * 4) * 128 * 2048 + 32 * 128 * 2048 + 128 * 2048 + 2 * 128 + 2 * 2048
    assert sum(numels) == 10 * per_layer + 2 * 151936 * 2048 + 2048
    # the largest four: embedding and LM head, and two layers' qkv
    assert staging_bytes(numels, "bfloat16") == 2 * (2 * 151936 * 2048 + 2 * (32 + 2 * 4) * 128 * 2048)
