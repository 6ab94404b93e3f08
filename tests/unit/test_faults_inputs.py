"""Bad input fails in `prepare`, in seconds and before any actor, with one message that names the file or field
and the fix. The CLIs printing it as one line with exit 2: tests/integration/test_faults_inputs.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.errors import VimeError


def prepare_error(cfg, model_dir=None) -> VimeError:
    import ray

    from vime_core.prepare import prepare

    with pytest.raises(VimeError) as e:
        prepare(cfg, model_dir)
    assert not ray.is_initialized(), "checked before Ray starts"
    return e.value


def test_a_gpt2_config_is_one_line_naming_the_model(tmp_path, model_copy):
    (model_copy / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_head": 4,
                "n_layer": 2,
                "vocab_size": 384,
                "architectures": ["GPT2LMHeadModel"],
            }
        )
    )
    e = prepare_error(tiny_config(tmp_path), model_copy)
    assert str(e) == (
        f"model {model_copy} is not a Qwen3/Qwen3-MoE checkpoint (model_type gpt2); vime-flow trains "
        "model_type qwen3 and qwen3_moe only"
    )


def test_a_config_json_that_is_not_json_is_named(tmp_path, model_copy):
    (model_copy / "config.json").write_bytes(b"\x00\xffnot json")
    e = prepare_error(tiny_config(tmp_path), model_copy)
    assert str(model_copy / "config.json") in str(e) and "not valid JSON" in str(e)


def test_a_tokenizer_without_chat_template_says_how_to_fix_it(tmp_path, model_copy):
    (model_copy / "chat_template.jinja").unlink()
    tok_cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    e = prepare_error(tiny_config(tmp_path), model_copy)
    assert "has no chat template" in str(e) and "data.apply_chat_template=false" in str(e)
    assert "bad_rows" not in str(e) and "row" not in str(e).split("has no chat template")[0]


@pytest.mark.parametrize("cut", [10, 4, 0])
def test_a_truncated_weights_file_is_found_in_prepare(tmp_path, model_copy, cut):
    w = model_copy / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // cut] if cut else b"")
    e = prepare_error(tiny_config(tmp_path), model_copy)
    assert str(w) in str(e) and "truncated" in str(e) and "again" in str(e)


def test_a_corrupt_weights_header_is_found_in_prepare(tmp_path, model_copy):
    w = model_copy / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[8:40] = b"\xff" * 32  # inside the JSON header
    w.write_bytes(bytes(data))
    e = prepare_error(tiny_config(tmp_path), model_copy)
    assert str(w) in str(e) and "corrupt" in str(e)


def test_a_missing_shard_is_named(tmp_path, model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    (model_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    e = prepare_error(tiny_config(tmp_path), model_copy)
    assert "model-00002-of-00002.safetensors" in str(e) and "missing" in str(e)


def test_a_synchronous_custom_generate_must_be_async(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "rollout.custom_generate=tests.helpers.custom_rewards:length_reward"))
    assert "must be `async def`" in str(e) and "tests.helpers.custom_rewards:length_reward" in str(e)


def test_a_custom_generate_that_does_not_import_is_named(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "rollout.custom_generate=tests.helpers.no_such_module:gen"))
    assert "rollout.custom_generate = 'tests.helpers.no_such_module:gen' cannot be loaded" in str(e)
    assert "No module named 'tests.helpers.no_such_module'" in str(e)


def test_a_read_only_output_dir_is_found_in_prepare(tmp_path, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.access(out, os.W_OK):  # root ignores the mode: make the write fail as it would for a user
        real = Path.write_bytes

        def refuse(self, data):
            if self.parent == out:
                raise PermissionError(13, "Permission denied", str(self))
            return real(self, data)

        monkeypatch.setattr(Path, "write_bytes", refuse)
    e = prepare_error(tiny_config(out))
    assert f"output_dir {out} is not writable (Permission denied)" in str(e)


def test_a_placement_that_cannot_fit_fails_before_ray(tmp_path):
    e = prepare_error(tiny_config(tmp_path, "cluster.num_cpus=2", "rollout.num_engines=2"))
    assert "needs 3 CPU(s)" in str(e) and "Ray has 2" in str(e) and "cluster.num_cpus" in str(e)


def test_eval_dataset_errors_name_the_eval_set(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "label": "2"}\n{"prompt": 3\n')
    e = prepare_error(tiny_config(tmp_path, f'eval.datasets=[{{"name": "heldout-x", "source": "{bad}"}}]'))
    assert str(e).startswith("eval dataset 'heldout-x' (eval.datasets") and f"{bad}:2" in str(e)
