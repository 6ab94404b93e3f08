"""The unit that flows from the data buffer through rollout and rewards into the trainer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt's one response. Samples of the same prompt share `group_id` (a GRPO group)."""

    group_id: int
    prompt_ids: list[int]
    label: str | None = None
    prompt: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    response_ids: list[int] = field(default_factory=list)
    response: str = ""
    # log-probs of the sampled tokens as vLLM computed them *after* temperature (processed_logprobs)
    rollout_logprobs: list[float] = field(default_factory=list)
    # mask of response tokens that are trained on: a custom generate marks tokens the policy did not sample (tool
    # output) with 0 and gives them log-prob 0, so that response_ids, rollout_logprobs and loss_mask stay aligned
    loss_mask: list[int] | None = None
    finish_reason: str = ""
    # rollout.routing_replay: vLLM's routed experts of prompt + response, int16 [len(tokens) - 1, MoE layers, top_k]
    routed_experts: Any = None
    reward: float | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    def to_dict(self) -> dict:
        """The fields as JSON takes them (a checkpoint's carried rollouts): routed experts as nested lists."""
        d = asdict(self)
        if self.routed_experts is not None:
            d["routed_experts"] = self.routed_experts.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        """`to_dict`'s inverse: routed experts back to an int16 array, as vLLM returns them."""
        s = cls(**d)
        if s.routed_experts is not None:
            import numpy as np  # only where routing replay carried them

            s.routed_experts = np.asarray(s.routed_experts, dtype=np.int16)
        return s
