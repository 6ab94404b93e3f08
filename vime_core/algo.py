"""GRPO as pure tensor functions: advantages, policy loss (PPO-clip / GSPO), KL estimators, TIS, aggregation.

Shapes: token-level tensors are 1-D over the concatenated response tokens of a micro-batch, with `sample_ids`
(same length) saying which sample each token belongs to; `num_samples` is the number of samples in it. That keeps
every function free of padding. Every function has hand-computed unit tests (tests/test_algo.py).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: reward minus its group's mean, divided by (group std + eps) unless `normalize_std` is False
    (Dr.GRPO). `rewards` is flat, groups are consecutive runs of `group_size`. Std is the unbiased one, as in vime."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().reshape(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        centred = centred / (std + eps)
    return centred.reshape(-1)


def group_reward_std(rewards: Tensor, group_size: int) -> Tensor:
    r = rewards.float().reshape(-1, group_size)
    return r.std(dim=1) if group_size > 1 else torch.zeros(r.shape[0])


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate. Returns (loss per token, clipped indicator per token, ratio per token).

    loss = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high)); with dual clip, for A < 0 the loss is also
    capped at -A * c."""
    ratio = torch.exp(logp - old_logp)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if dual_clip_c is not None:
        loss3 = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > loss3)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
        clipped = torch.where(dual, torch.ones_like(clipped), clipped)
    return loss, clipped, ratio


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    sample_ids: Tensor,
    num_samples: int,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO: the ratio is the sequence-level geometric mean exp(mean_t(logp - old_logp)), applied to every token of
    the sequence with a stop-gradient trick so that each token's gradient flows through its own log-prob."""
    log_ratio = logp - old_logp
    seq_log_ratio = per_sample_mean(log_ratio, sample_ids, num_samples)[sample_ids]
    # value = seq ratio, gradient = seq ratio * d logp_t (token-level)
    token_log_ratio = seq_log_ratio.detach() + logp - logp.detach()
    ratio = torch.exp(token_log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(loss1, loss2)
    return loss, (loss2 > loss1).float(), ratio


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the policy against the reference (Schulman's k1/k2/k3; low_var_kl is k3 clamped)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # k3 = exp(ref - logp) - (ref - logp) - 1, unbiased and >= 0
        neg = -log_ratio
        kl = torch.exp(neg) - neg - 1.0
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2, k3 or low_var_kl")


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling: clamp(exp(old - rollout), 0, cap), and which tokens were clipped."""
    w = torch.exp(old_logp - rollout_logp)
    return w.clamp(0.0, cap), (w > cap).float()


def per_sample_sum(x: Tensor, sample_ids: Tensor, num_samples: int) -> Tensor:
    return torch.zeros(num_samples, dtype=x.dtype, device=x.device).index_add(0, sample_ids, x)


def per_sample_mean(x: Tensor, sample_ids: Tensor, num_samples: int) -> Tensor:
    counts = torch.bincount(sample_ids, minlength=num_samples).clamp(min=1).to(x.dtype)
    return per_sample_sum(x, sample_ids, num_samples) / counts


def aggregate(x: Tensor, sample_ids: Tensor, num_samples: int, mode: str, denominator: float) -> Tensor:
    """Sum of this micro-batch's share of the loss.

    `sample_mean`: sum over samples of each sample's token mean, divided by `denominator` = samples in the whole
    optimizer step (all micro-batches and data-parallel ranks), so that summing micro-batches gives vime's
    mean over samples of token means. `token_mean`: sum over tokens divided by `denominator` = tokens in the step."""
    if mode == "sample_mean":
        return per_sample_mean(x, sample_ids, num_samples).sum() / denominator
    if mode == "token_mean":
        return x.sum() / denominator
    raise ValueError(f"unknown loss aggregation {mode!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k < 1 or k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}" if k > n else f"pass@k needs k >= 1, got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: correct count {c} is outside 0..{n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod
