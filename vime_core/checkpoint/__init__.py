"""Checkpoints: HF safetensors in and out (hf.py), Megatron torch_dist save/load and its `vime_meta.json`
(torch_dist.py), HF <-> torch_dist conversion in spawned ranks (convert.py); training checkpoints with exact resume
live in vime_core/resume.py and are re-exported here, where callers import them from."""

from vime_core.checkpoint.convert import (
    convert_hf_to_torch_dist,
    convert_torch_dist_to_hf,
    finish_rank,
    init_rank,
)
from vime_core.checkpoint.hf import (
    HF_SIDE_FILES,
    ModelFileError,
    check_model_files,
    copy_hf_side_files,
    load_hf_state_dict,
    read_hf_config,
    save_hf_checkpoint,
    weight_files,
)
from vime_core.checkpoint.torch_dist import (
    HF_CONFIG_DIR,
    META_FILE,
    ConversionError,
    check_loaded,
    check_torch_dist_matches,
    converted_meta,
    is_converted,
    load_torch_dist,
    read_torch_dist_tensors,
    save_torch_dist,
    write_torch_dist_meta,
)
from vime_core.resume import (
    LATEST,
    STATE_FILE,
    Checkpointer,
    ResumeError,
    check_resumable,
    fingerprint_differences,
    iter_name,
)

__all__ = [
    "HF_CONFIG_DIR",
    "HF_SIDE_FILES",
    "LATEST",
    "META_FILE",
    "STATE_FILE",
    "Checkpointer",
    "ConversionError",
    "ModelFileError",
    "ResumeError",
    "check_loaded",
    "check_model_files",
    "check_resumable",
    "check_torch_dist_matches",
    "convert_hf_to_torch_dist",
    "convert_torch_dist_to_hf",
    "converted_meta",
    "copy_hf_side_files",
    "finish_rank",
    "fingerprint_differences",
    "init_rank",
    "is_converted",
    "iter_name",
    "load_hf_state_dict",
    "load_torch_dist",
    "read_hf_config",
    "read_torch_dist_tensors",
    "save_hf_checkpoint",
    "save_torch_dist",
    "weight_files",
    "write_torch_dist_meta",
]
