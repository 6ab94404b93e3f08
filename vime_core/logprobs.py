"""Token log-probs and entropy straight from the final hidden states, chunk by chunk: no [tokens, vocab] tensor.

Today's path (`megatron_model.token_logprobs` / `entropy` on the output layer's logits) keeps the bf16 logits, their
fp32 copy and softmax intermediates of every token alive for backward: for 9,216 tokens of Qwen3-1.7B (vocab 151,936)
that is 2.8 GB of bf16 logits plus 5.6 GB per fp32 copy. `chunked_logprobs` computes the logits of `chunk_tokens`
tokens at a time (in the weight's dtype, then fp32, as the output layer + `.float()` did), keeps only two floats per
token (log Z and E[x]) for backward, and recomputes each chunk's logits there. Under tensor parallelism the weight is
the rank's vocab shard: max, sum-exp, target logit and E[x] are all-reduced over the TP group (the math of
`vocab_parallel_cross_entropy` and of `megatron_model.entropy`), and the hidden-state gradient is summed over TP ranks
by megatron's `copy_to_tensor_model_parallel_region`, as the ColumnParallelLinear output layer does.

Logits are divided by the sampling temperature (vLLM returns processed log-probs). With rollout.top_k > 0 or
rollout.top_p < 1, vLLM's processed log-probs are renormalised over the tokens its sampler kept, so the trainer's are
too (`keep_threshold`): without it, at identical weights, top_p = 0.9 gave a mean TIS weight of 0.901 and top_k = 50
one of 0.880 instead of 1.0 on the review's model, 0.9944 and 0.99980 on the builtin tiny one (issue 28, N2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None
    return ps.get_tensor_model_parallel_group()


def keep_threshold(x: torch.Tensor, top_k: int, top_p: float, rows_per_block: int = 128) -> torch.Tensor | None:
    """Per row of `x` [rows, V] (fp32 logits / temperature): the smallest logit vLLM's sampler keeps under top_k then
    top_p (None when neither truncates). The same ops as vLLM's `apply_top_k_top_p_pytorch` (its CPU path;
    `apply_top_k_only` for top-k alone): top-k keeps the logits >= the k-th largest; top-p sorts ascending, takes the
    cumulative softmax of what top-k kept and drops the tokens whose cumulative mass is <= 1 - p (p as an fp32
    tensor, as vLLM holds it), the largest always kept. Kept tokens are those >= the threshold: logits tied with it
    are all kept, where vLLM's unstable sort may drop some of them (exact fp32 ties)."""
    vocab = x.size(-1)
    use_k = 0 < top_k < vocab
    if top_p >= 1.0:
        return x.topk(top_k, dim=-1).values[:, -1] if use_k else None
    one_minus_p = 1 - torch.tensor(top_p, dtype=torch.float32, device=x.device)
    out = torch.empty(x.size(0), dtype=x.dtype, device=x.device)
    for a in range(0, x.size(0), rows_per_block):  # a sort of [rows, V] holds int64 indices: bounded by blocks
        srt = x[a : a + rows_per_block].sort(dim=-1).values
        if use_k:
            srt = srt.masked_fill(srt < srt[:, vocab - top_k].unsqueeze(-1), float("-inf"))
        cut = srt.softmax(dim=-1).cumsum(dim=-1) <= one_minus_p
        cut[:, -1] = False
        out[a : a + rows_per_block] = srt.gather(1, cut.sum(-1, keepdim=True)).squeeze(1)
    return out


def _row_max(raw: torch.Tensor, temperature: float) -> torch.Tensor:
    return (raw.float() / temperature).max(dim=-1).values


