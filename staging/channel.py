"""The data channel: a node's socket that serves chunks of its cache, and the fetches that pull them.

A `Stager` is one thread with its own asyncio loop and its own `zmq.Context` (so its own ZAP
handler: ZAP is per context), apart from the daemon's: hashing a 4 MiB chunk and writing it never
delays a heartbeat (hashlib and libzmq let the GIL go on large buffers; the cache's reads and writes
run on a few I/O threads of the Stager's). It is two things:

- A server: a ROUTER bound to its own port (never the control socket) that answers `manifest`,
  `chunk`, `offer` and `put` (staging/README.md). A chunk it does not hold but is fetching right
  now is held, up to a deadline, and sent the moment it lands: a node still fetching serves what it
  has and what it is about to get, so the lead can chain fetchers (source -> n1 -> n2 -> n3) and n
  nodes stage in about the time of one.
- Fetches: `fetch(digest, sources)` gets the manifest from a source (checked against the digest),
  then every chunk the cache lacks, from up to MAX_SOURCES sources at once, each with a window of
  requests in flight (credit-based flow control, as the ZeroMQ guide's file transfer: a reply
  frees a slot once its chunk is written). A source that dies, falls silent, refuses, or serves
  bytes that fail their hash is dropped and its chunks go to another; one that served garbage is
  never asked again in that fetch. `sources()` is called again whenever the fetch needs another
  source. Verified chunks stay in the cache: a fetch started again resumes. A `Pacer` bounds what a
  fetch pulls to a rate that can change at any time.

With keys, the server is a CURVE server with the node's own pair, and its ZAP handler asks
`authorize(public_key_z85)` for the peer's role ("node:NAME", "client:NAME", None = refused) at the
handshake and again on every request, so a key taken off the allow-list is refused on its next
request, on a connection already open too. Nodes and clients may read; a put (and the offer before
it) needs `may_put(role, digest)`. Without keys (loopback pools, --insecure) there is no CURVE and
every peer is "node:?", which may read and put.

`upload` is dpctl's side of a push into one node: it offers the manifest, the node answers which
chunks it lacks, and dpctl sends those (pipelined). It is not a node: a blocking function with a
context of its own.

This module is the Stager; its parts live apart: `serve.py` (the server), `fetch.py` (a fetch),
`upload.py` (dpctl's push) and `parts.py` (the limits, errors and pacer they share).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from dpool.protocol.logs import get_logger
from dpool.protocol.security import ClientKeys
from dpool.staging.cache import Cache
from dpool.staging.fetch import Fetch
from dpool.staging.parts import (
    HOLD_S,
    IO_THREADS,
    STATS,
    TIMEOUT_S,
    WINDOW,
    Authorize,
    ChannelError,
    FetchError,
    Key,
    MayPut,
    Pacer,
    Progress,
    Source,
    UploadError,
    chunk_key,
    effective,
    settle,
)
from dpool.staging.serve import Server
from dpool.staging.upload import upload
from dpool.staging.wire import MAX_HOLD_S

__all__ = [
    "WINDOW", "ChannelError", "FetchError", "Pacer", "Progress", "Source", "Stager", "UploadError", "upload",
]


# -- the Stager: a thread, a loop, a context --------------------------------------------------------


class Stager:
    """The node's side of the data channel (module docstring). Every public method may be called
    from any thread; the work happens on the Stager's own."""

    def __init__(
        self,
        cache: Cache,
        *,
        bind: str | None = "tcp://0.0.0.0:0",
        keys: ClientKeys | None = None,
        authorize: Authorize | None = None,
        may_put: MayPut | None = None,
        log: Any = None,
        window: int = WINDOW,
        hold_s: float = HOLD_S,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        if keys is not None and bind is not None and authorize is None:
            raise ValueError("a Stager that serves with keys needs `authorize` (public key -> role or None)")
        self.cache, self.bind, self.keys = cache, bind, keys
        self.authorize, self.may_put = authorize, may_put
        self.log = log if log is not None else get_logger(component="staging")
        self.window, self.timeout_s = max(1, window), timeout_s
        self.hold_s = min(hold_s, MAX_HOLD_S, timeout_s / 2)  # a held request is answered before its asker gives up
        self.endpoint = ""
        self.rate_all: float | None = None
        self._stats: dict[str, int] = dict.fromkeys(STATS, 0)
        self._stats_lock = threading.Lock()
        self._fetches: dict[str, Fetch] = {}
        self._lock = threading.Lock()  # guards _fetches for callers on other threads
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._stopped = False
        self.ctx: zmq.asyncio.Context | None = None
        self.io: concurrent.futures.ThreadPoolExecutor | None = None
        self.server: Server | None = None
        self.expected: collections.Counter[Key] = collections.Counter()  # chunks this node's fetches are getting
        self.unknown: collections.Counter[str] = collections.Counter()  # digests fetched whose chunk list is not known yet
        cache.on_chunk(self._on_chunk)

    # -- called from any thread ----------------------------------------------------------------

    def start(self) -> str:
        """Start the thread; the bound endpoint with its real port ("" without `bind`)."""
        if self._thread is not None:
            raise ChannelError("this Stager was started already")
        self._thread = threading.Thread(target=self._main, name="staging", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise ChannelError(f"the data channel could not start on {self.bind}: {self._start_error}") from self._start_error
        return self.endpoint

    def fetch(self, digest: str, sources: Callable[[], Sequence[Source]], *, rate_bps: float | None = None) -> concurrent.futures.Future[Path]:
        """Stage the tree `digest` into the cache (module docstring). The future's result is the
        complete tree; its exception FetchError, CacheFull or ManifestError (or OSError from the
        disk). A second fetch of a digest being fetched gets the same future."""
        with self._lock:
            running = self._fetches.get(digest)
            if running is not None:
                return running.future
            future: concurrent.futures.Future[Path] = concurrent.futures.Future()
            loop = self._loop
            if loop is None or self._stopped or loop.is_closed():
                future.set_exception(FetchError("the data channel is not running: start() it first"))
                return future
            job = Fetch(self, digest, sources, rate_bps, future)
            self._fetches[digest] = job

        def cancelled(f: concurrent.futures.Future[Path]) -> None:  # the caller cancelled the future itself
            if f.cancelled():
                self._call(job.stop, None)

        future.add_done_callback(cancelled)
        try:
            loop.call_soon_threadsafe(job.begin)
        except RuntimeError:  # the loop closed meanwhile
            with self._lock:
                self._fetches.pop(digest, None)
            settle(future, exc=FetchError("the data channel stopped"))
        return future

    def progress(self, digest: str) -> Progress | None:
        with self._lock:
            job = self._fetches.get(digest)
        if job is None:
            return None
        rate = job.rate_bps if time.monotonic() - job.rate_at < job.quiet_s() else 0.0  # nothing came of late
        return Progress(digest, job.done_bytes, job.total_bytes, rate, list(job.source_names))

    def set_rate(self, digest: str | None, rate_bps: float | None) -> None:
        """Pace one fetch (None: unpaced), or with digest None set the limit of every fetch, now and
        later (a fetch's own rate and this one: the lower applies)."""
        self._call(self._set_rate, digest, rate_bps)

    def cancel(self, digest: str) -> None:
        """Stop a fetch; its future is cancelled. What it verified stays in the cache."""
        self._call(self._cancel, digest)

    def stats(self) -> dict[str, int]:
        """Counters since start: see STATS."""
        with self._stats_lock:
            return dict(self._stats)

    def stop(self) -> None:
        """End the thread and its sockets; a fetch running gets FetchError. Returns once done."""
        self._stopped = True
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join()

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # stopped: nothing to change
                loop.call_soon_threadsafe(fn, *args)

    def _on_chunk(self, sha256: str, index: int) -> None:
        """The cache verified and wrote a chunk (on whatever thread wrote it): wake its holds."""
        loop = self._loop
        if loop is not None and self.server is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.server.landed, chunk_key(sha256, index))

    # -- on the Stager's thread ------------------------------------------------------------------

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run(loop))
        finally:
            self._loop = None
            loop.close()

    async def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stopping = asyncio.Event()
        self.ctx = zmq.asyncio.Context()
        self.io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="staging-io")
        try:
            if self.bind is not None:
                self.server = Server(self, self.ctx)
                self.endpoint = self.server.open(self.bind)
                self.log.info("staging.listening", endpoint=self.endpoint, curve=self.keys is not None)
        except Exception as e:
            self._start_error = e
        self._loop = loop
        self._ready.set()
        try:
            if self._start_error is None:
                await self._stopping.wait()
        finally:
            with self._lock:
                jobs = list(self._fetches.values())
            for job in jobs:
                job.stop("the data channel stopped")
            await asyncio.gather(*(j.task for j in jobs if j.task is not None), return_exceptions=True)
            if self.server is not None:
                await self.server.close()
            self.io.shutdown(wait=True, cancel_futures=True)
            self.ctx.destroy(linger=0)

    def _set_rate(self, digest: str | None, rate: float | None) -> None:
        if digest is None:
            self.rate_all = rate
        with self._lock:
            jobs = list(self._fetches.values()) if digest is None else [j for j in (self._fetches.get(digest),) if j]
        for job in jobs:
            if digest is not None:
                job.own_rate = rate
            job.pacer.set_rate(effective(job.own_rate, self.rate_all), time.monotonic())
            job.wake.set()

    def _cancel(self, digest: str) -> None:
        with self._lock:
            job = self._fetches.get(digest)
        if job is not None:
            job.stop(None)

    def count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:  # the I/O threads count too
            self._stats[name] += n

    async def run_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self.io is not None
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    def expect(self, keys: Iterable[Key]) -> None:
        self.expected.update(keys)

    def unexpect(self, keys: Iterable[Key]) -> None:
        self.expected.subtract(keys)
        for k in [k for k, n in self.expected.items() if n <= 0]:
            del self.expected[k]
        if self.server is not None:
            self.server.recheck()

    def ended(self, job: Fetch) -> None:
        with self._lock:
            if self._fetches.get(job.digest) is job:
                del self._fetches[job.digest]
