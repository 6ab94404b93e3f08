"""Our own rollout logic with stand-in engines: the router's assignment, one rollout step with dynamic sampling, and
the batching of custom generate calls. (The real engines are exercised in the e2e tests.)"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.data import DataBuffer, Prompt, PromptSet
from vime_core.kv_cache import kv_cache_shortfall, model_runner
from vime_core.cli import user_error_exit
from vime_core.generate_hook import CustomGenerateError
from vime_core.rollout import GenerateContext, Generation, SamplingSpec
from vime_core.router import assign_groups, collect_rollout, request_seed
from vime_core.sample import Sample


def test_assign_groups_balances_cost_and_keeps_groups_whole():
    parts = assign_groups([10, 1, 1, 1, 9, 2], 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum([10, 1, 1, 1, 9, 2][i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 2
    assert assign_groups([5, 5], 3)[2] == []


def test_request_seed_is_stable_and_distinct():
    assert request_seed(1, 2, 3) == request_seed(1, 2, 3)
    assert request_seed(1, 2, 3) != request_seed(1, 3, 2)
    assert 0 <= request_seed("x") < 2**31


class FakeRouter:
    """Answers every group with n samples whose response is the label (correct) or not, by a fixed pattern."""

    def __init__(self, pattern):
        self.pattern, self.calls = pattern, []

    def call_all(self, method, *args):
        self.calls.append(method)
        return []

    def generate(self, requests, spec, cold_cache=False):
        self.calls.append(("generate", len(requests), cold_cache))
        groups = []
        for r in requests:
            idx = r.template.metadata["index"]
            good = self.pattern(idx)  # how many of the n samples are right
            groups.append(
                [
                    Sample(
                        group_id=r.template.group_id,
                        prompt_ids=r.template.prompt_ids,
                        label=r.template.label,
                        metadata=dict(r.template.metadata),
                        response_ids=[1, 2, 3],
                        rollout_logprobs=[-0.1] * 3,
                        finish_reason="stop",
                        response=f"\\boxed{{{r.template.label if k < good else 'x'}}}",
                    )
                    for k in range(spec.n)
                ]
            )
        return groups


class MathReward:
    def score(self, groups):
        for g in groups:
            for s in g:
                s.reward = 1.0 if f"\\boxed{{{s.label}}}" in s.response else 0.0


def buffer(n=64):
    return DataBuffer(PromptSet("x", [Prompt(i, [5, 6, i % 7], "", "7") for i in range(n)]), seed=0, shuffle=False)


def test_dynamic_sampling_keeps_only_informative_groups(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16",
        "rollout.dynamic_sampling=true",
        "rollout.over_sampling_batch_size=4",
    )
    # prompts with an even index get 2 of 4 right (informative), odd ones 0 of 4 (no signal)
    router = FakeRouter(lambda i: 2 if i % 2 == 0 else 0)
    groups, metrics, consumed = collect_rollout(0, cfg, buffer(), router, MathReward())
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    assert all(len({s.reward for s in g}) > 1 for g in groups)
    assert [g[0].group_id for g in groups] == [0, 1, 2, 3]
    assert (
        metrics["rollout/dynamic_sampling/attempts"] == 2.0
        and metrics["rollout/dynamic_sampling/dropped_groups"] == 4.0
    )
    assert consumed == list(range(8))  # two attempts of 4 prompts, in order
    assert metrics["rollout/zero_std_ratio"] == 0.5 and metrics["rollout/raw_reward"] == pytest.approx(0.25)
    # the step's first call samples from a cold prefix cache (a resume samples as the uninterrupted run), not the next
    assert [c[2] for c in router.calls] == [True, False]


def test_dynamic_sampling_fills_a_shortfall_with_dropped_groups(tmp_path):
    cfg = tiny_config(
        tmp_path,
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "train.global_batch_size=16",
        "rollout.dynamic_sampling=true",
        "rollout.over_sampling_batch_size=4",
        "rollout.max_sampling_attempts=2",
    )
    router = FakeRouter(lambda i: 1 if i == 0 else 4)  # only prompt 0 is informative
    groups, metrics, _ = collect_rollout(0, cfg, buffer(), router, MathReward())
    assert len(groups) == 4 and metrics["rollout/dynamic_sampling/shortfall"] == 3.0
    assert len({s.reward for s in groups[0]}) > 1


def test_without_dynamic_sampling_one_pass_is_used(tmp_path):
    cfg = tiny_config(
        tmp_path, "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16"
    )
    router = FakeRouter(lambda i: 0)
    groups, metrics, consumed = collect_rollout(3, cfg, buffer(), router, MathReward())
    assert len(groups) == 4 and consumed == [0, 1, 2, 3] and metrics["rollout/zero_std_ratio"] == 1.0
    assert [c for c in router.calls if isinstance(c, tuple)] == [("generate", 4, True)]


class FakeEngine:
    def __init__(self):
        self.batches = []

    def _generate_batch(self, items):
        self.batches.append(len(items))
        return [Generation([len(ids)], [-0.5], "stop", f"len {len(ids)}") for ids, _ in items]


def test_custom_generate_calls_are_batched_per_turn(monkeypatch):
    """Concurrent ctx.generate calls of all samples go to the engine as one batch per turn."""
    monkeypatch.setattr("vime_core.rollout.SamplingSpec.vllm_params", lambda self, seed, n=None, **kw: ("params", seed))
    engine = FakeEngine()
    ctx = GenerateContext(engine, SamplingSpec(1, 1.0, 1.0, -1, 8))

    async def two_turns(i):
        c = ctx.for_sample(seed=i)
        first = await c.generate([1, 2, 3])
        second = await c.generate([1, 2, 3] + first.token_ids + [9])
        return first.text, second.text

    async def main():
        return await asyncio.gather(*(two_turns(i) for i in range(5)))

    out = asyncio.run(main())
    assert engine.batches == [5, 5]
    assert out[0] == ("len 3", "len 5")


def test_run_sync_works_inside_a_running_event_loop():
    from vime_core.aio import run_sync

    async def value():
        return 42

    async def outer():  # as in a Ray actor or Prefect task whose thread already runs a loop
        return run_sync(value())

    assert run_sync(value()) == 42
    assert asyncio.run(outer()) == 42

    async def boom():
        raise ValueError("inner")

    async def outer_boom():
        return run_sync(boom())

    with pytest.raises(ValueError, match="inner"):
        asyncio.run(outer_boom())


def test_engine_kwargs_choose_processed_logprobs_and_executor():
    from vime_core.rollout import EngineOptions, engine_kwargs

    cpu = engine_kwargs(EngineOptions(model_path="m", dtype="float32", max_model_len=512, seed=1))
    assert cpu["logprobs_mode"] == "processed_logprobs"  # log-probs after temperature, as the trainer recomputes them
    assert cpu["enable_chunked_prefill"] is False and cpu["enforce_eager"]
    one = engine_kwargs(EngineOptions(model_path="m", dtype="bfloat16", max_model_len=512, seed=1, platform="cuda"))
    assert "distributed_executor_backend" not in one and "kv_cache_memory_bytes" not in one
    two = engine_kwargs(
        EngineOptions(
            model_path="m",
            dtype="bfloat16",
            max_model_len=512,
            seed=1,
            platform="cuda",
            tensor_parallel_size=2,
            sleep_mode=True,
        )
    )
    assert two["distributed_executor_backend"] == "mp" and two["enable_sleep_mode"]


def test_kv_cache_shortfall_warns_only_when_concurrent_samples_cannot_fit(tmp_path):
    # 16 prompts x 8 samples, each up to data.max_prompt_len + rollout.max_response_len tokens, at once on one engine
    cfg = tiny_config(tmp_path, "rollout.rollout_batch_size=16", "rollout.n_samples_per_prompt=8")
    need = 128 * (cfg.data.max_prompt_len + cfg.rollout.max_response_len)
    assert kv_cache_shortfall(cfg, [{"kv_cache_tokens": need, "max_num_seqs": 256}], "cpu") is None
    short = kv_cache_shortfall(cfg, [{"kv_cache_tokens": need - 1, "max_num_seqs": 256}], "cpu")
    assert f"holds {need - 1:,} tokens" in short and f"{need:,}" in short and "rollout.cpu_kv_cache_gib" in short
    gpu = kv_cache_shortfall(cfg, [{"kv_cache_tokens": 1000, "max_num_seqs": None}], "cuda")
    assert "rollout.gpu_memory_utilization (0.5)" in gpu
    # the scheduler runs at most max_num_seqs at once; two engines split the groups; an unknown capacity is no warning
    assert kv_cache_shortfall(cfg, [{"kv_cache_tokens": need // 2, "max_num_seqs": 64}], "cpu") is None
    two = [{"kv_cache_tokens": need // 2, "max_num_seqs": 256}, {"kv_cache_tokens": need // 2 - 1, "max_num_seqs": 256}]
    assert kv_cache_shortfall(cfg, two, "cpu").startswith("vLLM engine 1's")
    assert kv_cache_shortfall(cfg, [{"kv_cache_tokens": None}], "cpu") is None


def test_model_runner_reads_vllms_choice_and_says_none_where_vllm_does_not():
    def llm(flag):
        return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=flag)))

    assert (model_runner(llm(True)), model_runner(llm(False))) == ("v2", "v1")
    assert model_runner(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace()))) is None
    assert model_runner(object()) is None


# --------------------------------------------------------------------------------------------------------------------
# what a custom generate returns (issue 28, N3)
# --------------------------------------------------------------------------------------------------------------------
class HookEngine(FakeEngine):
    """What VLLMEngine._generate_custom reads of its engine: the hook, its name, and _generate_batch (FakeEngine's:
    one token per turn, log-prob -0.5)."""

    def __init__(self, hook, name="tests.hooks:gen"):
        super().__init__()
        self.custom_generate, self.opts = hook, SimpleNamespace(custom_generate=name)


def run_hook(hook, monkeypatch, groups=1, n=2, name="tests.hooks:gen"):
    from vime_core.rollout import GroupRequest, VLLMEngine

    monkeypatch.setattr("vime_core.rollout.SamplingSpec.vllm_params", lambda self, seed, n=None, **kw: ("params", seed))
    requests = [
        GroupRequest(Sample(group_id=g, prompt_ids=[5, 6], metadata={"index": 10 + g}), seed=g) for g in range(groups)
    ]
    return asyncio.run(VLLMEngine._generate_custom(HookEngine(hook, name), requests, SamplingSpec(n, 1.0, 1.0, -1, 8)))


def four_tokens(masks=None, logprobs=None):
    """A hook giving every sample 4 response tokens, with the k-th call's mask / log-probs from the lists."""
    calls = []

    async def hook(ctx, sample, spec):
        k = len(calls)
        calls.append(k)
        return replace(
            sample,
            response_ids=[7, 8, 9, 10],
            loss_mask=masks[k] if masks else None,
            rollout_logprobs=logprobs[k] if logprobs else [-0.1] * 4,
        )

    return hook


