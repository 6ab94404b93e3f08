"""Which names a checkpoint or a state dict lacks or has too many of, said the same way everywhere."""

from __future__ import annotations

from typing import Iterable


def name_diff(
    expected: Iterable[str], present: Iterable[str], allowed_extra: Iterable[str] = ()
) -> tuple[list[str], list[str]]:
    """(missing, unexpected), each sorted: names of `expected` not `present`, and `present` ones neither expected
    nor allowed."""
    want, have = set(expected), set(present)
    return sorted(want - have), sorted(have - want - set(allowed_extra))


def describe_name_diff(missing: list[str], unexpected: list[str], what: str = "tensor", limit: int = 6) -> str:
    """'missing 2 tensor(s): a, b; unexpected 1 tensor(s): c' (the first `limit` of each); '' when both are empty."""

    def part(label: str, names: list[str]) -> str:
        more = " ..." if len(names) > limit else ""
        return f"{label} {len(names)} {what}(s): {', '.join(names[:limit])}{more}"

    return "; ".join(part(label, names) for label, names in (("missing", missing), ("unexpected", unexpected)) if names)
