"""Chunked log-probs / entropy from hidden states (vime_core.logprobs) against the full-logits math, fp32: values and
gradients of hidden states and output weight, at TP=1 and vocab-parallel at TP=2 (two gloo ranks)."""

from __future__ import annotations


import pytest
import torch

from vime_core.logprobs import chunked_logprobs
from vime_core.ports import free_port

N, H, V = 37, 16, 50  # 37 tokens: chunks of 8 leave a ragged last chunk


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).float()
    targets = torch.randint(0, V, (N,), generator=g)
    # upstream gradients as a loss would send them: any values, the entropy's of another scale
    g_lp = torch.randn(N, generator=g)
    g_ent = torch.randn(N, generator=g) * 0.3
    return hidden, weight, targets, g_lp, g_ent


def _full(hidden, weight, targets, temperature):
    """Today's math: logits, then fp32 log_softmax / entropy (megatron_model.token_logprobs / entropy at TP=1)."""
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _values_and_grads(fn, hidden, weight, targets, g_lp, g_ent, with_entropy: bool):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fn(h, w, targets)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    loss.backward()
    return lp.detach(), (ent.detach() if with_entropy else None), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [8, 1024])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_matches_full_logits(temperature, chunk, with_entropy):
    hidden, weight, targets, g_lp, g_ent = _inputs()
    got = _values_and_grads(
        lambda h, w, t: chunked_logprobs(h, w, t, temperature, with_entropy, chunk),
        hidden,
        weight,
        targets,
        g_lp,
        g_ent,
        with_entropy,
    )
    want = _values_and_grads(
        lambda h, w, t: _full(h, w, t, temperature), hidden, weight, targets, g_lp, g_ent, with_entropy
    )
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, want):
        if b is None:
            assert a is None
            continue
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (name, float((a - b).abs().max()))


def test_no_grad_forward_keeps_nothing_and_matches():
    hidden, weight, targets, *_ = _inputs(1)
    with torch.no_grad():
        lp, ent = chunked_logprobs(hidden, weight, targets, 1.0, with_entropy=False, chunk_tokens=5)
    assert ent is None and not lp.requires_grad
    assert torch.allclose(lp, _full(hidden, weight, targets, 1.0)[0], atol=1e-6)


def test_entropy_gradient_alone():
    """A loss of the entropy only (entropy bonus without policy gradient) still reaches hidden states and weight."""
    hidden, weight, targets, _, g_ent = _inputs(2)
    zero = torch.zeros(N)
    got = _values_and_grads(
        lambda h, w, t: chunked_logprobs(h, w, t, 1.0, True, 8), hidden, weight, targets, zero, g_ent, True
    )
    want = _values_and_grads(lambda h, w, t: _full(h, w, t, 1.0), hidden, weight, targets, zero, g_ent, True)
    assert got[2].abs().sum() > 0
    assert torch.allclose(got[2], want[2], atol=1e-5) and torch.allclose(got[3], want[3], atol=1e-5)


@pytest.mark.parametrize("chunk", [8, 1024])
def test_kept_logits_give_the_recomputed_values_and_gradients(chunk):
    """train.logprob_keep_logits: backward reads the forward's logits instead of recomputing them, bit for bit the
    same values and gradients (the same matmul on the same inputs), and drops them once used."""
    hidden, weight, targets, g_lp, g_ent = _inputs(4)
    args = (hidden, weight, targets, g_lp, g_ent, True)
    kept = _values_and_grads(lambda h, w, t: chunked_logprobs(h, w, t, 0.7, True, chunk, keep_logits=True), *args)
    recomputed = _values_and_grads(lambda h, w, t: chunked_logprobs(h, w, t, 0.7, True, chunk), *args)
    assert kept[2].abs().sum() > 0 and kept[3].abs().sum() > 0
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    h = hidden.clone().requires_grad_(True)
    lp, _ = chunked_logprobs(h, weight, targets, 1.0, False, chunk, keep_logits=True)
    assert len(lp.grad_fn.logits) == -(-N // chunk)  # one [chunk, V] tensor per chunk, held until backward
    lp.sum().backward()
    assert lp.grad_fn.logits is None


# ---- TP=2: each rank holds half the vocab ----------------------------------------------------------------------------
def _tp_rank(rank: int, world: int, port: int, q) -> None:
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        hidden, weight, targets, g_lp, g_ent = _inputs(3)
        shard = weight.chunk(world, dim=0)[rank].contiguous()
        lp, ent, dh, dw = _values_and_grads(
            lambda h, w, t: chunked_logprobs(h, w, t, 0.7, True, 8), hidden, shard, targets, g_lp, g_ent, True
        )
        w_lp, w_ent, w_dh, w_dw = _values_and_grads(
            lambda h, w, t: _full(h, w, t, 0.7), hidden, weight, targets, g_lp, g_ent, True
        )
        diffs = {
            "logp": float((lp - w_lp).abs().max()),
            "entropy": float((ent - w_ent).abs().max()),
            "d hidden": float((dh - w_dh).abs().max()),
            "d weight shard": float((dw - w_dw.chunk(world, dim=0)[rank]).abs().max()),
        }
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        q.put((rank, diffs))
    except BaseException as e:  # the parent reports it
        q.put((rank, repr(e)))


def test_vocab_parallel_tp2_matches_tp1():
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, diffs in results.items():
        assert isinstance(diffs, dict), (rank, diffs)
        for name, d in diffs.items():
            assert d < 1e-5, (rank, name, d)
