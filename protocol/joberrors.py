"""The error of a job file that cannot be used, shared by the TOML job file (jobspec.py) and the
mlx-lm config it may be made from (mlxlm_config.py); and `one_line`, for the libraries' errors
that such a message quotes."""

from __future__ import annotations

from typing import Any


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


class JobFileError(ValueError):
    """A job file that cannot be used; the message is meant for the user as it is."""

    def __init__(self, source: str, key: str, given: Any, allowed: str) -> None:
        self.source, self.key, self.given, self.allowed = source, key, given, allowed
        shown = "missing" if given is MISSING else f"= {given!r}"
        super().__init__(f"{source}: {key} {shown}: {allowed}")


def one_line(e: BaseException) -> str:
    """An exception's message on one line (a tokenizer's or YAML's error runs over several)."""
    return " ".join(str(e).split())
