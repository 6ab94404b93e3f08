"""How the engine asks vLLM for outputs and reads them (vime_core.rollout): no per-token detokenization unless stop
strings need it, and the sampled tokens' log-probs from either of vLLM's log-prob layouts. The real engine's texts and
log-probs through this path are compared with vLLM's own in tests/e2e (test_engine_outputs)."""

from __future__ import annotations

import pytest
from vllm.logprobs import FlatLogprobs, Logprob

from vime_core.rollout import SamplingSpec, sampled_logprobs


def test_vllm_detokenizes_only_when_stop_strings_need_it():
    plain = SamplingSpec(4, 1.0, 1.0, -1, 32).vllm_params(seed=1)
    assert plain.detokenize is False and plain.flat_logprobs is True
    assert SamplingSpec(4, 1.0, 1.0, -1, 32, stop=("</answer>",)).vllm_params(seed=1).detokenize is True
    assert SamplingSpec(4, 1.0, 1.0, -1, 32).vllm_params(seed=1, stop=["\n\n"]).detokenize is True  # a hook's
    assert SamplingSpec(4, 1.0, 1.0, -1, 32).vllm_params(seed=1, detokenize=True).detokenize is True


def test_sampled_logprobs_read_flat_and_dict_layouts_alike():
    ids = [7, 3, 9]
    flat = FlatLogprobs()
    for t, lp in zip(ids, (-0.5, -1.25, -2.0)):
        flat.append({t: Logprob(lp, 1, None)})
    dicts = [{t: Logprob(lp, 1, None)} for t, lp in zip(ids, (-0.5, -1.25, -2.0))]
    assert sampled_logprobs(flat, ids) == sampled_logprobs(dicts, ids) == [-0.5, -1.25, -2.0]
    assert sampled_logprobs(None, ids) == []
    with pytest.raises(RuntimeError, match="sampled tokens"):
        sampled_logprobs(flat, [7, 3, 8])
