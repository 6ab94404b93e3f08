"""The one typed run configuration.

`RunConfig` holds every knob of a run in sections (model, data, rollout, train, grpo, sync, eval, checkpoint,
cluster, tracking). Defaults follow vime's Qwen3 scripts where they apply (see shared REFERENCE.md); the embedded
CPU default lives in `configs/tiny-cpu.yaml`. Configs load from YAML plus dotted overrides
(`--set grpo.eps_clip_high=0.28`); unknown keys are errors.

Validation happens in two stages:
- `RunConfig` itself checks everything the config alone determines (batch arithmetic, device counts, ranges);
- `check_model_compat(cfg, arch)` checks what needs the model's architecture (tensor parallel vs heads and KV groups,
  experts vs expert parallel), before any actor starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vime_core.errors import VimeError

__all__ = [
    "RunConfig",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "check_model_compat",
    "ModelArch",
]


class ConfigError(VimeError, ValueError):
    """A configuration problem, with a message that names the field(s) and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)




# --------------------------------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------------------------------
class ModelConfig(_Section):
    source: Annotated[
        str,
        Field(
            description="Where the HF checkpoint comes from: `builtin://tiny-qwen3-arith`, `hf://org/name[@revision]`, "
            "a local directory, or `mlflow://models:/<name>@<alias>`."
        ),
    ] = "builtin://tiny-qwen3-arith"
    dtype: Annotated[
        Literal["float32", "bfloat16"],
        Field(description="Parameter and compute dtype of the trainer (and of vLLM unless `rollout_dtype` is set)."),
    ] = "bfloat16"
    rollout_dtype: Annotated[
        Literal["float32", "bfloat16"] | None,
        Field(description="vLLM's dtype; None means the same as `dtype`."),
    ] = None

    @property
    def engine_dtype(self) -> str:
        return self.rollout_dtype or self.dtype


class DataConfig(_Section):
    source: Annotated[
        str,
        Field(description="Training prompts: `builtin://arith`, a .jsonl/.parquet path, or `hf://datasets/org/name`."),
    ] = "builtin://arith"
    prompt_key: Annotated[str, Field(min_length=1, description="Row key holding the prompt (text or chat messages).")] = (
        "prompt"
    )
    label_key: Annotated[str, Field(min_length=1, description="Row key holding the reference answer.")] = "label"
    apply_chat_template: Annotated[
        bool, Field(description="Render prompts with the tokenizer's chat template (a plain string becomes one user turn).")
    ] = True
    max_prompt_len: Annotated[int, Field(ge=1, description="Prompts longer than this many tokens are rejected.")] = 1024
    bad_rows: Annotated[
        Literal["error", "skip"],
        Field(description="A malformed row stops loading with an error naming file and row (`error`), or is skipped and counted (`skip`)."),
    ] = "error"
    shuffle: Annotated[bool, Field(description="Shuffle prompts each epoch (seeded by `seed` and the epoch).")] = True


