"""Batch arithmetic of the trainer, pure (no process group, no model): rollout groups -> trainer samples with GRPO
advantages (`make_train_batch`, driver side), their split over optimizer steps and data-parallel ranks, and the
token-budget packing of micro-batches (on each rank)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vime_core import algo
from vime_core.config import RunConfig


@dataclass
class TrainSample:
    """What the trainer needs of a rollout sample."""

    tokens: list[int]  # prompt + response
    prompt_len: int
    loss_mask: list[int]  # per response token
    rollout_logprobs: list[float]  # per response token
    advantage: float
    # vLLM's routed experts [len(tokens) - 1, MoE layers, top_k] (rollout.routing_replay), else None
    routed_experts: Any = None

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


def split_steps_and_ranks(samples: list[TrainSample], num_steps: int, dp: int) -> list[list[list[TrainSample]]]:
    """[dp_rank][optimizer_step] -> samples. Each step takes a contiguous slice of the rollout (whole groups when the
    global batch is a multiple of the group size); within a step, samples go to DP ranks balancing their tokens."""
    if len(samples) % num_steps:
        raise ValueError(f"{len(samples)} samples do not split into {num_steps} optimizer steps")
    per_step = len(samples) // num_steps
    out: list[list[list[TrainSample]]] = [[[] for _ in range(num_steps)] for _ in range(dp)]
    for step in range(num_steps):
        chunk = samples[step * per_step : (step + 1) * per_step]
        loads = [0] * dp
        counts = [0] * dp
        cap = per_step // dp  # every rank gets the same number of samples (sample_mean normalises by it)
        for s in sorted(chunk, key=lambda s: -len(s.tokens)):
            r = min((k for k in range(dp) if counts[k] < cap), key=lambda k: (loads[k], k))
            out[r][step].append(s)
            loads[r] += len(s.tokens)
            counts[r] += 1
    return out


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Token-budget packing: each micro-batch's summed length <= max_tokens (samples are packed into one row, no
    padding); a sample longer than the budget gets its own micro-batch. First fit over samples sorted longest first,
    so few micro-batches and each sample's place depends only on the lengths (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        k = next((j for j, used in enumerate(loads) if used + n <= max_tokens), None)
        if k is None:
            batches.append([i])
            loads.append(n)
        else:
            batches[k].append(i)
            loads[k] += n
    return batches


def lockstep_pads(sizes: list[int], targets: list[int]) -> list[int]:
    """Tokens of padding each of a rank's micro-batches needs so that every expert-parallel rank runs `targets`
    (the element-wise max over the ranks of their micro-batch sizes, as many as the most any rank packs): megatron's
    allgather token dispatcher gathers each MoE layer's tokens in equal pieces, in lockstep."""
    if len(targets) < len(sizes) or any(t < n for t, n in zip(targets, sizes)):
        raise ValueError(f"lockstep targets {targets} below this rank's micro-batch sizes {sizes}")
    return [t - (sizes[j] if j < len(sizes) else 0) for j, t in enumerate(targets)]


def pad_samples(tokens: int, routing: tuple[int, int] | None = None) -> list[TrainSample]:
    """A sample of `tokens` prompt tokens and no response (nothing trained, no log-prob gathered): the padding of a
    lockstep micro-batch (none for 0). Packed attention restarts per sample and nothing drops routed tokens, so it
    changes no other sample's values. `routing` (MoE layers, top_k), with rollout.routing_replay: the padding routes
    every token to experts 0..top_k-1, since a replayed micro-batch needs a routing for each of its tokens."""
    if tokens == 0:
        return []
    experts = None
    if routing is not None:
        layers, top_k = routing
        experts = torch.arange(top_k).expand(tokens - 1, layers, top_k)
    return [
        TrainSample(
            tokens=[0] * tokens,
            prompt_len=tokens,
            loss_mask=[],
            rollout_logprobs=[],
            advantage=0.0,
            routed_experts=experts,
        )
    ]


def make_train_batch(groups: list, cfg: RunConfig) -> tuple[list[TrainSample], dict[str, float]]:
    """Scored groups -> trainer samples with GRPO advantages (group-normalised rewards broadcast to every token)."""
    n = cfg.rollout.n_samples_per_prompt
    samples = [s for g in groups for s in g]
    if any(len(g) != n for g in groups):
        raise ValueError(f"every group must hold rollout.n_samples_per_prompt = {n} samples")
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if not torch.isfinite(rewards).all():  # RewardModel refuses these already; a NaN here would reach every weight
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"sample {bad % n} of group {bad // n} has a non-finite reward {samples[bad].reward}")
    adv = algo.group_advantages(rewards, n, cfg.grpo.normalize_std)
    batch = [
        TrainSample(
            tokens=list(s.prompt_ids) + list(s.response_ids),
            prompt_len=len(s.prompt_ids),
            loss_mask=list(s.mask),
            rollout_logprobs=list(s.rollout_logprobs),
            advantage=float(a),
            routed_experts=s.routed_experts,
        )
        for s, a in zip(samples, adv.tolist())
    ]
    return batch, {"rollout/rewards": float(adv.mean()), "rollout/advantage_abs_mean": float(adv.abs().mean())}
