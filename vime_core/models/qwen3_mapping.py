"""Qwen3 / Qwen3-MoE weights: HF checkpoint names <-> megatron-core local-spec names, and tensor-parallel sharding.

HF side: the safetensors checkpoint format (what `save_pretrained` writes and vLLM loads), MoE experts as
`mlp.experts.<e>.{gate,up,down}_proj.weight`. Megatron side: `GPTModel` built from the local layer spec, experts as
`mlp.experts.local_experts.<e>.linear_fc{1,2}.weight` (SequentialMLP's names; a model built with grouped experts
converts its two expert tensors to them at its edge: vime_core.grouped_experts). All functions here work on *full* tensors with
*global* expert ids; `shard_tp` / `unshard_tp` and `local_expert_name` / `global_expert_name` go between full and a
rank's local view. Checked against transformers' logits in tests (fp32, < 1e-4).

Layout facts that matter:
- `linear_qkv` holds, per query group, `[q heads of the group, k, v]`, so a contiguous TP chunk is whole groups;
- `linear_fc1` is `[gate; up]` *per TP rank*: a rank's shard is `[gate_r; up_r]`, not a plain chunk of the full one;
- `input_layernorm` of the HF layer is the local spec's `input_layernorm` (TE specs fuse it into `linear_qkv`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

import torch

from vime_core.errors import VimeError
from vime_core.namediff import describe_name_diff, name_diff

if TYPE_CHECKING:
    from vime_core.models.qwen3 import Qwen3Arch  # the architecture (read from config.json) lives there

Tensor = torch.Tensor


class CheckpointMismatchError(VimeError, ValueError):
    """The checkpoint's tensors do not match what the config says; the message names the tensors."""


# --------------------------------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------------------------------
def hf_names(arch: Qwen3Arch) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if arch.is_moe:
            names.append(p + "mlp.gate.weight")
            names += [
                p + f"mlp.experts.{e}.{x}.weight"
                for e in range(arch.num_experts)
                for x in ("gate_proj", "up_proj", "down_proj")
            ]
        else:
            names += [p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
    return names


def check_hf_names(present: set[str], arch: Qwen3Arch, where: str = "checkpoint") -> None:
    """Raise naming the missing / unexpected tensors (HF may also store a tied lm_head: allowed)."""
    missing, unexpected = name_diff(hf_names(arch), present, {"lm_head.weight"} if arch.tie_embeddings else ())
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{where} does not match its config.json ({'qwen3_moe' if arch.is_moe else 'qwen3'}, "
            f"{arch.num_layers} layers): " + describe_name_diff(missing, unexpected)
        )


def check_shapes(hf: Mapping[str, Tensor], arch: Qwen3Arch, where: str = "checkpoint") -> None:
    H, D = arch.hidden_size, arch.head_dim
    want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, H), "model.norm.weight": (H,)}
    if not arch.tie_embeddings:
        want["lm_head.weight"] = (arch.vocab_size, H)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        want.update(
            {
                p + "self_attn.q_proj.weight": (arch.num_heads * D, H),
                p + "self_attn.k_proj.weight": (arch.num_kv_heads * D, H),
                p + "self_attn.v_proj.weight": (arch.num_kv_heads * D, H),
                p + "self_attn.o_proj.weight": (H, arch.num_heads * D),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
            }
        )
        if arch.is_moe:
            F = arch.moe_ffn_hidden_size
            want[p + "mlp.gate.weight"] = (arch.num_experts, H)
            for e in range(arch.num_experts):
                q = p + f"mlp.experts.{e}."
                want.update(
                    {q + "gate_proj.weight": (F, H), q + "up_proj.weight": (F, H), q + "down_proj.weight": (H, F)}
                )
        else:
            F = arch.ffn_hidden_size
            want.update(
                {
                    p + "mlp.gate_proj.weight": (F, H),
                    p + "mlp.up_proj.weight": (F, H),
                    p + "mlp.down_proj.weight": (H, F),
                }
            )
    for name, shape in want.items():  # values: tensors, or shapes (read from safetensors headers)
        got = tuple(getattr(hf[name], "shape", hf[name]))
        if got != shape:
            fields = (
                "vocab_size, hidden_size" if name in ("model.embed_tokens.weight", "lm_head.weight") else "its sizes"
            )
            raise CheckpointMismatchError(
                f"{where}: tensor {name} has shape {got}, config.json implies {shape} (from {fields}); config.json "
                "does not describe these weights: restore the config.json they were saved with, or download the "
                "model again"
            )


