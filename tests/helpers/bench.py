"""bench/ is scripts, not a package: its modules loaded by path for the unit tests, and a result file to summarize."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def result_doc(steps_loop, steps_vllm, steps_hf, trainer_info=None) -> dict:
    """A 1.7B x 4,096 result file with these phase steps (what gpu_scale_report.summarize reads)."""
    return {
        "shape": "1.7b",
        "prompts": 16,
        "samples": 8,
        "response_len": 4096,
        "phases": {
            "loop": {"steps": steps_loop, "trainer_info": trainer_info or []},
            "vllm": {"steps": steps_vllm},
            "hf": {"steps": steps_hf},
        },
    }
