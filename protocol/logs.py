"""structlog, configured once per process: readable lines on a TTY, JSON lines (orjson) otherwise.

Shared by dpd, dpctl and the trainer so every process logs the same way; bind `node`, `job`,
`rank`, `generation` as context and name events `noun.verb`. `RotatingFile` bounds a log file's
size on disk (dpd's `--log-file`, each trainer's `worker.log`); `Quiet` keeps a failing stream (a
full disk under stderr) from raising into the code that logs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
from pathlib import Path
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


LOG_MAX_BYTES = 4 << 20  # a log file is rotated past this size...
LOG_BACKUPS = 3  # ...into NAME.1 (newest) .. NAME.3 (oldest); at most (1 + 3) x 4 MiB per log


class RotatingFile:
    """An append-only log file bounded in size: once a write takes it past `max_bytes`, it becomes
    `PATH.1` (`PATH.1` becomes `PATH.2`, ..., the oldest is deleted) and a new `PATH` is started, so
    one log never holds more than `(backups + 1) * max_bytes` (plus one write) on disk.

    Writes go straight to the file descriptor (no buffer that a later flush could fail on). A
    write that fails (a full disk, a folder removed) raises OSError and the next write tries again
    (opening the file anew): a log is never worth the process that writes it. Files are created
    0600 whatever the umask. `write` takes bytes; `flush` exists for loggers that call it. `quiet`:
    a failed write is counted in `failed` and dropped instead of raised (the daemon's own log: a
    full disk must not stop the daemon through its logging)."""

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS, *, quiet: bool = False) -> None:
        self.path = Path(path)
        self.quiet = quiet
        self.failed = 0
        self.max_bytes, self.backups = max(1, max_bytes), max(0, backups)
        self._fd: int | None = None
        self._size = 0
        self._lock = threading.Lock()  # structlog may log from several threads

    def open(self) -> None:
        """Open (create) the file now: OSError when it cannot be written."""
        with self._lock:
            self._open()

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._size = os.fstat(self._fd).st_size
        return self._fd

    def _rotate(self) -> None:
        self.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for n in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{n}")
            newer = self.path if n == 1 else self.path.with_name(f"{self.path.name}.{n - 1}")
            try:
                os.replace(newer, older)
            except FileNotFoundError:
                continue

    def write(self, data: bytes) -> int:
        with self._lock:
            try:
                self._open()
                if self._size > 0 and self._size + len(data) > self.max_bytes:
                    self._rotate()
                fd = self._open()
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    self._size += n
                    view = view[n:]
                return len(data)
            except OSError:
                self.close()  # opened anew (and its size read again) by the next write
                self.failed += 1
                if self.quiet:
                    return 0
                raise

    def isatty(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> RotatingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Quiet:
    """A binary stream whose failed writes and flushes are counted and dropped, never raised."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed = 0

    def write(self, data: bytes) -> int:
        try:
            return int(self.stream.write(data) or 0)
        except (OSError, ValueError):  # ValueError: the stream was closed
            self.failed += 1
            return 0

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self.failed += 1

    def isatty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (OSError, ValueError):
            return False
