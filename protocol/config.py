"""The config file dpd and dpctl share (default ~/.config/dpool/config.toml): its keys, what each
may hold, and the one loader both use, so a file one of them refuses the other refuses too, with
the same message naming the file, the key, the value and what is allowed."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from dpool.protocol.endpoints import endpoint_problem
from dpool.protocol.payloads import NODE_NAME_MEANS, NODE_NAME_PATTERN

DEFAULT_CONFIG = Path("~/.config/dpool/config.toml").expanduser()

# dpd's keys: the `dpd run` flags, spelled with underscores. A switch-like flag that takes an
# optional address (--serve, --dashboard) is `true` for its default address or a string; a size
# (cache_max, stage_rate) is a number of bytes or a string such as "50GB".
DAEMON_KEYS: dict[str, tuple[type, ...]] = {
    "join": (str,),
    "serve": (str, bool),
    "name": (str,),
    "advertise": (str,),
    "workers": (int,),
    "state_dir": (str,),
    "insecure": (bool,),
    "keys": (str,),
    "heartbeat_interval": (float,),
    "liveness": (int,),
    "heartbeat_rate": (float,),
    "stop_grace": (float,),
    "cache_max": (str, int),
    "stage_rate": (str, int, float),
    "log_level": (str,),
    "log_file": (str,),
    "yield_when": (str,),
    "dashboard": (str, bool),
}
# dpctl's keys, accepted (and checked) by dpd too; `keys` is both's.
CLIENT_KEYS: dict[str, tuple[type, ...]] = {"coordinator": (str,), "timeout": (float,)}
KEYS = DAEMON_KEYS | CLIENT_KEYS

MAX_TIMEOUT_S = 86400.0  # a day: past it a timeout is a typo (or inf), not a wait anyone means
MAX_HEARTBEAT_S, MAX_LIVENESS, MAX_STOP_GRACE_S = 60.0, 1000, 3600.0
LOG_LEVELS = ("debug", "info", "warning", "error")
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class ConfigError(ValueError):
    """The config file cannot be used: which file, which key, what it holds and what is allowed."""


def parse_size(text: str | None) -> int | None:
    """A size (`--cache-max`, `--stage-rate`): '50GB', '500MB', '1.5TiB' or bytes; None: none given.
    ValueError saying what a size looks like."""
    if text is None:
        return None
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0 or not math.isfinite(value):
        raise ValueError("expected a size such as 50GB, 500MB or 2TiB")
    return int(value * SIZE_UNITS[unit])


def _size(v: Any) -> str | None:
    try:
        parse_size(str(v))
    except ValueError as e:
        return str(e)
    return None


def _rate(v: Any) -> str | None:
    return None if str(v).strip() in ("0", "off") or _size(v) is None else "expected bytes a second such as 25MB or 100MiB, or 0 (never paced)"


def _within(lo: float, hi: float, what: str, *, lo_open: bool = False) -> Any:
    def check(v: Any) -> str | None:
        ok = (lo < v if lo_open else lo <= v) and v <= hi
        return None if ok else f"must be {what} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"

    return check


def _name(v: Any) -> str | None:
    return None if re.fullmatch(NODE_NAME_PATTERN, v) else f"must be {NODE_NAME_MEANS}"


def _endpoint(v: Any) -> str | None:
    return None if isinstance(v, bool) else endpoint_problem(v)


# What a value may be, beyond its type: the same rule as the flag's (daemon/cli.py, client/cli.py
# use these bounds), checked whatever flag overrides the key, so that a file one program refuses
# the other refuses too. (yield_when and dashboard are read by dpd alone, which names the key.)
VALUES: dict[str, Any] = {
    "timeout": _within(0, MAX_TIMEOUT_S, "seconds", lo_open=True),
    "workers": _within(1, 1 << 16, "a number of slots"),
    "heartbeat_interval": _within(0, MAX_HEARTBEAT_S, "seconds", lo_open=True),
    "liveness": _within(2, MAX_LIVENESS, "a count of heartbeats"),
    "stop_grace": _within(0, MAX_STOP_GRACE_S, "seconds"),
    "heartbeat_rate": _within(0, 1e9, "heartbeats a second", lo_open=True),
    "cache_max": _size,
    "stage_rate": _rate,
    "log_level": lambda v: None if v in LOG_LEVELS else "must be one of " + ", ".join(LOG_LEVELS),
    "name": _name,
    "coordinator": _endpoint,  # a bind's '*' is refused where the address is used to reach a coordinator
    "join": _endpoint,
    "serve": _endpoint,
}


def value_problem(key: str, value: Any) -> str | None:
    """What is wrong with `value` for `key` (a flag's or the config file's), or None: the one rule
    dpd's and dpctl's flags and the file share."""
    check = VALUES.get(key)
    return check(value) if check is not None else None


def _fits(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in kinds
    if isinstance(value, float) and not math.isfinite(value):
        return False  # TOML's inf and nan: no setting means them
    return isinstance(value, kinds) or (float in kinds and isinstance(value, int))


def _names(kinds: tuple[type, ...]) -> str:
    words = {str: "a string", int: "an integer", float: "a finite number", bool: "true or false"}
    return " or ".join(words[k] for k in kinds)


def load_config(path: Path, required: bool = False) -> dict[str, Any]:
    """The file's keys, each checked against KEYS; {} when there is no file and none was asked
    for by name (`required`: a --config flag)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"--config {path}: no such file") from None
        return {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for key, value in data.items():
        kinds = KEYS.get(key)
        if kinds is None:
            raise ConfigError(f"{path}: unknown key {key!r}; allowed: {', '.join(KEYS)}")
        if not _fits(value, kinds):
            raise ConfigError(f"{path}: {key} = {value!r}: must be {_names(kinds)}")
        problem = value_problem(key, value)
        if problem:
            raise ConfigError(f"{path}: {key} = {value!r}: {problem}")
    return data
