"""Fused core attention for megatron-core's local layer spec (no Transformer Engine here), and packed sequences.

`SDPAttention` replaces the spec's `DotProductAttention` (which materialises [b, heads, s, s] scores in the
activation dtype plus an fp32 softmax: 123 GB of saved activations for two 4,136-token rows of Qwen3-1.7B, the OOM of
issue 13) with `torch.nn.functional.scaled_dot_product_attention`: flash / cuDNN / memory-efficient kernels on CUDA,
the fused CPU kernel on CPU. Same constructor and forward signature as megatron's module.

Packed micro-batches (`PackedSeqs`, megatron's `thd` format: one row [1, total tokens], per-sample positions) use a
variable-length path with no cross-sample attention: samples are grouped by length (greedy, longest first) so that
each group pads to its own longest sample with at most `PAD_SLACK` wasted tokens, and each group is one SDPA call
with `is_causal=True`. Right padding under a causal mask is exact for the real rows (a real query at position i only
sees keys 0..i, all real), so no mask tensor is needed and the flash kernel stays eligible on GPU. Long samples and
runs of equal-length neighbours are attended on views of the packed row instead, with no copy (`VIEW_MIN_TOKENS`).
The index tensors are built once per forward on the host from Python lengths (no device sync) and shared by every
layer.

Rotary embedding: with `rope_base` set (what `megatron_model.build_gpt` does, the model itself then having none),
the module applies megatron's unfused RoPE to q and k itself, from cos/sin tables computed once per forward for the
packed positions and shared by every layer. Megatron recomputes them in each layer and, for a packed row, slices
and concatenates them per sample: 1.12 ms forward + backward of q alone per layer at 2 x 4,136 tokens on an H200
against 0.45-0.69 ms from the shared tables (bench/kernel_variants.py). Same values: the tables are megatron's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vime_core.memory import to_device

# a group of samples may pad up to 25% more tokens than it holds before a new group (one more SDPA call) starts
PAD_SLACK = 1.25
# samples at least this long get an SDPA call each, on a view of the packed row: no padding copies in and out (and
# their backward scatters). H200, bf16, Qwen3-1.7B heads, 2 samples of ~4,140 tokens, forward + backward per layer
# (bench/kernel_variants.py): padded group 2.40-2.50 ms, a call per sample 1.99-2.11 ms, one call on a view of two
# equal-length neighbours 1.41 ms. Shorter samples stay grouped: there one call for many beats a launch each.
VIEW_MIN_TOKENS = 2048
_NO_FUSED_GQA: set = set()  # (dtype, head_dim, unmasked) for which no fused CUDA kernel accepted enable_gqa


def _packed_seq_params_cls():
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams


@dataclass
class SeqGroup:
    """Samples attended together. A view group (`dst` None) is `rows` consecutive samples of length `width` from token
    `start` of the packed row, attended as a [rows, width] view. Otherwise `src` are the samples' token indices in the
    packed row and `dst` where each goes in the padded [rows * width] layout."""

    rows: int
    width: int
    start: int
    src: torch.Tensor | None
    dst: torch.Tensor | None = None


@dataclass
class VarlenLayout:
    seq_lens: list[int]
    groups: list[SeqGroup] = field(default_factory=list)
    # every group a view, sorted by `start`, tiling the row: the output is their concatenation (no index copy)
    in_order: bool = False
    positions: torch.Tensor | None = None  # each token's position in its sample (the rotary tables' input)
    rope_tables: dict = field(default_factory=dict)  # (dim, base, dtype) -> (cos, sin), shared by the layers


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


def _view_groups(members: list[int], seq_lens: list[int], view_min_tokens: int) -> list[list[int]] | None:
    """`members` (a group of group_lengths) as runs of samples attended on views of the packed row, or None (pad)."""
    lens = [seq_lens[i] for i in members]
    if len(set(lens)) == 1 and members == list(range(members[0], members[0] + len(members))):
        return [members]  # equal-length neighbours: one [rows, width] view
    if lens[0] >= view_min_tokens:
        return [[i] for i in members]  # long samples: a call each beats padding copies
    return None


def varlen_layout(
    seq_lens: list[int], device: torch.device | str, view_min_tokens: int = VIEW_MIN_TOKENS
) -> VarlenLayout:
    starts = [0]
    for n in seq_lens[:-1]:
        starts.append(starts[-1] + n)
    layout = VarlenLayout(list(seq_lens))
    layout.positions = to_device([i for n in seq_lens for i in range(n)], torch.long, device)
    for members in group_lengths(seq_lens):
        runs = _view_groups(members, seq_lens, view_min_tokens)
        if runs is not None:
            layout.groups += [SeqGroup(len(r), seq_lens[r[0]], starts[r[0]], None) for r in runs]
            continue
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
    if all(g.dst is None for g in layout.groups):
        layout.groups.sort(key=lambda g: g.start)
        layout.in_order = True
    else:  # views among padded groups: the output is assembled by token index
        for g in layout.groups:
            if g.src is None:
                g.src = to_device(list(range(g.start, g.start + g.rows * g.width)), torch.long, device)
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


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None = None
):
    """Causal (or `mask`ed) SDPA on q [b, h, s, d], k/v [b, g, s, d] with h a multiple of g (GQA): the fused kernels
    only on CUDA (`_sdpa_cuda`), torch's fused CPU kernel elsewhere."""
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
        if g.dst is None:  # a view of the packed row, no copy
            part = [
                x.narrow(0, g.start, g.rows * g.width).view(g.rows, g.width, *x.shape[1:]).transpose(1, 2)
                for x in (q, k, v)
            ]
        else:
            part = []
            for x in (q, k, v):
                padded = x.new_zeros(g.rows * g.width, *x.shape[1:]).index_copy(0, g.dst, x.index_select(0, g.src))
                part.append(padded.view(g.rows, g.width, *x.shape[1:]).transpose(1, 2))  # [rows, heads, width, d]
        o = sdpa(*part, scale=scale, causal=True).transpose(1, 2).reshape(g.rows * g.width, *q.shape[1:])
        outs.append(o if g.dst is None else o.index_select(0, g.dst))
        srcs.append(g.src)
    if layout.in_order:
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return q.new_zeros(t, *q.shape[1:]).index_copy(0, torch.cat(srcs), torch.cat(outs))