def _row_sums(
    raw: torch.Tensor,
    temperature: float,
    gmax: torch.Tensor,
    local: torch.Tensor,
    own: torch.Tensor,
    tau: torch.Tensor | None = None,
):
    """[rows, 3]: sum exp(x - max), sum exp(x - max) (x - max), and the target's x - max (0 off this rank's shard);
    the sums over the kept tokens (x >= tau) when a sampling threshold is given."""
    x = raw.float() / temperature
    shifted = x - gmax.unsqueeze(-1)
    e = shifted.exp()
    if tau is not None:
        e = torch.where(x >= tau.unsqueeze(-1), e, 0.0)
    tgt = shifted.gather(-1, local.clamp(0, raw.size(-1) - 1).unsqueeze(-1)).squeeze(-1) * own
    return torch.stack([e.sum(-1), (e * shifted).sum(-1), tgt], dim=-1)


def _grad_logits(
    raw: torch.Tensor,
    temperature: float,
    logz: torch.Tensor,
    ex: torch.Tensor,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor,
    local: torch.Tensor,
    own: torch.Tensor,
    tau: torch.Tensor | None = None,
) -> torch.Tensor:
    """d loss / d raw logits, in the logits' dtype: d log p(t) / dx = onehot(t) - p; dH/dx = -p (x - E[x]); p is 0
    outside the kept tokens (x >= tau) when a sampling threshold is given (the kept set is held fixed)."""
    x = raw.float() / temperature
    p = (x - logz.unsqueeze(-1)).exp()
    if tau is not None:
        p = torch.where(x >= tau.unsqueeze(-1), p, 0.0)
    onehot = torch.arange(raw.size(-1), device=raw.device).unsqueeze(0) == local.unsqueeze(-1)
    g = g_logp.unsqueeze(-1) * ((onehot & own.unsqueeze(-1)).float() - p) - g_ent.unsqueeze(-1) * p * (
        x - ex.unsqueeze(-1)
    )
    return (g / temperature).to(raw.dtype)  # the output layer's matmul backward ran in the weight's dtype


def _kernel(fn, cuda: bool):
    """On CUDA, `fn` fused by torch.compile (one pass over the [chunk, vocab] logits instead of ~8 fp32 passes: 60 of
    the 380 ms of a Qwen3-1.7B fwd+bwd of 8,272 tokens were these passes); eager elsewhere or if compiling fails."""
    if not cuda:
        return fn
    from vime_core.megatron_model import fused

    return fused(fn)


def _sampled_threshold(raw: torch.Tensor, temperature: float, targets: torch.Tensor, top_k: int, top_p: float):
    """keep_threshold of a chunk, lowered to the target's logit where the trainer's logits put the sampled token
    just outside the kept set (vLLM kept it: it sampled it); a log-prob of -inf would make the ratio NaN."""
    x = raw.float() / temperature
    tau = keep_threshold(x, top_k, top_p)
    if tau is None:
        return None
    return torch.minimum(tau, x.gather(-1, targets.unsqueeze(-1)).squeeze(-1))


