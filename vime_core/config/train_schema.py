"""The trainer's sections of `RunConfig`: `train` (layout, batch and micro-batch sizes, memory knobs, optimizer, LR
schedule) and `grpo` (the loss: advantages, clipping, KL, entropy, TIS). The other sections and `RunConfig` itself are
in `schema`; every name is importable from `vime_core.config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from vime_core.config.fingerprint import FIXED, FREE
from vime_core.config.section import Section


class TrainConfig(Section):
    num_devices: Annotated[
        int, FIXED, Field(ge=1, description="Trainer ranks (devices); data parallel = num_devices / (TP*PP).")
    ] = 1
    tensor_parallel_size: Annotated[int, FIXED, Field(ge=1, description="Megatron tensor parallel size.")] = 1
    pipeline_parallel_size: Annotated[int, FIXED, Field(ge=1, description="Megatron pipeline parallel size.")] = 1
    expert_parallel_size: Annotated[int, FIXED, Field(ge=1, description="Megatron expert parallel size (MoE).")] = 1
    sequence_parallel: Annotated[
        bool,
        FIXED,
        Field(
            description="Megatron sequence parallel. Not supported yet: megatron-core has a sequence-parallel RMSNorm "
            "only in its Transformer Engine layer spec, and vime-flow builds the local spec; must be false."
        ),
    ] = False
    moe_grouped_gemm: Annotated[
        Literal["auto"] | bool,
        FIXED,
        Field(
            description="MoE experts as one grouped GEMM per projection (megatron's GroupedMLP on torch._grouped_mm) "
            "instead of a loop over experts (SequentialMLP), which launches a kernel per expert (speed: "
            "bench/gpu_scale.py's loop_sequential phase). Same values; torch_dist checkpoints load either way. `auto`: on for "
            "MoE models whose expert GEMMs have 16-byte rows (every Qwen3-MoE). Fixed across a resume: the "
            "optimizer state is saved per parameter, and the two hold different parameters."
        ),
    ] = "auto"
    moe_token_dispatcher: Annotated[
        Literal["allgather", "alltoall"],
        FREE,
        Field(
            description="How an MoE layer hands its tokens to the experts (megatron's token dispatcher). "
            "`allgather`: every rank of the TP x EP group gathers all tokens and keeps those routed to its own "
            "experts; runs on every platform. `alltoall`: each token goes only to the ranks holding its experts "
            "(megatron's recommended dispatcher at EP > 1); needs a GPU platform, since megatron builds a CUDA "
            "stream for it. Same values either way, so a resume may switch; at EP = 1 both permute locally "
            "(speed: bench/gpu_scale.py's loop_alltoall phase)."
        ),
    ] = "allgather"
    global_batch_size: Annotated[int, FIXED, Field(ge=1, description="Samples per optimizer step.")] = 256
    timeout_s: Annotated[
        int,
        FREE,
        Field(
            ge=10,
            description="Timeout of one call to the trainer ranks (a rollout's training, a checkpoint save or "
            "load, the trainer start); a hung rank then fails the run naming itself.",
        ),
    ] = 3600
    stall_timeout_s: Annotated[
        int,
        FREE,
        Field(
            ge=0,
            description="Progress window of a rollout's training: a rank that finishes no micro-batch (forward "
            "or backward) and no optimizer step for this long is reported as hung, naming it, within this window "
            "plus 10 s, instead of after train.timeout_s. Progress, not call time: a whole 8B training step on "
            "4,096-token samples takes 60-120 s on an H200, each of its micro-batches seconds. 0 turns the check "
            "off.",
        ),
    ] = 180
    max_tokens_per_device: Annotated[
        int,
        FREE,
        Field(
            ge=16,
            description="Token budget of one micro-batch: the summed length of the samples packed into one row "
            "(no padding). 9216 holds two 4,096-token responses (vime's --max-tokens-per-gpu; peaks per shape in "
            "bench/trainer_profile.py). A budget that does not fit fails naming this field.",
        ),
    ] = 9216
    recompute: Annotated[
        Literal["auto", "none", "selective", "full"],
        FREE,
        Field(
            description="Activation recompute (megatron): `none` keeps every activation; `selective` recomputes each "
            "layer's MLP (the MoE block) in backward; `full` recomputes whole layers (least memory, one "
            "more forward). `auto`: selective on GPUs (about 10% slower than none for a third less peak memory at "
            "Qwen3-1.7B, bench/trainer_profile.py), none on CPU."
        ),
    ] = "auto"
    logprob_chunk_tokens: Annotated[
        int,
        FREE,
        Field(
            ge=1,
            description="Tokens per chunk of the log-prob / entropy computation from the final hidden states: "
            "no [tokens, vocab] tensor is kept; one chunk needs ~4 x chunk x vocab/TP fp32 "
            "(1024 x 151,936: 2.5 GB).",
        ),
    ] = 1024
    logprob_keep_logits: Annotated[
        bool,
        FREE,
        Field(
            description="Keep each log-prob chunk's logits (in the weights' dtype) from forward to backward instead "
            "of recomputing them there: one output-layer matmul less per trained token, for response tokens x "
            "vocab/TP x 2 bytes more at the peak by arithmetic. Same values and gradients. Off: the measured peak "
            "grew far more than that arithmetic for a few percent of speed (bench/trainer_profile.py).",
        ),
    ] = False
    old_logprobs: Annotated[
        Literal["auto", "forward"],
        FREE,
        Field(
            description="Where the old-policy log-probs of the PPO ratio come from. `forward`: a no-grad forward "
            "over the whole rollout before training (slime's way). `auto`: the first optimizer step of "
            "a rollout runs on the old policy's weights, so its training forward's own log-probs "
            "(detached) serve, and the no-grad pass covers only the later steps' samples (none with "
            "one step per rollout). The same values up to kernel noise, a forward less per trained token "
            "(bench/trainer_profile.py)."
        ),
    ] = "auto"
    offload_optimizer: Annotated[
        Literal["auto"] | bool,
        FREE,
        Field(
            description="Move the optimizer state (Adam moments, fp32 main params) and gradients to pinned host "
            "memory while vLLM generates, and back before training. `auto`: on for colocated GPUs "
            "whose engines sleep (cluster.colocate, cluster.engines_sleep) only; `true`: on every GPU placement; "
            "no effect on CPU."
        ),
    ] = "auto"
    optimizer_cpu_offload: Annotated[
        bool,
        FIXED,
        Field(
            description="Keep megatron's fp32 master weights, Adam moments and their gradient copies in pinned host "
            "memory and run their Adam step on the host CPU (megatron-core's HybridDeviceOptimizer, through its "
            "distributed optimizer): what lets Qwen3-8B train on one 141 GB GPU (configs/qwen3-8b-cuda-1gpu.yaml). "
            "Host memory: 16 bytes per offloaded parameter. GPU platforms and train.optimizer megatron/auto only.",
        ),
    ] = False
    optimizer_offload_fraction: Annotated[
        float,
        FIXED,
        Field(
            ge=0.0,
            le=1.0,
            description="With train.optimizer_cpu_offload: the share of the parameters whose optimizer state "
            "lives on the host; the rest (12 bytes per parameter) stays on the GPU through both phases. Lower it "
            "when host memory is what runs out (the fit check names both numbers).",
        ),
    ] = 1.0
    optimizer: Annotated[
        Literal["auto", "adamw", "megatron"],
        FIXED,
        Field(
            description="`adamw`: torch AdamW with a TP-aware clip (CPU); `megatron`: megatron-core's optimizer (GPU); `auto` picks by platform."
        ),
    ] = "auto"
    distributed_optimizer: Annotated[
        bool,
        FIXED,
        Field(
            description="Shard megatron's optimizer state over data-parallel ranks (saves memory when DP > 1). Its "
            "checkpoint format is not implemented yet: needs checkpoint.save_optimizer = false."
        ),
    ] = False
    lr: Annotated[float, FIXED, Field(gt=0.0, le=1.0, description="Peak learning rate.")] = 1e-6
    min_lr: Annotated[float, FIXED, Field(ge=0.0, description="Learning rate at the end of decay.")] = 0.0
    lr_schedule: Annotated[
        Literal["constant", "cosine", "linear"],
        FIXED,
        Field(
            description="Schedule over optimizer steps; defined by absolute step so that extending a run is well defined."
        ),
    ] = "constant"
    lr_warmup_steps: Annotated[int, FIXED, Field(ge=0, description="Linear warm-up optimizer steps.")] = 0
    lr_decay_steps: Annotated[
        int | None,
        FIXED,
        Field(ge=1, description="Optimizer steps of decay (cosine/linear); after them the LR stays at min_lr."),
    ] = None
    weight_decay: Annotated[float, FIXED, Field(ge=0.0, le=1.0, description="AdamW weight decay.")] = 0.1
    adam_beta1: Annotated[float, FIXED, Field(ge=0.0, lt=1.0, description="Adam first-moment decay (beta1).")] = 0.9
    adam_beta2: Annotated[float, FIXED, Field(ge=0.0, lt=1.0, description="Adam second-moment decay (beta2).")] = 0.98
    adam_eps: Annotated[float, FIXED, Field(gt=0.0, le=1e-3, description="Adam epsilon added to the denominator.")] = (
        1e-8
    )
    clip_grad: Annotated[
        float, FIXED, Field(ge=0.0, description="Clip gradients to this global norm; 0 disables clipping.")
    ] = 1.0
    cpu_threads: Annotated[
        int | None,
        FREE,
        Field(
            ge=1,
            description="torch threads of the trainer on CPU, and of the host-side Adam step of "
            "train.optimizer_cpu_offload on GPUs. None: every core on-policy (split between the trainer ranks "
            "for the host-side step); with rollout.max_staleness > 0 the CPU cores are split with the engines.",
        ),
    ] = None

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.num_devices // self.model_parallel_size


class GRPOConfig(Section):
    normalize_std: Annotated[
        bool, FIXED, Field(description="Divide group-centred rewards by the group std (GRPO); False is Dr.GRPO.")
    ] = True
    policy_loss: Annotated[
        Literal["ppo", "gspo"],
        FIXED,
        Field(description="Token-level clipped ratio (`ppo`) or GSPO's sequence-level ratio."),
    ] = "ppo"
    eps_clip: Annotated[float, FIXED, Field(gt=0.0, lt=1.0, description="Lower clip: ratio >= 1 - eps_clip.")] = 0.2
    eps_clip_high: Annotated[
        float, FIXED, Field(gt=0.0, le=10.0, description="Upper clip: ratio <= 1 + eps_clip_high (DAPO clip-higher).")
    ] = 0.28
    dual_clip_c: Annotated[
        float | None, FIXED, Field(gt=1.0, description="Dual-clip constant for negative advantages (None disables).")
    ] = None
    kl_loss_coef: Annotated[
        float, FIXED, Field(ge=0.0, description="Weight of the KL loss against the frozen reference.")
    ] = 0.0
    kl_loss_type: Annotated[Literal["k1", "k2", "k3", "low_var_kl"], FIXED, Field(description="KL estimator.")] = (
        "low_var_kl"
    )
    entropy_coef: Annotated[float, FIXED, Field(ge=0.0, description="Entropy bonus weight.")] = 0.0
    loss_aggregation: Annotated[
        Literal["sample_mean", "token_mean"],
        FIXED,
        Field(description="Mean over samples of per-sample token means (vime default), or mean over all tokens."),
    ] = "sample_mean"
    use_tis: Annotated[
        bool | Literal["auto"],
        FIXED,
        Field(
            description="Truncated importance sampling against the rollout log-probs (weights exp(old - rollout) "
            "capped at tis_cap). `auto`: on when rollout.max_staleness > 0 (samples from an older "
            "policy than the trained one), off on-policy; the loaded config holds the resolved bool."
        ),
    ] = "auto"
    tis_cap: Annotated[float, FIXED, Field(gt=0.0, description="Upper clamp of the TIS weight.")] = 2.0
