"""megatron-core GPTModel for Qwen3 / Qwen3-MoE: build from an HF config, load HF weights, gather full weights back,
and the vocab-parallel log-prob / entropy math the trainer needs.

Expects `torch.distributed` and megatron's `parallel_state` to be initialised (see `train.init_parallel`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from vime_core.models import spec_of
from vime_core.models.qwen3 import Qwen3Arch
from vime_core.memory import RECOMPUTE
from vime_core.namediff import describe_name_diff, name_diff

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def recompute_options(recompute: str, num_layers: int, is_moe: bool) -> dict:
    """megatron's activation-recompute settings for `train.recompute`.

    - `selective`: recompute the MLP (dense layers) / the MoE block in backward. Saved activations per token and layer
      of a Qwen3-1.7B layer (bf16, counted with saved-tensor hooks on CPU): 143 KB -> 83 KB (the CPU norms save fp32
      copies; ~100 KB -> ~36 KB with CUDA's fused RMSNorm), for one more MLP forward (~45% of a layer's forward at
      4k tokens).
      Core attention is not recomputed: the fused kernel saves only q, k, v and the output already.
    - `full`: keep only each layer's input (4 KB per token and layer) and recompute the whole layer (one more
      forward: ~33% more compute).
    """
    if recompute == "none":
        return {}
    if not torch.cuda.is_available():
        _shim_checkpoint_rng_for_cpu()
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["moe"] if is_moe else ["mlp"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"train.recompute = {recompute!r}: expected one of {', '.join(RECOMPUTE)}")


def _shim_checkpoint_rng_for_cpu() -> None:
    """megatron's activation checkpoint saves and restores the CUDA RNG state around the recomputed forward; a CPU-only
    torch has none. Nothing random is recomputed (dropout is 0), and the CPU RNG state is still restored."""
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def moe_options(arch: Qwen3Arch, ep: int, grouped_gemm: bool = False, dispatcher: str = "allgather") -> dict:
    """TransformerConfig's MoE fields for Qwen3-MoE at expert-parallel size `ep`; `grouped_gemm`: the experts are
    vime_core.grouped_experts.TorchGroupedMLP instead of SequentialMLP (build_gpt reads the field); `dispatcher`:
    train.moe_token_dispatcher."""
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        # Qwen3-MoE: softmax over all experts, top-k, renormalise (norm_topk_prob) == softmax over the top-k logits
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_grouped_gemm=grouped_gemm,
        # allgather gathers every layer's tokens over the TP x EP group in equal pieces (no split sizes); alltoall
        # takes split sizes but is collective per layer too. So the trainer gives each EP rank the same count of
        # equal-sized micro-batches either way (trainer.batching.lockstep_pads).
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep,
    )


def transformer_config(
    arch: Qwen3Arch,
    dtype: str,
    tp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    on_cpu: bool = True,
    pp: int = 1,
    recompute: str = "none",
    grouped_gemm: bool = False,
    routing_replay: bool = False,
    dispatcher: str = "allgather",
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch_dtype = DTYPES[dtype]
    moe = moe_options(arch, ep, grouped_gemm, dispatcher) if arch.is_moe else {}
    if arch.is_moe and routing_replay:  # a RouterReplay per router (rollout.routing_replay: vime_core.trainer.routing)
        moe["moe_enable_routing_replay"] = True
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # megatron's SwiGLUFunction (torch.compile) on GPUs: it saves only the fc1 output for backward where the
        # unfused glu saves two more [tokens, ffn] tensors (24 of ~118 KB per token and Qwen3-1.7B layer), and takes
        # 0.70 ms for 0.79 ms forward + backward at 8,272 tokens on an H200 (bench/kernel_variants.py); the other
        # fused kernels need Transformer Engine / apex
        bias_activation_fusion=not on_cpu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        params_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        pipeline_dtype=torch_dtype,
        # keep softmax in fp32 under bf16 so that log-probs match vLLM's closely
        attention_softmax_in_fp32=True,
        **recompute_options(recompute, arch.num_layers, arch.is_moe),
        **moe,
    )


def build_gpt(arch: Qwen3Arch, config, attention: str = "sdpa", lean_norm: bool = True) -> torch.nn.Module:
    """This rank's GPTModel (its pipeline stage: embedding on the first, output layer on the last).

    `attention`: `sdpa` (fused, packed sequences: vime_core.attention) or `local` (megatron's unfused
    DotProductAttention, kept as the reference of the equivalence tests). `lean_norm`: the layers' RMSNorms are
    `LeanRMSNorm` instead of torch's (same parameters and values, a quarter of the saved activations)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    position_embedding = "rope"
    if attention == "sdpa":
        from megatron.core.transformer.spec_utils import ModuleSpec

        from vime_core.attention import SDPAttention

        # the core attention applies RoPE from tables computed once per forward (vime_core.attention): the model's own
        # RoPE would recompute them in every layer
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=SDPAttention, params={"rope_base": float(arch.rope_theta)}
        )
        position_embedding = "none"
    elif attention != "local":
        raise ValueError(f"attention = {attention!r}: expected sdpa or local")
    if arch.is_moe and config.moe_grouped_gemm:
        use_grouped_experts(spec)
    if lean_norm:
        use_lean_norms(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type=position_embedding,
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
    )
    # megatron's torch-norm fallback (no Apex/TE) builds the final norm in fp32 whatever params_dtype says: keep every
    # weight in the model's dtype, as HF and vLLM hold it (and megatron-core 0.16.1's host-side optimizer refuses a
    # non-leaf fp32 view of it: train.optimizer_cpu_offload)
    for p in model.parameters():
        if p.dtype != config.params_dtype:
            p.data = p.data.to(config.params_dtype)
    return model


