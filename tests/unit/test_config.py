"""Unit tests of vime_core.config: loading, overrides, validation messages (model checks: test_config_model_compat.py;
the resume fingerprint: test_fingerprint.py)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from vime_core.config import (
    ConfigError,
    RunConfig,
    flatten,
    load_config,
    parse_override,
)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.yaml"


def _error(overrides: list[str], path: str | Path | None = None) -> str:
    """The ConfigError message load_config raises for these overrides (fails the test if it does not raise)."""
    with pytest.raises(ConfigError) as ei:
        load_config(path, overrides)
    return str(ei.value)


# --------------------------------------------------------------------------------------------------------------------
# defaults, files, overrides
# --------------------------------------------------------------------------------------------------------------------
def test_defaults_validate():
    cfg = load_config()
    assert cfg == RunConfig()
    assert cfg.grpo.eps_clip == 0.2
    assert cfg.train.global_batch_size == 256
    # 32 prompts * 8 samples = 256 samples, one optimizer step of 256
    assert cfg.samples_per_rollout == 256
    assert cfg.num_steps_per_rollout == 1


def test_tiny_cpu_yaml_with_override():
    cfg = load_config(TINY, ["grpo.eps_clip=0.1"])
    assert cfg.grpo.eps_clip == 0.1
    assert type(cfg.grpo.eps_clip) is float
    # values of the file itself survive the merge
    assert cfg.name == "tiny-cpu"
    assert cfg.model.dtype == "float32"
    assert cfg.rollout.rollout_batch_size == 16
    assert cfg.train.lr == 1e-4
    assert cfg.grpo.eps_clip_high == 0.28  # sibling of the overridden key is kept
    assert cfg.eval.datasets[0].name == "arith-heldout"
    # 16 prompts * 8 samples = 128 samples / global batch 64 = 2 optimizer steps
    assert cfg.num_steps_per_rollout == 2


def test_override_value_types():
    cfg = load_config(
        None,
        [
            "seed=7",
            "train.lr=1e-4",
            "rollout.dynamic_sampling=true",
            "rollout.over_sampling_batch_size=48",
            "rollout.stop=[foo, '###']",
            "checkpoint.resume=false",
        ],
    )
    assert cfg.seed == 7 and type(cfg.seed) is int
    assert cfg.train.lr == pytest.approx(1e-4) and type(cfg.train.lr) is float
    assert cfg.rollout.dynamic_sampling is True
    assert cfg.rollout.over_sampling_batch_size == 48
    assert cfg.rollout.stop == ["foo", "###"]
    assert cfg.checkpoint.resume is False


def test_parse_override_yaml_values():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a.b=0.5") == (["a", "b"], 0.5)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=null") == (["a", "b"], None)
    assert parse_override("a.b=x=y") == (["a", "b"], "x=y")  # only the first '=' splits
    assert parse_override("a.b=") == (["a", "b"], "")


@pytest.mark.parametrize("bad", ["no_equals_sign", "=3", " . =3"])
def test_parse_override_rejects_malformed(bad):
    with pytest.raises(ConfigError, match="override"):
        parse_override(bad)


def test_override_into_a_value_is_an_error():
    # seed set by the file: the override walks into a scalar
    msg = _error(["seed.x=1"], TINY)
    assert "'seed' is a value, not a section" in msg
    # seed not set by the file: the override builds {x: 1}, which is then not an integer
    msg = _error(["seed.x=1"])
    assert "seed: Input should be a valid integer" in msg


def test_override_with_invalid_yaml_value():
    msg = _error(["rollout.stop=[a, b"])
    assert "rollout.stop=[a, b" in msg and "not valid YAML" in msg


# --------------------------------------------------------------------------------------------------------------------
# unknown keys
# --------------------------------------------------------------------------------------------------------------------
def test_unknown_top_level_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("nmae: x\n")
    msg = _error([], f)
    assert "nmae: unknown key" in msg


def test_unknown_key_in_section(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("grpo:\n  eps_clipp: 0.1\n")
    msg = _error([], f)
    assert "grpo.eps_clipp: unknown key" in msg


def test_unknown_key_via_override():
    msg = _error(["train.learning_rate=0.1"])
    assert "train.learning_rate: unknown key" in msg


def test_unknown_section_via_override():
    msg = _error(["trainer.lr=0.1"])
    assert "trainer: unknown key" in msg


def test_unknown_key_in_eval_dataset():
    msg = _error(["eval.datasets=[{name: a, source: builtin://arith, size: 3}]"])
    assert "eval.datasets.0.size: unknown key" in msg


# --------------------------------------------------------------------------------------------------------------------
# cross-field errors
# --------------------------------------------------------------------------------------------------------------------
def test_samples_not_divisible_by_global_batch():
    # 32 prompts * 8 samples = 256 samples; 256 % 48 = 16
    msg = _error(["train.global_batch_size=48"])
    assert "rollout.rollout_batch_size * rollout.n_samples_per_prompt" in msg
    assert "= 256 is not divisible by train.global_batch_size = 48" in msg
    assert "pick a global_batch_size that divides 256" in msg


def test_num_devices_not_divisible_by_model_parallel():
    # TP*PP = 2*2 = 4 does not divide 6 devices
    msg = _error(["train.num_devices=6", "train.tensor_parallel_size=2", "train.pipeline_parallel_size=2"])
    assert "train.num_devices = 6" in msg
    assert "train.tensor_parallel_size * train.pipeline_parallel_size = 4" in msg
    assert "multiple of 4" in msg


def test_global_batch_not_divisible_by_data_parallel():
    # 3 devices, TP=PP=1 -> DP = 3; global batch 256 % 3 = 1
    msg = _error(["train.num_devices=3"])
    assert "train.global_batch_size = 256 is not divisible by the data parallel size 3" in msg
    assert "multiple of 3" in msg


def test_colocate_needs_equal_device_counts():
    # 2 trainer devices vs 1 engine * TP 1 = 1 rollout device
    msg = _error(["cluster.colocate=true", "train.num_devices=2"])
    assert "cluster.colocate" in msg
    assert "train.num_devices = 2" in msg
    assert "rollout.num_engines * rollout.engine_tensor_parallel_size = 1" in msg
    assert "make them equal or set cluster.colocate = false" in msg
    # and the same layout with 2 engines is fine
    cfg = load_config(None, ["cluster.colocate=true", "train.num_devices=2", "rollout.num_engines=2"])
    assert cfg.rollout_devices == 2


def test_pass_k_above_samples_per_eval_prompt():
    msg = _error(["eval.pass_k=8", "eval.n_samples_per_eval_prompt=4"])
    assert "eval.pass_k = 8 is larger than eval.n_samples_per_eval_prompt = 4" in msg
    assert "lower eval.pass_k or raise eval.n_samples_per_eval_prompt" in msg


def test_cosine_schedule_needs_decay_steps():
    msg = _error(["train.lr_schedule=cosine"])
    assert "train.lr_schedule = cosine needs train.lr_decay_steps" in msg
    assert load_config(None, ["train.lr_schedule=cosine", "train.lr_decay_steps=100"]).train.lr_decay_steps == 100


def test_dynamic_sampling_needs_over_sampling_batch_size():
    msg = _error(["rollout.dynamic_sampling=true"])
    assert "rollout.dynamic_sampling needs rollout.over_sampling_batch_size" in msg


def test_cuda_ipc_needs_colocate():
    msg = _error(["sync.strategy=cuda_ipc"])
    assert "sync.strategy = cuda_ipc needs cluster.colocate = true" in msg


def test_vllm_kwargs_pass_through_but_not_the_arguments_vime_flow_sets():
    cfg = load_config(TINY, ["rollout.vllm_kwargs.max_num_seqs=64", "rollout.vllm_kwargs.async_scheduling=true"])
    assert cfg.rollout.vllm_kwargs == {"max_num_seqs": 64, "async_scheduling": True}
    assert flatten(cfg)["rollout.vllm_kwargs.max_num_seqs"] == 64  # one MLflow param per argument
    msg = _error(["rollout.vllm_kwargs.dtype=float16", "rollout.vllm_kwargs.gpu_memory_utilization=0.9"])
    assert "rollout.vllm_kwargs.dtype is set by vime-flow from model.dtype" in msg
    assert "rollout.vllm_kwargs.gpu_memory_utilization is set by vime-flow from rollout.gpu_memory_utilization" in msg


def test_cpu_platform_rejects_nccl():
    msg = _error(["cluster.platform=cpu", "sync.strategy=nccl"])
    assert "sync.strategy = nccl needs a GPU platform" in msg
    assert "cluster.platform = cpu" in msg and "use `cpu` or `auto`" in msg


def test_cpu_platform_rejects_vllms_v2_runner():
    msg = _error(["cluster.platform=cpu", "rollout.model_runner=v2"])
    assert "rollout.model_runner = v2 needs a GPU platform; on CPU set it to auto or v1" in msg
    assert load_config(TINY, ["cluster.platform=cuda", "rollout.model_runner=v2"]).rollout.model_runner == "v2"
    assert load_config(TINY, []).rollout.model_runner == "auto"


def test_cpu_platform_rejects_the_alltoall_dispatcher():
    msg = _error(["cluster.platform=cpu", "train.moe_token_dispatcher=alltoall"])
    assert "train.moe_token_dispatcher = alltoall needs a GPU platform; on CPU set it to allgather" in msg
    cfg = load_config(TINY, ["cluster.platform=cuda", "train.moe_token_dispatcher=alltoall"])
    assert cfg.train.moe_token_dispatcher == "alltoall"
    assert load_config(TINY, []).train.moe_token_dispatcher == "allgather"  # runs everywhere


def test_several_cross_field_problems_are_all_reported():
    msg = _error(["train.lr_schedule=linear", "rollout.dynamic_sampling=true"])
    assert "train.lr_decay_steps" in msg and "rollout.over_sampling_batch_size" in msg


# --------------------------------------------------------------------------------------------------------------------
# ranges
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, field",
    [
        ("grpo.eps_clip=1.5", "grpo.eps_clip"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("train.lr=-1e-5", "train.lr"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("train.global_batch_size=0", "train.global_batch_size"),
        ("model.dtype=float16", "model.dtype"),
    ],
)
def test_out_of_range_values_name_the_field(override, field):
    msg = _error([override])
    assert f"{field}: " in msg
    assert "(got " in msg  # the offending value is echoed


def test_all_range_errors_are_reported_together():
    msg = _error(["grpo.eps_clip=1.5", "rollout.temperature=0", "train.lr=-1"])
    assert "grpo.eps_clip: Input should be less than 1 (got 1.5)" in msg
    assert "rollout.temperature: Input should be greater than 0 (got 0)" in msg
    assert "train.lr: Input should be greater than 0 (got -1)" in msg


# --------------------------------------------------------------------------------------------------------------------
# flatten (the fingerprint: tests/unit/test_fingerprint.py)
# --------------------------------------------------------------------------------------------------------------------
def test_flatten_gives_dotted_keys():
    cfg = load_config(TINY)
    flat = flatten(cfg)
    assert flat["grpo.eps_clip"] == 0.2
    assert flat["train.lr"] == 1e-4
    assert flat["name"] == "tiny-cpu"
    assert flat["output_dir"] == "runs/tiny-cpu"
    assert flat["model.rollout_dtype"] is None
    assert flat["eval.datasets"] == [
        {"name": "arith-heldout", "source": "builtin://arith?split=heldout&size=128", "max_prompts": None}
    ]
    assert not any(isinstance(v, dict) for v in flat.values())
    # every field of every section appears exactly once
    n_fields = 3 + sum(
        len(type(getattr(cfg, s)).model_fields)
        for s in RunConfig.model_fields
        if s not in ("name", "seed", "output_dir")
    )
    assert len(flat) == n_fields


# --------------------------------------------------------------------------------------------------------------------
# bad files
# --------------------------------------------------------------------------------------------------------------------
def test_bad_yaml_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("grpo: [eps_clip: 0.1\n")
    msg = _error([], f)
    assert str(f) in msg and "is not valid YAML" in msg


def test_missing_file(tmp_path):
    f = tmp_path / "nope.yaml"
    msg = _error([], f)
    assert str(f) in msg and "does not exist" in msg


def test_non_mapping_yaml(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    msg = _error([], f)
    assert str(f) in msg and "must hold a mapping" in msg and "list" in msg


def test_empty_yaml_file_gives_defaults(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("# nothing\n")
    assert load_config(f) == RunConfig()


# --------------------------------------------------------------------------------------------------------------------
# documentation
# --------------------------------------------------------------------------------------------------------------------
def _nested_models(annotation) -> list[type[BaseModel]]:
    """Model classes inside an annotation (`ModelConfig`, `list[EvalDatasetConfig]`, `X | None`...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _nested_models(a)]


