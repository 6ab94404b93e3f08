"""The GRPO loss of one micro-batch (vime_core.loss) with every option, hand-computed, and the step arithmetic
around it (DP loss scale, denominators, LR schedules, DP splitting, the finiteness guard). The real Trainer and
megatron DDP in spawned gloo ranks: tests/integration/test_loss.py."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.config import GRPOConfig, config_from_dict
from vime_core.loss import (
    MicroBatch,
    NonFiniteStepError,
    check_finite_step,
    loss_scale,
    lr_at,
    micro_batch_loss,
    set_step_schedule,
    step_denominator,
    step_train_metrics,
)
from vime_core.trainer import TrainSample, split_steps_and_ranks

EPS, EPS_HIGH = 0.2, 0.28


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def mb(log_ratios, adv, ids, mask=None, **extra) -> MicroBatch:
    """A micro-batch whose old log-probs are 0, so that logp = the log-ratio (a leaf with grad)."""
    logp = t(*log_ratios).requires_grad_(True)
    n = len(log_ratios)
    return MicroBatch(
        logp=logp,
        old_logp=torch.zeros(n, dtype=torch.float64),
        advantages=t(*adv),
        mask=t(*(mask or [1] * n)),
        sample_ids=torch.tensor(ids),
        num_samples=max(ids) + 1,
        **extra,
    )


def grad_of(batch: MicroBatch, g: GRPOConfig, denom: float) -> tuple[float, torch.Tensor]:
    loss, _ = micro_batch_loss(batch, g, denom)
    loss.backward()
    return float(loss), batch.logp.grad


def close(a, b, tol=1e-5) -> bool:
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0
    )


# --------------------------------------------------------------------------------------------------------------------
# the default and the aggregations
# --------------------------------------------------------------------------------------------------------------------
def test_default_ppo_sample_mean():
    # ratios 1: pg = -A per token; sample 0 (A = 1, 2 tokens) mean -1, sample 1 (A = -0.5, 1 token) mean 0.5;
    # step of 4 samples (denominator): (-1 + 0.5) / 4 = -0.125. d/d logp_t = -A * r / (n_i * 4)
    loss, grad = grad_of(mb([0, 0, 0], [1, 1, -0.5], [0, 0, 1]), GRPOConfig(), 4)
    assert loss == pytest.approx(-0.125)
    assert close(grad, [-1 / 8, -1 / 8, 0.5 / 4])


def test_sample_mean_divides_by_trained_tokens_not_response_length():
    # sample 0 has 4 tokens of which 3 are trained (a tool token masked out): its mean is over 3 tokens (slime:
    # mask.sum().clamp_min(1)); dividing by 4 made the gradient 25% too small
    batch = mb([0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1], mask=[1, 1, 0, 1, 1])
    loss, grad = grad_of(batch, GRPOConfig(), 2)
    assert loss == pytest.approx((-1 + -1) / 2)
    assert close(grad, [-1 / 6, -1 / 6, 0.0, -1 / 6, -1 / 2])


def test_token_mean():
    # 3 trained tokens of 4 in the step (denominator 4: another micro-batch holds one more): sum(-A) / 4
    batch = mb([0, 0, 0], [1, 1, -0.5], [0, 0, 1])
    loss, grad = grad_of(batch, GRPOConfig(loss_aggregation="token_mean"), 4)
    assert loss == pytest.approx((-1 - 1 + 0.5) / 4)
    assert close(grad, [-0.25, -0.25, 0.125])


def test_token_mean_without_trained_tokens_is_zero_not_nan():
    # every token masked and a step denominator of 0: loss 0 and zero gradients (was 0/0 = NaN, applied by AdamW)
    batch = mb([0.3, -0.2], [1, 1], [0, 0], mask=[0, 0])
    loss, grad = grad_of(batch, GRPOConfig(loss_aggregation="token_mean"), 0)
    assert loss == 0.0
    assert torch.equal(grad, torch.zeros(2, dtype=torch.float64))


def test_overflowing_ratio_with_zero_advantage_stays_finite():
    # log-ratio 100 in fp32: exp overflows to inf and -0 * inf = NaN; clamped to 20 first it is 4.9e8 * 0 = 0
    logp = torch.tensor([100.0, 0.0], requires_grad=True)
    batch = MicroBatch(
        logp=logp,
        old_logp=torch.zeros(2),
        advantages=torch.zeros(2),
        mask=torch.ones(2),
        sample_ids=torch.tensor([0, 0]),
        num_samples=1,
        ref_logp=torch.tensor([-100.0, 0.0]),
    )
    loss, _ = micro_batch_loss(batch, GRPOConfig(kl_loss_coef=0.1, kl_loss_type="k3"), 1)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_masked_out_token_far_below_the_reference_gives_no_nan(kind):
    # E3 with the KL clamp gone from k1/k2 (issue 28 N1): a masked-out token at logp - ref = -100 (k3's exp(100) is
    # inf in fp32, and 0 x inf = NaN in backward) must leave the loss and every gradient finite, its own gradient 0
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    batch = MicroBatch(
        logp=logp,
        old_logp=logp.detach().clone(),
        advantages=torch.tensor([1.0, 1.0]),
        mask=torch.tensor([0.0, 1.0]),
        sample_ids=torch.tensor([0, 0]),
        num_samples=1,
        ref_logp=torch.tensor([0.0, -1.5]),
    )
    loss, _ = micro_batch_loss(batch, GRPOConfig(kl_loss_coef=0.1, kl_loss_type=kind), 1)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() != 0.0


# --------------------------------------------------------------------------------------------------------------------
# options: KL, TIS, GSPO, dual clip, entropy
# --------------------------------------------------------------------------------------------------------------------
def test_kl_against_reference():
    # logp = old = 0 (ratio 1, A = 0: pg = 0); ref = [-0.5, 1.0] -> k1 = logp - ref = [0.5, -1.0], coef 0.1:
    # sample mean over one sample of 2 tokens: 0.1 * (0.5 - 1.0) / 2 = -0.025; d/d logp_t = 0.1 / 2
    batch = mb([0, 0], [0, 0], [0, 0], ref_logp=t(-0.5, 1.0))
    g = GRPOConfig(kl_loss_coef=0.1, kl_loss_type="k1")
    loss, part = micro_batch_loss(batch, g, 1)
    loss.backward()
    assert float(loss) == pytest.approx(-0.025)
    assert close(batch.logp.grad, [0.05, 0.05])
    assert part["kl_loss"] == pytest.approx(-0.5)  # token sum; the trainer divides by trained tokens


def test_kl_needs_the_reference():
    with pytest.raises(ValueError, match="kl_loss_coef > 0 needs the reference"):
        micro_batch_loss(mb([0], [1], [0]), GRPOConfig(kl_loss_coef=0.1), 1)


def test_tis_weights_the_policy_loss():
    # old = 0, rollout = [0, -1]: weights exp(0 - rollout) = [1, 2.718 -> capped at 2]; pg = -A * 1 * w
    batch = mb([0, 0], [1, 1], [0, 0], rollout_logp=t(0.0, -1.0))
    loss, part = micro_batch_loss(batch, GRPOConfig(use_tis=True, tis_cap=2.0), 1)
    assert float(loss) == pytest.approx((-1 * 1 + -1 * 2) / 2)
    assert part["tis"] == pytest.approx(3.0) and part["tis_clipfrac"] == pytest.approx(1.0)


def test_gspo_sequence_ratio_is_the_masked_mean():
    # trained tokens log-ratios 0.1, 0.3 -> mean 0.2 -> ratio 1.2214 (inside the clip range); the masked token's 5.0
    # must not count (with it: mean 1.8, ratio 6.05, clipped)
    batch = mb([0.1, 0.3, 5.0], [1, 1, 1], [0, 0, 0], mask=[1, 1, 0])
    loss, part = micro_batch_loss(batch, GRPOConfig(policy_loss="gspo"), 1)
    assert float(loss) == pytest.approx(-math.exp(0.2), abs=1e-6)
    assert part["pg_clipfrac"] == 0.0


def test_gspo_with_dual_clip():
    # A = -1, sequence ratio 5 (log 5 on each token): loss max(5, 1.28) = 5 capped by dual clip c = 3 -> 3, clipped
    lr = math.log(5.0)
    loss, part = micro_batch_loss(mb([lr, lr], [-1, -1], [0, 0]), GRPOConfig(policy_loss="gspo", dual_clip_c=3.0), 1)
    assert float(loss) == pytest.approx(3.0)
    assert part["pg_clipfrac"] == 2.0
    loss, _ = micro_batch_loss(mb([lr, lr], [-1, -1], [0, 0]), GRPOConfig(policy_loss="gspo"), 1)
    assert float(loss) == pytest.approx(5.0)


def test_ppo_dual_clip():
    loss, _ = micro_batch_loss(mb([math.log(5.0)], [-1], [0]), GRPOConfig(dual_clip_c=3.0), 1)
    assert float(loss) == pytest.approx(3.0)


def test_entropy_bonus():
    # A = 0: loss = -coef * mean entropy = -0.01 * (2 + 4) / 2
    batch = mb([0, 0], [0, 0], [0, 0], entropy=t(2.0, 4.0))
    loss, part = micro_batch_loss(batch, GRPOConfig(entropy_coef=0.01), 1)
    assert float(loss) == pytest.approx(-0.03)
    assert part["entropy_loss"] == pytest.approx(6.0)


def test_step_train_metrics():
    g = GRPOConfig()
    out = step_train_metrics(
        {
            "pg_loss": 3.0,
            "pg_clipfrac": 1.0,
            "ppo_kl": 0.0,
            "entropy_loss": 6.0,
            "kl_loss": 0.0,
            "tis": 0.0,
            "tis_clipfrac": 0.0,
        },
        3,
        -0.5,
        g,
    )
    assert out["train/pg_loss"] == 1.0 and out["train/entropy_loss"] == 2.0 and out["train/loss"] == -0.5
    assert "train/kl_loss" not in out and "train/tis" not in out


# --------------------------------------------------------------------------------------------------------------------
# step arithmetic
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, dp, scale",
    [("adamw", 1, 1.0), ("adamw", 4, 1.0), ("megatron", 1, 1.0), ("megatron", 2, 2.0), ("megatron", 8, 8.0)],
)
def test_loss_scale(kind, dp, scale):
    assert loss_scale(kind, dp) == scale


def test_loss_scale_on_a_simulated_dp_group():
    # two ranks, each with its share of a loss over 4 samples: the true gradient is the sum of the shares'
    # gradients. AdamW sums over DP; megatron's DDP averages, so its loss must be scaled by DP
    shares = [torch.tensor([0.3, -0.1]), torch.tensor([0.2, 0.4])]  # d(share)/dw on rank 0 and 1
    true = shares[0] + shares[1]
    adamw = sum(loss_scale("adamw", 2) * s for s in shares)
    megatron = sum(loss_scale("megatron", 2) * s for s in shares) / 2
    assert torch.allclose(adamw, true) and torch.allclose(megatron, true)


def test_step_denominator():
    assert step_denominator("sample_mean", 4, 0, 2) == 8.0
    assert step_denominator("token_mean", 4, 37, 2) == 37.0


def test_check_finite_step():
    check_finite_step(0.5, 1.2, "step 0")
    check_finite_step(0.5, None, "step 0")
    with pytest.raises(NonFiniteStepError, match=r"step 3: non-finite loss = nan; the step was not applied"):
        check_finite_step(math.nan, 1.0, "step 3")
    with pytest.raises(NonFiniteStepError, match=r"non-finite grad norm = inf"):
        check_finite_step(0.1, math.inf, "step 3")


def _cfg(**train):
    return config_from_dict({"train": {"lr": 1e-3, "min_lr": 1e-4, **train}})


def test_lr_warmup_then_constant():
    cfg = _cfg(lr_warmup_steps=4)
    assert [lr_at(s, cfg) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_lr_cosine():
    cfg = _cfg(lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=4)
    # after warm-up: progress 0, .25, .5, .75, 1 -> min + (max - min) * (1 + cos(pi p)) / 2, then min_lr
    expected = [1e-4 + 9e-4 * (1 + math.cos(math.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75, 1.0)]
    assert [lr_at(s, cfg) for s in range(2, 7)] == pytest.approx(expected)
    assert lr_at(50, cfg) == pytest.approx(1e-4)


def test_lr_linear():
    cfg = _cfg(lr_schedule="linear", lr_decay_steps=4)
    assert [lr_at(s, cfg) for s in range(6)] == pytest.approx([1e-3, 7.75e-4, 5.5e-4, 3.25e-4, 1e-4, 1e-4])


def test_step_schedule_applies_megatrons_weight_decay_multipliers():
    # megatron's optimizer groups as get_megatron_optimizer builds them: wd_mult 0 for 1-D params (norms, biases)
    groups = [{"wd_mult": 1.0, "weight_decay": 0.1, "lr": 0.0}, {"wd_mult": 0.0, "weight_decay": 0.1, "lr": 0.0}]
    set_step_schedule(groups, 3e-4, 0.1)
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(3e-4, 0.1), (3e-4, 0.0)]
    # torch AdamW's groups carry their own decay (0 for the 1-D group): only the LR changes
    adamw = [{"weight_decay": 0.1, "lr": 0.0}, {"weight_decay": 0.0, "lr": 0.0}]
    set_step_schedule(adamw, 1e-3)
    assert [(g["lr"], g["weight_decay"]) for g in adamw] == [(1e-3, 0.1), (1e-3, 0.0)]


@pytest.mark.parametrize("bad, finite", [(None, True), (math.nan, False), (math.inf, False), (-math.inf, False)])
def test_megatron_grads_finite_by_buffer_sums(bad, finite):
    from types import SimpleNamespace

    from vime_core.grads import megatron_grads_finite

    dense, expert = torch.randn(1000), torch.randn(10)
    if bad is not None:
        expert[3] = bad
        dense[7] = -math.inf if bad == math.inf else 0.0  # inf + -inf sums to NaN: still non-finite
    ddp = SimpleNamespace(
        buffers=[SimpleNamespace(grad_data=dense)], expert_parallel_buffers=[SimpleNamespace(grad_data=expert)]
    )
    assert megatron_grads_finite(ddp) is finite


def test_split_steps_and_ranks_dp2():
    # 8 samples, 2 optimizer steps, DP 2: each step takes 4 consecutive samples, 2 per rank, balancing tokens
    samples = [
        TrainSample(
            tokens=[1] * n, prompt_len=1, loss_mask=[1] * (n - 1), rollout_logprobs=[0.0] * (n - 1), advantage=0.0
        )
        for n in (10, 2, 3, 9, 4, 4, 4, 4)
    ]
    split = split_steps_and_ranks(samples, 2, 2)
    assert [[sorted(len(s.tokens) for s in step) for step in rank] for rank in split] == [
        [[2, 10], [4, 4]],
        [[3, 9], [4, 4]],
    ]


def test_make_train_batch_constant_groups_and_non_finite_rewards():
    from vime_core.sample import Sample
    from vime_core.trainer import make_train_batch

    cfg = config_from_dict(
        {"rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4}, "train": {"global_batch_size": 8}}
    )

    def group(*rewards):
        return [
            Sample(group_id=0, prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-1.0], reward=r) for r in rewards
        ]

    batch, _ = make_train_batch([group(0.7, 0.7, 0.7, 0.7), group(0.1, 0.9, 0.1, 0.1)], cfg)
    assert [s.advantage for s in batch[:4]] == [0.0] * 4  # was 0.056 each: fp32 mean/std rounding
    assert batch[5].advantage > 0
    with pytest.raises(ValueError, match=r"sample 2 of group 1 has a non-finite reward nan"):
        make_train_batch([group(0.0, 1.0, 0.0, 1.0), group(0.0, 1.0, math.nan, 1.0)], cfg)
