"""Whether the ring ports of ranks on this machine are listening yet (Linux).

MLX's ring start-up is ordered by connects: ranks 0..n-2 listen as soon as they call `init`, and
the last rank connects to rank 0 first; that connect sets off a chain in which each rank r < n-1,
once its left neighbour is in, connects to r + 1. A connect to a rank that has not called `init`
yet is refused and retried only after 1 s (mlx/distributed/utils.cpp). Ranks told to go at the same
moment by their daemons reach `init` up to tens of milliseconds apart on a busy machine, so a fixed
head start for the others is either too short or wasted. Where the other ranks share this machine,
the last rank can instead look: it calls `init` once every one of their ports is listening.

How it looks: a socket with SO_REUSEADDR binds the address. On Linux that succeeds while the port
is free or only bound (MLX sets SO_REUSEADDR too), and fails with EADDRINUSE once a socket listens
there; it never disturbs MLX's own bind and listen. A probe costs microseconds, where reading the
kernel's table of every TCP socket (/proc/net/tcp) cost 5 ms on a machine with 800 sockets, taken
from the ranks it waits for. (BSD semantics differ: a bound port already refuses the probe, and
the probe could refuse MLX's bind; macOS keeps the fixed delay.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator

from dpool.trainer.priority import thread_ids

POLL_S = 0.001


def is_listening(host: str, port: int) -> bool | None:
    """True when a socket listens on host:port of this machine; None where this cannot be told."""
    if not sys.platform.startswith("linux"):
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return True if e.errno == errno.EADDRINUSE else None
    return False


def wait_for_listeners(addresses: Iterable[tuple[str, int]], timeout_s: float) -> bool | None:
    """Wait until every (host, port) listens: True once they do, False after `timeout_s`, None
    when it cannot be told here (the caller falls back to a fixed delay)."""
    left = list(addresses)
    deadline = time.monotonic() + timeout_s
    while left:
        states = [is_listening(h, p) for h, p in left]
        if any(s is None for s in states):
            return None
        left = [a for a, s in zip(left, states, strict=True) if not s]
        if not left:
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)  # nothing to block on: the peer's listen is not an event here
    return True


@contextlib.contextmanager
def last_rank_apart(is_last: bool, ranks_here: int) -> Iterator[None]:
    """While MLX's init runs (Linux, ranks sharing this machine): the last rank on a core of its
    own, the others on the rest; every thread back on all of them after.

    The race left after waiting for listeners: the last rank connects to rank 0, which sets off the
    chain of connects back round to it, and must listen before rank n-2's connect arrives. On a
    machine with fewer free cores than ranks, rank n-2 woken from its accept takes the core of the
    last rank, between its connect and its listen, so the last rank loses that race often (8 of 21
    generations of the recovery bench). On a core of its own, it is not preempted by them."""
    allowed = sorted(os.sched_getaffinity(0)) if sys.platform.startswith("linux") and ranks_here > 1 else []
    pinned = False
    if len(allowed) > 1:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {allowed[-1]} if is_last else set(allowed[:-1]))
            pinned = True
    try:
        yield
    finally:
        if pinned:
            for tid in thread_ids():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(tid, allowed)  # MLX's socket threads, started during init, too
