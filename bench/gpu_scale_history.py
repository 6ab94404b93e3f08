"""One line per merged gpu_scale result in `results/gpu-scale/history.csv`: the shape's result file holds only the
latest run, and the CSV keeps the headline figures of every earlier one (git has the full documents)."""

from __future__ import annotations

import csv
from pathlib import Path

# what a run is known by (its phases' start times), then its headline figures
KEY_COLUMNS = ("shape", "response_len", "prompts", "samples", "loop_started_at", "vllm_started_at", "hf_started_at")
FIGURES = (
    "rollout_tok_per_gpu_s",
    "raw_vllm_tok_s",
    "trainer_tok_s",
    "hf_sdpa_tok_s",
    "trainer_peak_gib",
    "sync_s",
    "step_s",
    "mfu",
    "logprob_abs_diff",
    "host_peak_gib",
)
COLUMNS = KEY_COLUMNS + FIGURES


def history_row(doc: dict) -> dict:
    phases = doc.get("phases", {})
    row = {k: doc.get(k) for k in ("shape", "response_len", "prompts", "samples")}
    row |= {f"{p}_started_at": phases.get(p, {}).get("started_at", "") for p in ("loop", "vllm", "hf")}
    row |= {k: "" if doc.get(k) is None else round(float(doc[k]), 4) for k in FIGURES}
    return row


def append_history(path: Path, doc: dict) -> bool:
    """Add `doc`'s row unless a row with the same key is there (a merge repeated); -> whether it was added."""
    row = history_row(doc)
    rows = list(csv.DictReader(path.open())) if path.is_file() else []
    key = tuple(str(row[k]) for k in KEY_COLUMNS)
    if any(tuple(r[k] for k in KEY_COLUMNS) == key for r in rows):
        return False
    new = not path.is_file() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerow(row)
    return True
