"""Keep secrets out of logs: query values whose names look like credentials are redacted."""

from __future__ import annotations

import logging
import re

# ?token=..., &access_token=..., api_key, password, secret, signature, auth...
_SECRET_QUERY = re.compile(
    r"(?i)([?&;][^=&;\s\"]*(?:token|key|secret|passw|auth|sig|session|code)[^=&;\s\"]*=)[^&;\s\"]*"
)
REDACTED = "[redacted]"


def redact(text: str) -> str:
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, text)


class RedactSecrets(logging.Filter):
    """Redacts credential-like query values in a record's message and arguments (uvicorn's
    access formatter unpacks the arguments, so they stay a tuple)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {
                k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()
            }
        return True


def redact_access_logs() -> None:
    """Install the filter on uvicorn's loggers (HTTP access lines and WebSocket lines)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
