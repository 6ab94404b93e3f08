"""What many tests share: the repository root and the embedded tiny-cpu config with its outputs in a temp dir.
(Kept out of conftest.py: pytest imports conftest itself, and a module imported twice under two names is two.)"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def tiny_config(output_dir: Path, *overrides: str):
    """configs/tiny-cpu.yaml with its outputs (checkpoints, MLflow store) under `output_dir`."""
    from vime_core.config import load_config

    return load_config(REPO / "configs" / "tiny-cpu.yaml", [f"output_dir={output_dir}", *overrides])