class RolloutConfig(_Section):
    num_rollout: Annotated[int, Field(ge=1, description="Number of rollout -> train -> sync steps of the run.")] = 100
    rollout_batch_size: Annotated[int, Field(ge=1, description="Prompts per rollout step.")] = 32
    n_samples_per_prompt: Annotated[int, Field(ge=1, description="Samples per prompt (the GRPO group size).")] = 8
    max_response_len: Annotated[int, Field(ge=1, description="Maximum generated tokens per sample.")] = 8192
    temperature: Annotated[float, Field(gt=0.0, le=10.0, description="Sampling temperature.")] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, description="Nucleus sampling threshold.")] = 1.0
    top_k: Annotated[int, Field(ge=-1, description="Top-k sampling; -1 disables it.")] = -1
    stop: Annotated[list[str], Field(description="Extra stop strings (EOS always stops).")] = []
    num_engines: Annotated[int, Field(ge=1, description="vLLM engines behind the router.")] = 1
    engine_tensor_parallel_size: Annotated[int, Field(ge=1, description="Devices (tensor parallel) per engine.")] = 1
    gpu_memory_utilization: Annotated[
        float, Field(gt=0.0, le=0.95, description="Fraction of device memory vLLM may use (GPU only).")
    ] = 0.5
    cpu_kv_cache_gib: Annotated[float, Field(gt=0.0, le=512, description="KV cache size on CPU, GiB.")] = 1.0
    enforce_eager: Annotated[bool, Field(description="Disable CUDA graphs / compilation in vLLM.")] = False
    reward: Annotated[
        str,
        Field(description="`math` (boxed answer vs label, math-verify) or a dotted path `pkg.module:function`."),
    ] = "math"
    reward_type: Annotated[
        Literal["sample", "group"],
        Field(description="A custom reward function scores one sample (`sample`) or a whole group (`group`)."),
    ] = "sample"
    strict_format: Annotated[
        bool, Field(description="Math reward: 0 unless the response ends with the boxed answer and EOS (no truncation).")
    ] = False
    reward_timeout_s: Annotated[
        float,
        Field(gt=0.0, le=3600.0, description="Time limit of one reward call: math-verify is killed at it (score 0, e.g. "
                                             "`9^{9^{9^{9}}}`); a custom reward over it stops the run naming the sample."),
    ] = 10.0
    custom_generate: Annotated[
        str | None,
        Field(description="Dotted path of an async function replacing per-sample generation (multi-turn, tools)."),
    ] = None
    dynamic_sampling: Annotated[
        bool, Field(description="DAPO dynamic sampling: drop groups whose reward std is zero, top up by over-sampling.")
    ] = False
    over_sampling_batch_size: Annotated[
        int | None, Field(ge=1, description="Prompts generated per attempt when dynamic sampling is on.")
    ] = None
    max_sampling_attempts: Annotated[
        int, Field(ge=1, le=64, description="Dynamic sampling gives up topping up after this many attempts.")
    ] = 8
    timeout_s: Annotated[
        int,
        Field(ge=10, description="Timeout of one call to the vLLM engines (a generate batch, an eval, the engine start); "
                                 "a hung engine then fails the run naming itself instead of stalling it forever."),
    ] = 1800


class TrainConfig(_Section):
    num_devices: Annotated[int, Field(ge=1, description="Trainer ranks (devices); data parallel = num_devices / (TP*PP).")] = 1
    tensor_parallel_size: Annotated[int, Field(ge=1, description="Megatron tensor parallel size.")] = 1
    pipeline_parallel_size: Annotated[int, Field(ge=1, description="Megatron pipeline parallel size.")] = 1
    expert_parallel_size: Annotated[int, Field(ge=1, description="Megatron expert parallel size (MoE).")] = 1
    sequence_parallel: Annotated[
        bool,
        Field(description="Megatron sequence parallel. Not supported yet: megatron-core has a sequence-parallel RMSNorm "
                          "only in its Transformer Engine layer spec, and vime-flow builds the local spec; must be false."),
    ] = False
    global_batch_size: Annotated[int, Field(ge=1, description="Samples per optimizer step.")] = 256
    timeout_s: Annotated[
        int,
        Field(ge=10, description="Timeout of one call to the trainer ranks (a rollout's training, a checkpoint save or "
                                 "load, the trainer start); a hung rank then fails the run naming itself."),
    ] = 3600
    max_tokens_per_device: Annotated[
        int,
        Field(ge=16, description="Token budget of one micro-batch: the summed length of the samples packed into one row "
                                 "(no padding). 9216 holds two 4,096-token responses: measured trainer peak for "
                                 "Qwen3-1.7B bf16 on an H200 (2 x 4,136 tokens, megatron optimizer) 44.6 GiB with "
                                 "train.recompute = selective, 57.9 GiB with none (29 GiB of weights, fp32 grads and "
                                 "Adam state + 58 / 118 KB of saved activations per token and layer). A budget that "
                                 "does not fit fails naming this field."),
    ] = 9216
    recompute: Annotated[
        Literal["auto", "none", "selective", "full"],
        Field(description="Activation recompute (megatron): `none` keeps every activation; `selective` recomputes each "
                          "layer's MLP (the MoE block) in backward; `full` recomputes whole layers (least memory, one "
                          "more forward). `auto`: selective on GPUs, none on CPU. Measured on an H200, Qwen3-1.7B bf16, "
                          "2 x 4,136 tokens per micro-batch: selective 44.6 GiB peak and 21.9k fwd+bwd tok/s, none "
                          "57.9 GiB and 19.9k."),
    ] = "auto"
    logprob_chunk_tokens: Annotated[
        int,
        Field(ge=1, description="Tokens per chunk of the log-prob / entropy computation from the final hidden states: "
                                "no [tokens, vocab] tensor is kept; one chunk needs ~4 x chunk x vocab/TP fp32 "
                                "(1024 x 151,936: 2.5 GB)."),
    ] = 1024
    offload_optimizer: Annotated[
        Literal["auto"] | bool,
        Field(description="Move the optimizer state (Adam moments, fp32 main params) and gradients to pinned host "
                          "memory while vLLM generates, and back before training. `auto`: on for colocated GPUs "
                          "(cluster.colocate) only; `true`: on every GPU placement; no effect on CPU."),
    ] = "auto"
    optimizer: Annotated[
        Literal["auto", "adamw", "megatron"],
        Field(description="`adamw`: torch AdamW with a TP-aware clip (CPU); `megatron`: megatron-core's optimizer (GPU); `auto` picks by platform."),
    ] = "auto"
    distributed_optimizer: Annotated[
        bool,
        Field(description="Shard megatron's optimizer state over data-parallel ranks (saves memory when DP > 1). Its "
                          "checkpoint format is not implemented yet: needs checkpoint.save_optimizer = false."),
    ] = False
    lr: Annotated[float, Field(gt=0.0, le=1.0, description="Peak learning rate.")] = 1e-6
    min_lr: Annotated[float, Field(ge=0.0, description="Learning rate at the end of decay.")] = 0.0
    lr_schedule: Annotated[
        Literal["constant", "cosine", "linear"],
        Field(description="Schedule over optimizer steps; defined by absolute step so that extending a run is well defined."),
    ] = "constant"
    lr_warmup_steps: Annotated[int, Field(ge=0, description="Linear warm-up optimizer steps.")] = 0
    lr_decay_steps: Annotated[
        int | None, Field(ge=1, description="Optimizer steps of decay (cosine/linear); after them the LR stays at min_lr.")
    ] = None
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0, description="AdamW weight decay.")] = 0.1
    adam_beta1: Annotated[float, Field(ge=0.0, lt=1.0, description="Adam first-moment decay (beta1).")] = 0.9
    adam_beta2: Annotated[float, Field(ge=0.0, lt=1.0, description="Adam second-moment decay (beta2).")] = 0.98
    adam_eps: Annotated[float, Field(gt=0.0, le=1e-3, description="Adam epsilon added to the denominator.")] = 1e-8
    clip_grad: Annotated[float, Field(ge=0.0, description="Clip gradients to this global norm; 0 disables clipping.")] = 1.0
    cpu_threads: Annotated[
        int | None, Field(ge=1, description="torch threads of the trainer on CPU; None uses every core.")
    ] = None

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.num_devices // self.model_parallel_size