def rope_tables(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype):
    """cos and sin [n, 1, dim] at `positions`, as megatron's RotaryEmbedding and unfused RoPE compute them: fp32 angles
    position x base^(-2i/dim), each frequency twice (non-interleaved halves), cast to the activations' dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = torch.outer(positions.to(torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron's `_apply_rotary_pos_emb_bshd` on x [..., heads, dim] with tables broadcast over the heads."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class SDPAttention(torch.nn.Module):
    """Drop-in `core_attention` for megatron's local spec, built on torch SDPA. Dropout must be 0 (the trainer's).
    `rope_base`: apply RoPE (that base, over the whole head dim) to q and k here; for a model built without its own."""

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
        rope_base: float | None = None,
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
        self.rope_base = rope_base

    def _rope(self, query, key, positions: torch.Tensor, cache: dict | None):
        """q and k rotated at `positions` (their leading dimension); the tables come from / go to `cache`."""
        if self.rope_base is None:
            return query, key
        spec = (query.size(-1), self.rope_base, query.dtype)
        tables = cache.get(spec) if cache is not None else None
        if tables is None:
            tables = rope_tables(positions, *spec)
            if cache is not None:
                cache[spec] = tables
        cos, sin = (t.view(t.size(0), *([1] * (query.dim() - 2)), t.size(-1)) for t in tables)
        return apply_rope(query, cos, sin), apply_rope(key, cos, sin)

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
            query, key = self._rope(query, key, layout.positions, layout.rope_tables)
            out = varlen_attention(query, key, value, layout, self.softmax_scale)  # [t, h, d]
            return out.reshape(out.size(0), -1)
        query, key = self._rope(query, key, torch.arange(query.size(0), device=query.device), None)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        out = sdpa(q, k, v, scale=self.softmax_scale, causal=True, mask=mask)
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)  # [s, b, h*d]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters or buffers
