"""Unit tests of vime_core.rewards: boxed-answer extraction, the math reward on answers that need no symbolic check,
custom reward loading and scoring. math-verify in its worker processes: tests/integration/test_rewards.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import custom_rewards
from vime_core.rewards import RewardModel, answers_equal, as_number, last_boxed, load_callable, math_reward
from vime_core.sample import Sample

HELPERS = "tests.helpers.custom_rewards"


def _sample(response: str, label: str | None = "5", group_id: int = 0, finish_reason: str = "stop") -> Sample:
    return Sample(group_id=group_id, prompt_ids=[1, 2, 3], label=label, response=response, finish_reason=finish_reason)


# --------------------------------------------------------------------------------------------------------------------
# last_boxed
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces are matched
        (r"\boxed{{a}{b{c}}}", r"{a}{b{c}}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box wins
        (r"\boxed{1} and then \boxed{2", None),  # the last box is cut off -> None, not the earlier box
        (r"\boxed{\frac{1}{2}", None),
        (r"the answer is \boxed 5", "5"),
        (r"$\boxed 5$", "5"),
        (r"\boxed  42 apples", "42"),
        (r"\fbox{3}", "3"),
        (r"\fbox{2} but \boxed{1}", "1"),
        (r"\boxed{1} but \fbox{2}", "2"),
        (r"\boxed{}", ""),
        ("the answer is 5", None),
        (r"ends with \boxed", None),
        (r"\boxed5", None),
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


# --------------------------------------------------------------------------------------------------------------------
# answers and the math reward
# --------------------------------------------------------------------------------------------------------------------
def test_as_number():
    assert as_number("1,000") == 1000
    assert as_number("-3/4") * 4 == -3
    assert as_number(r"-\frac{1}{2}") * 2 == -1
    assert as_number("0.25") * 4 == 1
    assert as_number("1/0") is None
    assert as_number("1,00") is None  # not a thousands separator
    assert as_number("x") is None


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{1/2}", "0.5"),
        (r"\boxed{68.0}", "68"),
        (r"\boxed{1,000}", "1000"),
        (r"\boxed{\dfrac{3}{4}}", "0.75"),
        (r"\boxed{\tfrac{3}{4}}", r"\frac{3}{4}"),
        (r"\boxed{\text{yes}}", "yes"),
        (r"\boxed{5\text{ cm}}", "5cm"),
        (r"\boxed{ 7 }.", "7"),
        (r"$\boxed{\left( 1, 2 \right)}$", "(1,2)"),
        (r"\boxed 12", "12"),
        (r"\fbox{12}", "12"),
    ],
)
def test_math_reward_correct(response, label):
    assert math_reward(response, label) == 1.0


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{67}", "68"),
        (r"\boxed{0.51}", "1/2"),
        ("the answer is 68", "68"),  # no box
        ("", "68"),
        (r"\boxed{}", "68"),
        (r"\boxed{68", "68"),  # truncated box
    ],
)
def test_math_reward_wrong(response, label):
    assert math_reward(response, label) == 0.0


def test_math_reward_uses_the_last_box():
    text = r"maybe \boxed{3}? no: \boxed{4}"
    assert math_reward(text, "4") == 1.0
    assert math_reward(text, "3") == 0.0


def test_math_reward_label_may_be_a_number():
    assert math_reward(r"\boxed{68}", 68) == 1.0  # type: ignore[arg-type]


def test_answers_equal_empty_prediction_is_wrong():
    assert answers_equal("", "") is False
    assert answers_equal(" $ ", "") is False


@pytest.mark.parametrize(
    "response",
    [
        r"The answer is \boxed{5}",
        r"The answer is \boxed{5}.",
        r"The answer is $\boxed{5}$.",
        "The answer is \\boxed{5}\n\n",
        r"The answer is \boxed 5",
        r"The answer is \boxed 5.",
    ],
)
def test_strict_format_box_ends_the_response(response):
    assert math_reward(response, "5", strict=True, finish_reason="stop") == 1.0


@pytest.mark.parametrize(
    "response",
    [
        r"\boxed{5} because 2 + 3 = 5",
        r"\boxed{5} and {5}",  # the text ends like the box but is not the box
        r"\boxed{5}}",
        r"\boxed 5 apples",
    ],
)
def test_strict_format_text_after_the_box(response):
    assert math_reward(response, "5", strict=False) == 1.0  # lenient mode accepts it
    assert math_reward(response, "5", strict=True) == 0.0


def test_strict_format_truncated_response_scores_zero():
    assert math_reward(r"so \boxed{5}", "5", strict=True, finish_reason="length") == 0.0
    # without strict, a truncated but correct response still counts
    assert math_reward(r"so \boxed{5}", "5", strict=False, finish_reason="length") == 1.0


def test_strict_format_wrong_answer_still_zero():
    assert math_reward(r"so \boxed{6}", "5", strict=True) == 0.0


# --------------------------------------------------------------------------------------------------------------------
# load_callable
# --------------------------------------------------------------------------------------------------------------------
def test_load_callable_colon_and_dot_forms():
    assert load_callable(f"{HELPERS}:length_reward") is custom_rewards.length_reward
    assert load_callable(f"{HELPERS}.length_reward") is custom_rewards.length_reward
    assert load_callable(f"{HELPERS}:Namespace.constant") is custom_rewards.Namespace.constant


def test_load_callable_missing_module():
    with pytest.raises(ValueError, match=r"cannot import module 'tests.helpers.no_such_module'"):
        load_callable("tests.helpers.no_such_module:f")


def test_load_callable_missing_attribute():
    with pytest.raises(ValueError, match=r"module 'tests.helpers.custom_rewards' has no attribute 'nope'"):
        load_callable(f"{HELPERS}:nope")
    with pytest.raises(ValueError, match=r"has no attribute 'nope'"):
        load_callable(f"{HELPERS}.nope")


def test_load_callable_not_callable():
    with pytest.raises(ValueError, match=r"'tests.helpers.custom_rewards:NOT_A_FUNCTION' is not callable"):
        load_callable(f"{HELPERS}:NOT_A_FUNCTION")


@pytest.mark.parametrize("spec", ["nodots", ":f", "mod:"])
def test_load_callable_malformed(spec):
    with pytest.raises(ValueError, match="is not a dotted path"):
        load_callable(spec)


# --------------------------------------------------------------------------------------------------------------------
# RewardModel
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def groups() -> list[list[Sample]]:
    return [
        [_sample("ab", group_id=0), _sample("abcd", group_id=0)],
        [_sample("", group_id=1)],
    ]


def _rewards(groups):
    return [[s.reward for s in g] for g in groups]


def test_reward_model_math():
    gs = [[_sample(r"\boxed{5}"), _sample(r"\boxed{4}"), _sample("5")], [_sample(r"\boxed{\frac{10}{2}}", group_id=1)]]
    RewardModel("math").score(gs)
    assert _rewards(gs) == [[1.0, 0.0, 0.0], [1.0]]


def test_reward_model_math_strict_uses_finish_reason():
    gs = [[_sample(r"\boxed{5}", finish_reason="length"), _sample(r"\boxed{5}", finish_reason="stop")]]
    RewardModel("math", strict_format=True).score(gs)
    assert _rewards(gs) == [[0.0, 1.0]]


def test_reward_model_math_needs_a_label():
    with pytest.raises(ValueError, match="math reward needs a label.*group 3"):
        RewardModel("math").score([[_sample(r"\boxed{5}", label=None, group_id=3)]])


def test_reward_model_sync_sample_reward(groups):
    RewardModel(f"{HELPERS}:length_reward").score(groups)
    # len("ab") = 2, len("abcd") = 4, len("") = 0
    assert _rewards(groups) == [[2.0, 4.0], [0.0]]


def test_reward_model_async_sample_reward(groups):
    RewardModel(f"{HELPERS}:async_length_reward").score(groups)
    # 2 * lengths
    assert _rewards(groups) == [[4.0, 8.0], [0.0]]


def test_reward_model_async_reward_inside_a_running_loop(groups):
    async def main():
        RewardModel(f"{HELPERS}:async_length_reward").score(groups)  # sync call from async code

    asyncio.run(main())
    assert _rewards(groups) == [[4.0, 8.0], [0.0]]


def test_reward_model_sync_group_reward(groups):
    RewardModel(f"{HELPERS}:rank_in_group", reward_type="group").score(groups)
    assert _rewards(groups) == [[0.0, 1.0], [1.0]]


def test_reward_model_async_group_reward(groups):
    RewardModel(f"{HELPERS}:async_group_position", reward_type="group").score(groups)
    assert _rewards(groups) == [[0.0, 1.0], [0.0]]
    assert all(type(s.reward) is float for g in groups for s in g)  # ints were converted


def test_reward_model_group_reward_wrong_count(groups):
    with pytest.raises(ValueError, match=r"returned 1 rewards for a group of 2 \(the group of prompt"):
        RewardModel(f"{HELPERS}:short_group", reward_type="group").score(groups)


def test_reward_model_group_reward_not_a_list(groups):
    with pytest.raises(ValueError, match=r"returned 1.0 for the group of prompt \? \(group 0, label '5'\), not a list"):
        RewardModel(f"{HELPERS}:scalar_group", reward_type="group").score(groups)


def test_reward_model_bad_spec_fails_at_construction():
    with pytest.raises(ValueError, match="cannot import module"):
        RewardModel("tests.helpers.no_such_module:f")


# --------------------------------------------------------------------------------------------------------------------
# verifier edge cases (issue 10)
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response",
    [
        "The answer is\n\\[\\boxed{5}\\]",
        "The answer is \\(\\boxed{5}\\)",
        "The answer is **\\boxed{5}**",
        "The answer is **\\boxed{5}**.\n",
        "So $$\\boxed{5}$$",
    ],
)
def test_strict_format_accepts_wrapped_final_box(response):
    # common Qwen3 endings: display math, inline math, bold
    assert math_reward(response, "5", strict=True, finish_reason="stop") == 1.0


@pytest.mark.parametrize("strict", [False, True])
def test_box_inside_think_is_not_the_answer(strict):
    # the reasoning boxed 5, the final answer is 6
    text = "<think>maybe \\boxed{5}</think>\nThe answer is \\boxed{6}"
    assert math_reward(text, "5", strict=strict) == 0.0
    assert math_reward(text, "6", strict=strict) == 1.0


def test_box_only_inside_think_scores_zero():
    assert math_reward("<think>so \\boxed{5}</think>\nThe answer is 5.", "5") == 0.0
    # Qwen3's template opens <think> in the prompt: the response holds only the closing tag
    assert math_reward("so \\boxed{5}\n</think>\n\nthe answer is five", "5") == 0.0
    assert math_reward("reasoning\n</think>\n\n\\boxed{5}", "5") == 1.0
    # cut off while still thinking: no final answer yet
    assert math_reward("<think>so \\boxed{5}", "5") == 0.0


@pytest.mark.parametrize(
    "pred, label",
    [
        (r"\$18.90", "18.90"),
        ("1e3", "1000"),
        ("2.5E-1", "1/4"),
        (r"\emptyset", r"\varnothing"),
        (r"\varnothing", r"\emptyset"),
    ],
)
def test_answers_equal_dollars_exponents_empty_set(pred, label):
    assert answers_equal(pred, label) is True
    assert math_reward(f"\\boxed{{{pred}}}", label) == 1.0


def test_exponent_numbers():
    assert as_number("1e3") == 1000
    assert as_number("-2.5e-2") * 40 == -1


# --------------------------------------------------------------------------------------------------------------------
# custom rewards: finite values, time limit
# --------------------------------------------------------------------------------------------------------------------
def test_nan_reward_names_function_and_sample():
    s = _sample("x", label="42")
    s.metadata["index"] = 17
    with pytest.raises(
        ValueError,
        match=rf"reward function {HELPERS}:nan_reward returned nan for the sample of prompt 17 "
        r"\(group 0, label '42'\): rewards must be finite",
    ):
        RewardModel(f"{HELPERS}:nan_reward").score([[s]])


def test_inf_group_reward_is_refused(groups):
    with pytest.raises(ValueError, match=rf"{HELPERS}:inf_for_long returned inf for the sample of prompt .*label '5'"):
        RewardModel(f"{HELPERS}:inf_for_long", reward_type="group").score(groups)


@pytest.mark.parametrize("fn", ["sleepy_reward", "async_sleepy_reward"])
def test_custom_reward_time_limit(fn):
    s = _sample("x", label="7")
    s.metadata["index"] = 3
    with pytest.raises(
        TimeoutError,
        match=rf"reward function {HELPERS}:{fn} took more than rollout.reward_timeout_s = 0.3 s "
        r"on the sample of prompt 3",
    ):
        RewardModel(f"{HELPERS}:{fn}", timeout_s=0.3).score([[s]])


@pytest.mark.parametrize("timeout, inner", [(0.3, 1), (2, 1), (3, 1), (9, 3), (30, 10)])
def test_math_verify_phases_time_out_before_the_caller(timeout, inner):
    """Three phases in a row (parse label, parse answer, verify) each get a third: math-verify gives up before the
    caller kills the worker; at least one second (signal.alarm counts whole seconds)."""
    from vime_core.verify_pool import phase_timeout

    assert phase_timeout(timeout) == inner
