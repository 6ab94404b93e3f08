"""The embedded default model and data: real HF checkpoints that transformers loads, warmed up into the band where
RL has something to improve."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("fixture", ["dense_model_dir", "moe_model_dir"])
def test_builtin_model_is_a_warmed_up_hf_checkpoint(fixture, request):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime_core.builtin import prompt_text, problems
    from vime_core.rewards import last_boxed

    path = request.getfixturevalue(fixture)
    info = json.loads((path / "vime_builtin.json").read_text())
    # sampled (temperature 1) accuracy on a validation slice of the *train* split, measured by the build
    assert 0.15 <= info["val_sampled_accuracy"] <= 0.45, info["history"]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (path / f).is_file(), f
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    p = problems("heldout")[0]
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt_text(p)}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(
        **ids, max_new_tokens=48, do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert last_boxed(answer) is not None, answer  # it learned the format: working, then a boxed answer
    assert out[0, -1].item() == tok.eos_token_id


def test_moe_experts_really_differ(moe_model_dir):
    """Upcycled experts carry noise of a quarter of the weights' scale: a wrong expert mapping would show."""
    from safetensors.torch import load_file

    sd = load_file(str(moe_model_dir / "model.safetensors"))
    a, b = sd["model.layers.0.mlp.experts.0.gate_proj.weight"], sd["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert (a - b).abs().mean() > 0.1 * a.abs().mean()