def test_custom_generate_masks_of_the_wrong_length_fail_naming_sample_and_hook(monkeypatch):
    # the review's case: masks of 3 and 5 values on two 4-token responses were shifted across the samples
    with pytest.raises(CustomGenerateError) as e:
        run_hook(four_tokens(masks=[[1, 1, 1], [1, 1, 1, 1, 0]]), monkeypatch, name="my.tools:agent")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rollout.custom_generate = 'my.tools:agent' returned for sample 0 ")
    assert "(prompt 0, sample 0 of its group; dataset index 10) a loss_mask of 3 values for its 4 response" in msg
    assert user_error_exit(e.value, debug=False) == 2  # the CLIs' exit code, also when raised inside a Ray actor


def test_custom_generate_off_by_one_logprobs_and_bad_mask_values_are_named(monkeypatch):
    with pytest.raises(CustomGenerateError, match=r"sample 3 \(prompt 1, sample 1 of its group; dataset index 11\) 5 "):
        run_hook(four_tokens(logprobs=[[-0.1] * 4] * 3 + [[-0.1] * 5]), monkeypatch, groups=2)
    with pytest.raises(
        CustomGenerateError, match=r"sample 1 .* a loss_mask of the value\(s\) \[2\] for its 4 response"
    ):
        run_hook(four_tokens(masks=[[1, 1, 0, 0], [1, 2, 0, 1]]), monkeypatch)

    async def not_a_sample(ctx, sample, spec):
        return {"response_ids": [1]}

    with pytest.raises(CustomGenerateError, match="sample 0 .* a dict, not a Sample"):
        run_hook(not_a_sample, monkeypatch)


