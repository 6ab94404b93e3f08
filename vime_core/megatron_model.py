"""megatron-core GPTModel for Qwen3 / Qwen3-MoE: build from an HF config, load HF weights, gather full weights back,
and the vocab-parallel log-prob / entropy math the trainer needs.

Expects `torch.distributed` and megatron's `parallel_state` to be initialised (see `train.init_parallel`).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from vime_core.qwen3_mapping import Qwen3Arch, expert_index, local_view, unshard_tp, with_expert_index

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config(arch: Qwen3Arch, dtype: str, tp: int = 1, ep: int = 1, sequence_parallel: bool = False, on_cpu: bool = True,
                       pp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch_dtype = DTYPES[dtype]
    moe = {}
    if arch.is_moe:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            # Qwen3-MoE: softmax over all experts, top-k, renormalise (norm_topk_prob) == softmax over the top-k logits
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            expert_model_parallel_size=ep,
        )
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
        # fused kernels are CUDA-only or need Transformer Engine / apex
        bias_activation_fusion=False,
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
        **moe,
    )


def build_gpt(arch: Qwen3Arch, config) -> torch.nn.Module:
    """This rank's GPTModel (its pipeline stage: embedding on the first, output layer on the last)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
    )


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
    local = local_view(full, tp, tp_rank, ep, ep_rank, arch.num_experts, ps.get_pipeline_model_parallel_world_size(),
                       ps.get_pipeline_model_parallel_rank(), arch.num_layers)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(set(own) - set(local)), sorted(set(local) - set(own))
    if missing or unexpected:
        raise ValueError(f"weights do not fit the megatron model: missing {missing[:5]}, unexpected {unexpected[:5]}")
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


def iter_full_weights(model: torch.nn.Module, arch: Qwen3Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (megatron name with global expert id, full tensor) for every parameter. Collective: every rank of the
    TP and EP groups must iterate in step; all of them receive the full tensors."""
    from megatron.core import parallel_state as ps

    tp, _, ep, _ = parallel_ranks()
    tp_group = ps.get_tensor_model_parallel_group()
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    per_rank = arch.num_experts // ep if arch.num_experts else 0
    for name, t in model.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        t = t.detach()
        e = expert_index(name)
        if e is not None:
            shards_by_ep = _all_gather(t, ep_group) if ep > 1 else [t]
            for r, shard in enumerate(shards_by_ep):
                global_name = with_expert_index(name, r * per_rank + e)
                yield global_name, unshard_tp(name, _all_gather(shard, tp_group)) if tp > 1 else shard
        else:
            yield name, unshard_tp(name, _all_gather(t, tp_group)) if tp > 1 else t


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
