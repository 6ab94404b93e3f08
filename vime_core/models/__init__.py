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
    "grouped_gemm_problem",
    "layout_problems",
    "resolve_grouped_gemm",
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
    if cfg.rollout.routing_replay and not arch.is_moe:
        raise ConfigError("rollout.routing_replay = true needs an MoE model (this one is dense); set it to false")
    if cfg.train.moe_grouped_gemm is True:
        why = grouped_gemm_problem(arch, cfg.model.dtype, cfg.train.tensor_parallel_size)
        if why:
            raise ConfigError(f"train.moe_grouped_gemm = true does not fit the model ({why}); set it to auto or false")


def grouped_gemm_problem(arch: Any, dtype: str, tp: int) -> str | None:
    """Why the MoE experts of `arch` cannot run as grouped GEMMs (vime_core.grouped_experts), or None: torch's
    grouped GEMM refuses operands whose rows are not 16-byte multiples ("strides should be multiple of 16 bytes")."""
    if not arch.is_moe:
        return "the model has no MoE layers"
    itemsize = {"float32": 4, "bfloat16": 2}[dtype]
    hidden, ffn = arch.hidden_size, arch.moe_ffn_hidden_size
    if all((n * itemsize) % 16 == 0 for n in (hidden, 2 * ffn // tp, ffn // tp)):
        return None
    return f"hidden_size {hidden} and moe_intermediate_size {ffn} / TP {tp} in {dtype} are not 16-byte rows"


def resolve_grouped_gemm(setting: str | bool, arch: Any, dtype: str, tp: int) -> bool:
    """train.moe_grouped_gemm -> whether the trainer builds grouped experts: `auto` wherever they run (an MoE model
    whose expert GEMMs torch's grouped GEMM takes); `true` that cannot is refused by check_model_compat."""
    return setting is not False and grouped_gemm_problem(arch, dtype, tp) is None
