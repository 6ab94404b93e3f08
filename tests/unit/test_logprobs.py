"""Chunked log-probs / entropy from hidden states (vime_core.logprobs) against the full-logits math, fp32: values and
gradients of hidden states and output weight at TP=1 (vocab-parallel at TP=2, in two gloo ranks:
tests/integration/test_logprobs.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.logprob_math import N, full_logprobs, inputs, values_and_grads
from vime_core.logprobs import chunked_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [8, 1024])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_matches_full_logits(temperature, chunk, with_entropy):
    hidden, weight, targets, g_lp, g_ent = inputs()
    got = values_and_grads(
        lambda h, w, t: chunked_logprobs(h, w, t, temperature, with_entropy, chunk),
        hidden,
        weight,
        targets,
        g_lp,
        g_ent,
        with_entropy,
    )
    want = values_and_grads(
        lambda h, w, t: full_logprobs(h, w, t, temperature), hidden, weight, targets, g_lp, g_ent, with_entropy
    )
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, want):
        if b is None:
            assert a is None
            continue
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (name, float((a - b).abs().max()))


def test_no_grad_forward_keeps_nothing_and_matches():
    hidden, weight, targets, *_ = inputs(1)
    with torch.no_grad():
        lp, ent = chunked_logprobs(hidden, weight, targets, 1.0, with_entropy=False, chunk_tokens=5)
    assert ent is None and not lp.requires_grad
    assert torch.allclose(lp, full_logprobs(hidden, weight, targets, 1.0)[0], atol=1e-6)


def test_entropy_gradient_alone():
    """A loss of the entropy only (entropy bonus without policy gradient) still reaches hidden states and weight."""
    hidden, weight, targets, _, g_ent = inputs(2)
    zero = torch.zeros(N)
    got = values_and_grads(
        lambda h, w, t: chunked_logprobs(h, w, t, 1.0, True, 8), hidden, weight, targets, zero, g_ent, True
    )
    want = values_and_grads(lambda h, w, t: full_logprobs(h, w, t, 1.0), hidden, weight, targets, zero, g_ent, True)
    assert got[2].abs().sum() > 0
    assert torch.allclose(got[2], want[2], atol=1e-5) and torch.allclose(got[3], want[3], atol=1e-5)


@pytest.mark.parametrize("chunk", [8, 1024])
def test_kept_logits_give_the_recomputed_values_and_gradients(chunk):
    """train.logprob_keep_logits: backward reads the forward's logits instead of recomputing them, bit for bit the
    same values and gradients (the same matmul on the same inputs), and drops them once used."""
    hidden, weight, targets, g_lp, g_ent = inputs(4)
    args = (hidden, weight, targets, g_lp, g_ent, True)
    kept = values_and_grads(lambda h, w, t: chunked_logprobs(h, w, t, 0.7, True, chunk, keep_logits=True), *args)
    recomputed = values_and_grads(lambda h, w, t: chunked_logprobs(h, w, t, 0.7, True, chunk), *args)
    assert kept[2].abs().sum() > 0 and kept[3].abs().sum() > 0
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    h = hidden.clone().requires_grad_(True)
    lp, _ = chunked_logprobs(h, weight, targets, 1.0, False, chunk, keep_logits=True)
    assert len(lp.grad_fn.logits) == -(-N // chunk)  # one [chunk, V] tensor per chunk, held until backward
    lp.sum().backward()
    assert lp.grad_fn.logits is None
