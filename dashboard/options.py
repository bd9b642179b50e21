"""What a dashboard is told to do, checked before anything starts: where it listens, which
coordinator it reads, with which keys, and who may look. Shared by `dpctl dashboard` and
`dpd run --dashboard` (which checks it before the daemon starts, so a refused address is exit 2 of
dpd itself); imports nothing heavy (no aiohttp, no ZeroMQ).

Who may look: a dashboard that listens on loopback answers everyone on this machine, as a pool
without keys does. Anywhere else it needs viewer tokens (`dpctl keys add-viewer NAME`: the hash of
each viewer's token sits beside its key in the pool's `allowed/viewers/`) or an explicit
`--insecure`. `--tokens DIR` names the folder of hashes; without it a full key directory's
`allowed/viewers/` is used. Given tokens, every request needs one, loopback or not.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:7341"
DEFAULT_POLL_S = 1.0  # how often the coordinator is read while someone looks
MIN_POLL_S = 0.05


class OptionsError(Exception):
    """Bad flags (exit 2); the message names the flag, what was given and what is allowed."""


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False  # a name: not provably loopback

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


def parse_listen(text: str, flag: str = "--listen") -> Listen:
    """`HOST:PORT`, `[V6]:PORT` or `PORT` (on 127.0.0.1)."""
    value = text.strip()
    host, port = "127.0.0.1", value
    if value.startswith("["):
        close = value.find("]")
        if close < 0 or value[close + 1 : close + 2] != ":":
            raise OptionsError(f"{flag} {text!r}: an IPv6 address is written [ADDR]:PORT, e.g. [::1]:7341")
        host, port = value[1:close], value[close + 2 :]
    elif ":" in value:
        host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535 or not host or any(c.isspace() or c in "/?#@" for c in host):
        raise OptionsError(f"{flag} {text!r}: must be HOST:PORT (e.g. {DEFAULT_LISTEN} or 0.0.0.0:7341), [V6]:PORT, or a port")
    return Listen(host, int(port))


@dataclass(frozen=True, slots=True)
class Options:
    listen: Listen
    coordinator: str
    keys: Path | None  # a full key directory or a bundle; None: a pool without keys
    tokens: Path | None  # the folder of viewers' token hashes; None: no tokens checked
    insecure: bool
    poll_s: float = DEFAULT_POLL_S
    timeout_s: float = 3.0
    parent_pid: int | None = None  # dpd's: the dashboard ends when that process is gone


def viewers_dir(keys: Path | None) -> Path | None:
    """A full key directory's allow-list of viewers (a bundle has none)."""
    if keys is None or not (keys / "coordinator.key_secret").exists():
        return None
    return keys / "allowed" / "viewers"


def check(listen: str, coordinator: str, *, keys: Path | None, tokens: Path | None, insecure: bool, poll_s: float = DEFAULT_POLL_S, timeout_s: float = 3.0, parent_pid: int | None = None, flag: str = "--listen") -> Options:
    """The options, or OptionsError naming what is wrong. A non-loopback address needs tokens
    (`tokens`, else the key directory's viewers) or `insecure`. `flag` names where `listen` came
    from: `--listen` (dpctl dashboard) or `--dashboard` (dpd run, which the message then speaks to)."""
    where = parse_listen(listen, flag)
    if tokens is not None and not tokens.is_dir():
        raise OptionsError(f"--tokens {tokens}: no such folder; it is the pool's allowed/viewers/ (or a copy), where `dpctl keys add-viewer NAME` writes NAME.token")
    chosen = tokens or viewers_dir(keys)
    if not where.loopback and chosen is None and not insecure:
        # Each command's remedy in its own flags: `dpd run --dashboard` takes no --tokens (its
        # dashboard checks the key directory's viewers), `dpctl dashboard --listen` does.
        keyed = "run dpd with the pool's key directory (--keys DIR)" if flag == "--dashboard" else "run the dashboard with the pool's key directory (--keys DIR) or --tokens DIR"
        raise OptionsError(
            f"{flag} {listen}: refusing to show the pool beyond this machine without viewer tokens; "
            f"issue one with `dpctl keys add-viewer NAME` and {keyed}, keep it on 127.0.0.1, or pass --insecure on a network you trust"
        )
    if tokens is None and where.loopback:
        chosen = None  # loopback answers this machine's users, as a pool without keys does
    if not MIN_POLL_S <= poll_s <= 60:
        raise OptionsError(f"--poll {poll_s:g}: must be between {MIN_POLL_S:g} and 60 seconds")
    if timeout_s <= 0:
        raise OptionsError(f"--timeout {timeout_s:g}: must be > 0")
    return Options(where, coordinator, keys, chosen, insecure, poll_s, timeout_s, parent_pid)
