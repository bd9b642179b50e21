"""The coordinator of `dpd run --serve` on a thread of its own, with its own asyncio loop.

A coordinator busy with a long piece of work (a thousand nodes registering at once, a big plan)
holds its loop for that long. On the loop of the serving node's agent it would also stop the
agent's heartbeats, and the coordinator would declare its own node lost. On its own thread it holds
only the GIL, which Python hands over every switch interval (5 ms): the agent's loop goes on.

Everything of the coordinator is made on its thread: the `Coordinator` (its SQLite connection may
only be used by the thread that opened it) and its sockets (a zmq.asyncio socket belongs to the
loop that uses it); only the zmq Context, which is thread-safe, is shared (an inproc:// pool needs
the agent on the same one). The other thread learns the bound endpoint, or why binding failed,
from `bound`, and how the coordinator ended from `ended`: both are concurrent futures, to await
with `asyncio.wrap_future` on any loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpool.daemon.coordinator import Coordinator


class CoordinatorThread:
    """Runs `make()`'s coordinator: `start()`, await `bound` (the endpoint, or the bind error),
    then `ended` (None once stopped, or the exception the coordinator died of); `stop()` from any
    thread; `join()`."""

    def __init__(self, make: Callable[[], Coordinator]) -> None:
        self.make = make
        self.bound: Future[str] = Future()
        self.ended: Future[None] = Future()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._stop_asked = False
        self._thread = threading.Thread(target=self._main, name="coordinator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the coordinator to stop (it finishes the work in hand first); from any thread."""
        with self._lock:
            self._stop_asked = True
            loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed: it has ended already
                loop.call_soon_threadsafe(stopping.set)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (after `stop()`); whether it has."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # handed to the thread that awaits `ended`
            if not self.bound.done():
                self.bound.set_exception(e)
            self.ended.set_exception(e)
        else:
            self.ended.set_result(None)

    async def _serve(self) -> None:
        stopping = asyncio.Event()
        with self._lock:
            self._loop, self._stopping = asyncio.get_running_loop(), stopping
            if self._stop_asked:
                stopping.set()
        coord = self.make()
        self.bound.set_result(coord.bind())
        await coord.run(stopping)
