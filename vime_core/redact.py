"""Credentials out of everything vime stores or prints: a URI's password (`http://alice:s3cret@host` ->
`http://alice:***@host`) and secret query parameters (`?token=...`, `&password=...`, `&sig=...` -> `=***`),
wherever they appear in a text (a config value, a tag, an error message, a YAML dump, a log line).

MLflow and requests take the credentials from the URI itself (`tracking.uri=http://alice:pw@host:5000` logs in with
basic auth), so a redacted URI is for showing and storing only; the run keeps using the real one.
"""

from __future__ import annotations

import re

MASK = "***"

# scheme://user:password@ : the password runs to the last `@` before the host (a raw `@` in it is common)
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#@\s:'\"]*):(?P<secret>[^/?#\s'\"]+)@")
# a query parameter whose name says it carries a secret (access_token, X-Amz-Signature, api_key, sig, ...)
_QUERY = re.compile(
    r"(?P<head>[?&;][\w.-]*(?:token|password|passwd|pwd|secret|api[_-]?key|apikey|key|sig|signature|credential|auth)"
    r"[\w.-]*=)(?P<secret>[^&#\s'\"]+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with every URI password and secret query parameter replaced by `***` (the user name, host, path and
    other parameters are kept, so the location stays readable)."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", text)
    return _QUERY.sub(lambda m: f"{m['head']}{MASK}", text)


def has_credentials(text: str) -> bool:
    """Whether `text` holds something `redact` would mask."""
    return redact(text) != text
