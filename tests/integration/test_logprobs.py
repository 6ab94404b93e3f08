"""Chunked log-probs / entropy from hidden states (vime_core.logprobs) against the full-logits math, fp32: values and
gradients of hidden states and output weight: vocab-parallel at TP=2 (two spawned gloo ranks) against TP=1."""

from __future__ import annotations

from tests.helpers.logprob_math import full_logprobs, inputs, values_and_grads
from vime_core.logprobs import chunked_logprobs
from vime_core.ports import free_port


# ---- TP=2: each rank holds half the vocab ----------------------------------------------------------------------------
def _tp_rank(rank: int, world: int, port: int, q) -> None:
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        hidden, weight, targets, g_lp, g_ent = inputs(3)
        shard = weight.chunk(world, dim=0)[rank].contiguous()
        lp, ent, dh, dw = values_and_grads(
            lambda h, w, t: chunked_logprobs(h, w, t, 0.7, True, 8), hidden, shard, targets, g_lp, g_ent, True
        )
        w_lp, w_ent, w_dh, w_dw = values_and_grads(
            lambda h, w, t: full_logprobs(h, w, t, 0.7), hidden, weight, targets, g_lp, g_ent, True
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
