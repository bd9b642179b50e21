"""Reading ZeroMQ sockets the one right way, shared by every receiver in dpool.

ZeroMQ's file descriptor is edge-triggered: after a wake-up a reader must take every message that
is waiting (until EAGAIN), or what arrived meanwhile sits there until the next message wakes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import zmq


def pending(sock: zmq.Socket[Any], limit: int | None = None) -> Iterator[list[bytes]]:
    """The multipart messages waiting on `sock`, without blocking (at most `limit` of them)."""
    taken = 0
    while limit is None or taken < limit:
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        taken += 1
        yield frames