# --------------------------------------------------------------------------------------------------------------------
# full-tensor conversion
# --------------------------------------------------------------------------------------------------------------------
def hf_to_mcore(hf: Mapping[str, Tensor], arch: Qwen3Arch) -> dict[str, Tensor]:
    """Full HF tensors -> full megatron tensors (global expert ids). Validates names and shapes first."""
    check_hf_names(set(hf), arch)
    check_shapes(hf, arch)
    H, D, G, qpg = arch.hidden_size, arch.head_dim, arch.num_kv_heads, arch.q_per_group
    out = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not arch.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(arch.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].reshape(G, qpg * D, H)
        k = hf[p + "self_attn.k_proj.weight"].reshape(G, D, H)
        v = hf[p + "self_attn.v_proj.weight"].reshape(G, D, H)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, H)
        out[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[m + "self_attention.q_layernorm.weight"] = hf[p + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[p + "self_attn.k_norm.weight"]
        out[m + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        if arch.is_moe:
            out[m + "mlp.router.weight"] = hf[p + "mlp.gate.weight"]
            for e in range(arch.num_experts):
                src, dst = p + f"mlp.experts.{e}.", m + f"mlp.experts.local_experts.{e}."
                out[dst + "linear_fc1.weight"] = torch.cat(
                    [hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]], 0
                )
                out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]
        else:
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], 0
            )
            out[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_PARAM = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_SIMPLE = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def mcore_param_to_hf(name: str, t: Tensor, arch: Qwen3Arch) -> list[tuple[str, Tensor]]:
    """One full megatron parameter (global expert id) -> its HF tensor(s). Per parameter, so exports can stream."""
    if name in _TOP:
        return [(_TOP[name], t)]
    m = _LAYER.fullmatch(name)
    if not m:
        raise CheckpointMismatchError(f"megatron parameter {name} has no HF counterpart")
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _SIMPLE:
        return [(p + _SIMPLE[rest], t)]
    if rest == "self_attention.linear_qkv.weight":
        H, D, G, qpg = arch.hidden_size, arch.head_dim, arch.num_kv_heads, arch.q_per_group
        q, k, v = torch.split(t.reshape(G, (qpg + 2) * D, H), [qpg * D, D, D], dim=1)
        return [
            (p + "self_attn.q_proj.weight", q.reshape(-1, H)),
            (p + "self_attn.k_proj.weight", k.reshape(-1, H)),
            (p + "self_attn.v_proj.weight", v.reshape(-1, H)),
        ]
    if rest == "mlp.linear_fc1.weight":
        gate, up = torch.chunk(t, 2, 0)
        return [(p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up)]
    e = _EXPERT_PARAM.fullmatch(rest)
    if e:
        q = p + f"mlp.experts.{e.group(1)}."
        if e.group(2) == "linear_fc2":
            return [(q + "down_proj.weight", t)]
        gate, up = torch.chunk(t, 2, 0)
        return [(q + "gate_proj.weight", gate), (q + "up_proj.weight", up)]
    raise CheckpointMismatchError(f"megatron parameter {name} has no HF counterpart")


# --------------------------------------------------------------------------------------------------------------------
# tensor / expert parallel views
# --------------------------------------------------------------------------------------------------------------------
_COL = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_FUSED = ("linear_fc1.weight",)


def tp_split(name: str) -> tuple[int | None, bool]:
    """(dim split across TP ranks or None if replicated, whether the tensor is a fused [gate; up])."""
    if name.endswith(_FUSED):
        return 0, True
    if name.endswith(_COL):
        return 0, False
    if name.endswith(_ROW):
        return 1, False
    return None, False


def shard_tp(name: str, full: Tensor, tp: int, rank: int) -> Tensor:
    dim, fused = tp_split(name)
    if dim is None or tp == 1:
        return full
    if fused:
        gate, up = torch.chunk(full, 2, 0)
        return torch.cat([torch.chunk(gate, tp, 0)[rank], torch.chunk(up, tp, 0)[rank]], 0).contiguous()
    return torch.chunk(full, tp, dim)[rank].contiguous()


def unshard_tp(name: str, shards: list[Tensor]) -> Tensor:
    dim, fused = tp_split(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if fused:
        halves = [torch.chunk(s, 2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(shards, dim)


_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")


def expert_index(name: str) -> int | None:
    m = _EXPERT.match(name)
    return int(m.group(2)) if m else None


def with_expert_index(name: str, index: int) -> str:
    m = _EXPERT.match(name)
    assert m, name
    return f"{m.group(1)}{index}{m.group(3)}"


def local_view(
    full: Mapping[str, Tensor],
    tp: int,
    tp_rank: int,
    ep: int,
    ep_rank: int,
    num_experts: int,
    pp: int = 1,
    pp_rank: int = 0,
    num_layers: int | None = None,
) -> dict[str, Tensor]:
    """A rank's local megatron state dict from full tensors: its pipeline stage's layers (renumbered from 0, the
    embedding on the first stage, the final norm and output layer on the last), its experts (local ids) and its TP
    shards."""
    per_rank = num_experts // ep if num_experts else 0
    per_stage = (num_layers // pp) if (pp > 1 and num_layers) else None
    out = {}
    for name, t in full.items():
        if per_stage is not None:
            m = _LAYER.fullmatch(name)
            if m:
                layer = int(m.group(1))
                if layer // per_stage != pp_rank:
                    continue
                name = f"decoder.layers.{layer - pp_rank * per_stage}.{m.group(2)}"
            elif name.startswith("embedding.") and pp_rank != 0:
                continue
            elif name.startswith(("decoder.final_layernorm", "output_layer")) and pp_rank != pp - 1:
                continue
        e = expert_index(name)
        if e is not None:
            if e // per_rank != ep_rank:
                continue
            name = with_expert_index(name, e - ep_rank * per_rank)
        out[name] = shard_tp(name, t, tp, tp_rank)
    return out
