"""Rewards: a math verifier on top of `math-verify`, and custom reward functions loaded by dotted path.

The math verifier drops the reasoning (`<think>...</think>`) first, takes the *last* `\\boxed{...}` of what is left
(brace-matched, so `\\boxed{\\frac{1}{2}}` works), compares it with the label as normalised strings, then as plain
numbers (integers, decimals, `a/b`, `1e3`), then with math-verify's symbolic equivalence (LaTeX, fractions vs
decimals, ...) in worker processes with a time limit (verify_pool.py). A missing box scores 0.

Every reward has a time limit (`rollout.reward_timeout_s`) wherever it runs: math-verify's worker is killed at the
limit (score 0); a custom reward over the limit stops the run with an error naming it and the sample. Rewards
must be finite numbers: NaN or inf stops the run with an error naming the function and the sample.

Custom rewards: `rollout.reward = "pkg.module:function"` with `rollout.reward_type`:
- `sample`: `f(sample) -> float` (or `async def`), called per sample;
- `group`:  `f(samples) -> list[float]` (or `async def`), called per prompt group.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import numbers
import queue
import re
import threading
from fractions import Fraction
from typing import Any, Callable, Sequence

from vime_core.errors import TransientError, VimeError
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


# `\$` before `$`: `\$18.90` is 18.90 dollars
_STRIP = [r"\!", r"\,", r"\;", r"\:", r"\left", r"\right", r"\$", "$", " ", r"\displaystyle"]
_SYNONYMS = [(r"\varnothing", r"\emptyset"), (r"\dfrac", r"\frac"), (r"\tfrac", r"\frac")]


def normalise(ans: str) -> str:
    s = ans.strip()
    for t in _STRIP:
        s = s.replace(t, "")
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for a, b in _SYNONYMS:
        s = s.replace(a, b)
    return s.rstrip(".").strip()


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d{1,3})?$")  # `1e3`: exponents up to 999
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


DEFAULT_TIMEOUT_S = 10.0


def quick_equal(pred: str, label: str) -> bool | None:
    """True/False when normalised strings or exact numbers decide; None when only math-verify can tell."""
    p, g = normalise(pred), normalise(label)
    if not p:
        return False
    if p == g:
        return True
    pn, gn = as_number(p), as_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    return None


def answers_equal(pred: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    quick = quick_equal(pred, label)
    if quick is not None:
        return quick
    from vime_core.verify_pool import shared_pool

    return shared_pool().run("equal", [(normalise(pred), normalise(label))], timeout_s)[0]


def strip_thinking(response: str) -> str:
    """The final answer part: after the last `</think>` (Qwen3 templates open `<think>` in the prompt), or, when a
    `<think>` is never closed (cut off while reasoning), what came before it."""
    end = response.rfind("</think>")
    if end >= 0:
        return response[end + len("</think>") :]
    start = response.find("<think>")
    return response[:start] if start >= 0 else response


# what may follow the box at the very end in strict mode: display/inline math closers, bold, a full stop
_TAIL_WRAPPERS = ("\\]", "\\)", "**", "$", ".")


def _strip_tail(text: str) -> str:
    prev = None
    while prev != text:
        prev, text = text, text.rstrip()
        for w in _TAIL_WRAPPERS:
            if text.endswith(w):
                text = text[: -len(w)]
    return text


def boxed_answer(response: str, strict: bool = False, finish_reason: str | None = None) -> str | None:
    """The answer the math reward compares, or None when the response has none (in strict mode: none that ends it)."""
    text = strip_thinking(response)
    if not strict:
        return last_boxed(text)
    if finish_reason == "length":
        return None
    tail = _strip_tail(text)
    box = _last_box(tail)
    if box is None or box[1] != len(tail):  # the last box must be the last thing in the response
        return None
    return box[0]


def math_reward(
    response: str,
    label: str,
    strict: bool = False,
    finish_reason: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> float:
    """1.0 when the last boxed answer (outside the reasoning) equals the label, else 0.0.

    strict: also require a complete response (not cut by the length limit) whose last text is the box, optionally
    wrapped as `$..$`, `\\[..\\]`, `\\(..\\)` or `**..**` and followed by a full stop.
    """
    ans = boxed_answer(response, strict, finish_reason)
    return 0.0 if ans is None else float(answers_equal(ans, str(label), timeout_s))


def math_rewards(samples: Sequence[Sample], strict: bool, timeout_s: float) -> list[float]:
    """math_reward of many samples; the comparisons only math-verify can decide run in parallel workers."""
    from vime_core.verify_pool import shared_pool

    out: list[float] = []
    slow: list[tuple[int, tuple[str, str]]] = []
    for s in samples:
        ans = boxed_answer(s.response, strict, s.finish_reason)
        quick = False if ans is None else quick_equal(ans, str(s.label))
        if quick is None:
            slow.append((len(out), (normalise(ans), normalise(str(s.label)))))
        out.append(float(bool(quick)))
    if slow:
        for (i, _), ok in zip(slow, shared_pool().run("equal", [c for _, c in slow], timeout_s)):
            out[i] = float(ok)
    return out


def usable_labels(labels: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> list[bool]:
    """Which labels the math verifier can compare answers with: numbers, or LaTeX that math-verify parses (each
    distinct non-number label parsed once, in the worker processes)."""
    from vime_core.verify_pool import shared_pool

    norm = [normalise(str(x)) for x in labels]
    unique = sorted({n for n in norm if n and as_number(n) is None})
    parsed = dict(zip(unique, shared_pool().run("label", [(n,) for n in unique], timeout_s)))
    return [bool(n) and (as_number(n) is not None or parsed[n]) for n in norm]


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


class RewardError(VimeError, ValueError):
    """rollout.reward cannot be loaded, or the function failed or returned something that is not a number; the
    message names the function (and the prompt and value)."""


class RewardCallError(TransientError):
    """A custom reward function raised; the message names it, the prompt and the exception (its traceback under
    --debug). Transient: a pipeline task retries it, as a reward that calls a service may pass a minute later."""


def load_reward(spec: str) -> Callable[..., Any]:
    """The function named by rollout.reward (checked in `prepare`, before any actor starts); RewardError naming the
    setting and the problem otherwise: a missing module or attribute, a module whose import fails."""
    try:
        return load_callable(spec)
    except Exception as e:  # ImportError (load_callable says ValueError), SyntaxError, a failing module body
        detail = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise RewardError(
            f"rollout.reward = {spec!r} cannot be loaded: {detail}; set rollout.reward to `math` or to "
            "`package.module:function` importable from the working directory or PYTHONPATH"
        ) from e


class RewardModel:
    """Scores groups of samples in place (sets `sample.reward`), each call within `timeout_s`."""

    def __init__(
        self,
        spec: str = "math",
        reward_type: str = "sample",
        strict_format: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.spec, self.reward_type, self.strict, self.timeout_s = spec, reward_type, strict_format, timeout_s
        self.fn = None if spec == "math" else load_reward(spec)

    def score(self, groups: Sequence[Sequence[Sample]]) -> None:
        if self.fn is None:
            flat = [s for g in groups for s in g]
            for s in flat:
                if s.label is None:
                    raise ValueError(f"math reward needs a label, but the sample of group {s.group_id} has none")
            for s, r in zip(flat, math_rewards(flat, self.strict, self.timeout_s)):
                s.reward = r
            return
        if self.reward_type == "group":
            results = self._call_all([list(g) for g in groups], lambda k: _describe_group(groups[k]))
            for g, r in zip(groups, results):
                if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
                    raise RewardError(
                        f"group reward {self.spec} returned {r!r} for {_describe_group(g)}, not a list of rewards; "
                        "return one int or float per sample of the group"
                    )
                r = list(r)
                if len(r) != len(g):
                    raise RewardError(
                        f"group reward {self.spec} returned {len(r)} rewards for a group of {len(g)} "
                        f"({_describe_group(g)}); return one per sample"
                    )
                for s, v in zip(g, r):
                    s.reward = _as_float(v, self.spec, s)
        else:
            flat = [s for g in groups for s in g]
            for s, v in zip(flat, self._call_all(flat, lambda k: _describe(flat[k]))):
                s.reward = _as_float(v, self.spec, s)

    def _call_all(self, items: list[Any], describe: Callable[[int], str]) -> list[Any]:
        """`self.fn(item)` for every item, each within `timeout_s`, on a helper thread (a hung call cannot be killed
        in a thread: it is left behind, daemonic, and the run stops with an error). Async functions run
        concurrently, each under asyncio.wait_for."""
        done: queue.Queue = queue.Queue()
        threading.Thread(
            target=_call_worker, args=(self.fn, items, self.timeout_s, done), daemon=True, name="vime-reward"
        ).start()
        results: list[tuple[Any] | None] = [None] * len(items)

        def too_slow(i: int) -> TimeoutError:
            return TimeoutError(
                f"reward function {self.spec} took more than rollout.reward_timeout_s = "
                f"{self.timeout_s:g} s on {describe(i)}; make it faster or raise the limit"
            )

        for _ in items:
            try:  # sync calls end one after another, async ones run together: each ends within the limit
                i, ok, value = done.get(timeout=self.timeout_s)
            except queue.Empty:
                raise too_slow(next(i for i, r in enumerate(results) if r is None)) from None
            if not ok:
                if isinstance(value, asyncio.TimeoutError):
                    raise too_slow(i) from None
                if not isinstance(value, Exception):  # KeyboardInterrupt, SystemExit: as they are
                    raise value
                raise RewardCallError(
                    f"reward function {self.spec} raised {type(value).__name__}: {str(value)[:300]} on "
                    f"{describe(i)}; fix the function"
                ) from value
            results[i] = (value,)
        return [r[0] for r in results]  # type: ignore[index]


def _call_worker(fn: Callable[..., Any], items: list[Any], timeout_s: float, done: queue.Queue) -> None:
    """Runs on the helper thread: sync calls one by one, then the awaitables together, reporting each as it ends."""
    waiting: list[tuple[int, Any]] = []
    for i, item in enumerate(items):
        try:
            r = fn(item)
        except BaseException as e:
            done.put((i, False, e))
            return
        if inspect.isawaitable(r):
            waiting.append((i, r))
        else:
            done.put((i, True, r))
    if not waiting:
        return

    async def one(i: int, aw: Any) -> None:
        try:
            done.put((i, True, await asyncio.wait_for(aw, timeout_s)))
        except BaseException as e:
            done.put((i, False, e))

    async def gather() -> None:
        await asyncio.gather(*[one(i, aw) for i, aw in waiting])

    asyncio.run(gather())


def _describe(s: Sample) -> str:
    return f"the sample of prompt {s.metadata.get('index', '?')} (group {s.group_id}, label {s.label!r})"


def _describe_group(g: Sequence[Sample]) -> str:
    first = g[0] if g else None
    return (
        f"the group of prompt {first.metadata.get('index', '?')} (group {first.group_id}, label {first.label!r})"
        if first
        else "an empty group"
    )


def _as_float(v: Any, spec: str, s: Sample) -> float:
    """A reward as a float: an int or a float (numpy's too). A bool, a string such as '1.0', None or a tensor is
    refused: float() would take '1.0' and True silently, and a reward of True is a bug in the function."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):  # numpy's bool_ is no Real
        raise RewardError(
            f"reward function {spec} returned {v!r} ({type(v).__name__}) for {_describe(s)}, not a number; "
            "return an int or a float"
        )
    x = float(v)
    if not math.isfinite(x):
        raise RewardError(
            f"reward function {spec} returned {v!r} for {_describe(s)}: rewards must be finite numbers "
            f"(a NaN reward turns the policy's weights into NaN)"
        )
    return x
