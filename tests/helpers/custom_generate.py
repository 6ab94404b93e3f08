"""A custom generate function (rollout.custom_generate) for the e2e tests: one policy turn through the hook's
context, then a fixed 'tool' suffix that the policy did not generate (loss mask 0, log-prob 0)."""

from __future__ import annotations

from dataclasses import replace

TOOL_SUFFIX = [0]  # a token the policy did not sample (the pad token of the builtin tokenizer)


async def with_tool_suffix(ctx, sample, spec):
    turn = await ctx.generate(sample.prompt_ids)
    ids = turn.token_ids + TOOL_SUFFIX
    return replace(
        sample,
        response_ids=ids,
        rollout_logprobs=turn.logprobs + [0.0] * len(TOOL_SUFFIX),
        loss_mask=[1] * len(turn.token_ids) + [0] * len(TOOL_SUFFIX),
        finish_reason=turn.finish_reason,
        response=turn.text,
        metadata={**sample.metadata, "turns": 1},
    )


async def off_by_one_mask(ctx, sample, spec):
    """with_tool_suffix whose loss_mask is one value short of the response (issue 28, N3): must fail naming it."""
    out = await with_tool_suffix(ctx, sample, spec)
    return replace(out, loss_mask=out.loss_mask[:-1])