def test_custom_generate_aligned_masks_pass_unchanged(monkeypatch):
    from tests.helpers.custom_generate import with_tool_suffix

    groups = run_hook(with_tool_suffix, monkeypatch, groups=2)
    samples = [s for g in groups for s in g]
    assert len(samples) == 4
    for s in samples:  # one policy token (FakeEngine's) and the tool token: mask [1, 0], log-probs [-0.5, 0.0]
        assert s.response_ids == [2, 0] and s.loss_mask == [1, 0] and s.rollout_logprobs == [-0.5, 0.0]
    # empty log-probs (none given) and a None mask (every token trained) are accepted as before
    plain = run_hook(four_tokens(logprobs=[[], []]), monkeypatch)[0]
    assert [s.rollout_logprobs for s in plain] == [[], []] and [s.mask for s in plain] == [[1, 1, 1, 1]] * 2


# ---- eval timeout ---------------------------------------------------------------------------------------------------
def test_eval_generate_calls_are_bounded_by_eval_timeout_s(tmp_path, monkeypatch):
    import vime_core.router as router_module
    from vime_core.router import RolloutRouter

    cfg = tiny_config(tmp_path, "eval.timeout_s=123")
    assert tiny_config(tmp_path).eval.timeout_s == 7200
    seen = []
    monkeypatch.setattr(
        router_module,
        "gather",
        lambda refs, who, doing, timeout_s, setting, stall: seen.append((timeout_s, setting)) or [],
    )
    engine = SimpleNamespace(generate=SimpleNamespace(remote=lambda reqs, spec, cold_cache: None))
    router = RolloutRouter([engine], cfg.rollout.timeout_s)
    request = SimpleNamespace(template=SimpleNamespace(prompt_ids=[1, 2]))
    spec = SimpleNamespace(n=1)
    router.generate([request], spec)
    router.generate([request], spec, cfg.eval.timeout_s, "eval.timeout_s")
    assert seen == [(cfg.rollout.timeout_s, "rollout.timeout_s"), (123, "eval.timeout_s")]


