"""The config file dpd and dpctl share (default ~/.config/dpool/config.toml): its keys, what each
may hold, and the one loader both use, so a file one of them refuses the other refuses too, with
the same message naming the file, the key, the value and what is allowed."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

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


class ConfigError(ValueError):
    """The config file cannot be used: which file, which key, what it holds and what is allowed."""


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
    return data
