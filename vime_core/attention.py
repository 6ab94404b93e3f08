"""Fused core attention for megatron-core's local layer spec (no Transformer Engine here), and packed sequences.

`SDPAttention` replaces the spec's `DotProductAttention` (which materialises [b, heads, s, s] scores in the
activation dtype plus an fp32 softmax: 123 GB of saved activations for two 4,136-token rows of Qwen3-1.7B, the OOM of
issue 13) with `torch.nn.functional.scaled_dot_product_attention`: flash / cuDNN / memory-efficient kernels on CUDA,
the fused CPU kernel on CPU. Same constructor and forward signature as megatron's module.

Packed micro-batches (`PackedSeqs`, megatron's `thd` format: one row [1, total tokens], per-sample positions) use a
variable-length path with no cross-sample attention: samples are grouped by length (greedy, longest first) so that
each group pads to its own longest sample with at most `PAD_SLACK` wasted tokens, and each group is one SDPA call
with `is_causal=True`. Right padding under a causal mask is exact for the real rows (a real query at position i only
sees keys 0..i, all real), so no mask tensor is needed and the flash kernel stays eligible on GPU. The index tensors
are built once per forward on the host from Python lengths (no device sync) and shared by every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vime_core.memory import to_device

# a group of samples may pad up to 25% more tokens than it holds before a new group (one more SDPA call) starts
PAD_SLACK = 1.25
_NO_FUSED_GQA: set = set()  # (dtype, head_dim, unmasked) for which no fused CUDA kernel accepted enable_gqa


def _packed_seq_params_cls():
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams


@dataclass
class SeqGroup:
    """Samples attended together: `src` are their token indices in the packed row, `dst` where each goes in the padded
    [rows * width] layout."""

    rows: int
    width: int
    start: int  # first token of a one-sample group (a plain slice, no copy)
    src: torch.Tensor
    dst: torch.Tensor


@dataclass
class VarlenLayout:
    seq_lens: list[int]
    groups: list[SeqGroup] = field(default_factory=list)


def group_lengths(seq_lens: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Indices of `seq_lens` grouped longest first; a group's padded size (rows x longest) stays within `slack` x
    its tokens, so padding waste is bounded whatever the length mix."""
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        width = seq_lens[cur[0]] if cur else seq_lens[i]
        if cur and (len(cur) + 1) * width > slack * (tokens + seq_lens[i]):
            groups.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += seq_lens[i]
    if cur:
        groups.append(cur)
    return groups


def varlen_layout(seq_lens: list[int], device: torch.device | str) -> VarlenLayout:
    starts = [0]
    for n in seq_lens[:-1]:
        starts.append(starts[-1] + n)
    layout = VarlenLayout(list(seq_lens))
    for members in group_lengths(seq_lens):
        width = seq_lens[members[0]]
        src, dst = [], []
        for row, i in enumerate(members):
            src += range(starts[i], starts[i] + seq_lens[i])
            dst += range(row * width, row * width + seq_lens[i])
        layout.groups.append(
            SeqGroup(
                len(members),
                width,
                starts[members[0]],
                to_device(src, torch.long, device),
                to_device(dst, torch.long, device),
            )
        )
    return layout


def packed_seq_params(seq_lens: list[int], device: torch.device | str):
    """Megatron `PackedSeqParams` (thd) for samples of `seq_lens` packed into one row, carrying our varlen layout.
    Megatron's rotary embedding restarts positions at every `cu_seqlens` boundary (`_apply_rotary_pos_emb_thd`). It
    reads them with `.tolist()` in every layer: kept on the host, that is no device sync (only our attention and the
    unfused rope read them; Transformer Engine's kernels, which would want them on the GPU, are not used)."""
    cu = torch.tensor([0] + list(_cumsum(seq_lens)), dtype=torch.int32)
    params = _packed_seq_params_cls()(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(seq_lens), max_seqlen_kv=max(seq_lens)
    )
    params.vime_layout = varlen_layout(seq_lens, device)  # megatron reads only its own fields
    return params


def _cumsum(xs: list[int]):
    total = 0
    for x in xs:
        total += x
        yield total


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None = None
):
    """q [b, h, s, d], k/v [b, g, s, d] with h a multiple of g (GQA)."""
    rep = q.size(1) // k.size(1)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=rep > 1
        )
    return _sdpa_cuda(q, k, v, scale, causal, mask, rep)


def _sdpa_cuda(q, k, v, scale: float, causal: bool, mask, rep: int):
    """Fused kernels only: SDPA's math fallback would materialise [b, h, s, s] (what this module exists to avoid), so
    it is excluded and a missing fused kernel is an error. GQA goes to flash with enable_gqa (bf16/fp16); where that
    kernel is not available (fp32, an old GPU), k/v heads are repeated for the memory-efficient kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    key = (q.dtype, q.size(-1), mask is None)
    with sdpa_kernel(fused):
        if rep > 1 and q.dtype in (torch.float16, torch.bfloat16) and key not in _NO_FUSED_GQA:
            try:
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale, enable_gqa=True
                )
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:  # no fused kernel takes GQA for these inputs: repeat heads from now on
                _NO_FUSED_GQA.add(key)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, scale: float
) -> torch.Tensor:
    """Causal attention within each sample of a packed row. q [t, h, d], k/v [t, g, d] -> [t, h, d]."""
    t = q.size(0)
    outs, srcs = [], []
    for g in layout.groups:
        if g.rows == 1:  # one sample: a view of its slice, no padding
            part = [x.narrow(0, g.start, g.width).transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            o = _sdpa(*part, scale=scale, causal=True)[0].transpose(0, 1)
        else:
            part = []
            for x in (q, k, v):
                padded = x.new_zeros(g.rows * g.width, *x.shape[1:]).index_copy(0, g.dst, x.index_select(0, g.src))
                part.append(padded.view(g.rows, g.width, *x.shape[1:]).transpose(1, 2))  # [rows, heads, width, d]
            o = _sdpa(*part, scale=scale, causal=True).transpose(1, 2).reshape(g.rows * g.width, *q.shape[1:])
            o = o.index_select(0, g.dst)
        outs.append(o)
        srcs.append(g.src)
    if len(outs) == 1 and layout.groups[0].rows == 1:
        return outs[0]
    return q.new_zeros(t, *q.shape[1:]).index_copy(0, torch.cat(srcs), torch.cat(outs))


class SDPAttention(torch.nn.Module):
    """Drop-in `core_attention` for megatron's local spec, built on torch SDPA. Dropout must be 0 (the trainer's)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.utils import divide

        self.config = config
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism is not supported")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPAttention: attention dropout must be 0 (the trainer sets it so)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise ValueError("SDPAttention: only vanilla softmax without a sliding window is supported")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # megatron's apply_query_key_layer_scaling divides the scale by layer_number and multiplies it back inside its
        # fp32 softmax: the logits are the same, so it has no counterpart here
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            layout = getattr(packed_seq_params, "vime_layout", None)
            if layout is None:  # built by someone else: derive the layout from cu_seqlens (one device sync)
                cu = packed_seq_params.cu_seqlens_q.tolist()
                layout = varlen_layout([b - a for a, b in zip(cu[:-1], cu[1:])], query.device)
                packed_seq_params.vime_layout = layout
            out = varlen_attention(query, key, value, layout, self.softmax_scale)  # [t, h, d]
            return out.reshape(out.size(0), -1)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        out = _sdpa(q, k, v, scale=self.softmax_scale, causal=True, mask=mask)
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)  # [s, b, h*d]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters or buffers
