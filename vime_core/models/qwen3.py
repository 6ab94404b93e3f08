"""Qwen3 and Qwen3-MoE: the architecture read from an HF config.json, the parallel layouts that fit it, and (in
`qwen3_mapping`, which imports torch) its weights between HF and megatron-core names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from vime_core.errors import VimeError
from vime_core.models.spec import Layout


class UnsupportedModelError(VimeError, ValueError):
    """The HF config describes something this mapping does not handle; the message names the field."""


@dataclass(frozen=True)
class Qwen3Arch:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def arch_from_hf_config(hf: Mapping[str, Any], where: str | Path | None = None) -> Qwen3Arch:
    """Read a Qwen3 / Qwen3-MoE config.json (of the model at `where`, for messages); anything the mapping does not
    support raises with the field named."""
    model_type = hf.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise UnsupportedModelError(
            f"model {where or '(config.json)'} is not a Qwen3/Qwen3-MoE checkpoint (model_type "
            f"{model_type}); vime-flow trains model_type qwen3 and qwen3_moe only"
        )
    check_supported_attention(hf)
    rope = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise UnsupportedModelError("config.json has neither rope_theta nor rope_parameters.rope_theta")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    absent = [k for k in required if k not in hf]
    if absent:
        raise UnsupportedModelError(f"config.json lacks {', '.join(absent)}")
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", heads)
    if heads % kv:
        raise UnsupportedModelError(f"num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv}")
    common = dict(
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
    )
    return Qwen3Arch(**common) if model_type == "qwen3" else Qwen3Arch(**common, **moe_fields(hf))


def check_supported_attention(hf: Mapping[str, Any]) -> None:
    """Qwen3's attention only: no bias, SiLU, default RoPE, no sliding window; raises naming the field otherwise."""
    if hf.get("attention_bias"):
        raise UnsupportedModelError("config.json attention_bias = true is not supported (Qwen3 has no attention bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config.json hidden_act = {hf.get('hidden_act')!r}: only silu is supported")
    for field in ("rope_parameters", "rope_scaling"):  # either may be present (transformers 5 / 4): check both
        rope_type = (hf.get(field) or {}).get("rope_type") or (hf.get(field) or {}).get("type") or "default"
        if rope_type != "default":
            raise UnsupportedModelError(
                f"config.json {field}.rope_type = {rope_type!r} is not supported (only default RoPE)"
            )
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise UnsupportedModelError(
            "config.json use_sliding_window / layer_types: sliding-window attention is not supported"
        )


def moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert fields; the MoE variants the mapping does not cover raise naming the field."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError("qwen3_moe config.json has no num_experts")
    if hf.get("mlp_only_layers"):
        raise UnsupportedModelError(
            f"config.json mlp_only_layers = {hf['mlp_only_layers']} (dense layers in an MoE) is not supported"
        )
    if hf.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModelError(
            f"config.json decoder_sparse_step = {hf['decoder_sparse_step']} is not supported (only 1)"
        )
    if hf.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("config.json shared_expert_intermediate_size: shared experts are not supported")
    return dict(
        num_experts=int(experts),
        moe_topk=int(hf["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
    )


# --------------------------------------------------------------------------------------------------------------------
# the one layout check
# --------------------------------------------------------------------------------------------------------------------
def layout_problems(arch: Qwen3Arch, layout: Layout) -> list[str]:
    """Every way `layout` does not fit the model, each naming the setting and the fix. Used by the config-time check
    (`vime_core.models.check_model_compat`, before any actor starts) and by the HF -> torch_dist conversion."""
    n = layout.names
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.engine_tp
    if min(tp, pp, ep, etp or 1) < 1:
        return [
            f"{n['tp']}, {n['pp']} and {n['ep']} must be at least 1 (got {n['tp']}={tp} {n['pp']}={pp} {n['ep']}={ep})"
        ]
    kind = "qwen3_moe" if arch.is_moe else "qwen3"
    ffn, ffn_field = (
        (arch.moe_ffn_hidden_size, "moe_intermediate_size")
        if arch.is_moe
        else (arch.ffn_hidden_size, "intermediate_size")
    )
    problems = []

    def divides(name: str, size: int, count: int, what: str) -> None:  # what: "{} attention heads"
        if count % size:
            problems.append(
                f"{n[name]} = {size} does not divide the model's {what.format(count)}; use a {n[name]} that "
                f"divides {count}"
            )

    # megatron shards heads, KV groups, the vocabulary and the MLP over its TP ranks
    divides("tp", tp, arch.num_heads, "{} attention heads")
    divides("tp", tp, arch.num_kv_heads, "{} KV groups (num_key_value_heads)")
    divides("tp", tp, arch.vocab_size, "vocabulary size {} (vocab_size)")
    divides("tp", tp, ffn, f"MLP size {{}} ({ffn_field})")
    divides("pp", pp, arch.num_layers, "{} layers")
    if etp is not None:  # vLLM shards heads and the MLP too, and replicates KV heads when its TP is a multiple of them
        divides("engine_tp", etp, arch.num_heads, "{} attention heads")
        divides("engine_tp", etp, ffn, f"MLP size {{}} ({ffn_field})")
        if arch.num_kv_heads % etp and etp % arch.num_kv_heads:
            problems.append(
                f"{n['engine_tp']} = {etp} neither divides nor is a multiple of the model's "
                f"{arch.num_kv_heads} KV groups (num_key_value_heads)"
            )
    if layout.trains and arch.is_moe and tp > 1:
        problems.append(
            f"{n['tp']} = {tp} with a MoE model: megatron-core trains MoE layers under TP only with "
            f"sequence parallel, which is not supported yet; set {n['tp']} = 1"
        )
    if ep > 1:
        if not arch.is_moe:
            problems.append(f"{n['ep']} = {ep} but the model ({kind}) has no experts; set {n['ep']} = 1")
        else:
            divides("ep", ep, arch.num_experts, "{} experts")
    return problems


def tensor_numels_per_device(arch: Qwen3Arch, layout: Layout) -> list[int]:
    """Elements of each weight tensor one trainer rank holds at `layout`, as its torch_dist checkpoint writes them (TP
    shards every matrix and the vocabulary, PP the layers, EP the experts, each expert's fc1 and fc2 a tensor of
    their own; norms and the router are replicated). The largest pipeline stage: it holds the embedding and, when the
    output layer is untied, sits on the last stage too (counted on one stage, an upper bound)."""
    h, d, tp = arch.hidden_size, arch.head_dim, layout.tp
    attn = [(arch.num_heads + 2 * arch.num_kv_heads) * d * h // tp, arch.num_heads * d * h // tp, d, d, h, h]
    if arch.is_moe:
        f = arch.moe_ffn_hidden_size
        mlp = [2 * f * h // tp, f * h // tp] * (arch.num_experts // layout.ep) + [h * arch.num_experts]
    else:
        mlp = [2 * arch.ffn_hidden_size * h // tp, arch.ffn_hidden_size * h // tp]
    layers = -(-arch.num_layers // layout.pp) * (attn + mlp)
    vocab = [arch.vocab_size * h // tp] * (1 if arch.tie_embeddings or layout.pp > 1 else 2)
    return layers + vocab + [h]  # + the final norm


def params_per_device(arch: Qwen3Arch, layout: Layout) -> int:
    """Parameters one trainer rank holds at `layout`: the sum of `tensor_numels_per_device`."""
    return sum(tensor_numels_per_device(arch, layout))


def expert_params_per_device(arch: Qwen3Arch, layout: Layout) -> int:
    """The routed experts' share of `params_per_device` (0 for a dense model): megatron shards their optimizer state
    over the expert-data-parallel group, not the data-parallel one."""
    if not arch.is_moe:
        return 0
    per_layer = arch.num_experts // layout.ep * 3 * arch.hidden_size * arch.moe_ffn_hidden_size // layout.tp
    return -(-arch.num_layers // layout.pp) * per_layer


class Qwen3Spec:
    """The Qwen3 family behind `vime_core.models.spec.ModelSpec`."""

    family = "Qwen3/Qwen3-MoE"
    model_types = ("qwen3", "qwen3_moe")
    arch_type = Qwen3Arch

    def arch_from_hf_config(self, hf: Mapping[str, Any], where: str | Path | None = None) -> Qwen3Arch:
        return arch_from_hf_config(hf, where)

    def layout_problems(self, arch: Qwen3Arch, layout: Layout) -> list[str]:
        return layout_problems(arch, layout)

    def params_per_device(self, arch: Qwen3Arch, layout: Layout) -> int:
        return params_per_device(arch, layout)

    def expert_params_per_device(self, arch: Qwen3Arch, layout: Layout) -> int:
        return expert_params_per_device(arch, layout)

    def tensor_numels_per_device(self, arch: Qwen3Arch, layout: Layout) -> list[int]:
        return tensor_numels_per_device(arch, layout)

    def mapping(self) -> ModuleType:
        from vime_core.models import qwen3_mapping  # imports torch (~1.7 s): only where weights are handled

        return qwen3_mapping


SPEC = Qwen3Spec()
