"""What one trainer rank is made of once built (`RankState`), shared by the collaborators the actor owns: the step
runner (vime_core.trainer.step), the rank checkpoint (checkpoint_io) and the weight exporter (vime_core/sync/). The
actor (`Trainer`, rank.py) builds it in `start`; each collaborator gets it in its constructor, so what a part reads
is this contract, not attributes another class happens to set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vime_core.config import RunConfig
from vime_core.memory import PhasePeaks
from vime_core.trainer.optim import OptimizerAdapter


@dataclass
class RankState:
    cfg: RunConfig
    rank: int  # global rank among the trainer ranks
    world_size: int
    platform: str
    device: torch.device
    ps: Any  # megatron's parallel_state module, initialised for this rank
    arch: Any  # the model record (vime_core.models), e.g. Qwen3Arch
    module: torch.nn.Module  # this rank's GPTModel (its shards)
    ref_model: torch.nn.Module | None  # the frozen reference of the KL loss (grpo.kl_loss_coef > 0), else None
    optim: OptimizerAdapter  # torch AdamW or megatron's optimizer
    peaks: PhasePeaks  # peak GPU memory per phase
    heartbeat: Any  # vime_core.progress.Heartbeat: the step beats per micro-batch for the driver's stall check
    step: int = 0  # optimizer steps taken; the LR schedule is a function of it
    onload_time: float = 0.0  # seconds of the last optimizer onload, reported with the next step's metrics

    @property
    def model(self) -> torch.nn.Module:
        """What the forward runs: megatron's DDP around `module`, or `module` itself (torch AdamW)."""
        return self.optim.model

    @property
    def optimizer(self):
        """The torch / megatron optimizer object (its state_dict is what a checkpoint saves)."""
        return self.optim.optimizer