def test_evaluate_passes_eval_timeout_s_to_the_router(tmp_path):
    from vime_core.data import PromptSet
    from vime_core.evaluation import evaluate
    from vime_core.sample import Sample

    cfg = tiny_config(tmp_path, "eval.timeout_s=321")
    seen = []

    class Router:
        def generate(self, requests, spec, timeout_s=None, setting="rollout.timeout_s"):
            seen.append((timeout_s, setting))
            return [
                [Sample(group_id=0, prompt_ids=[1], response_ids=[2], finish_reason="stop", reward=1.0)]
                for _ in requests
            ]

    prompt = SimpleNamespace(index=0, template=lambda group_id: SimpleNamespace(prompt_ids=[1]))
    metrics = evaluate(Router(), {"held": PromptSet("x", [prompt])}, cfg, SimpleNamespace(score=lambda groups: None))
    assert seen == [(321, "eval.timeout_s")] and metrics["eval/held/num_prompts"] == 1.0


# ---- prefix cache ---------------------------------------------------------------------------------------------------
def test_an_engine_drops_its_prefix_cache_before_sampling_after_a_weights_op_or_when_asked():
    from vime_core.rollout import VLLMEngine

    log = []
    llm = SimpleNamespace(
        reset_prefix_cache=lambda: log.append("reset") or True,
        collective_rpc=lambda method, args: log.append(args[:2]) or [3],
        generate=lambda prompts, params, use_tqdm: log.append("generate") or [],
    )
    engine = SimpleNamespace(
        llm=llm, cache_stale=False, custom_generate=None, opts=SimpleNamespace(stack_sample_ms=0), stack_reports=[]
    )
    engine.reset_prefix_cache = lambda: VLLMEngine.reset_prefix_cache(engine)
    engine.stack_samples = lambda: VLLMEngine.stack_samples(engine)
    spec = SamplingSpec(1, 1.0, 1.0, -1, 8)

    def generate(cold=False):
        log.clear()
        VLLMEngine.generate(engine, [], spec, cold)
        return log[:]

    assert generate() == ["generate"]  # a warm cache of these weights is kept
    assert VLLMEngine.weights(engine, "cpu", "load", []) == 3 and engine.cache_stale
    assert generate() == ["reset", "generate"] and not engine.cache_stale  # KV of the old weights never served
    assert generate() == ["generate"]
    assert generate(cold=True) == ["reset", "generate"]  # a rollout step's first call


