"""The error every configuration problem raises."""

from __future__ import annotations

from vime_core.errors import VimeError

__all__ = ["ConfigError"]


class ConfigError(VimeError, ValueError):
    """A configuration problem, with a message that names the field(s) and the fix."""
