"""The GRPO loss of one micro-batch as a pure function, and the step arithmetic around it (loss scale under data
parallelism, denominators, the LR schedule, the finiteness guard). The trainer (trainer/step.py) calls these; tests run
every option through them on CPU (tests/unit/test_loss.py).

Conventions (see algo.py): token tensors are 1-D over the concatenated response tokens of a micro-batch, with
`sample_ids` saying which sample each token belongs to. The loss of a micro-batch is its *share* of the optimizer
step's loss: the denominator (samples or trained tokens) counts the whole step over every micro-batch and
data-parallel rank, so that summing the shares over micro-batches and ranks gives the step's loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vime_core import algo
from vime_core.config import GRPOConfig, RunConfig

Tensor = torch.Tensor

# masked token sums returned by micro_batch_loss; the trainer divides them by the step's trained tokens
METRIC_KEYS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss", "tis", "tis_clipfrac")


class NonFiniteStepError(RuntimeError):
    """A loss or gradient norm is NaN or inf: the step is abandoned before the optimizer applies it."""


@dataclass
class MicroBatch:
    """What the loss needs of one micro-batch (all on the same device)."""

    logp: Tensor  # current policy log-probs of the response tokens (with grad)
    old_logp: Tensor  # log-probs recomputed before the step (PPO's "old" policy)
    advantages: Tensor  # per token (the sample's advantage broadcast)
    mask: Tensor  # per token: 1 = trained, 0 = not (tool output of a custom generate)
    sample_ids: Tensor  # per token: index of its sample in the micro-batch
    num_samples: int
    entropy: Tensor | None = None  # per token; needed when entropy_coef > 0
    ref_logp: Tensor | None = None  # frozen reference; needed when kl_loss_coef > 0
    rollout_logp: Tensor | None = None  # vLLM's log-probs; needed for TIS


def micro_batch_loss(mb: MicroBatch, g: GRPOConfig, denominator: float) -> tuple[Tensor, dict[str, Tensor | float]]:
    """(this micro-batch's share of the step loss, masked token sums of the metrics in METRIC_KEYS).

    The sums stay 0-dim tensors on the device (0.0 for a metric off): a host read per micro-batch would stall the
    GPU while the CPU queues the next one; the trainer reads them once per step.

    per token: pg = clipped surrogate (PPO or GSPO) x TIS weight; total = pg - entropy_coef * entropy +
    kl_loss_coef * KL(policy || reference); aggregated by `g.loss_aggregation` over mask = 1 tokens."""
    mask = mb.mask.to(mb.logp.dtype)
    if g.policy_loss == "gspo":
        pg, clipped, _ = algo.gspo_policy_loss(
            mb.logp,
            mb.old_logp,
            mb.advantages,
            mb.sample_ids,
            mb.num_samples,
            g.eps_clip,
            g.eps_clip_high,
            mask=mask,
            dual_clip_c=g.dual_clip_c,
        )
    else:
        pg, clipped, _ = algo.ppo_policy_loss(
            mb.logp, mb.old_logp, mb.advantages, g.eps_clip, g.eps_clip_high, g.dual_clip_c
        )
    sums: dict[str, Tensor | float] = dict.fromkeys(METRIC_KEYS, 0.0)

    def msum(x: Tensor) -> Tensor:  # sum over trained tokens; where(): a masked-out inf/NaN must not leak in
        return torch.where(mask > 0, x.detach(), torch.zeros_like(x)).sum()

    if g.use_tis is True:  # `auto` is resolved by RunConfig (rollout.max_staleness); a bare GRPOConfig means off
        if mb.rollout_logp is None:
            raise ValueError("grpo.use_tis needs the rollout log-probs of every sample")
        w, tis_clip = algo.tis_weights(mb.old_logp, mb.rollout_logp, g.tis_cap)
        pg = pg * w
        sums["tis"], sums["tis_clipfrac"] = msum(w), msum(tis_clip)
    total = pg
    if g.entropy_coef > 0:
        if mb.entropy is None:
            raise ValueError("grpo.entropy_coef > 0 needs the entropy of every token")
        total = total - g.entropy_coef * mb.entropy
    kl = None
    if g.kl_loss_coef > 0:
        if mb.ref_logp is None:
            raise ValueError("grpo.kl_loss_coef > 0 needs the reference model's log-probs")
        kl = algo.kl_penalty(mb.logp, mb.ref_logp, g.kl_loss_type)
        total = total + g.kl_loss_coef * kl
    masked = torch.where(mask > 0, total, torch.zeros_like(total))
    loss = algo.aggregate(masked, mb.sample_ids, mb.num_samples, g.loss_aggregation, denominator, mask)
    sums["pg_loss"], sums["pg_clipfrac"], sums["ppo_kl"] = msum(pg), msum(clipped), msum(mb.old_logp - mb.logp)
    if mb.entropy is not None:
        sums["entropy_loss"] = msum(mb.entropy)
    if kl is not None:
        sums["kl_loss"] = msum(kl)
    return loss, sums


def step_train_metrics(sums: dict[str, float], trained_tokens: int, loss: float, g: GRPOConfig) -> dict[str, float]:
    """train/* metrics of one optimizer step on one rank: token means of the sums over trained tokens, and the loss
    (the trainer passes totals over data-parallel ranks)."""
    out = {f"train/{k}": v / max(1, trained_tokens) for k, v in sums.items()}
    out["train/loss"] = loss
    if g.use_tis is not True:
        out.pop("train/tis"), out.pop("train/tis_clipfrac")
    if g.kl_loss_coef <= 0:
        out.pop("train/kl_loss")
    return out


def loss_scale(optimizer_kind: str, dp_size: int) -> float:
    """Factor on the loss before backward so that the applied gradient is the gradient of the step's loss.

    The loss is already each rank's share of the global loss (global denominator), so the true gradient is the SUM
    of the ranks' gradients. The AdamW path all-reduces with SUM: factor 1. megatron's DistributedDataParallel
    AVERAGES over data-parallel ranks (gradient_scaling_factor = 1 / dp): factor dp, as slime's loss_function does.
    Without it the H200 bench's dp2 grad norm was 0.50x the dp1 one at every step."""
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    if optimizer_kind == "megatron":
        return float(dp_size)
    if optimizer_kind == "adamw":
        return 1.0
    raise ValueError(f"unknown optimizer kind {optimizer_kind!r}; use adamw or megatron")


def step_denominator(mode: str, num_samples: int, trained_tokens_all_ranks: int, dp_size: int) -> float:
    """The step's loss denominator: samples over all DP ranks (every rank holds `num_samples`), or trained tokens."""
    if mode == "sample_mean":
        return float(num_samples * dp_size)
    if mode == "token_mean":
        return float(trained_tokens_all_ranks)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def check_finite_step(loss: float, grad_norm: float | None, where: str) -> None:
    """Raise NonFiniteStepError unless the step's loss and gradient norm are finite. Call it before the optimizer
    applies the step, with values that agree on every rank (reduced), so that every rank raises together."""
    bad = [
        f"{name} = {v}"
        for name, v in (("loss", loss), ("grad norm", grad_norm))
        if v is not None and not math.isfinite(v)
    ]
    if bad:
        raise NonFiniteStepError(
            f"{where}: non-finite {' and '.join(bad)}; the step was not applied and nothing was saved (the last good "
            f"checkpoints are kept). Look for NaN/inf rewards or advantages, or lower train.lr"
        )


def lr_at(step: int, cfg: RunConfig) -> float:
    """LR for optimizer step `step` (0-based), by absolute step: extending a run continues the same curve."""
    t = cfg.train
    if t.lr_warmup_steps and step < t.lr_warmup_steps:
        return t.lr * (step + 1) / t.lr_warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.lr_warmup_steps) / max(1, t.lr_decay_steps or 1))
    if t.lr_schedule == "linear":
        return t.lr + (t.min_lr - t.lr) * progress
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_step_schedule(param_groups: list[dict], lr: float, weight_decay: float | None = None) -> None:
    """Every group's LR for this step; with `weight_decay` (megatron's optimizer), also each group's decay scaled by
    its `wd_mult`: megatron tags its groups (wd_mult 0 for 1-D parameters: norms, biases) but only its
    OptimizerParamScheduler applies the tag, which we do not use: without this the norms were decayed too.
    torch AdamW's groups carry their decay already (0 for the 1-D group): `weight_decay` None leaves them."""
    for group in param_groups:
        group["lr"] = lr
        if weight_decay is not None:
            group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