def _undocumented(cls: type[BaseModel], prefix: str = "") -> list[str]:
    missing = []
    for name, field in cls.model_fields.items():
        path = f"{prefix}{name}"
        nested = _nested_models(field.annotation)
        is_section = len(nested) == 1 and field.annotation is nested[0]
        if not is_section and not field.description:
            # a field holding a whole section (RunConfig.model, ...) is documented by its own fields
            missing.append(path)
        for m in nested:
            missing += _undocumented(m, path + ".")
    return missing


def test_every_field_has_a_description():
    missing = _undocumented(RunConfig)
    assert missing == []
    # the walk really reaches nested sections and list items
    names = set()

    def walk(cls, prefix=""):
        for n, f in cls.model_fields.items():
            names.add(prefix + n)
            for m in _nested_models(f.annotation):
                walk(m, prefix + n + ".")

    walk(RunConfig)
    assert {"train.adam_beta1", "train.adam_eps", "eval.datasets.source", "eval.temperature"} <= names


def test_sequence_parallel_is_refused_with_the_reason():
    msg = _error(["train.num_devices=2", "train.tensor_parallel_size=2", "train.sequence_parallel=true"])
    assert "train.sequence_parallel" in msg and "set it to false" in msg


def test_distributed_optimizer_needs_optimizer_checkpoints_off():
    msg = _error(["train.num_devices=2", "train.distributed_optimizer=true"])
    assert "checkpoint.save_optimizer = false" in msg
    assert "train.distributed_optimizer needs megatron" in _error(
        ["train.optimizer=adamw", "train.distributed_optimizer=true", "checkpoint.save_optimizer=false"]
    )
    cfg = load_config(
        None, ["train.num_devices=2", "train.distributed_optimizer=true", "checkpoint.save_optimizer=false"]
    )
    assert cfg.train.distributed_optimizer
