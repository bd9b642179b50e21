"""structlog, configured once per process: readable lines on a TTY, JSON lines (orjson) otherwise.

Shared by dpd, dpctl and the trainer so every process logs the same way; bind `node`, `job`,
`rank`, `generation` as context and name events `noun.verb`.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import orjson
import structlog


def configure_logging(level: str = "info", *, json: bool | None = None, stream: Any = None) -> None:
    stream = stream or sys.stderr
    as_json = (not stream.isatty()) if json is None else json
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if as_json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(serializer=orjson.dumps)]
        factory: Any = structlog.BytesLoggerFactory(file=getattr(stream, "buffer", stream))
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=stream.isatty())]
        factory = structlog.PrintLoggerFactory(file=stream)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )


def get_logger(**context: Any) -> Any:
    return structlog.get_logger().bind(**context)


class Throttle:
    """At most `lines` log lines per key every `every` seconds, so nothing a peer sends can flood
    the log. `allow(key, now)` is None for a line to hold back, else how many were held back since
    the last one let through (log it with the line, as `repeated`). Keys are a small set: error
    codes, exception types, refusal reasons."""

    def __init__(self, lines: int = 1, every: float = 10.0) -> None:
        self.lines, self.every = lines, every
        self._state: dict[str, tuple[float, int, int]] = {}  # key -> (window start, let through, held back)

    def allow(self, key: str, now: float) -> int | None:
        start, used, held = self._state.get(key, (-math.inf, 0, 0))
        if now - start >= self.every:
            start, used = now, 0
        if used >= self.lines:
            self._state[key] = (start, used, held + 1)
            return None
        self._state[key] = (start, used + 1, 0)
        return held
