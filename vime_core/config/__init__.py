"""The one typed run configuration.

- `schema`: `RunConfig` and its sections (model, data, rollout, sync, eval, checkpoint, cluster, tracking), every field
  typed and described; the trainer's sections (train, grpo) are in `train_schema`, their common base in `section`;
- `checks`: `RunConfig` itself checks everything the config alone determines (batch arithmetic, device counts,
  ranges). What needs the model's architecture (tensor parallel vs heads, KV groups and MLP size, experts vs expert
  parallel) is `vime_core.models.check_model_compat(cfg, arch)`, run before any actor starts;
- `load`: YAML plus dotted overrides (`--set grpo.eps_clip_high=0.28`); unknown keys are errors;
- `fingerprint`: every field is tagged FIXED or FREE across a resume; the resume fingerprint is derived from the tags.
"""

from __future__ import annotations

from vime_core.config.checks import cross_field_problems, gpu_only_problems
from vime_core.config.errors import ConfigError
from vime_core.config.fingerprint import FINGERPRINT_VERSION, FIXED, FREE, VERSION_KEY
from vime_core.config.load import apply_overrides, config_from_dict, dump_config, flatten, load_config, parse_override
from vime_core.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EvalConfig,
    EvalDatasetConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SyncConfig,
    TrackingConfig,
)
from vime_core.config.train_schema import GRPOConfig, TrainConfig

__all__ = [
    "RunConfig",
    "ConfigError",
    "load_config",
    "apply_overrides",
    "config_from_dict",
    "cross_field_problems",
    "gpu_only_problems",
    "FINGERPRINT_VERSION",
    "FIXED",
    "FREE",
    "VERSION_KEY",
    "dump_config",
    "flatten",
    "parse_override",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "EvalConfig",
    "EvalDatasetConfig",
    "GRPOConfig",
    "ModelConfig",
    "RolloutConfig",
    "SyncConfig",
    "TrackingConfig",
    "TrainConfig",
]