def test_an_engine_samples_its_stacks_around_each_generate_call_when_asked(monkeypatch):
    import vime_core.rollout as rollout

    monkeypatch.setattr(rollout, "STACK_REPORTS", 2)
    log = []

    def rpc(method, args):
        log.append((method, *args))
        return [{"call": len(log)}] if args[0] == "stop" else [None]

    llm = SimpleNamespace(collective_rpc=rpc, generate=lambda prompts, params, use_tqdm: log.append("generate") or [])
    engine = SimpleNamespace(
        llm=llm, cache_stale=False, custom_generate=None, opts=SimpleNamespace(stack_sample_ms=5.0), stack_reports=[]
    )
    engine.stack_samples = lambda: rollout.VLLMEngine.stack_samples(engine)
    for _ in range(3):
        rollout.VLLMEngine.generate(engine, [], SamplingSpec(1, 1.0, 1.0, -1, 8))
    assert log[:3] == [("vime_stacks", "start", 5.0), "generate", ("vime_stacks", "stop")]
    assert engine.stack_reports == [{"call": 6}, {"call": 9}]  # the last STACK_REPORTS calls'


def test_a_cold_cache_generate_resets_the_engines_given_no_group_too(monkeypatch):
    import vime_core.router as router_module
    from vime_core.rollout import GroupRequest
    from vime_core.router import RolloutRouter

    calls = []
    monkeypatch.setattr(
        router_module, "gather", lambda refs, who, doing, timeout_s, setting, stall: (calls.append(who), refs)[1]
    )

    def engine(i):
        return SimpleNamespace(
            generate=SimpleNamespace(remote=lambda reqs, spec, cold: [(f"engine {i}", cold)] * len(reqs)),
            reset_prefix_cache=SimpleNamespace(remote=lambda: f"reset {i}"),
        )

    router = RolloutRouter([engine(0), engine(1)], 60)
    request = GroupRequest(Sample(group_id=0, prompt_ids=[1, 2]), seed=1)
    spec = SamplingSpec(1, 1.0, 1.0, -1, 8)
    assert router.generate([request], spec, cold_cache=True) == [("engine 0", True)]
    assert calls == [["vLLM engine 0", "vLLM engine 1"]]  # engine 0 samples cold, engine 1 (idle) only resets
    calls.clear()
    assert router.generate([request], spec) == [("engine 0", False)]
    assert calls == [["vLLM engine 0"]]