class GRPOConfig(_Section):
    normalize_std: Annotated[
        bool, Field(description="Divide group-centred rewards by the group std (GRPO); False is Dr.GRPO.")
    ] = True
    policy_loss: Annotated[
        Literal["ppo", "gspo"], Field(description="Token-level clipped ratio (`ppo`) or GSPO's sequence-level ratio.")
    ] = "ppo"
    eps_clip: Annotated[float, Field(gt=0.0, lt=1.0, description="Lower clip: ratio >= 1 - eps_clip.")] = 0.2
    eps_clip_high: Annotated[float, Field(gt=0.0, le=10.0, description="Upper clip: ratio <= 1 + eps_clip_high (DAPO clip-higher).")] = 0.28
    dual_clip_c: Annotated[
        float | None, Field(gt=1.0, description="Dual-clip constant for negative advantages (None disables).")
    ] = None
    kl_loss_coef: Annotated[float, Field(ge=0.0, description="Weight of the KL loss against the frozen reference.")] = 0.0
    kl_loss_type: Annotated[Literal["k1", "k2", "k3", "low_var_kl"], Field(description="KL estimator.")] = "low_var_kl"
    entropy_coef: Annotated[float, Field(ge=0.0, description="Entropy bonus weight.")] = 0.0
    loss_aggregation: Annotated[
        Literal["sample_mean", "token_mean"],
        Field(description="Mean over samples of per-sample token means (vime default), or mean over all tokens."),
    ] = "sample_mean"
    use_tis: Annotated[bool, Field(description="Truncated importance sampling against rollout log-probs.")] = False
    tis_cap: Annotated[float, Field(gt=0.0, description="Upper clamp of the TIS weight.")] = 2.0