def use_lean_norms(spec) -> None:
    """The layer spec's torch RMSNorms -> LeanRMSNorm (same parameters and values, less saved activation)."""
    layer, attn = spec.submodules, spec.submodules.self_attention.submodules
    for owner, name in (
        (layer, "input_layernorm"),
        (layer, "pre_mlp_layernorm"),
        (attn, "q_layernorm"),
        (attn, "k_layernorm"),
    ):
        if getattr(owner, name) is not None and getattr(getattr(owner, name), "__name__", "") == "WrappedTorchNorm":
            setattr(owner, name, LeanRMSNorm)


def use_grouped_experts(spec) -> None:
    """The MoE layer spec's experts -> vime_core.grouped_experts.TorchGroupedMLP. Swapped into the spec rather than
    asked of megatron's spec builder, whose legacy GroupedMLP needs the grouped_gemm package and warns that it is
    deprecated in favour of Transformer Engine's."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from vime_core.grouped_experts import TorchGroupedMLP

    spec.submodules.mlp.submodules.experts = ModuleSpec(module=TorchGroupedMLP)


def _rms_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd


def _rms_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    normed = x.float() * rstd
    gf = grad.float()
    grad_w = (gf * normed).reshape(-1, weight.numel()).sum(0)
    g = gf * weight.float()
    # y = x r with r = (mean(x^2) + eps)^-1/2:  dx = r (g - n mean(g n)), n = x r
    grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)


_FUSED: dict = {}


def fused(fn):
    """`fn` compiled by torch.compile (one Triton kernel instead of ~10 elementwise passes) on CUDA; eager if that
    fails (no compiler): the values are the same."""
    if fn not in _FUSED:
        _FUSED[fn] = torch.compile(fn, dynamic=True)
    compiled = _FUSED[fn]
    if compiled is fn:
        return fn

    def run(*args):
        try:
            return compiled(*(without_view_base(a) for a in args))
        except torch.OutOfMemoryError:  # the step is too big: eager would need the same memory, and hide the cause
            raise
        except Exception as e:  # inductor needs a C compiler and Triton: fall back once, for good
            logging.getLogger(__name__).warning("torch.compile of %s failed (%s); using eager", fn.__name__, e)
            _FUSED[fn] = fn
            return fn(*args)

    return run


def without_view_base(t):
    """`t`'s memory, sizes and strides as a tensor that is not a view of another (`_base` None), for inputs that
    autograd does not follow. dynamo guards a view input on its base's sizes and strides as well as its own: the
    q/k norms' rows are views into the QKV output, so each new layout of a base compiled another graph; on CPU (tiny
    MoE loop) `_rms_backward` compiled 7 (dynamo's limit is 8), two of them in the second training step, and 4
    without the base: contiguous rows and strided rows, each split once more by a row-count guard of inductor's CPU
    code generator."""
    if not isinstance(t, torch.Tensor) or t._base is None or (t.requires_grad and torch.is_grad_enabled()):
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
    )


def kernel(fn, x: torch.Tensor):
    """`fn` as the norms run it on `x`'s device: fused on CUDA, eager elsewhere (tests swap in other compilers)."""
    return fused(fn) if x.is_cuda else fn


class _RMSNormFn(torch.autograd.Function):
    """torch's rms_norm values (x / rms(x) x weight in fp32, cast to the input dtype), saving only the input and the
    fp32 1/rms per row: torch's composite saves two fp32 copies of the input per norm (measured on an H200: 56 of the
    154 KB of saved activations per token and Qwen3-1.7B layer; 118 KB with this norm).

    The kernels see 2-D [rows, d] tensors without autograd state: one compiled callable serves the layer norms
    ([t, 1, h]) and the q/k norms ([t, 1, heads, head_dim], strided views of the QKV output), with and without
    requires_grad, Parameter or not; given the tensors as they come, dynamo compiled a graph per variant and hit its
    recompile limit (8) on an H200 run. Reshaped, and passed without their view bases (`fused`): one graph each way
    for contiguous rows and one for strided rows, besides the code generator's own guards."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        shape = x.shape
        x2 = x.detach().reshape(-1, shape[-1])
        y, rstd = kernel(_rms_forward, x)(x2, weight.detach(), eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd = ctx.saved_tensors
        shape = ctx.shape
        grad_x, grad_w = kernel(_rms_backward, x2)(grad.reshape(-1, shape[-1]).contiguous(), x2, weight.detach(), rstd)
        return grad_x.view(shape), (grad_w if ctx.needs_input_grad[1] else None), None


class LeanRMSNorm(torch.nn.Module):
    """RMSNorm for megatron's local spec (the constructor of its WrappedTorchNorm), with `_RMSNormFn`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError("LeanRMSNorm: only RMSNorm (Qwen3's) is supported")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (or the model itself)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def output_weight(gpt: torch.nn.Module) -> torch.Tensor:
    """This rank's vocab shard [V/tp, h] of the output layer (the embedding when they are tied)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


@contextmanager
def hidden_states_only(gpt: torch.nn.Module):
    """While active, GPTModel's forward returns the final-norm hidden states [s, b, h] instead of logits: its
    `_postprocess` returns them before the output layer when `post_process` is false."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def parallel_ranks() -> tuple[int, int, int, int]:
    """(tp, tp_rank, ep, ep_rank) from megatron's parallel_state."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_model_parallel_rank(),
    )


def load_full_weights(model: torch.nn.Module, full: Mapping[str, torch.Tensor], arch: Qwen3Arch) -> None:
    """Copy full megatron tensors (global expert ids) into this rank's model shards. Strict about names."""
    from megatron.core import parallel_state as ps

    tp, tp_rank, ep, ep_rank = parallel_ranks()
    local = (
        spec_of(arch)
        .mapping()
        .local_view(
            full,
            tp,
            tp_rank,
            ep,
            ep_rank,
            arch.num_experts,
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_rank(),
            arch.num_layers,
        )
    )
    from vime_core.grouped_experts import group_experts, is_grouped  # imports megatron

    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if arch.is_moe and is_grouped(own):
        local = group_experts(local)
    missing, unexpected = name_diff(own, local)
    if missing or unexpected:
        raise ValueError("weights do not fit the megatron model: " + describe_name_diff(missing, unexpected))
    with torch.no_grad():
        for name, t in own.items():
            src = local[name]
            if src.shape != t.shape:
                raise ValueError(f"{name}: checkpoint shard {tuple(src.shape)} vs model {tuple(t.shape)}")
            t.copy_(src.to(t.dtype))


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    n = dist.get_world_size(group)
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def local_weights(model: torch.nn.Module, num_local_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's (name, detached tensor) pairs, MoE experts under SequentialMLP's per-expert names whichever
    experts module the model runs (vime_core.grouped_experts)."""
    from vime_core.grouped_experts import ungroup_experts  # imports megatron

    for name, t in model.state_dict().items():
        if not name.endswith("_extra_state"):
            yield from (
                ungroup_experts(name, t.detach(), num_local_experts) if num_local_experts else [(name, t.detach())]
            )


def iter_full_weights(model: torch.nn.Module, arch: Qwen3Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (megatron name with global expert id, full tensor) for every parameter. Collective: every rank of the
    TP and EP groups must iterate in step; all of them receive the full tensors."""
    from megatron.core import parallel_state as ps

    tp, _, ep, _ = parallel_ranks()
    tp_group = ps.get_tensor_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    per_rank = arch.num_experts // ep if arch.num_experts else 0
    mapping = spec_of(arch).mapping()
    for name, t in local_weights(model, arch.num_experts // ep if arch.is_moe else 0):
        e = mapping.expert_index(name)
        if e is not None:
            shards_by_ep = _all_gather(t, ep_group) if ep > 1 else [t]
            for r, shard in enumerate(shards_by_ep):
                global_name = mapping.with_expert_index(name, r * per_rank + e)
                yield global_name, mapping.unshard_tp(name, _all_gather(shard, tp_group)) if tp > 1 else shard
        else:
            yield name, mapping.unshard_tp(name, _all_gather(t, tp_group)) if tp > 1 else t


# --------------------------------------------------------------------------------------------------------------------
# log-probs and entropy over (possibly vocab-parallel) logits
# --------------------------------------------------------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) from logits [..., V/tp] sharded over the TP group (differentiable)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if ps.get_tensor_model_parallel_world_size() == 1:
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    x = logits.float().contiguous()
    if x is logits:  # megatron's function overwrites its input in place (shift, exp): keep the caller's logits intact
        x = x.clone()
    return -vocab_parallel_cross_entropy(x, targets)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, logits sharded over the TP group (differentiable)."""
    from megatron.core import parallel_state as ps

    logits = logits.float()
    if ps.get_tensor_model_parallel_world_size() == 1:
        logp = torch.log_softmax(logits, dim=-1)
        return -(logp.exp() * logp).sum(-1)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = ps.get_tensor_model_parallel_group()
    gmax = logits.max(dim=-1, keepdim=True).values.detach()
    dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - gmax
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1, keepdim=True))
    sum_exp_x = reduce_from_tensor_model_parallel_region((exp * shifted).sum(-1, keepdim=True))
    # H = log Z - E[x] with x the shifted logits
    return (sum_exp.log() - sum_exp_x / sum_exp).squeeze(-1)
