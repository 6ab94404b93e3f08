"""Loading a `RunConfig`: YAML plus dotted overrides (`--set grpo.eps_clip_high=0.28`); unknown keys are errors, and
pydantic's errors become one line per field naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vime_core.config.errors import ConfigError
from vime_core.config.schema import RunConfig


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a','b','c'], value parsed as YAML so that numbers, bools and lists get their types)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form section.field=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = json.loads(json.dumps(data, default=str))  # deep copy of plain data
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not a field of this section; check the spelling)"
        got = err.get("input")
        tail = (
            f" (got {got!r})"
            if err["type"] not in ("extra_forbidden", "value_error", "missing") and not isinstance(got, dict)
            else ""
        )
        lines.append(f"{loc}: {msg}{tail}" if loc else msg)
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults when path is None) and apply dotted overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """`section.field -> value` for logging as params; a mapping field (rollout.vllm_kwargs) gives one key per entry,
    or `{}` when empty, so that every field appears."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict) and not node and prefix:
            out[prefix] = "{}"
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", cfg.model_dump(mode="json"))
    return out