class SyncConfig(_Section):
    strategy: Annotated[
        Literal["auto", "cpu", "cuda_ipc", "nccl"],
        Field(description="Weight sync: `cpu` (tensors through Ray), `cuda_ipc` (colocated), `nccl` (disaggregated); `auto` picks by mode."),
    ] = "auto"
    bucket_size_mb: Annotated[int, Field(ge=1, le=16384, description="Pack weights into buckets of this size.")] = 512
    timeout_s: Annotated[
        int, Field(ge=10, description="Timeout of each actor call of a weight sync (NCCL rendezvous included).")
    ] = 900


class EvalDatasetConfig(_Section):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Metric name: eval/<name>/pass@1.")]
    source: Annotated[str, Field(description="Same sources as data.source.")]
    max_prompts: Annotated[int | None, Field(ge=1, description="Evaluate only the first N prompts.")] = None


class EvalConfig(_Section):
    datasets: Annotated[list[EvalDatasetConfig], Field(description="Held-out datasets.")] = []
    interval: Annotated[int | None, Field(ge=1, description="Evaluate every N rollout steps (None: only before and after).")] = None
    before_train: Annotated[bool, Field(description="Evaluate once before the first step (the baseline).")] = True
    n_samples_per_eval_prompt: Annotated[int, Field(ge=1, description="Samples per eval prompt (pass@k uses them).")] = 4
    pass_k: Annotated[int, Field(ge=1, description="k of pass@k (unbiased estimator); <= n_samples_per_eval_prompt.")] = 4
    temperature: Annotated[float, Field(gt=0.0, le=10.0, description="Sampling temperature of eval generations.")] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, description="Nucleus sampling threshold of eval generations.")] = 1.0
    max_response_len: Annotated[int | None, Field(ge=1, description="None: rollout.max_response_len.")] = None
    timeout_s: Annotated[
        int,
        Field(ge=10, description="Timeout of one eval generate call (a whole eval set: often far more prompts and "
                                 "samples than a rollout batch, so it has its own bound, not rollout.timeout_s)."),
    ] = 7200


class CheckpointConfig(_Section):
    save_interval: Annotated[int | None, Field(ge=1, description="Save every N rollout steps (and always at the end).")] = None
    keep_last: Annotated[int, Field(ge=1, description="Keep this many most recent checkpoints.")] = 2
    resume: Annotated[
        bool, Field(description="Resume from the latest complete checkpoint in the save dir if there is one.")
    ] = True
    start_fresh: Annotated[
        bool, Field(description="Move an existing save dir aside (renamed with a timestamp) and start from step 0.")
    ] = False
    save_optimizer: Annotated[bool, Field(description="Include optimizer state (needed for exact resume).")] = True


class ClusterConfig(_Section):
    platform: Annotated[Literal["auto", "cpu", "cuda", "rocm"], Field(description="Device platform; auto detects.")] = "auto"
    colocate: Annotated[
        bool, Field(description="Trainer and vLLM share devices and take turns (needs equal device counts).")
    ] = False
    ray_address: Annotated[
        str | None, Field(description="Join this Ray cluster; None starts a local one on 127.0.0.1 (or uses RAY_ADDRESS).")
    ] = None
    num_cpus: Annotated[int | None, Field(ge=1, description="Logical CPUs of a local Ray (None: detected).")] = None


class TrackingConfig(_Section):
    enabled: Annotated[bool, Field(description="Log params, metrics and artifacts to MLflow.")] = True
    uri: Annotated[
        str | None,
        Field(description="MLflow tracking URI; None: MLFLOW_TRACKING_URI or a local sqlite store under output_dir's parent."),
    ] = None
    experiment: Annotated[str | None, Field(description="Experiment name; None: the config's name.")] = None
    registered_model: Annotated[str | None, Field(description="Registry name for the final policy; None: vime-<name>.")] = None
    log_checkpoints: Annotated[bool, Field(description="Log checkpoint locations as artifacts references.")] = True


