"""GRPO as pure tensor functions: advantages, policy loss (PPO-clip / GSPO), KL estimators, TIS, aggregation.

Shapes: token-level tensors are 1-D over the concatenated response tokens of a micro-batch, with `sample_ids`
(same length) saying which sample each token belongs to; `num_samples` is the number of samples in it. That keeps
every function free of padding. Every function has hand-computed unit tests (tests/unit/test_algo.py).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


# verl clamps the log-ratio to +-20 before `exp`: exp(20) = 4.9e8 stays finite in fp32 (and bf16), while an overflowed
# ratio (inf) times a zero advantage or mask is NaN, which would reach every weight through the optimizer.
LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages (float64): reward minus its group's mean, divided by (group std + eps) unless `normalize_std`
    is False (Dr.GRPO). `rewards` is flat, groups are consecutive runs of `group_size`. Std is the unbiased one, as
    in vime. A group whose rewards are all equal gets exactly 0: in fp32, [0.7] * 8 has a mean 6e-8 off 0.7 and a
    std of 6e-8, which made advantages of +-0.1 instead of 0; float64 alone still leaves 1e-17 residues for
    group sizes like 3, so such groups are zeroed explicitly (the rollout's zero_std_ratio uses the same test)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().reshape(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        centred = centred / (std + eps)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred).reshape(-1)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float, dual_clip_c: float | None = None
) -> tuple[Tensor, Tensor]:
    """max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high)); with dual clip, for A < 0 the loss is also capped
    at -A * c. Returns (loss per token, clipped indicator per token)."""
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).to(ratio.dtype)
    if dual_clip_c is not None:
        loss3 = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > loss3)
        loss = torch.where(advantages < 0, torch.minimum(loss, loss3), loss)
        clipped = torch.where(dual, torch.ones_like(clipped), clipped)
    return loss, clipped


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate. Returns (loss per token, clipped indicator per token, ratio per token).

    See `clipped_surrogate`; the log-ratio is clamped to +-LOG_RATIO_CLAMP before `exp`."""
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, clipped = clipped_surrogate(ratio, advantages, eps_clip, eps_clip_high, dual_clip_c)
    return loss, clipped, ratio


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    sample_ids: Tensor,
    num_samples: int,
    eps_clip: float,
    eps_clip_high: float,
    mask: Tensor | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO: the ratio is the sequence-level geometric mean exp(mean_t(logp - old_logp)) over the sequence's trained
    (mask = 1) tokens, as slime's compute_gspo_kl and verl do, applied to every token of the sequence with a
    stop-gradient trick so that each token's gradient flows through its own log-prob. The dual clip applies to the
    sequence ratio as in slime (its GSPO path shares compute_policy_loss with PPO)."""
    log_ratio = logp - old_logp
    if mask is None:
        mask = torch.ones_like(log_ratio)
    seq_log_ratio = per_sample_mean(log_ratio * mask, sample_ids, num_samples, mask)[sample_ids]
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # value = seq ratio, gradient = seq ratio * d logp_t (token-level)
    token_log_ratio = seq_log_ratio.detach() + logp - logp.detach()
    ratio = torch.exp(token_log_ratio)
    loss, clipped = clipped_surrogate(ratio, advantages, eps_clip, eps_clip_high, dual_clip_c)
    return loss, clipped, ratio


# k3's exp(ref - logp) is exact up to this argument and follows its tangent beyond. exp(89) = inf in fp32, and inf
# times a zero mask was E3's NaN; exp(30) = 1.1e13 squares to 1.1e26, far from fp32's 3.4e38, so a grad norm over
# such tokens stays finite. A plain clamp (verl's +-20) would flip the gradient's sign past the cap (+1 instead of
# 1 - exp(ref - logp)); the tangent keeps it. At 30, |logp - ref| = 25 (the review's case) is slime's exact k3.
KL_EXP_MAX = 30.0


def exp_tangent_capped(x: Tensor, cap: float) -> Tensor:
    """exp(x) for x <= cap; beyond, the tangent at cap, exp(cap) (1 + x - cap): finite, with gradient exp(cap)."""
    e = torch.exp(x.clamp(max=cap))
    return torch.where(x > cap, e * (1.0 + x - cap), e)  # where: one branch's gradient at x = cap, not both


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the policy against the reference (Schulman's k1/k2/k3; low_var_kl is k3 clamped to
    +-10, as slime and verl do). Only k3's exp is capped (KL_EXP_MAX): k1 and k2 have no exp to overflow, and
    clamping their log-ratio (as the +-20 clamp of E3 did) zeroed their gradient on the tokens that drifted furthest
    from the reference (logp - ref = 25: k1 value 20 and gradient 0; slime and verl: 25 and 1)."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        # k3 = exp(ref - logp) - (ref - logp) - 1, unbiased and >= 0; exp(-inf) = 0 needs no lower cap
        neg = -log_ratio
        kl = exp_tangent_capped(neg, KL_EXP_MAX) - neg - 1.0
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2, k3 or low_var_kl")


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling: clamp(exp(old - rollout), 0, cap), and which tokens were clipped."""
    w = torch.exp((old_logp - rollout_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return w.clamp(0.0, cap), (w > cap).float()


def per_sample_sum(x: Tensor, sample_ids: Tensor, num_samples: int) -> Tensor:
    return torch.zeros(num_samples, dtype=x.dtype, device=x.device).index_add(0, sample_ids, x)


def per_sample_mean(x: Tensor, sample_ids: Tensor, num_samples: int, mask: Tensor | None = None) -> Tensor:
    """Per-sample sum of `x` divided by the sample's token count, or by its number of mask = 1 tokens when `mask` is
    given (slime/vime: `mask.sum().clamp_min(1)`; `x` is expected to be masked already). Empty samples give 0."""
    if mask is None:
        counts = torch.bincount(sample_ids, minlength=num_samples).to(x.dtype)
    else:
        counts = per_sample_sum(mask.to(x.dtype), sample_ids, num_samples)
    return per_sample_sum(x, sample_ids, num_samples) / counts.clamp(min=1)


def aggregate(
    x: Tensor, sample_ids: Tensor, num_samples: int, mode: str, denominator: float, mask: Tensor | None = None
) -> Tensor:
    """Sum of this micro-batch's share of the loss; `x` is the masked per-token loss.

    `sample_mean`: sum over samples of each sample's mean over its trained (mask = 1) tokens, divided by
    `denominator` = samples in the whole optimizer step (all micro-batches and data-parallel ranks), so that summing
    micro-batches gives vime's mean over samples of token means. `token_mean`: sum over tokens divided by
    `denominator` = trained tokens in the step. A denominator of 0 (no trained token anywhere) counts as 1, so that
    such a step has loss 0 and zero gradients instead of NaN."""
    denominator = max(float(denominator), 1.0)
    if mode == "sample_mean":
        return per_sample_mean(x, sample_ids, num_samples, mask).sum() / denominator
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
