"""The reward contract: a custom reward returns an int or a float (numpy numbers too) for each sample; anything else
(a bool, a string such as '1.0', None) is refused naming the function, the prompt index and the value, and a function
that raises is named with the prompt and its exception, as one line (exit 2 in the CLIs)."""

from __future__ import annotations

import pytest

from vime_core.rewards import RewardModel
from vime_core.sample import Sample

HELPERS = "tests.helpers.custom_rewards"


def _sample(response: str, group_id: int) -> Sample:
    return Sample(group_id=group_id, prompt_ids=[1, 2, 3], label="5", response=response, finish_reason="stop")


@pytest.fixture
def groups() -> list[list[Sample]]:
    return [[_sample("ab", 0), _sample("abcd", 0)], [_sample("", 1)]]


def _rewards(groups):
    return [[s.reward for s in g] for g in groups]


@pytest.mark.parametrize(
    "fn, shown",
    [
        ("not_a_number", r"'high' \(str\)"),
        ("returns_none", r"None \(NoneType\)"),
        ("string_number", r"'1.0' \(str\)"),
        ("returns_true", r"True \(bool\)"),
    ],
)
def test_reward_model_non_number(groups, fn, shown):
    """The function, the prompt index and the value, as one RewardError (a VimeError: one line, exit 2)."""
    from vime_core.rewards import RewardError

    groups[0][0].metadata["index"] = 11
    with pytest.raises(
        RewardError,
        match=rf"reward function {HELPERS}:{fn} returned {shown} for the sample of prompt 11 \(group 0, label '5'\), "
        "not a number; return an int or a float",
    ):
        RewardModel(f"{HELPERS}:{fn}").score(groups)


def test_group_reward_of_strings_is_refused(groups):
    from vime_core.rewards import RewardError

    with pytest.raises(RewardError, match=r"strings_for_group returned '1' \(str\) for the sample of prompt"):
        RewardModel(f"{HELPERS}:strings_for_group", reward_type="group").score(groups)


def test_numpy_numbers_are_rewards(groups):
    RewardModel(f"{HELPERS}:numpy_values").score(groups)
    assert _rewards(groups) == [[2.0, 2.0], [0.5]]
    assert all(type(s.reward) is float for g in groups for s in g)


def test_a_reward_that_raises_names_the_function_prompt_and_error(groups):
    from vime_core.errors import TransientError, VimeError
    from vime_core.rewards import RewardCallError

    groups[0][1].metadata["index"] = 4
    with pytest.raises(RewardCallError) as e:
        RewardModel(f"{HELPERS}:raises_on_long").score(groups)
    assert str(e.value) == (
        f"reward function {HELPERS}:raises_on_long raised KeyError: \"no score for 'abcd'\" on the sample of prompt 4 "
        "(group 0, label '5'); fix the function"
    )
    assert isinstance(e.value.__cause__, KeyError), "the user's traceback is kept (shown under --debug)"
    assert isinstance(e.value, VimeError) and isinstance(e.value, TransientError), "one line; a pipeline retries"