# --------------------------------------------------------------------------------------------------------------------
# the run config
# --------------------------------------------------------------------------------------------------------------------
class RunConfig(_Section):
    """Everything a run needs. Build it with `load_config`."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="Run family name (MLflow experiment).")] = "vime"
    seed: Annotated[int, Field(ge=0, description="Seed of data order, sampling and initialisation.")] = 1234
    output_dir: Annotated[Path, Field(description="Checkpoints, converted weights and exports go here.")] = Path("runs/vime")

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    grpo: GRPOConfig = GRPOConfig()
    sync: SyncConfig = SyncConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    cluster: ClusterConfig = ClusterConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RunConfig":
        problems = list(_cross_field_problems(self))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # derived quantities ------------------------------------------------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def num_steps_per_rollout(self) -> int:
        return self.samples_per_rollout // self.train.global_batch_size

    @property
    def rollout_devices(self) -> int:
        return self.rollout.num_engines * self.rollout.engine_tensor_parallel_size

    @property
    def save_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    def fingerprint_fields(self) -> dict[str, Any]:
        """What must not change across a resume: model, layout and algorithm. Sizes of the run (num_rollout) may."""
        d = self.model_dump(mode="json")
        return {
            "model": d["model"],
            "data": {k: d["data"][k] for k in ("source", "prompt_key", "label_key", "apply_chat_template")},
            "rollout": {
                k: d["rollout"][k]
                for k in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len", "temperature", "top_p", "top_k", "reward")
            },
            "train": {
                k: d["train"][k]
                for k in (
                    "num_devices",
                    "tensor_parallel_size",
                    "pipeline_parallel_size",
                    "expert_parallel_size",
                    "global_batch_size",
                    "optimizer",
                    "lr",
                    "min_lr",
                    "lr_schedule",
                    "lr_warmup_steps",
                    "lr_decay_steps",
                    "weight_decay",
                    "adam_beta1",
                    "adam_beta2",
                )
            },
            "grpo": d["grpo"],
            "seed": d["seed"],
        }

    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _cross_field_problems(c: RunConfig):
    r, t = c.rollout, c.train
    samples = c.samples_per_rollout
    if samples % t.global_batch_size:
        yield (
            f"rollout.rollout_batch_size * rollout.n_samples_per_prompt = {r.rollout_batch_size} * "
            f"{r.n_samples_per_prompt} = {samples} is not divisible by train.global_batch_size = {t.global_batch_size}; "
            f"pick a global_batch_size that divides {samples}"
        )
    if t.num_devices % t.model_parallel_size:
        yield (
            f"train.num_devices = {t.num_devices} is not divisible by train.tensor_parallel_size * "
            f"train.pipeline_parallel_size = {t.model_parallel_size}; use a num_devices that is a multiple of "
            f"{t.model_parallel_size} or smaller parallel sizes"
        )
    elif t.global_batch_size % t.data_parallel_size:
        yield (
            f"train.global_batch_size = {t.global_batch_size} is not divisible by the data parallel size "
            f"{t.data_parallel_size} (train.num_devices / (TP*PP)); pick a global_batch_size that is a multiple of "
            f"{t.data_parallel_size}"
        )
    if t.expert_parallel_size > 1 and t.num_devices % t.expert_parallel_size:
        yield f"train.expert_parallel_size = {t.expert_parallel_size} does not divide train.num_devices = {t.num_devices}"
    if t.sequence_parallel:
        yield ("train.sequence_parallel is not supported yet (megatron-core's local layer spec, which vime-flow builds, "
               "has no sequence-parallel RMSNorm); set it to false")
    if t.distributed_optimizer and t.optimizer == "adamw":
        yield "train.distributed_optimizer needs megatron's optimizer; set train.optimizer to megatron or auto"
    if t.distributed_optimizer and c.checkpoint.save_optimizer:
        yield ("train.distributed_optimizer = true cannot be checkpointed yet (its sharded optimizer format is not "
               "implemented); set checkpoint.save_optimizer = false (a resume then restarts Adam's moments) or "
               "train.distributed_optimizer = false")
    if c.cluster.colocate and t.num_devices != c.rollout_devices:
        yield (
            f"cluster.colocate needs as many trainer devices as rollout devices: train.num_devices = {t.num_devices} but "
            f"rollout.num_engines * rollout.engine_tensor_parallel_size = {c.rollout_devices}; make them equal or "
            f"set cluster.colocate = false"
        )
    if c.cluster.platform == "cpu" and c.sync.strategy in ("cuda_ipc", "nccl"):
        yield f"sync.strategy = {c.sync.strategy} needs a GPU platform; on cluster.platform = cpu use `cpu` or `auto`"
    if c.sync.strategy == "cuda_ipc" and not c.cluster.colocate:
        yield "sync.strategy = cuda_ipc needs cluster.colocate = true (IPC handles only work on shared devices)"
    if t.lr_schedule != "constant" and t.lr_decay_steps is None:
        yield f"train.lr_schedule = {t.lr_schedule} needs train.lr_decay_steps (so that extending a run keeps the schedule)"
    if t.min_lr > t.lr:
        yield f"train.min_lr = {t.min_lr} is above train.lr = {t.lr}"
    if c.eval.pass_k > c.eval.n_samples_per_eval_prompt:
        yield (
            f"eval.pass_k = {c.eval.pass_k} is larger than eval.n_samples_per_eval_prompt = "
            f"{c.eval.n_samples_per_eval_prompt}; lower eval.pass_k or raise eval.n_samples_per_eval_prompt"
        )
    names = [d.name for d in c.eval.datasets]
    if len(set(names)) != len(names):
        yield f"eval.datasets names must be unique, got {names}"
    if r.dynamic_sampling:
        if r.over_sampling_batch_size is None:
            yield "rollout.dynamic_sampling needs rollout.over_sampling_batch_size (prompts per attempt)"
    if c.grpo.policy_loss == "gspo" and c.grpo.use_tis:
        yield "grpo.use_tis is token-level and not defined for grpo.policy_loss = gspo"


# --------------------------------------------------------------------------------------------------------------------
# model-aware checks
# --------------------------------------------------------------------------------------------------------------------
class ModelArch(BaseModel):
    """The architecture facts validation needs, read from an HF config.json."""

    model_type: str
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    num_experts: int = 0

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelArch":
        return cls(
            model_type=hf.get("model_type", "?"),
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            num_hidden_layers=hf["num_hidden_layers"],
            vocab_size=hf["vocab_size"],
            num_experts=hf.get("num_experts", 0) or 0,
        )


def check_model_compat(cfg: RunConfig, arch: ModelArch) -> None:
    """Raise ConfigError when the parallel layout does not fit the model (before any actor starts)."""
    t, r = cfg.train, cfg.rollout
    problems = []
    tp = t.tensor_parallel_size
    if arch.num_attention_heads % tp:
        problems.append(f"train.tensor_parallel_size = {tp} does not divide the model's {arch.num_attention_heads} attention heads")
    if arch.num_key_value_heads % tp:
        problems.append(
            f"train.tensor_parallel_size = {tp} does not divide the model's {arch.num_key_value_heads} KV groups "
            f"(num_key_value_heads); use a size that divides {arch.num_key_value_heads}"
        )
    if arch.vocab_size % tp:
        problems.append(f"train.tensor_parallel_size = {tp} does not divide the model's vocabulary size {arch.vocab_size}")
    etp = r.engine_tensor_parallel_size
    if arch.num_attention_heads % etp:
        problems.append(f"rollout.engine_tensor_parallel_size = {etp} does not divide the model's {arch.num_attention_heads} attention heads")
    # vLLM replicates KV heads when its TP is a multiple of the KV groups
    if arch.num_key_value_heads % etp and etp % arch.num_key_value_heads:
        problems.append(
            f"rollout.engine_tensor_parallel_size = {etp} neither divides nor is a multiple of the model's "
            f"{arch.num_key_value_heads} KV groups (num_key_value_heads)"
        )
    if arch.num_hidden_layers % t.pipeline_parallel_size:
        problems.append(
            f"train.pipeline_parallel_size = {t.pipeline_parallel_size} does not divide the model's "
            f"{arch.num_hidden_layers} layers"
        )
    if arch.num_experts and tp > 1:
        problems.append(
            f"train.tensor_parallel_size = {tp} with a MoE model: megatron-core trains MoE layers under TP only with "
            f"sequence parallel, which is not supported yet; set train.tensor_parallel_size = 1 and spread the experts "
            f"with train.expert_parallel_size"
        )
    if t.expert_parallel_size > 1:
        if not arch.num_experts:
            problems.append(f"train.expert_parallel_size = {t.expert_parallel_size} but the model ({arch.model_type}) has no experts")
        elif arch.num_experts % t.expert_parallel_size:
            problems.append(
                f"train.expert_parallel_size = {t.expert_parallel_size} does not divide the model's {arch.num_experts} experts"
            )
    if problems:
        raise ConfigError("config does not fit the model: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------------------------
def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML so that numbers, bools and lists get their types)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = json.loads(json.dumps(data, default=str))  # deep copy of plain data
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not a field of this section; check the spelling)"
        got = err.get("input")
        tail = f" (got {got!r})" if err["type"] not in ("extra_forbidden", "value_error", "missing") and not isinstance(got, dict) else ""
        lines.append(f"{loc}: {msg}{tail}" if loc else msg)
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """`section.field -> value` for logging as params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", cfg.model_dump(mode="json"))
    return out
