"""The inputs and the full-logits reference of the chunked log-prob tests (tests/unit/test_logprobs.py at TP=1,
tests/integration/test_logprobs.py at TP=2)."""

from __future__ import annotations

import torch

N, H, V = 37, 16, 50  # 37 tokens: chunks of 8 leave a ragged last chunk


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).float()
    targets = torch.randint(0, V, (N,), generator=g)
    # upstream gradients as a loss would send them: any values, the entropy's of another scale
    g_lp = torch.randn(N, generator=g)
    g_ent = torch.randn(N, generator=g) * 0.3
    return hidden, weight, targets, g_lp, g_ent


def full_logprobs(hidden, weight, targets, temperature):
    """Today's math: logits, then fp32 log_softmax / entropy (megatron_model.token_logprobs / entropy at TP=1)."""
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def values_and_grads(fn, hidden, weight, targets, g_lp, g_ent, with_entropy: bool):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fn(h, w, targets)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    loss.backward()
    return lp.detach(), (ent.detach() if with_entropy else None), h.grad, w.grad
