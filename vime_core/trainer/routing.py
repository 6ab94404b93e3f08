"""Rollout routing replay (R3, rollout.routing_replay): the trainer's MoE routers take the experts vLLM routed each
token to, instead of choosing their own, so that the GRPO ratio compares the same computation on both sides.

A sample carries vLLM's `routed_experts`: int [len(tokens) - 1, MoE layers, top_k] (prompt tokens included; the last
token never went through the engine's forward). A micro-batch packs them in its token order; megatron-core's
`RouterReplay` (built when TransformerConfig.moe_enable_routing_replay is set) then gathers the router's scores at those
experts, so the router still gets gradients through the gathered scores. The packed last token of each sample takes
its previous row: its output feeds no log-prob (it predicts nothing) and no other token attends to it (causal).

Replay and recording are set per model (its own routers), not through RouterReplay's global lists, which hold the
routers of every model in the process (the policy and the frozen reference).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from vime_core.errors import VimeError

if TYPE_CHECKING:
    from vime_core.config.schema import RolloutConfig


class RoutingReplayError(VimeError, ValueError):
    """A sample's routed experts do not fit the trainer's model; the message names the sample."""


def routing_metrics_interval(rollout: RolloutConfig) -> int:
    """Rollouts between R3's measurement forwards; 0: none run (R3 off, or rollout.routing_metrics_every = 0)."""
    return rollout.routing_metrics_every if rollout.routing_replay else 0


def measures_routing(rollout: RolloutConfig, rollout_id: int) -> bool:
    """Whether this rollout's train phase runs R3's measurement forward: on the rollouts 0, N, 2N, ... so that a
    resumed run measures the same ones."""
    every = routing_metrics_interval(rollout)
    return every > 0 and rollout_id % every == 0


def routers(model: torch.nn.Module) -> list:
    """The model's MoE routers that carry a RouterReplay, in layer order."""
    found = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
    return sorted(found, key=lambda r: r.layer_number)


def check_routed_experts(batch: Sequence, num_layers: int, top_k: int, num_experts: int) -> None:
    """Raise RoutingReplayError naming the first sample whose routed experts do not fit the model."""
    for i, s in enumerate(batch):
        want = (len(s.tokens) - 1, num_layers, top_k)
        got = tuple(getattr(s.routed_experts, "shape", ()))
        where = f"sample {i} of the micro-batch ({len(s.tokens)} tokens, prompt {s.prompt_len})"
        if s.routed_experts is None:
            raise RoutingReplayError(f"{where} carries no routed experts although rollout.routing_replay is on")
        if got != want:
            raise RoutingReplayError(
                f"{where}: routed experts of shape {got}, expected {want} (tokens - 1, MoE layers, top-k); the "
                "engine's model is not the trainer's: check model.source, or set rollout.routing_replay = false"
            )
        t = torch.as_tensor(s.routed_experts)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
            raise RoutingReplayError(
                f"{where}: routed expert ids span {int(t.min())}..{int(t.max())}, the model has {num_experts} experts"
            )


def packed_routing(batch: Sequence) -> torch.Tensor:
    """The micro-batch's routed experts in packed token order: [tokens, layers, top_k] int64 (the forward's order)."""
    parts = []
    for s in batch:
        t = torch.as_tensor(s.routed_experts).long()
        # the last token: see the module docstring; a one-token sample (lockstep padding) has no neighbour
        last = t[-1:] if len(t) else torch.arange(t.shape[2]).expand(1, *t.shape[1:])
        parts += [t, last]
    return torch.cat(parts)


def replay(model: torch.nn.Module, routing: torch.Tensor | None) -> None:
    """From now on every router of `model` takes its top-k from `routing` ([tokens, all layers, top_k]), in the forward
    and in a recompute during backward; None: the routers choose again. Set before each forward: the indices stay
    until the next call, so the micro-batch's backward (after the forward returned) recomputes with them."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(model)
    for r in rs:
        r.router_replay.clear_indices()
        r.router_replay.clear_router_replay_action()
    if routing is None:
        return
    for r in rs:  # layer_number: 1-based over the whole model (a pipeline stage holds some of the layers)
        r.router_replay.set_target_indices(routing[:, r.layer_number - 1].contiguous())
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """While active, the routers of `model` choose their own top-k and record it; the yielded list receives the
    routing of the last forward, [tokens, layers, top_k], when the context ends."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(model)
    for r in rs:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    out: list[torch.Tensor] = []
    try:
        yield out
        out.append(torch.stack([r.router_replay.get_recorded_indices() for r in rs], 1))
    finally:
        for r in rs:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()


def agreement(chosen: torch.Tensor, replayed: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[int, int]:
    """(same, total) over (token, layer): whether the top-k *sets* are equal (vLLM and megatron order them
    differently). `valid` [tokens] leaves out the packed last tokens, which have no engine routing."""
    same = (chosen.sort(-1).values == replayed.to(chosen.device).sort(-1).values).all(-1)  # [tokens, layers]
    if valid is not None:
        same = same[valid]
    return int(same.sum()), same.numel()


def engine_rows(batch: Sequence) -> torch.Tensor:
    """[tokens] bool of a packed micro-batch: True where the engine routed the token (all but each sample's last)."""
    mask = []
    for s in batch:
        mask += [True] * (len(s.tokens) - 1) + [False]
    return torch.tensor(mask)