def _chunk_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_start: int,
    group,
    sampling: tuple[int, float],
):
    """For one chunk: the global log Z, log p(target), entropy and E[x] of the fp32 logits x / temperature (over the
    tokens the sampler kept under `sampling` = (top_k, top_p)), and that threshold (None: the whole vocabulary)."""
    raw = h @ weight.t()  # [chunk, V/tp] in the weight's dtype, as the output layer computed it
    local = targets - vocab_start
    own = (local >= 0) & (local < raw.size(-1))
    gmax = _kernel(_row_max, raw.is_cuda)(raw, temperature)
    if group is not None:
        dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
    tau = _sampled_threshold(raw, temperature, targets, *sampling)  # refused under TP (chunked_logprobs)
    sums = _kernel(_row_sums, raw.is_cuda)(raw, temperature, gmax, local, own, tau)
    if group is not None:
        dist.all_reduce(sums, group=group)  # one all-reduce for the three
    sum_exp, sum_exp_x, tgt = sums.unbind(-1)
    log_sum = sum_exp.log()
    logz = gmax + log_sum
    ex = gmax + sum_exp_x / sum_exp  # E_p[x]
    return logz, tgt - log_sum, log_sum - sum_exp_x / sum_exp, ex, raw, tau


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        temperature: float,
        chunk: int,
        vocab_start: int,
        group,
        with_entropy: bool,
        keep_logits: bool,
        sampling: tuple[int, float],
    ):
        n = hidden.size(0)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logz = torch.empty_like(logp)
        ex = torch.empty_like(logp)
        keep = keep_logits and any(ctx.needs_input_grad[:2])
        ctx.logits = [] if keep else None  # each chunk's raw logits, for backward instead of their recompute
        taus = []  # each chunk's sampling threshold (one float a token), for backward's kept set
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            logz[a:b], logp[a:b], ent[a:b], ex[a:b], raw, tau = _chunk_stats(
                hidden[a:b], weight, targets[a:b], temperature, vocab_start, group, sampling
            )
            if tau is not None:
                taus.append(tau)
            if keep:
                ctx.logits.append(raw)
        tau_all = torch.cat(taus) if taus else logp.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, logz, ex, tau_all)
        ctx.cfg = (temperature, chunk, vocab_start, group, with_entropy)
        ctx.set_materialize_grads(False)
        return logp, (ent if with_entropy else logp.new_empty(0))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, logz, ex, tau_all = ctx.saved_tensors
        temperature, chunk, vocab_start, group, with_entropy = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_ent = with_entropy and g_ent is not None
        none = (None,) * 8  # the non-tensor arguments
        if g_logp is None and not use_ent:
            return None, None, *none
        grad_h = torch.empty_like(hidden) if need_h else None
        # the weight gradient sums every chunk's: accumulated in fp32 (V/tp x h: 1.2 GB for Qwen3-1.7B), cast once
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        n = hidden.size(0)
        zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        g_logp = zeros if g_logp is None else g_logp.float()
        g_ent = g_ent.float() if use_ent else zeros
        grad_logits = _kernel(_grad_logits, hidden.is_cuda)
        kept, ctx.logits = ctx.logits, None
        for i, a in enumerate(range(0, n, chunk)):
            b = min(n, a + chunk)
            h = hidden[a:b]
            local = targets[a:b] - vocab_start
            raw = kept[i] if kept else h @ weight.t()
            if kept:
                kept[i] = None  # freed chunk by chunk
            own = (local >= 0) & (local < raw.size(-1))
            tau = tau_all[a:b] if tau_all.numel() else None
            g = grad_logits(raw, temperature, logz[a:b], ex[a:b], g_logp[a:b], g_ent[a:b], local, own, tau)
            del raw
            if need_h:
                grad_h[a:b] = g @ weight
            if need_w:
                if g.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), h)
                else:  # the chunk's product in the weight's dtype (a V/tp x h temporary), added in fp32
                    grad_w.add_(g.t() @ h)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, *none


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    keep_logits: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and (optionally) the entropy per row of `hidden` [n, h] under softmax(hidden @ weight.T / T).

    `weight` [V/tp, h] is this rank's vocab shard of the output layer (contiguous shards in rank order, as megatron's
    vocab-parallel layers split it). Differentiable in `hidden` and `weight`; values in fp32. `keep_logits`: keep each
    chunk's logits (in the weight's dtype: n x V/tp of them) for backward instead of recomputing them there.
    `top_k` > 0 / `top_p` < 1: the softmax (and entropy) over the tokens vLLM's sampler kept (`keep_threshold`),
    as its processed log-probs are; one rank must hold the whole vocabulary for that (TP = 1)."""
    group = _tp_group()
    vocab_start = 0
    if (top_k > 0 or top_p < 1.0) and group is not None:  # RunConfig refuses this; a direct call is told the same
        raise ValueError("top_k / top_p truncation of the log-probs needs the whole vocabulary on one rank (TP = 1)")
    if group is not None:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        vocab_start = dist.get_rank(group) * weight.size(0)
        hidden = copy_to_tensor_model_parallel_region(hidden)  # backward: sum of the ranks' partial gradients
    logp, ent = _ChunkedLogProbs.apply(
        hidden,
        weight,
        targets,
        float(temperature),
        max(1, int(chunk_tokens)),
        vocab_start,
        group,
        with_entropy,
        keep_logits,
        (int(top_k), float(top_p)),
    )
    return logp, (ent if with_entropy else None)
