"""The custom generate hook (`rollout.custom_generate = "pkg.mod:fn"`): loading it (in `prepare`, in seconds, and in
each engine) and checking what it returns, each failure one line naming the hook and the fix. The engine runs it
through `vime_core.rollout.GenerateContext`."""

from __future__ import annotations

import inspect

from vime_core.errors import VimeError
from vime_core.sample import Sample


class CustomGenerateError(VimeError, ValueError):
    """rollout.custom_generate cannot be used; the message says why."""


def load_custom_generate(spec: str):
    """The `async def` function named by rollout.custom_generate; raises CustomGenerateError naming the problem
    (checked in `prepare`, in seconds, and again in each engine)."""
    from vime_core.rewards import load_callable

    try:
        fn = load_callable(spec)
    except Exception as e:  # ImportError (load_callable says ValueError), SyntaxError, a failing module body
        detail = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise CustomGenerateError(
            f"rollout.custom_generate = {spec!r} cannot be loaded: {detail}; fix the module, or set "
            "rollout.custom_generate to an `async def` `package.module:function` importable from the working "
            "directory or PYTHONPATH (or remove it)"
        ) from e
    # a callable object: its __call__ is what must be `async def` (callable() would not say which)
    target = getattr(fn, "__call__", fn) if not inspect.isfunction(fn) else fn  # noqa: B004
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)):
        raise CustomGenerateError(
            f"rollout.custom_generate = {spec!r} must be `async def` (it is a plain function): "
            "`async def fn(ctx, sample, sampling) -> Sample`, awaiting ctx.generate(...)"
        )
    return fn


def check_hook_samples(hook: str, samples: list, group_size: int) -> None:
    """Every sample the custom generate `hook` returned is a Sample whose loss_mask (None: all trained) holds one 0/1
    and whose rollout_logprobs (empty: none given) one log-prob per response token; else CustomGenerateError naming
    the sample and the hook. Unchecked, masks of 3 and 5 values on two 4-token responses were shifted across the
    samples of a packed micro-batch (grad norm 0.701 instead of 1.163), and an off-by-one raised a bare
    RuntimeError ("The size of tensor a (7) must match ...") in the trainer, naming no sample (issue 28, N3)."""
    for k, s in enumerate(samples):
        index = s.metadata.get("index") if isinstance(s, Sample) else None
        where = (
            f"rollout.custom_generate = {hook!r} returned for sample {k} (prompt {k // group_size}, sample "
            f"{k % group_size} of its group{'' if index is None else f'; dataset index {index}'})"
        )
        if not isinstance(s, Sample):
            raise CustomGenerateError(
                f"{where} a {type(s).__name__}, not a Sample: return dataclasses.replace(sample, response_ids=...)"
            )
        n = len(s.response_ids)
        if s.loss_mask is not None and (len(s.loss_mask) != n or set(s.loss_mask) - {0, 1}):
            what = (
                f"{len(s.loss_mask)} values"
                if len(s.loss_mask) != n
                else f"the value(s) {sorted(set(s.loss_mask) - {0, 1})}"
            )
            raise CustomGenerateError(
                f"{where} a loss_mask of {what} for its {n} response tokens: give one 0 or 1 per response token "
                "(None trains every token)"
            )
        if s.rollout_logprobs and len(s.rollout_logprobs) != n:
            raise CustomGenerateError(
                f"{where} {len(s.rollout_logprobs)} rollout_logprobs for its {n} response tokens: give one per "
                "response token (0.0 for a token the policy did not sample), or none"
            )
