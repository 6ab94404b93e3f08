"""Inputs that the command line, the config and the model's files alone decide fail `vime train` with one line naming
the field or file and the fix, exit 2, before the output_dir lock, MLflow or Ray (each used to fail after the actors
started, 12-40 s in, most with a traceback): the reward and generate hooks, the tokenizer's JSON, vocab_size against
the weights, the context length, vLLM argument values, --metrics-out, a read-only output dir, the tracking server.
`prepare` (the pipeline's and the evaluation's path) refuses the same model and hook problems."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO, tiny_config
from vime_core.errors import VimeError

VIME = Path(sys.executable).parent / "vime"


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, dense_model_dir) -> dict[str, Path]:
    """Copies of the tiny model: a tokenizer.json cut in half; a config.json whose vocab_size is not the weights'."""
    root = tmp_path_factory.mktemp("models")
    tok, vocab = root / "tok", root / "vocab"
    for d in (tok, vocab):
        shutil.copytree(dense_model_dir, d)
    text = (tok / "tokenizer.json").read_text()
    (tok / "tokenizer.json").write_text(text[: len(text) // 2])
    hf = json.loads((vocab / "config.json").read_text())
    (vocab / "config.json").write_text(json.dumps({**hf, "vocab_size": hf["vocab_size"] + 16}))
    return {"tok": tok, "vocab": vocab}


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


# --------------------------------------------------------------------------------------------------------------------
# `prepare`: the same problems on the pipeline's and the evaluation's path (no CLI check ahead of it)
# --------------------------------------------------------------------------------------------------------------------
def prepare_error(cfg, model_dir=None) -> VimeError:
    import ray

    from vime_core.prepare import prepare

    with pytest.raises(VimeError) as e:
        prepare(cfg, model_dir)
    assert not ray.is_initialized(), "checked before Ray starts"
    return e.value


def test_prepare_refuses_a_reward_that_does_not_import(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "rollout.reward=nosuchmod:f"))
    assert "rollout.reward = 'nosuchmod:f' cannot be loaded" in str(e)


def test_prepare_refuses_the_bad_model_files(tmp_path, bad_models):
    assert "tokenizer.json is not valid JSON" in str(prepare_error(tiny_config(tmp_path), bad_models["tok"]))
    e = prepare_error(tiny_config(tmp_path), bad_models["vocab"])
    assert "says vocab_size = 400" in str(e)


def test_prepare_refuses_a_context_over_the_model(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "rollout.max_response_len=600"))
    assert "664 tokens is above the model's context length 512" in str(e)


def test_prepare_checks_every_tensor_shape_from_the_headers(tmp_path, dense_model_dir, monkeypatch):
    """Beyond vocab_size: a hidden layer size that disagrees with the weights is named from the headers."""
    model = tmp_path / "m"
    shutil.copytree(dense_model_dir, model)
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "intermediate_size": hf["intermediate_size"] * 2}))
    e = prepare_error(tiny_config(tmp_path / "run"), model)
    assert "mlp.gate_proj.weight has shape" in str(e) and "(safetensors headers)" in str(e)
    assert "config.json does not describe these weights" in str(e)


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.vllm_kwargs.max_num_batched_tokens=-5", "max_num_batched_tokens = -5: vLLM needs an integer >= 1"),
        ("rollout.vllm_kwargs.block_size=true", "block_size = True: vLLM needs an integer >= 1"),
        ("rollout.vllm_kwargs.cpu_offload_gb=-1", "cpu_offload_gb = -1: vLLM needs a number >= 0"),
        ("rollout.vllm_kwargs.kv_cache_memory_bytes='1e9'", "kv_cache_memory_bytes = '1e9'"),
    ],
)
def test_vllm_argument_values_are_checked_at_load(tmp_path, override, named):
    from vime_core.config import ConfigError

    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, override)
    assert named in str(e.value)


def test_valid_vllm_argument_values_pass(tmp_path):
    cfg = tiny_config(tmp_path, "rollout.vllm_kwargs.max_num_seqs=4", "rollout.vllm_kwargs.cpu_offload_gb=0.5")
    assert cfg.rollout.vllm_kwargs == {"max_num_seqs": 4, "cpu_offload_gb": 0.5}


# --------------------------------------------------------------------------------------------------------------------
# notes at start: a sample over the micro-batch budget, a dataset smaller than one rollout batch
# --------------------------------------------------------------------------------------------------------------------
SMALL = ("rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16")
NOTES = ("note: train.max_tokens_per_device = 32 is below the longest possible sample", "note: the dataset builtin://")


def test_prepare_notes_a_small_budget_and_a_small_dataset_once(tmp_path, caplog):
    import logging

    from vime_core.prepare import prepare

    cfg = tiny_config(tmp_path, *SMALL, "train.max_tokens_per_device=32", "data.source=builtin://arith?size=3")
    with caplog.at_level(logging.WARNING, logger="vime_core.prepare"):
        prepare(cfg)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("note: ")]
    assert len(notes) == 2 and notes[0].startswith(NOTES[0]) and notes[1].startswith(NOTES[1]), notes
    assert "a sample over the budget is trained alone" in notes[0] and "+ rollout.max_response_len 48" in notes[0]
    assert "has 3 prompts, fewer than one rollout batch (4 prompts): every step wraps around" in notes[1]


def test_no_note_for_the_default_run(tmp_path, caplog):
    import logging

    from vime_core.prepare import prepare

    with caplog.at_level(logging.WARNING, logger="vime_core.prepare"):
        prepare(tiny_config(tmp_path))
    assert not [r for r in caplog.records if r.getMessage().startswith("note: ")]


@pytest.mark.e2e
def test_vime_train_prints_each_note_once(tmp_path):
    """Two steps (each one re-reads the budget and wraps the data): each note is printed once, at start."""
    args = [a for o in SMALL for a in ("--set", o)]
    r = vime_train(
        tmp_path,
        *args,
        *("--set", "train.max_tokens_per_device=32", "--set", "data.source=builtin://arith?size=3"),
        *("--set", "rollout.num_rollout=2", "--set", "eval.datasets=[]"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2/2" in r.stdout
    assert [r.stderr.count(n) for n in NOTES] == [1, 1], r.stderr[-3000:]
    assert r.stderr.index(NOTES[1]) < r.stderr.index("trainer and engines ready"), "said at start"
