"""Hand-computed unit tests of vime_core.algo (GRPO as tensor functions)."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.algo import (
    aggregate,
    group_advantages,
    gspo_policy_loss,
    kl_penalty,
    pass_at_k,
    per_sample_mean,
    per_sample_sum,
    ppo_policy_loss,
    tis_weights,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def close(a: torch.Tensor, b, tol: float = 1e-4) -> bool:
    return torch.allclose(a.double(), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------------------------------
def test_group_advantages_group_of_2_with_std():
    # groups [1,0] and [0,1]: mean 0.5, centred +-0.5; unbiased std = sqrt((0.25+0.25)/1) = 0.70711
    # -> +-0.5/0.70711 = +-0.70711
    adv = group_advantages(t(1, 0, 0, 1), group_size=2)
    assert close(adv, [0.70711, -0.70711, -0.70711, 0.70711])


def test_group_advantages_group_of_4_with_std():
    # one group [1,0,0,1]: mean 0.5, centred +-0.5; unbiased std = sqrt(4*0.25/3) = 0.57735 -> +-0.86603
    adv = group_advantages(t(1, 0, 0, 1), group_size=4)
    assert close(adv, [0.86603, -0.86603, -0.86603, 0.86603])


@pytest.mark.parametrize("group_size", [2, 4])
def test_group_advantages_without_std(group_size):
    # Dr.GRPO: only centred; both groupings have mean 0.5 per group -> +-0.5
    adv = group_advantages(t(1, 0, 0, 1), group_size=group_size, normalize_std=False)
    assert close(adv, [0.5, -0.5, -0.5, 0.5])


def test_group_advantages_asymmetric_group():
    # [3,0,0]: mean 1, centred [2,-1,-1]; unbiased var = (4+1+1)/2 = 3, std = 1.73205 -> [1.15470, -0.57735, -0.57735]
    assert close(group_advantages(t(3, 0, 0), 3), [1.15470, -0.57735, -0.57735])
    assert close(group_advantages(t(3, 0, 0), 3, normalize_std=False), [2.0, -1.0, -1.0])


def test_group_advantages_equal_rewards_give_zeros():
    # group [1,1]: centred 0, std 0 -> 0 / eps = 0 (not NaN); group [0,1] as usual
    adv = group_advantages(t(1, 1, 0, 1), group_size=2)
    assert close(adv, [0.0, 0.0, -0.70711, 0.70711])
    assert not torch.isnan(adv).any()


def test_group_advantages_group_of_one_is_zero():
    assert close(group_advantages(t(1, 0, 5), group_size=1), [0.0, 0.0, 0.0])


def test_group_advantages_wrong_size_raises():
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        group_advantages(t(1, 0, 0, 1, 1), group_size=2)


# --------------------------------------------------------------------------------------------------------------------
# PPO clipped loss
# --------------------------------------------------------------------------------------------------------------------
EPS, EPS_HIGH = 0.2, 0.28  # ratio clipped to [0.8, 1.28]


def _ppo(ratios, advantages, dual_clip_c=None):
    old = torch.zeros(len(ratios), dtype=torch.float64)
    logp = torch.log(t(*ratios)).requires_grad_(True)
    loss, clipped, ratio = ppo_policy_loss(logp, old, t(*advantages), EPS, EPS_HIGH, dual_clip_c)
    loss.sum().backward()
    return loss.detach(), clipped, ratio.detach(), logp.grad


def test_ppo_inside_clip_range():
    # ratio 1.1, A = 2: loss = -A * r = -2.2, not clipped; d loss / d logp = -A * r = -2.2
    loss, clipped, ratio, grad = _ppo([1.1], [2.0])
    assert close(ratio, [1.1]) and close(loss, [-2.2]) and close(clipped, [0.0]) and close(grad, [-2.2])


def test_ppo_above_upper_clip_positive_advantage():
    # ratio 1.5, A = 1: -A*r = -1.5, -A*clip(r) = -1.28; max -> -1.28, clipped, no gradient
    loss, clipped, _, grad = _ppo([1.5], [1.0])
    assert close(loss, [-1.28]) and close(clipped, [1.0]) and close(grad, [0.0])


def test_ppo_above_upper_clip_negative_advantage_is_not_clipped():
    # ratio 1.5, A = -1: -A*r = 1.5, -A*clip(r) = 1.28; max -> 1.5 (pessimistic bound), not clipped
    loss, clipped, _, grad = _ppo([1.5], [-1.0])
    assert close(loss, [1.5]) and close(clipped, [0.0]) and close(grad, [1.5])


def test_ppo_below_lower_clip_negative_advantage():
    # ratio 0.5, A = -1: -A*r = 0.5, -A*clip(r) = 0.8; max -> 0.8, clipped, no gradient
    loss, clipped, _, grad = _ppo([0.5], [-1.0])
    assert close(loss, [0.8]) and close(clipped, [1.0]) and close(grad, [0.0])


def test_ppo_below_lower_clip_positive_advantage_is_not_clipped():
    # ratio 0.5, A = 1: -0.5 vs -0.8 -> -0.5, not clipped
    loss, clipped, _, _ = _ppo([0.5], [1.0])
    assert close(loss, [-0.5]) and close(clipped, [0.0])


def test_ppo_uses_asymmetric_clip():
    # ratio 1.25 is inside [0.8, 1.28] (clip-higher) although it is above 1 + eps_clip = 1.2
    loss, clipped, _, _ = _ppo([1.25], [1.0])
    assert close(loss, [-1.25]) and close(clipped, [0.0])


def test_ppo_dual_clip_caps_negative_advantage_loss():
    # c = 3. ratio 5, A = -1: max(5, 1.28) = 5 > -A*c = 3 -> 3, clipped, no gradient
    # ratio 2, A = -1: max(2, 1.28) = 2 < 3 -> 2, not clipped
    # ratio 5, A = +1: max(-5, -1.28) = -1.28, dual clip does not apply to A > 0 (clipped by the upper bound)
    loss, clipped, _, grad = _ppo([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], dual_clip_c=3.0)
    assert close(loss, [3.0, 2.0, -1.28])
    assert close(clipped, [1.0, 0.0, 1.0])
    assert close(grad, [0.0, 2.0, 0.0])
    # without the dual clip the first token's loss would be 5
    loss_nodual, _, _, _ = _ppo([5.0], [-1.0])
    assert close(loss_nodual, [5.0])


# --------------------------------------------------------------------------------------------------------------------
# GSPO
# --------------------------------------------------------------------------------------------------------------------
def test_gspo_sequence_ratio_value_and_token_gradients():
    # sample 0 has tokens with log ratios 0.1 and 0.3 -> mean 0.2 -> ratio exp(0.2) = 1.22140 (inside [0.8, 1.28])
    # sample 1 has one token with log ratio -0.4 -> ratio exp(-0.4) = 0.67032 (below 0.8, but A > 0: not clipped)
    old = t(-1.0, -2.0, -0.5)
    logp = t(-0.9, -1.7, -0.9).requires_grad_(True)
    ids = torch.tensor([0, 0, 1])
    adv = t(1.0, 1.0, 1.0)
    loss, clipped, ratio = gspo_policy_loss(logp, old, adv, ids, 2, EPS, EPS_HIGH)
    assert close(ratio.detach(), [1.22140, 1.22140, 0.67032])
    # loss = -A * ratio; max(-0.67032, -0.8) = -0.67032
    assert close(loss.detach(), [-1.22140, -1.22140, -0.67032])
    assert close(clipped, [0.0, 0.0, 0.0])
    loss.sum().backward()
    # each token's gradient flows through its own log-prob: d(-A * s) / d logp_t = -A * s (stop-gradient trick)
    assert close(logp.grad, [-1.22140, -1.22140, -0.67032])
    assert (logp.grad != 0).all()


def test_gspo_ratio_differs_from_token_ratio():
    # same tokens, token ratios exp(0.1) = 1.10517 and exp(0.3) = 1.34986 vs the shared sequence ratio 1.22140
    old, logp, ids = t(-1.0, -2.0), t(-0.9, -1.7), torch.tensor([0, 0])
    _, _, tok_ratio = ppo_policy_loss(logp, old, t(1, 1), EPS, EPS_HIGH)
    _, _, seq_ratio = gspo_policy_loss(logp, old, t(1, 1), ids, 1, EPS, EPS_HIGH)
    assert close(tok_ratio, [1.10517, 1.34986])
    assert close(seq_ratio, [1.22140, 1.22140])


def test_gspo_clips_whole_sequence():
    # one sample, log ratios 0.4 and 0.6 -> mean 0.5 -> ratio 1.64872 > 1.28, A = 1 -> both tokens clipped at -1.28
    old = t(0.0, 0.0)
    logp = t(0.4, 0.6).requires_grad_(True)
    loss, clipped, _ = gspo_policy_loss(logp, old, t(1, 1), torch.tensor([0, 0]), 1, EPS, EPS_HIGH)
    assert close(loss.detach(), [-1.28, -1.28]) and close(clipped, [1.0, 1.0])
    loss.sum().backward()
    assert close(logp.grad, [0.0, 0.0])


# --------------------------------------------------------------------------------------------------------------------
# KL, TIS
# --------------------------------------------------------------------------------------------------------------------
LOGP, REF = t(-1.0, -2.0), t(-1.5, -1.0)  # log ratio logp - ref = [0.5, -1.0]


def test_kl_k1():
    assert close(kl_penalty(LOGP, REF, "k1"), [0.5, -1.0])


def test_kl_k2():
    # 0.5 * [0.25, 1.0]
    assert close(kl_penalty(LOGP, REF, "k2"), [0.125, 0.5])


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_kl_k3(kind):
    # ref - logp = [-0.5, 1.0]: exp(-0.5) + 0.5 - 1 = 0.10653; exp(1) - 1 - 1 = 0.71828
    assert close(kl_penalty(LOGP, REF, kind), [0.10653, 0.71828])


def test_low_var_kl_is_clamped():
    # ref - logp = 15: k3 = exp(15) - 16 = 3269001.37; low_var_kl clamps to 10
    logp, ref = t(-16.0), t(-1.0)
    assert close(kl_penalty(logp, ref, "k3"), [math.exp(15) - 16], tol=1e-3)
    assert close(kl_penalty(logp, ref, "low_var_kl"), [10.0])


def slime_kl_float64(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    """slime's compute_approx_kl (verl's k1/k2 too), unclamped, in float64: the reference for kl_penalty."""
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.square() / 2
    k3 = (-log_ratio).exp() - 1 + log_ratio
    return k3.clamp(-10, 10) if kind == "low_var_kl" else k3


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_value_and_gradient_equal_the_float64_reference(kind):
    # issue 28 N1: the +-20 clamp on the log-ratio gave k1 a value of 20 and a gradient of 0 at logp - ref = 25
    # (slime/verl: 25 and 1); k2 and k3 were cut the same way. fp32 inputs like the trainer's, references in float64
    ratios = [-25.0, -5.0, -0.5, 0.0, 0.5, 5.0, 25.0]
    ref = torch.full((len(ratios),), -1.0)
    logp = (torch.tensor(ratios) + ref).requires_grad_(True)
    kl = kl_penalty(logp, ref, kind)
    kl.sum().backward()
    x = torch.tensor(ratios, dtype=torch.float64, requires_grad=True)
    want = slime_kl_float64(x, kind)
    want.sum().backward()
    assert torch.allclose(kl.double(), want.detach(), rtol=1e-6, atol=1e-6), (kl, want)
    assert torch.allclose(logp.grad.double(), x.grad, rtol=1e-6, atol=1e-6), (logp.grad, x.grad)
    at_25 = {"k1": (25.0, 1.0), "k2": (312.5, 25.0), "k3": (24.0, 1.0), "low_var_kl": (10.0, 0.0)}[kind]
    assert kl[-1].item() == pytest.approx(at_25[0], abs=1e-5) and logp.grad[-1].item() == pytest.approx(at_25[1])


def test_k3_beyond_the_exp_cap_is_finite_and_keeps_its_sign():
    # ref - logp = 100: exp(100) = inf in fp32; past KL_EXP_MAX = 30 k3 follows its tangent, gradient 1 - exp(30) < 0
    logp = torch.tensor([-101.0, -31.0], requires_grad=True)
    kl = kl_penalty(logp, torch.tensor([-1.0, -1.0]), "k3")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()
    assert logp.grad[0].item() == pytest.approx(1 - math.exp(30), rel=1e-5)
    assert logp.grad[1].item() == pytest.approx(1 - math.exp(30), rel=1e-5)  # continuous at the cap
    assert kl[0].item() == pytest.approx(math.exp(30) * 71 - 101, rel=1e-5)


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(LOGP, REF, "k4")


def test_tis_weights_clamp_and_clipfrac():
    # exp(old - rollout) = [exp(0), exp(1), exp(-0.5)] = [1, 2.71828, 0.60653]; cap 2 -> [1, 2, 0.60653]
    w, clipped = tis_weights(t(0.0, 0.0, 0.0), t(0.0, -1.0, 0.5), cap=2.0)
    assert close(w, [1.0, 2.0, 0.60653])
    assert close(clipped, [0.0, 1.0, 0.0])
    assert clipped.mean().item() == pytest.approx(1 / 3)


# --------------------------------------------------------------------------------------------------------------------
# per-sample reductions and aggregation
# --------------------------------------------------------------------------------------------------------------------
def test_per_sample_sum_and_mean():
    # tokens [1 | 2 3 4 | -]: sums [1, 9, 0], counts [1, 3, 0 -> clamped to 1] -> means [1, 3, 0]
    x, ids = t(1, 2, 3, 4), torch.tensor([0, 1, 1, 1])
    assert close(per_sample_sum(x, ids, 3), [1.0, 9.0, 0.0])
    assert close(per_sample_mean(x, ids, 3), [1.0, 3.0, 0.0])


def test_aggregate_sample_mean_vs_token_mean():
    # two samples, 1 and 3 tokens: [4 | 1 2 3]
    x, ids = t(4, 1, 2, 3), torch.tensor([0, 1, 1, 1])
    # sample_mean: per-sample means [4, 2] -> sum 6 / 2 samples = 3
    assert aggregate(x, ids, 2, "sample_mean", denominator=2).item() == pytest.approx(3.0)
    # token_mean: 10 / 4 tokens = 2.5
    assert aggregate(x, ids, 2, "token_mean", denominator=4).item() == pytest.approx(2.5)


def test_aggregate_micro_batches_sum_to_the_step_mean():
    # step = micro-batch A [4 | 1 2 3] + micro-batch B [6]: 3 samples, 5 tokens
    a, a_ids = t(4, 1, 2, 3), torch.tensor([0, 1, 1, 1])
    b, b_ids = t(6), torch.tensor([0])
    # mean of sample means = (4 + 2 + 6) / 3 = 4
    s = aggregate(a, a_ids, 2, "sample_mean", 3) + aggregate(b, b_ids, 1, "sample_mean", 3)
    assert s.item() == pytest.approx(4.0)
    # token mean = (4+1+2+3+6) / 5 = 3.2
    s = aggregate(a, a_ids, 2, "token_mean", 5) + aggregate(b, b_ids, 1, "token_mean", 5)
    assert s.item() == pytest.approx(3.2)


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss aggregation 'seq_mean'"):
        aggregate(t(1), torch.tensor([0]), 1, "seq_mean", 1)


# --------------------------------------------------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),  # c / n
        (4, 1, 4, 1.0),  # every sample drawn, the correct one among them
        (4, 0, 1, 0.0),
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_binomial_formula():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k)), (n, c, k)


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples, got 4"):
        pass_at_k(4, 1, 5)


# --------------------------------------------------------------------------------------------------------------------
# off the default path: masks, constant groups, overflow
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, group_size", [(0.7, 8), (0.9, 8), (0.1, 3), (0.3, 5)])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_equal_inexact_rewards_give_exact_zeros(value, group_size, normalize_std):
    # fp32 mean/std rounding gave [0.7] * 8 advantages of 0.056 (with std) instead of 0; float32 inputs as the
    # rollout produces them, and a second group that does carry signal
    rewards = torch.tensor([value] * group_size + [0.0] * (group_size - 1) + [1.0], dtype=torch.float32)
    adv = group_advantages(rewards, group_size, normalize_std=normalize_std)
    assert torch.equal(adv[:group_size], torch.zeros(group_size, dtype=adv.dtype))
    assert adv[-1] > 0


def test_per_sample_mean_over_mask_tokens():
    # sample 0: [2, 4, (masked 100)] -> masked sum 6 over 2 trained tokens = 3 (not 6 / 3); sample 1 fully masked -> 0
    x, ids, mask = t(2, 4, 0, 0), torch.tensor([0, 0, 0, 1]), t(1, 1, 0, 0)
    assert close(per_sample_mean(x, ids, 2, mask), [3.0, 0.0])


def test_aggregate_sample_mean_with_mask():
    x, ids, mask = t(2, 4, 0, 6), torch.tensor([0, 0, 0, 1]), t(1, 1, 0, 1)
    # means [3, 6] -> 9 / 2 samples
    assert aggregate(x, ids, 2, "sample_mean", 2, mask).item() == pytest.approx(4.5)


def test_aggregate_zero_denominator_is_zero():
    assert aggregate(t(0.0, 0.0), torch.tensor([0, 0]), 1, "token_mean", 0).item() == 0.0


def test_gspo_masked_sequence_ratio_and_dual_clip():
    # log ratios [0.1, 0.3 | masked 5.0]: masked mean 0.2 -> ratio 1.2214 on every token, not clipped
    old, logp, ids = t(0, 0, 0), t(0.1, 0.3, 5.0), torch.tensor([0, 0, 0])
    _, clipped, ratio = gspo_policy_loss(logp, old, t(1, 1, 1), ids, 1, EPS, EPS_HIGH, mask=t(1, 1, 0))
    assert close(ratio, [1.22140] * 3) and close(clipped, [0.0] * 3)
    # A = -1, sequence ratio 5 > c = 3: the dual clip caps the loss at 3
    loss, clipped, _ = gspo_policy_loss(
        t(math.log(5)), t(0), t(-1), torch.tensor([0]), 1, EPS, EPS_HIGH, dual_clip_c=3.0
    )
    assert close(loss, [3.0]) and close(clipped, [1.0])


def test_ratio_and_kl_overflow_is_clamped():
    # fp32: exp(100) = inf; with A = 0, -A * inf = NaN. Clamped at +-20 the ratio is exp(20) and the loss 0
    logp, old = torch.tensor([100.0]), torch.tensor([0.0])
    loss, _, ratio = ppo_policy_loss(logp, old, torch.tensor([0.0]), EPS, EPS_HIGH)
    assert loss.item() == 0.0 and ratio.item() == pytest.approx(math.exp(20), rel=1e-5)
    assert torch.isfinite(kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")).all()
    w, _ = tis_weights(torch.tensor([0.0]), torch.tensor([-100.0]), cap=2.0)
    assert w.item() == 2.0
