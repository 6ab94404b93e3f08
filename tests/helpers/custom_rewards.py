"""Custom reward functions for tests/unit/test_rewards.py, referred to by dotted path
`tests.helpers.custom_rewards:...`."""

from __future__ import annotations

import asyncio

from vime_core.sample import Sample

NOT_A_FUNCTION = 42


def length_reward(sample: Sample) -> float:
    """Sync per-sample: the response length in characters."""
    return float(len(sample.response))


async def async_length_reward(sample: Sample) -> float:
    """Async per-sample: twice the response length (so it differs from length_reward)."""
    await asyncio.sleep(0)
    return 2.0 * len(sample.response)


def rank_in_group(samples: list[Sample]) -> list[float]:
    """Sync per-group: 1 for the longest response of the group, 0 for the others (first one on ties)."""
    lengths = [len(s.response) for s in samples]
    best = lengths.index(max(lengths))
    return [1.0 if i == best else 0.0 for i in range(len(samples))]


async def async_group_position(samples: list[Sample]) -> list[int]:
    """Async per-group: the position of each sample in its group (ints, to check conversion to float)."""
    await asyncio.sleep(0)
    return list(range(len(samples)))


def short_group(samples: list[Sample]) -> list[float]:
    """Per-group with the wrong count: one reward fewer than samples."""
    return [0.0] * (len(samples) - 1)


def scalar_group(samples: list[Sample]) -> float:
    """Per-group returning a single number instead of a list."""
    return 1.0


def not_a_number(sample: Sample):
    return "high"


def returns_none(sample: Sample):
    return None


def string_number(sample: Sample):
    """'1.0': float() would take it; the contract is a number."""
    return "1.0"


def returns_true(sample: Sample):
    """A bool (an int subclass): a reward of True is a bug in the function, refused."""
    return True


def numpy_values(sample: Sample):
    """numpy numbers are numbers: accepted."""
    import numpy as np

    return np.float32(0.5) if sample.group_id else np.int64(2)


def raises_on_long(sample: Sample) -> float:
    """Raises on a response longer than 2 characters (user code with a bug)."""
    if len(sample.response) > 2:
        raise KeyError(f"no score for {sample.response!r}")
    return 0.0


def strings_for_group(samples: list[Sample]) -> list:
    return ["1"] * len(samples)


class Namespace:
    """For `module:Namespace.method` paths."""

    @staticmethod
    def constant(sample: Sample) -> float:
        return 0.5


# --------------------------------------------------------------------------------------------------------------------
# misbehaving rewards (non-finite values, over the time limit)
# --------------------------------------------------------------------------------------------------------------------
def nan_reward(sample: Sample) -> float:
    return float("nan")


def inf_for_long(samples: list[Sample]) -> list[float]:
    """Per-group: inf for responses longer than 2 characters, else 0."""
    return [float("inf") if len(s.response) > 2 else 0.0 for s in samples]


def sleepy_reward(sample: Sample) -> float:
    """Far over any test's rollout.reward_timeout_s (the helper thread is left behind, daemonic)."""
    import time

    time.sleep(30)
    return 0.0


async def async_sleepy_reward(sample: Sample) -> float:
    await asyncio.sleep(30)
    return 0.0


CALLS = {"n": 0}


def nan_after_calls(sample: Sample) -> float:
    """The math reward for the first VIME_TEST_NAN_AFTER calls of this process (reset CALLS["n"] first), then NaN:
    a run using it fails at the step where the NaN appears, after its earlier steps were checkpointed."""
    import os

    from vime_core.rewards import math_reward

    CALLS["n"] += 1
    if CALLS["n"] > int(os.environ.get("VIME_TEST_NAN_AFTER", "0")):
        return float("nan")
    return math_reward(sample.response, sample.label, finish_reason=sample.finish_reason)
