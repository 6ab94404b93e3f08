"""Model families: one spec each (`spec.ModelSpec`): the architecture read from an HF config.json, the one parallel
layout check, and the HF <-> megatron weight mapping. Today: Qwen3 and Qwen3-MoE (`qwen3`, `qwen3_mapping`).

Sits above `config` (the config-time check reads the run's layout) and below checkpoint/trainer/rollout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from vime_core.config import ConfigError, RunConfig
from vime_core.models import qwen3
from vime_core.models.qwen3 import Qwen3Arch, UnsupportedModelError
from vime_core.models.spec import CONFIG_NAMES, CONVERSION_NAMES, Layout, ModelSpec

__all__ = [
    "CONFIG_NAMES",
    "CONVERSION_NAMES",
    "Layout",
    "ModelSpec",
    "Qwen3Arch",
    "SPECS",
    "UnsupportedModelError",
    "arch_from_hf_config",
    "check_model_compat",
    "layout_problems",
    "spec_for",
    "spec_of",
]

SPECS: tuple[ModelSpec, ...] = (qwen3.SPEC,)


def spec_for(hf: Mapping[str, Any], where: str | Path | None = None) -> ModelSpec:
    """The family that reads this HF config.json (by its model_type)."""
    model_type = hf.get("model_type")
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    families = "/".join(s.family for s in SPECS)
    types = " and ".join(t for s in SPECS for t in s.model_types)
    raise UnsupportedModelError(
        f"model {where or '(config.json)'} is not a {families} checkpoint (model_type "
        f"{model_type}); vime-flow trains model_type {types} only"
    )


def spec_of(arch: Any) -> ModelSpec:
    """The family of an architecture read by one of the specs."""
    for spec in SPECS:
        if isinstance(arch, spec.arch_type):
            return spec
    raise TypeError(f"{type(arch).__name__} is not the architecture of a known model family")


def arch_from_hf_config(hf: Mapping[str, Any], where: str | Path | None = None) -> Any:
    """The architecture of the model an HF config.json describes; unsupported models raise naming the field."""
    return spec_for(hf, where).arch_from_hf_config(hf, where)


def layout_problems(arch: Any, layout: Layout) -> list[str]:
    return spec_of(arch).layout_problems(arch, layout)


def check_model_compat(cfg: RunConfig, arch: Any) -> None:
    """Raise ConfigError when the run's parallel layout (trainer TP/PP/EP, engine TP) does not fit the model, before
    any actor starts. The same check as the conversion's, with the config's field names."""
    problems = layout_problems(arch, Layout.of_config(cfg))
    if problems:
        raise ConfigError("config does not fit the model: " + "; ".join(problems))
