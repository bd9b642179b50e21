"""A dpctl `Client` that nobody closed must never stall the thread that collects it. pyzmq's
Context ends itself in `__del__` with `term()`, which waits for every socket of the context; when the
client sat in a reference cycle, the garbage collector cleared the context's weak list of sockets
before the socket itself was closed, and `term()` waited forever, in whichever thread ran the
collection: a dashboard's poller dropped unclosed once froze a coordinator's event loop this way.
The client now owns a finalizer that closes its socket before its context, whoever drops it."""

from __future__ import annotations

import gc
import threading

from peers import Running

from dpool.client.rpc import Client
from dpool.protocol import messages as m


class Cycle:
    """An object that refers to itself, holding a client: only the cycle collector frees it."""

    def __init__(self, addr: str) -> None:
        self.me = self
        self.client = Client(addr, 5.0)


def collect_within(seconds: float) -> bool:
    """Whether a full collection, run on its own thread, finishes within `seconds`."""
    done = threading.Event()
    threading.Thread(target=lambda: (gc.collect(), done.set()), daemon=True).start()
    return done.wait(seconds)


def test_a_client_dropped_unclosed_in_a_cycle_is_freed_without_waiting(coordinator: Running) -> None:
    for _ in range(20):  # the collector's order varies; the old code hung within a few
        c = Cycle(coordinator.addr)
        assert c.client.call(m.Nodes(), m.NodesReply).nodes == []  # connected, a reply read
        del c
        assert collect_within(10), "collecting a dropped client waited on its zmq context"


def test_close_is_idempotent_and_the_client_still_works_as_a_context_manager(coordinator: Running) -> None:
    with Client(coordinator.addr, 5.0) as c:
        assert c.call(m.Nodes(), m.NodesReply).nodes == []
        c.close()
    c.close()
