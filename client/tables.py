"""Aligned tables for people (`kubectl get` style) and the small formatters they use."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from dpool.protocol.payloads import EventRow


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows under their headers, columns aligned. Every cell is on one line, with any control
    character written as its escape: a value from the pool (a node's chip, a reason) holding ESC
    or a newline would otherwise clear the terminal or print a row of its own."""
    cells = [[str(h) for h in headers]] + [["-" if v is None else shown(str(v), keep="") for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def shown(text: str, keep: str = "\n\t") -> str:
    """Text for a terminal: the control characters in `keep` as they are (a sample's lines and
    tabs), any other written as its escape (a model's sample, a node's chip may hold ESC, which a
    terminal would obey)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


def num(v: float | None, digits: int = 4) -> str | None:
    return None if v is None else f"{v:.{digits}f}"


def size(n: int | None) -> str | None:
    if not n:
        return None
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return None


def held(part: int | None, total: int, complete: bool) -> str:
    """A tree's size, and for one not complete what of it the node holds: `12.0MiB of 22.9MiB`."""
    whole = size(total) or "0B"
    if complete or part is None:
        return whole
    return f"{size(part) or '0B'} of {whole}"


def age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def duration(seconds: float | None) -> str | None:
    """A span for people: 42s, 3m05s, 1h02m, 2d03h."""
    if seconds is None:
        return None
    n = round(seconds)
    if n < 60:
        return f"{n}s"
    if n < 3600:
        return f"{n // 60}m{n % 60:02d}s"
    if n < 86400:
        return f"{n // 3600}h{n % 3600 // 60:02d}m"
    return f"{n // 86400}d{n % 86400 // 3600:02d}h"


def when(t: float | None, now: float | None = None) -> str | None:
    """A moment in local time: the time of day when it was today, else the date too."""
    if t is None:
        return None
    day = time.localtime(time.time() if now is None else now)[:3]
    local = time.localtime(t)
    return time.strftime("%H:%M:%S" if local[:3] == day else "%Y-%m-%d %H:%M", local)


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def event_details(e: EventRow) -> str:
    """An event's fields beyond its time and kind, as `key=value` words (`ranks=n1,n2`)."""
    return " ".join(f"{k}={value_text(v, ',')}" for k, v in e.fields.items())


def value_text(v: Any, sep: str = ", ") -> str:
    """An event field's value in words, as a person reads it (never a Python repr): a list as its
    items (`n1, n1`), null and an empty list as `-`, a bool as JSON writes it."""
    if isinstance(v, list | tuple):
        return sep.join(value_text(x, sep) for x in v) or "-"
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
