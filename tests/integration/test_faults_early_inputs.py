"""Inputs that the command line, the config and the model's files alone decide fail `vime train` with one line naming
the field or file and the fix, exit 2, before the output_dir lock, MLflow or Ray (each used to fail after the actors
started, 12-40 s in, most with a traceback): the reward and generate hooks, the tokenizer's JSON, vocab_size against
the weights, the context length, the parallel layout against the model, vLLM argument values, --metrics-out, a
read-only output dir, the tracking server.
`prepare` refusing the same problems in-process: tests/unit/test_faults_early_inputs.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO

VIME = Path(sys.executable).parent / "vime"


def vime_train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VIME), "train", "-c", str(REPO / "configs/tiny-cpu.yaml"), "--set", f"output_dir={tmp_path / 'out'}"]
        + ["--set", "tracking.enabled=false", *args],
        capture_output=True,
        text=True,
        cwd=REPO,  # tests.helpers.* importable, as a user's own package in the working directory
        timeout=300,
        env={**os.environ, "VIME_DEBUG": "", "PYTHONPATH": str(REPO)},
    )


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]  # no Ray line ahead of it: nothing started
    assert "--debug shows the traceback" in lines[0]
    return lines[0]


CASES = {
    "reward module": (
        ["rollout.reward=nosuchmod:f"],
        ["RewardError: rollout.reward = 'nosuchmod:f' cannot be loaded", "No module named 'nosuchmod'"],
    ),
    "reward attribute": (
        ["rollout.reward=tests.helpers.custom_rewards:nope"],
        ["RewardError: rollout.reward", "has no attribute 'nope'", "package.module:function"],
    ),
    "reward import raises": (
        ["rollout.reward=tests.helpers.broken_on_import:f"],
        ["RewardError: rollout.reward", "RuntimeError: broken on purpose at import"],
    ),
    "generate hook import raises": (
        ["rollout.custom_generate=tests.helpers.broken_on_import:gen"],
        ["CustomGenerateError: rollout.custom_generate", "RuntimeError: broken on purpose at import", "fix the module"],
    ),
    "generate hook module": (
        ["rollout.custom_generate=tests.helpers.no_such_module:gen"],
        [
            "CustomGenerateError: rollout.custom_generate",
            "No module named 'tests.helpers.no_such_module'",
            "PYTHONPATH",
        ],
    ),
    "context length": (
        ["rollout.max_response_len=600"],
        ["data.max_prompt_len + rollout.max_response_len = 64 + 600 = 664 tokens", "context length 512"],
    ),
    "eval context length": (
        ["eval.max_response_len=500"],
        ["data.max_prompt_len + eval.max_response_len = 64 + 500 = 564", "lower eval.max_response_len"],
    ),
    "vllm max_num_seqs": (
        ["rollout.vllm_kwargs.max_num_seqs=0"],
        ["rollout.vllm_kwargs.max_num_seqs = 0: vLLM needs an integer >= 1"],
    ),
    "trainer layout": (
        ["train.num_devices=3", "train.tensor_parallel_size=3", "rollout.num_engines=3"],
        ["ConfigError: config does not fit the model: train.tensor_parallel_size = 3 does not divide the model's 4"],
    ),
    "unknown builtin model": (["model.source=builtin://nope"], ["SourceError: unknown builtin model 'nope'"]),
    "tracking server down": (
        ["tracking.enabled=true", "tracking.uri=http://127.0.0.1:9"],  # port 9 (discard): nothing listens
        ["TrackingUnreachableError: MLflow tracking store http://127.0.0.1:9 cannot be reached", "tracking.enabled"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_line_before_anything_starts(tmp_path, case):
    overrides, wanted = CASES[case]
    line = one_line(vime_train(tmp_path, *[a for o in overrides for a in ("--set", o)]))
    assert all(w in line for w in wanted), line
    assert not (tmp_path / "out" / ".vime-run.lock").exists(), "refused before the output_dir lock"


@pytest.mark.parametrize("which", ["tok", "vocab"])
def test_a_bad_model_file_is_named_before_anything_starts(tmp_path, bad_models, which):
    model = bad_models[which]
    line = one_line(vime_train(tmp_path, "--set", f"model.source={model}"))
    if which == "tok":
        assert f"ModelFileError: {model / 'tokenizer.json'} is not valid JSON" in line and "line " in line
    else:
        assert f"{model / 'config.json'} says vocab_size = 400" in line
        assert "model.embed_tokens.weight has 384 rows" in line


def test_metrics_out_naming_a_directory_is_refused(tmp_path):
    line = one_line(vime_train(tmp_path, "--metrics-out", str(tmp_path)))
    assert line.startswith(f"MetricsPathError: --metrics-out {tmp_path} is a directory")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no write can go into, also for root: chattr +i (immutable) where allowed, else mode 555."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("root, and chattr +i is not allowed here: no directory is read-only to this test")
    try:
        yield d
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)


@pytest.mark.parametrize("where", ["itself", "below"])
def test_a_read_only_output_dir_is_refused(tmp_path, read_only_dir, where):
    out = read_only_dir if where == "itself" else read_only_dir / "run"
    line = one_line(vime_train(tmp_path, "--set", f"output_dir={out}"))
    assert line.startswith(f"OutputDirError: output_dir {out} is not writable (")
    assert "choose another output_dir" in line


def test_metrics_out_in_a_read_only_dir_is_refused(tmp_path, read_only_dir):
    line = one_line(vime_train(tmp_path, "--metrics-out", str(read_only_dir / "m.jsonl")))
    assert f"MetricsPathError: --metrics-out {read_only_dir / 'm.jsonl'}: {read_only_dir} is not writable" in line
