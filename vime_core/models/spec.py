"""What vime-flow needs of a model family, and the parallel layout checked against it.

A family (today: Qwen3 dense + MoE in `qwen3.py`) reads its architecture from an HF config.json, says which parallel
layouts fit it (one check, used by the config-time checks before any actor starts and by the conversion), and maps
its weights between HF and megatron-core names (`mapping()`: a module that imports torch, so config-time checks
never pay torch's ~1.7 s import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping, Protocol

from vime_core.config import RunConfig

CONVERSION_NAMES = {"tp": "tp", "pp": "pp", "ep": "ep", "engine_tp": "engine_tp"}
CONFIG_NAMES = {
    "tp": "train.tensor_parallel_size",
    "pp": "train.pipeline_parallel_size",
    "ep": "train.expert_parallel_size",
    "engine_tp": "rollout.engine_tensor_parallel_size",
}


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the names of the settings that chose it, so that a problem names the field to change."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    engine_tp: int | None = None  # vLLM's tensor parallel size; None: no engine runs the model (a conversion)
    trains: bool = False  # megatron trains at this layout (a conversion only builds and saves)
    names: Mapping[str, str] = field(default_factory=lambda: dict(CONVERSION_NAMES))

    @classmethod
    def of_config(cls, cfg: RunConfig) -> "Layout":
        t = cfg.train
        return cls(
            tp=t.tensor_parallel_size,
            pp=t.pipeline_parallel_size,
            ep=t.expert_parallel_size,
            engine_tp=cfg.rollout.engine_tensor_parallel_size,
            trains=True,
            names=dict(CONFIG_NAMES),
        )


class ModelSpec(Protocol):
    """One model family."""

    family: str  # for messages: "Qwen3/Qwen3-MoE"
    model_types: tuple[str, ...]  # the config.json `model_type` values it reads
    arch_type: type

    def arch_from_hf_config(self, hf: Mapping[str, Any], where: Any = None) -> Any:
        """The architecture from an HF config.json; what the family does not support raises naming the field."""

    def layout_problems(self, arch: Any, layout: Layout) -> list[str]:
        """Every way `layout` does not fit `arch`, each naming the setting and the fix; empty when it fits."""

    def params_per_device(self, arch: Any, layout: Layout) -> int:
        """Parameters one trainer rank holds at `layout` (the memory fit check, vime_core.fit)."""

    def expert_params_per_device(self, arch: Any, layout: Layout) -> int:
        """Of those, the routed experts' (0 for a dense model): their optimizer state shards over expert-data-parallel
        ranks."""

    def tensor_numels_per_device(self, arch: Any, layout: Layout) -> list[int]:
        """Those parameters as the weight tensors a torch_dist checkpoint writes (sizes of its host staging copies)."""

    def mapping(self) -> ModuleType:
        """The HF <-> megatron weight mapping: hf_names, check_hf_names, check_shapes, hf_to_mcore,
        mcore_param_to_hf, local_view, shard_tp / unshard_tp, expert_index / with_expert_index."""
