"""ZeroMQ endpoints as dpool takes them from flags, the environment and config files: checked
before a socket sees them, so a typo is a message that names it, not libzmq's "Invalid argument"."""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("tcp", "ipc", "inproc")
EXAMPLE = "tcp://127.0.0.1:7340"


def endpoint_problem(addr: str, *, connect: bool = False) -> str | None:
    """What is wrong with `addr` as a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH, inproc://NAME),
    or None when nothing is. `connect`: an address to reach, where the wildcards a bind takes
    (`*` for every interface or any port) mean nothing."""
    try:
        parts = urlsplit(addr)
    except ValueError as e:
        return f"not an address ({e})"
    if parts.scheme not in SCHEMES or not (parts.netloc or parts.path):
        return f"must be a ZeroMQ address such as {EXAMPLE}"
    if parts.scheme != "tcp":
        return None
    host, sep, port = parts.netloc.rpartition(":")
    if not sep or not host or parts.path or parts.query or parts.fragment:
        return f"a tcp address is tcp://HOST:PORT, such as {EXAMPLE}"
    if connect and "*" in (host, port):
        return f"'*' is for binding (every interface, any port); to reach a coordinator name its host and port, such as {EXAMPLE}"
    if port != "*" and not (port.isdigit() and 0 < int(port) < 65536):
        return f"port {port!r}: must be 1-65535"
    return None
