"""Whether the ring ports of ranks on this machine are listening yet (Linux: /proc/net/tcp).

MLX's ring start-up is ordered by connects: ranks 0..n-2 listen as soon as they call `init`, and
the last rank connects to rank 0 first; that connect sets off a chain in which each rank r < n-1,
once its left neighbour is in, connects to r + 1. A connect to a rank that has not called `init`
yet is refused and retried only after 1 s (mlx/distributed/utils.cpp). Ranks told to go at the same
moment by their daemons reach `init` up to tens of milliseconds apart on a busy machine, so a fixed
head start for the others is either too short or wasted. Where the other ranks share this machine,
the last rank can instead look: it calls `init` once every one of their ports is in LISTEN.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes the state
POLL_S = 0.002


def listening_ports() -> set[int] | None:
    """The local TCP ports in LISTEN in this network namespace; None where that cannot be read."""
    if not sys.platform.startswith("linux"):
        return None
    ports: set[int] = set()
    read = False
    for table in TABLES:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == LISTEN:
                _, _, port = fields[1].rpartition(":")
                try:
                    ports.add(int(port, 16))
                except ValueError:
                    continue
    return ports if read else None


def wait_for_listeners(ports: Iterable[int], timeout_s: float) -> bool | None:
    """Wait until every port in `ports` is listening: True once they are, False after `timeout_s`,
    None when this machine's sockets cannot be read (the caller falls back to a fixed delay)."""
    wanted = set(ports)
    deadline = time.monotonic() + timeout_s
    while True:
        found = listening_ports()
        if found is None:
            return None
        if wanted <= found:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)  # polling the kernel's table: there is nothing to block on
