"""Rewards: a math verifier on top of `math-verify`, and custom reward functions loaded by dotted path.

The math verifier takes the *last* `\\boxed{...}` of the response (brace-matched, so `\\boxed{\\frac{1}{2}}` works),
compares it with the label as normalised strings, then as plain numbers (integers, decimals, `a/b`), then with
math-verify's symbolic equivalence (LaTeX, fractions vs decimals, ...). A missing box scores 0.

Custom rewards: `rollout.reward = "pkg.module:function"` with `rollout.reward_type`:
- `sample`: `f(sample) -> float` (or `async def`), called per sample;
- `group`:  `f(samples) -> list[float]` (or `async def`), called per prompt group.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import re
import threading
from fractions import Fraction
from typing import Any, Callable, Sequence

from vime_core.aio import run_sync
from vime_core.sample import Sample

log = logging.getLogger(__name__)

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`; None if there is none or it is
    unbalanced."""
    box = _last_box(text)
    return box[0] if box else None


def _last_box(text: str) -> tuple[str, int] | None:
    """(content, end index just past the box) of the last box in `text`; None if there is none or it is unbalanced."""
    if not text:
        return None
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":  # `\boxed 5` form: up to the next space or `$`
        m = re.match(r" +([^\s$]+)", text[i:])
        return (m.group(1), i + m.end()) if m else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j], j + 1
    return None  # unbalanced: the answer was cut off


_STRIP = [r"\!", r"\,", r"\;", r"\:", r"\left", r"\right", "$", " ", r"\displaystyle"]


def normalise(ans: str) -> str:
    s = ans.strip()
    for t in _STRIP:
        s = s.replace(t, "")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    return s.rstrip(".").strip()


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_FRACTION = re.compile(r"^([+-]?\d+)/(\d+)$")
_LATEX_FRACTION = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{(\d+)\}$")


def as_number(s: str) -> Fraction | None:
    """Exact value of an integer, decimal, `a/b` or `\\frac{a}{b}` string (thousands separators allowed); else None."""
    s = s.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    if _NUMBER.match(s):
        return Fraction(s)
    m = _FRACTION.match(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    m = _LATEX_FRACTION.match(s)
    if m and int(m.group(3)) != 0:
        sign = -1 if m.group(1) == "-" else 1
        return sign * Fraction(int(m.group(2)), int(m.group(3)))
    return None


def _symbolic_equal(pred: str, label: str) -> bool:
    """math-verify's parse + verify. Its timeouts use SIGALRM, which only works in the main thread."""
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call made without a timeout
    try:
        gold = parse(f"${label}$", parsing_timeout=timeout)
        target = parse(f"${pred}$", parsing_timeout=timeout)
        return bool(gold and target and verify(gold, target, timeout_seconds=timeout))
    except Exception as e:  # a parse bug must cost one sample's reward, not the run
        log.debug("math-verify failed on %r vs %r: %s", pred, label, e)
        return False


def answers_equal(pred: str, label: str) -> bool:
    p, g = normalise(pred), normalise(label)
    if not p:
        return False
    if p == g:
        return True
    pn, gn = as_number(p), as_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return _symbolic_equal(p, g)


def math_reward(response: str, label: str, strict: bool = False, finish_reason: str | None = None) -> float:
    """1.0 when the last boxed answer equals the label, else 0.0.

    strict: also require a complete response (not cut by the length limit) whose last non-space text is the box.
    """
    ans = last_boxed(response)
    if ans is None:
        return 0.0
    if strict:
        if finish_reason == "length":
            return 0.0
        tail = response.rstrip().rstrip(".$").rstrip()
        box = _last_box(tail)
        if box is None or box[1] != len(tail):  # the last box must be the last thing in the response
            return 0.0
        ans = box[0]
    return 1.0 if answers_equal(ans, str(label)) else 0.0


# --------------------------------------------------------------------------------------------------------------------
# custom rewards
# --------------------------------------------------------------------------------------------------------------------
def load_callable(spec: str) -> Callable[..., Any]:
    """`pkg.module:function` (or `pkg.module.function`) -> the function, with errors that say what is wrong."""
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
    else:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"{spec!r} is not a dotted path of the form 'package.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod_name!r} of {spec!r}: {e}") from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"module {mod_name!r} has no attribute {attr!r} (from {spec!r})")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"{spec!r} is not callable")
    return fn


class RewardModel:
    """Scores groups of samples in place (sets `sample.reward`)."""

    def __init__(self, spec: str = "math", reward_type: str = "sample", strict_format: bool = False):
        self.spec, self.reward_type, self.strict = spec, reward_type, strict_format
        self.fn = None if spec == "math" else load_callable(spec)

    def _math(self, s: Sample) -> float:
        if s.label is None:
            raise ValueError(f"math reward needs a label, but the sample of group {s.group_id} has none")
        return math_reward(s.response, s.label, self.strict, s.finish_reason)

    def score(self, groups: Sequence[Sequence[Sample]]) -> None:
        if self.fn is None:
            for g in groups:
                for s in g:
                    s.reward = self._math(s)
            return
        if self.reward_type == "group":
            results = _run_all([self.fn(list(g)) for g in groups])
            for g, r in zip(groups, results):
                if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
                    raise ValueError(f"group reward {self.spec} returned {r!r}, not a list of rewards")
                r = list(r)
                if len(r) != len(g):
                    raise ValueError(f"group reward {self.spec} returned {len(r)} rewards for a group of {len(g)}")
                for s, v in zip(g, r):
                    s.reward = _as_float(v, self.spec)
        else:
            flat = [s for g in groups for s in g]
            for s, v in zip(flat, _run_all([self.fn(s) for s in flat])):
                s.reward = _as_float(v, self.spec)


def _as_float(v: Any, spec: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError) as e:
        raise ValueError(f"reward function {spec} returned {v!r}, not a number") from e


def _run_all(results: list[Any]) -> list[Any]:
    """Resolve a mix of plain values and awaitables (async reward functions run concurrently)."""
    if not any(inspect.isawaitable(r) for r in results):
        return results

    async def gather():
        return await asyncio.gather(*[r if inspect.isawaitable(r) else _value(r) for r in results])

    return run_sync(gather())


async def _value(v: Any) -> Any:
    return v
