"""rollout.vllm_kwargs names checked against the installed vLLM, in a child process (importing vLLM takes ~12 s and
sets process-wide state the unit tests do without)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.tiny import REPO


def test_vllm_kwargs_names_are_checked_against_the_installed_vllm():
    """In a child process: importing vLLM takes ~12 s here and sets process-wide state the other tests do without."""
    code = "from vime_core.rollout import check_vllm_kwargs as c; c({'max_num_seqs': 8}); c({'max_num_seq': 8})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode != 0 and "VllmKwargsError" in out.stderr, out.stderr[-2000:]
    assert "rollout.vllm_kwargs.max_num_seq is not an argument of vLLM" in out.stderr
    assert "did you mean max_num_seqs" in out.stderr
