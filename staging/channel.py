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
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from dpool.protocol.logs import Throttle, get_logger
from dpool.protocol.security import HANDSHAKE_REASONS, ZAP_ENDPOINT, ClientKeys
from dpool.staging.cache import Cache, CacheFull
from dpool.staging.manifest import Entry, Manifest, ManifestError
from dpool.staging.wire import (
    MAX_DATA_BYTES,
    MAX_FRAMES,
    MAX_HOLD_S,
    MAX_MANIFEST_BYTES,
    REPLIES,
    REQUESTS,
    ChunkData,
    Code,
    Error,
    GetChunk,
    GetManifest,
    Incoming,
    ManifestData,
    Message,
    Offer,
    OfferReply,
    Put,
    PutDone,
    WireError,
    decode,
    error_frames,
    pending,
)

WINDOW = 8  # requests in flight to one source: 32 MiB of 4 MiB chunks, many round trips of a LAN
MAX_SOURCES = 4  # sources one fetch pulls from at once
HOLD_S = 10.0  # how long a node holds a request for a chunk it is fetching (and a fetcher asks for)
TIMEOUT_S = 30.0  # a source silent this long with requests out is dropped; a fetch without progress this long fails
RETRY_S = 0.25  # a chunk a source is still fetching (or is busy) is asked of it again after this
RATE_WINDOW_S = 3.0  # a fetch's rate is measured over this much of its recent past
SOURCES_EVERY_S = 1.0  # `sources()` is called at most this often
MAX_LOSSES = 2  # times a source may be dropped for silence or a lost connection before it is left for good
IO_THREADS = 4  # cache reads, writes and hashing, off the loop
MAX_WORK = 64  # cache reads and writes in progress for peers; past it a request is answered busy
MAX_WORK_BYTES = 512 << 20  # the chunk bytes those may hold
MAX_HOLDS = 4096  # requests held for chunks on their way
BATCH = 256  # messages read from a socket before the loop serves others
SERVER_HWM = 64  # messages queued per peer, each way (a well-behaved peer has WINDOW out)
READ_ROLES = frozenset({"node", "client"})  # roles that may ask for manifests and chunks
KEY_PROPERTY = "X-Key"  # the ZAP reply's metadata: the connection's public key, for re-authorizing
LINK_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
NO_KEYS = "node:?"  # every peer's role without keys

Authorize = Callable[[str], "str | None"]
MayPut = Callable[[str, str], bool]


@dataclass(frozen=True)
class Source:
    """A node to fetch from: its data channel's endpoint, its public key (CURVE), a name for messages."""

    endpoint: str  # "tcp://host:port"
    server_key: bytes | None = None
    name: str = ""

    def __str__(self) -> str:
        return self.name or self.endpoint


class ChannelError(Exception):
    """The data channel could not do what it was asked; the message says what, where and why."""


class FetchError(ChannelError):
    """No source could give a manifest or a chunk: the message names each source tried and why."""


class UploadError(ChannelError):
    """A push into a node failed. `code`: the node's error code (staging/README.md), or "" when it
    did not answer."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Progress:
    """A fetch, as it stands: verified bytes of the total, the rate of the last seconds, its sources."""

    digest: str
    done_bytes: int
    total_bytes: int
    rate_bps: float
    sources: list[str]


class Pacer:
    """What a fetch may pull: `rate` bytes a second (None: unpaced; 0: paused), changeable at any time.

    A bucket that fills at `rate` from empty, capped at the largest request seen: `take(n, now)`
    debits n and answers 0 when the bucket holds n, else says how long until it will. So whatever
    the rates were, the bytes taken by time T never pass the integral of the rate up to T: a
    fetch of S bytes at R takes at least S / R. Bytes asked for but not delivered (a "not here")
    are given back."""

    PAUSED_WAIT_S = 0.5

    def __init__(self, rate: float | None, now: float | None = None) -> None:
        self.rate = rate
        self.allowance = 0.0
        self.burst = 0.0
        self.at = time.monotonic() if now is None else now

    def set_rate(self, rate: float | None, now: float) -> None:
        self._refill(now)
        if self.rate is None:
            self.allowance = 0.0  # from unpaced to paced: start empty, no burst of what came before
        self.rate = rate

    def take(self, n: int, now: float) -> float:
        if self.rate is None:
            return 0.0
        self.burst = max(self.burst, float(n))
        self._refill(now)
        if self.allowance >= n:
            self.allowance -= n
            return 0.0
        return self.PAUSED_WAIT_S if self.rate <= 0 else (n - self.allowance) / self.rate

    def give_back(self, n: int) -> None:
        if self.rate is not None:
            self.allowance = min(self.allowance + n, self.burst)

    def _refill(self, now: float) -> None:
        if self.rate is not None and self.rate > 0:
            self.allowance = min(self.allowance + self.rate * max(0.0, now - self.at), self.burst)
        self.at = now


def _effective(own: float | None, every: float | None) -> float | None:
    """A fetch's rate: its own and the Stager's limit for every fetch, the lower of those set."""
    rates = [r for r in (own, every) if r is not None]
    return min(rates) if rates else None


def _shown(key: str | None) -> str:
    return "-" if key is None else key[:12] + "..."


Key = tuple[str, ...]  # what a hold waits for: ("m", digest) or ("c", sha256, str(index))


def chunk_key(sha256: str, index: int) -> Key:
    return ("c", sha256, str(index))


def manifest_key(digest: str) -> Key:
    return ("m", digest)


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
        self._fetches: dict[str, _Fetch] = {}
        self._lock = threading.Lock()  # guards _fetches for callers on other threads
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping: asyncio.Event | None = None
        self._stopped = False
        self.ctx: zmq.asyncio.Context | None = None
        self.io: concurrent.futures.ThreadPoolExecutor | None = None
        self.server: _Server | None = None
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
            job = _Fetch(self, digest, sources, rate_bps, future)
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
            _settle(future, exc=FetchError("the data channel stopped"))
        return future

    def progress(self, digest: str) -> Progress | None:
        with self._lock:
            job = self._fetches.get(digest)
        if job is None:
            return None
        rate = job.rate_bps if time.monotonic() - job.rate_at < RATE_WINDOW_S else 0.0  # nothing came of late
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
                self.server = _Server(self, self.ctx)
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
            job.pacer.set_rate(_effective(job.own_rate, self.rate_all), time.monotonic())
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

    def ended(self, job: _Fetch) -> None:
        with self._lock:
            if self._fetches.get(job.digest) is job:
                del self._fetches[job.digest]


STATS = (
    "requests",  # requests read by the server, well-formed or not
    "manifests_served",
    "chunks_served",
    "bytes_served",
    "not_here",  # answered not_here
    "held",  # requests held for a chunk on its way
    "busy",  # answered busy
    "refused",  # refused: a key no longer allowed, a role that may not, a put without permission
    "rejected",  # malformed requests
    "offers",
    "puts",
    "bytes_put",
    "bad_puts",  # puts whose bytes failed their hash
    "chunks_fetched",
    "bytes_fetched",
    "corrupt",  # fetched chunks that failed their hash
    "sources_dropped",
    "fetches_done",
    "fetches_failed",
)


def _settle(future: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless it is settled already (the caller may cancel it meanwhile)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


# -- the server ----------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Hold:
    rid: bytes
    msg_id: int
    msg: GetChunk | GetManifest
    deadline: float  # loop time
    timer: asyncio.TimerHandle | None = None


class _Server:
    """The ROUTER that answers peers, its ZAP handler, and the requests held for chunks on their way."""

    def __init__(self, stager: Stager, ctx: zmq.asyncio.Context) -> None:
        self.s, self.ctx = stager, ctx
        self.cache, self.log = stager.cache, stager.log
        self.curve = stager.keys is not None
        self.sock = ctx.socket(zmq.ROUTER)
        self.raw: zmq.Socket[Any] = zmq.Socket.shadow(self.sock.underlying)
        self.zap: zmq.asyncio.Socket | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.holds: dict[Key, list[_Hold]] = {}
        self.held = 0
        self.work = 0
        self.work_bytes = 0
        self.landings = 0
        self.landed_at: dict[Key, int] = {}  # expected keys -> the landing that brought them
        self.manifests: collections.OrderedDict[str, tuple[Manifest, dict[str, Entry]]] = collections.OrderedDict()
        self.manifests_lock = threading.Lock()  # the I/O threads share those
        self.throttle = Throttle(lines=5, every=1.0)

    def open(self, bind: str) -> str:
        sock = self.sock
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES)
        sock.sndhwm = sock.rcvhwm = SERVER_HWM
        if self.s.keys is not None:
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.linger = 0
            self.zap.bind(ZAP_ENDPOINT)  # in this Stager's own context: the daemon's has its own
            sock.curve_server = True
            sock.curve_secretkey = self.s.keys.secret
            sock.curve_publickey = self.s.keys.public
            sock.zap_domain = b"dpool.data"
            self.tasks.append(asyncio.create_task(self._answer_zap(self.zap)))
        sock.bind(bind)
        self.tasks.append(asyncio.create_task(self._serve()))
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for holds in self.holds.values():
            for h in holds:
                if h.timer is not None:
                    h.timer.cancel()
        self.sock.close(linger=0)
        if self.zap is not None:
            self.zap.close(linger=0)

    # -- authentication ---------------------------------------------------------------------------

    async def _answer_zap(self, zap: zmq.asyncio.Socket) -> None:
        """ZAP (RFC 27) for this Stager's context: a CURVE key `authorize` knows gets its role as the
        connection's User-Id and the key itself as a property, so each request can be asked about
        again. Never dies: a request it fails on is answered 500."""
        raw: zmq.Socket[Any] = zmq.Socket.shadow(zap.underlying)
        while True:
            await zap.poll(500)
            for inc in pending(raw, BATCH, keep=16, metadata=False):
                frames = [f.bytes for f in inc.frames]
                try:
                    reply = self._zap_reply(frames)
                except Exception as e:  # answered all the same: an unanswered request hangs that handshake
                    self._warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
                    reply = [frames[0] if frames else b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"internal error", b"", b""]
                raw.send_multipart(reply)

    def _zap_reply(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *creds = frames
        if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            self._warn("auth.refused", "not curve", peer=address.decode(errors="replace"), reason="not CURVE")
            return [version, request_id, b"400", b"CURVE only", b"", b""]
        key = z85.encode(creds[0]).decode()
        role = self._authorize(key)
        if role is None:
            self._warn("auth.refused", "not allowed", peer=address.decode(errors="replace"), key=key, reason="public key not allowed")
            return [version, request_id, b"400", b"public key not allowed", b"", b""]
        name, value = KEY_PROPERTY.encode(), key.encode()
        metadata = bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value  # ZMTP property encoding
        return [version, request_id, b"200", b"OK", role.encode(), metadata]

    def _authorize(self, key: str) -> str | None:
        assert self.s.authorize is not None
        try:
            role = self.s.authorize(key)
        except Exception as e:  # the lead's allow-list failing refuses, it does not crash the channel
            self._warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
            return None
        return role if isinstance(role, str) and role else None

    def _role(self, inc: Incoming) -> str | None:
        """The requester's role now: asked again on every request (a revoked key is refused on an
        open connection), None = refused."""
        if not self.curve:
            return NO_KEYS
        return self._authorize(inc.key) if inc.key else None

    def _may_put(self, role: str, digest: str) -> bool:
        if not self.curve:
            return True
        if self.s.may_put is None:
            return False
        try:
            return bool(self.s.may_put(role, digest))
        except Exception as e:
            self._warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
            return False

    # -- requests ---------------------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            await self.sock.poll(500)  # a timeout: the descriptor is edge-triggered (protocol/sockets.py)
            for inc in pending(self.raw, BATCH, keep=1 + MAX_FRAMES, metadata=self.curve):
                self.s.count("requests")
                try:
                    self._request(inc)
                except Exception as e:  # a bug must not end the server: logged, the next request is served
                    self._warn("request.failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
            await asyncio.sleep(0)

    def _request(self, inc: Incoming) -> None:
        rid = inc.frames[0].bytes
        try:
            msg, msg_id, data = decode(inc.frames[1:], REQUESTS, cut=inc.cut)
        except WireError as e:
            self.s.count("rejected")
            self._warn("frame.rejected", str(e.code), code=str(e.code), error=e.message, user=inc.user)
            self._send(rid, error_frames(e))
            return
        role = self._role(inc)
        if role is None:
            self._refuse(rid, msg_id, inc, "revoked", "this key is not allowed (any more)")
        elif isinstance(msg, GetChunk | GetManifest):
            if role.partition(":")[0] not in READ_ROLES:
                self._refuse(rid, msg_id, inc, "read", f"role {role!r} may not read")
            else:
                self._read(rid, msg_id, msg, None)
        elif isinstance(msg, Offer | Put):
            if not self._may_put(role, msg.digest):
                self._refuse(rid, msg_id, inc, "put", f"{role} may not put chunks of {_shown(msg.digest)}")
            elif data is not None:
                self._write(rid, msg_id, msg, data)

    def _refuse(self, rid: bytes, msg_id: int, inc: Incoming, kind: str, why: str) -> None:
        self.s.count("refused")
        self._warn("request.refused", kind, user=inc.user, key=inc.key, reason=why)
        self._send(rid, error_frames(WireError(Code.REFUSED, why, msg_id)))

    def _busy(self, nbytes: int) -> bool:
        return self.work >= MAX_WORK or self.work_bytes + nbytes > MAX_WORK_BYTES

    def _read(self, rid: bytes, msg_id: int, msg: GetChunk | GetManifest, deadline: float | None) -> None:
        """Answer a read from the cache, on an I/O thread; a miss the node is fetching is held."""
        nbytes = msg.chunk_bytes if isinstance(msg, GetChunk) else MAX_MANIFEST_BYTES // 64
        if self._busy(nbytes):
            self.s.count("busy")
            self._send(rid, error_frames(WireError(Code.BUSY, f"{self.work} reads and writes in progress here", msg_id)))
            return
        self.work += 1
        self.work_bytes += nbytes
        loop = asyncio.get_running_loop()
        if isinstance(msg, GetChunk):
            key = chunk_key(msg.sha256, msg.index)
            fut = loop.run_in_executor(self.s.io, self.cache.read_chunk, msg.sha256, msg.index, msg.chunk_bytes)
        else:
            key = manifest_key(msg.digest)
            fut = loop.run_in_executor(self.s.io, self._manifest_bytes, msg.digest)
        fut.add_done_callback(functools.partial(self._read_done, rid, msg_id, msg, key, self.landings, deadline, nbytes))

    def _manifest_bytes(self, digest: str) -> bytes | None:
        m = self.cache.manifest(digest)
        return None if m is None else m.to_bytes()

    def _read_done(self, rid: bytes, msg_id: int, msg: GetChunk | GetManifest, key: Key, seq: int, deadline: float | None, nbytes: int, fut: asyncio.Future[bytes | None]) -> None:
        self.work -= 1
        self.work_bytes -= nbytes
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._warn("read.failed", type(exc).__name__, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self._not_here(rid, msg_id, f"cannot read it here: {type(exc).__name__}: {str(exc)[:200]}", later=False)
            return
        data = fut.result()
        if data is not None:
            if isinstance(msg, GetChunk):
                self.s.count("chunks_served")
                self.s.count("bytes_served", len(data))
                self._send(rid, [*ChunkData().frames(msg_id), data])
            else:
                self.s.count("manifests_served")
                self._send(rid, [*ManifestData().frames(msg_id), data])
            return
        if self.landed_at.get(key, -1) >= seq:  # it landed while this read was looking: look again
            self._read(rid, msg_id, msg, deadline)
            return
        later = self._expects(key, msg)
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + min(msg.hold_s, self.s.hold_s)
        if not later or deadline <= loop.time():
            self._not_here(rid, msg_id, "not held here" if not later else "still on its way here", later=later)
        elif self.held >= MAX_HOLDS:
            self.s.count("busy")
            self._send(rid, error_frames(WireError(Code.BUSY, f"{self.held} requests held here", msg_id)))
        else:
            hold = _Hold(rid, msg_id, msg, deadline)
            hold.timer = loop.call_at(deadline, self._expire, key, hold)
            self.holds.setdefault(key, []).append(hold)
            self.held += 1
            self.s.count("held")

    def _expects(self, key: Key, msg: GetChunk | GetManifest) -> bool:
        """Whether a fetch of this node's is about to get `key` (or may: its chunks are not known yet)."""
        if key in self.s.expected:
            return True
        return isinstance(msg, GetChunk) and msg.digest is not None and msg.digest in self.s.unknown

    def _not_here(self, rid: bytes, msg_id: int, why: str, *, later: bool) -> None:
        self.s.count("not_here")
        self._send(rid, error_frames(WireError(Code.NOT_HERE, why, msg_id), later=later))

    def _take(self, key: Key, hold: _Hold) -> bool:
        holds = self.holds.get(key)
        if holds is None or hold not in holds:
            return False
        holds.remove(hold)
        if not holds:
            del self.holds[key]
        self.held -= 1
        if hold.timer is not None:
            hold.timer.cancel()
        return True

    def _expire(self, key: Key, hold: _Hold) -> None:
        if self._take(key, hold):
            self._not_here(hold.rid, hold.msg_id, f"still on its way here after {hold.msg.hold_s:g} s", later=True)

    def landed(self, key: Key) -> None:
        """`key` is in the cache now: serve what waits for it."""
        self.landings += 1
        if key in self.s.expected:
            self.landed_at[key] = self.landings
        for hold in list(self.holds.get(key, ())):
            if self._take(key, hold):
                self._read(hold.rid, hold.msg_id, hold.msg, hold.deadline)

    def recheck(self) -> None:
        """What this node's fetches expect changed: a hold for what none expects now is looked up
        once more, then answered."""
        for k in [k for k in self.landed_at if k not in self.s.expected]:
            del self.landed_at[k]
        for key, holds in list(self.holds.items()):
            for hold in list(holds):
                if not self._expects(key, hold.msg) and self._take(key, hold):
                    self._read(hold.rid, hold.msg_id, hold.msg, hold.deadline)

    def _write(self, rid: bytes, msg_id: int, msg: Offer | Put, data: memoryview) -> None:
        if self._busy(len(data)):
            self.s.count("busy")
            self._send(rid, error_frames(WireError(Code.BUSY, f"{self.work} reads and writes in progress here", msg_id)))
            return
        self.work += 1
        self.work_bytes += len(data)
        fn = self._offer if isinstance(msg, Offer) else self._put
        assert self.s.io is not None
        fut = asyncio.get_running_loop().run_in_executor(self.s.io, fn, msg, data)
        fut.add_done_callback(functools.partial(self._write_done, rid, msg_id, len(data)))

    def _write_done(self, rid: bytes, msg_id: int, nbytes: int, fut: asyncio.Future[tuple[Message, bytes | None]]) -> None:
        self.work -= 1
        self.work_bytes -= nbytes
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, WireError):
            exc.msg_id = msg_id
            self._send(rid, error_frames(exc))
        elif exc is not None:
            self._warn("put.failed", type(exc).__name__, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            full = isinstance(exc, CacheFull) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
            code = Code.FULL if full else Code.INTERNAL
            self._send(rid, error_frames(WireError(code, f"{type(exc).__name__}: {str(exc)[:1000]}", msg_id)))
        else:
            reply, data = fut.result()
            self._send(rid, reply.frames(msg_id) + ([data] if data is not None else []))

    def _offer(self, msg: Offer, data: memoryview) -> tuple[Message, bytes | None]:
        """On an I/O thread: keep the offered manifest, make room, say what is missing."""
        self.s.count("offers")
        got = hashlib.sha256(data).hexdigest()
        if got != msg.digest:
            raise WireError(Code.BAD_REQUEST, f"the manifest's bytes hash to {got}, not {msg.digest}")
        try:
            manifest = self.cache.put_manifest(bytes(data))
        except ManifestError as e:
            raise WireError(Code.BAD_REQUEST, f"manifest {_shown(msg.digest)}: {e}") from None
        try:
            self.cache.reserve(manifest)
        except CacheFull as e:
            raise WireError(Code.FULL, str(e)) from None
        missing = self.cache.missing(manifest)
        if not missing:
            self.cache.complete(manifest)
        first: dict[str, int] = {}  # an entry's path -> the place of its chunk 0 in the bitmap
        n = 0
        for entry in manifest.entries:
            first[entry.path] = n
            n += len(entry.chunks)
        bitmap = bytearray((n + 7) // 8)
        for entry, index in missing:
            k = first[entry.path] + index
            bitmap[k // 8] |= 1 << (k % 8)
        size = sum(entry.chunk_size(index, manifest.chunk_bytes) for entry, index in missing)
        return OfferReply(missing=len(missing), bytes=size), bytes(bitmap)

    def _put(self, msg: Put, data: memoryview) -> tuple[Message, bytes | None]:
        """On an I/O thread: write one offered chunk, verified."""
        self.s.count("puts")
        found = self._manifest(msg.digest)
        if found is None:
            raise WireError(Code.BAD_REQUEST, f"no manifest {_shown(msg.digest)} here: offer it first")
        manifest, by_sha = found
        entry = by_sha.get(msg.sha256)
        if entry is None:
            raise WireError(Code.BAD_REQUEST, f"manifest {_shown(msg.digest)} has no file of sha256 {msg.sha256}")
        if msg.index >= len(entry.chunks):
            raise WireError(Code.BAD_REQUEST, f"{entry.path} has {len(entry.chunks)} chunks, no chunk {msg.index}")
        size = entry.chunk_size(msg.index, manifest.chunk_bytes)
        if len(data) != size:
            raise WireError(Code.BAD_REQUEST, f"chunk {msg.index} of {entry.path} is {size} bytes, got {len(data)}")
        if not self.cache.write_chunk(entry, msg.index, data, manifest.chunk_bytes):
            self.s.count("bad_puts")
            raise WireError(Code.BAD_CHUNK, f"chunk {msg.index} of {entry.path}: its bytes do not hash to {entry.chunks[msg.index]}")
        self.s.count("bytes_put", size)
        return PutDone(), None

    def _manifest(self, digest: str) -> tuple[Manifest, dict[str, Entry]] | None:
        """A manifest and its entries by sha256, from a few kept parsed (puts come in runs)."""
        with self.manifests_lock:
            found = self.manifests.get(digest)
        if found is not None:
            return found
        manifest = self.cache.manifest(digest)
        if manifest is None:
            return None
        found = (manifest, {e.sha256: e for e in manifest.entries})
        with self.manifests_lock:
            self.manifests[digest] = found
            while len(self.manifests) > 4:
                self.manifests.popitem(last=False)
        return found

    def _send(self, rid: bytes, frames: list[Any]) -> None:
        """To one peer; a ROUTER drops what a peer past its high-water mark would not take."""
        with contextlib.suppress(zmq.ZMQError):
            self.raw.send_multipart([rid, *frames], copy=False)

    def _warn(self, event: str, what: str, **fields: Any) -> None:
        """A line at most 5 times a second per event and `what` (a small set: codes, kinds of
        refusal, exception types), with the count held back: a peer cannot flood the log."""
        held = self.throttle.allow(f"{event} {what}", time.monotonic())
        if held is not None:
            self.log.warning(event, repeated=held, **fields)


# -- a fetch --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Item:
    """A manifest or a chunk to get, and what the sources said of it."""

    key: Key
    size: int  # bytes it pulls (0 for the manifest: not paced)
    entry: Entry | None = None
    index: int = 0
    lacks: set[str] = field(default_factory=set)  # endpoints that do not hold it
    retry: dict[str, float] = field(default_factory=dict)  # endpoint -> not asked again before

    def __str__(self) -> str:
        if self.entry is None:
            return "the manifest"
        return f"chunk {self.index} of {self.entry.path}"


@dataclass(eq=False)
class _Link:
    """One source of a fetch: a DEALER to it, and what is in flight there."""

    source: Source
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    created: float
    heard: float = 0.0  # when it last answered (or was first waited on)
    up: bool = False  # handshake done
    closed: bool = False
    retiring: bool = False  # `sources()` no longer offers it: asked for nothing new, closed once idle
    inflight: dict[int, _Item] = field(default_factory=dict)
    writing: int = 0  # its chunks being verified and written: they hold their window slots
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return self.source.endpoint


class _Fetch:
    """One fetch on the Stager's loop: a little state machine (items queued, in flight, done; links
    up, dropped) fed by its links' replies and events, and a loop that sends what it can and waits."""

    def __init__(self, stager: Stager, digest: str, sources: Callable[[], Sequence[Source]], rate: float | None, future: concurrent.futures.Future[Path]) -> None:
        self.s, self.digest, self.sources_fn, self.future = stager, digest, sources, future
        self.log = stager.log.bind(digest=digest[:12])
        self.own_rate = rate
        self.pacer = Pacer(_effective(rate, stager.rate_all))
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.links: dict[str, _Link] = {}
        self.tried: dict[str, str] = {}  # endpoint -> why it was left
        self.banned: set[str] = set()
        self.losses: collections.Counter[str] = collections.Counter()
        self.queue: collections.OrderedDict[int, _Item] = collections.OrderedDict()
        self.left = 0
        self.next_id = 1
        self.failure: BaseException | None = None
        self.stopped: str | None = None
        self.keys: list[Key] = []  # what this fetch told the server it expects
        self.unknown = False
        self.manifest_bytes: bytes | None = None
        self.chunk_bytes = 0
        self.done_bytes = self.total_bytes = 0
        self.rate_bps = 0.0  # over the last RATE_WINDOW_S, as of rate_at
        self.rate_at = 0.0
        self.samples: collections.deque[tuple[float, int]] = collections.deque()
        self.source_names: tuple[str, ...] = ()
        self.sources_at = -math.inf  # the last periodic look at `sources()`
        self.needed_at = -math.inf  # the last call for want of a source
        self.fruitless = 0  # `sources()` calls in a row that gave nothing new while one was needed
        self.need: str | None = None  # why the fetch cannot go on with the sources it has
        self.progress_at = time.monotonic()

    def begin(self) -> None:
        if self.stopped is not None or self.future.done():
            self.s.ended(self)
            return
        # Expectations are set before the first await: a chained fetcher asking right after this
        # node began is held, not told "not here".
        self.keys = [manifest_key(self.digest)]
        self.s.expect(self.keys)
        self.s.unknown[self.digest] += 1
        self.unknown = True
        self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self, why: str | None) -> None:
        """End this fetch: `why` becomes its FetchError; None: it was cancelled."""
        self.stopped = why
        if self.task is not None:
            self.task.cancel()
            return
        self.s.ended(self)
        if why is None:
            self.future.cancel()
        else:
            _settle(self.future, exc=FetchError(why))

    async def run(self) -> None:
        started = time.monotonic()
        self.log.info("fetch.started")
        try:
            path = await self._stage()
        except asyncio.CancelledError:
            if self.stopped is None:
                self.future.cancel()
            else:
                _settle(self.future, exc=FetchError(self.stopped))
            self.log.info("fetch.stopped", reason=self.stopped or "cancelled")
        except BaseException as e:
            self.s.count("fetches_failed")
            self.log.warning("fetch.failed", error=f"{type(e).__name__}: {str(e)[:500]}")
            _settle(self.future, exc=e)
        else:
            self.s.count("fetches_done")
            self.log.info("fetch.done", bytes=self.total_bytes, seconds=round(time.monotonic() - started, 3))
            _settle(self.future, path)
        finally:
            for link in list(self.links.values()):
                self._close(link)
            if self.unknown:
                self._known()
            self.s.unexpect(self.keys)
            self.s.ended(self)
            if not self.future.done() or self.future.cancelled() or self.future.exception() is not None:
                self.s.cache.release(self.digest)  # not fetching it any more: its blobs may be evicted

    async def _stage(self) -> Path:
        cache, io = self.s.cache, self.s.run_io
        tree = await io(cache.tree, self.digest)
        if tree is not None:
            return Path(tree)
        manifest = await io(cache.manifest, self.digest)
        if manifest is None:
            await self._pull([_Item(manifest_key(self.digest), 0)])
            manifest = await io(cache.put_manifest, self.manifest_bytes)
            if self.s.server is not None:
                self.s.server.landed(manifest_key(self.digest))
        self.total_bytes, self.chunk_bytes = manifest.total_bytes, manifest.chunk_bytes
        await io(cache.reserve, manifest)
        missing = await io(cache.missing, manifest)
        items = [_Item(chunk_key(e.sha256, i), e.chunk_size(i, manifest.chunk_bytes), e, i) for e, i in missing]
        self.done_bytes = max(0, self.total_bytes - sum(it.size for it in items))
        keys = [it.key for it in items]
        self.keys += keys
        self.s.expect(keys)
        self._known()
        if items:
            await self._pull(items)
        return Path(await io(cache.complete, manifest))

    def _known(self) -> None:
        """The chunks this fetch will get are known (or it ended): holds for others are answered."""
        self.unknown = False
        self.s.unknown[self.digest] -= 1
        if self.s.unknown[self.digest] <= 0:
            del self.s.unknown[self.digest]
        if self.s.server is not None:
            self.s.server.recheck()

    # -- the loop ------------------------------------------------------------------------------------

    async def _pull(self, items: list[_Item]) -> None:
        for it in items:
            self.queue[id(it)] = it
        self.left = len(items)
        self.progress_at = time.monotonic()
        while self.left:
            if self.failure is not None:
                raise self.failure
            now = time.monotonic()
            self._expire(now)
            wake_at = self._fill(now)
            if now - self.progress_at > self.s.timeout_s:
                raise FetchError(self._why(self.need or f"no progress for {self.s.timeout_s:g} s"))
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(0.0, min(wake_at, now + 0.25) - now))
        if self.failure is not None:
            raise self.failure

    def _fill(self, now: float) -> float:
        """Send what the windows and the pace allow; when something could go next (inf: on a reply)."""
        soonest, self.need = math.inf, None
        if self.queue and now >= self.sources_at + SOURCES_EVERY_S:
            self._more_sources(now, None)  # the sources offered now: a lost one replaced, a chain's place taken
        for link in list(self.links.values()):
            self._close_if_retired(link)
        for link in [lk for lk in self.links.values() if lk.up and not lk.retiring]:  # not before its handshake: a dead source takes nothing
            while not link.closed and len(link.inflight) + link.writing < self.s.window and self.queue:
                item, retry_at = self._pick(link, now)
                if item is None:
                    soonest = min(soonest, retry_at)
                    break
                wait = self.pacer.take(item.size, now) if item.size else 0.0
                if wait > 0:
                    self.progress_at = now  # held back by the pace, not stalled
                    return min(soonest, now + wait)
                del self.queue[id(item)]
                self._send(link, item, now)
        if self.queue and soonest == math.inf and all(lk.up and not (lk.inflight or lk.writing) for lk in self.links.values()):
            stuck = next(iter(self.queue.values()))
            self.need = "no source left" if not self.links else f"no source holds {stuck}"
            self._more_sources(now, self.need)
            soonest = now + SOURCES_EVERY_S
        return min(soonest, self.sources_at + SOURCES_EVERY_S) if self.queue else soonest

    def _pick(self, link: _Link, now: float) -> tuple[_Item | None, float]:
        """The first queued item this link may be asked for; else when one may be."""
        retry_at = math.inf
        for item in self.queue.values():
            if link.endpoint in item.lacks:
                continue
            at = item.retry.get(link.endpoint, 0.0)
            if at > now:
                retry_at = min(retry_at, at)
                continue
            return item, 0.0
        return None, retry_at

    def _more_sources(self, now: float, need: str | None) -> None:
        """Ask `sources()` for others; `need`: why the fetch cannot go on without one (it fails when
        two calls in a row give nothing new). `need` None: the periodic look at where to read now,
        on a clock of its own, so it never delays the asking that can fail a fetch."""
        if need is None:
            if now < self.sources_at + SOURCES_EVERY_S:
                return
            self.sources_at = now
        else:
            if now < self.needed_at + SOURCES_EVERY_S:
                return
            self.needed_at = now
        try:
            offered = list(self.sources_fn())
        except Exception as e:
            self.log.warning("fetch.sources_failed", error=f"{type(e).__name__}: {str(e)[:300]}")
            offered = []
        added = 0
        offered = [src for src in offered if isinstance(src, Source)]
        if offered:
            # `sources()` says where to read now (the node fetching ahead of this one in a chain,
            # rather than the holder every fetcher would share): a source it no longer names is
            # asked for nothing more, and closed once what it has in flight is in.
            named = {src.endpoint for src in offered}
            for link in list(self.links.values()):
                link.retiring = link.endpoint not in named
                self._close_if_retired(link)
        for src in offered:
            if len([lk for lk in self.links.values() if not lk.retiring]) >= MAX_SOURCES:
                break
            ep = src.endpoint
            if ep in self.links or ep in self.banned or self.losses[ep] > MAX_LOSSES:
                continue
            if self._connect(src, now):
                added += 1
        if added:
            self.fruitless = 0
        if added or need is None:
            return
        self.fruitless += 1
        if self.fruitless >= 2:
            raise FetchError(self._why(need))

    def _why(self, what: str) -> str:
        tried = "; ".join(f"{ep}: {why}" for ep, why in self.tried.items())
        live = ", ".join(f"{lk.source} ({len(lk.inflight)} in flight)" for lk in self.links.values())
        return (
            f"fetch of {self.digest}: {what} ({self.left} items left"
            + (f"; sources in use: {live}" if live else "")
            + (f"; sources left: {tried}" if tried else "; no other source offered")
            + ")"
        )

    # -- links ---------------------------------------------------------------------------------------

    def _connect(self, src: Source, now: float) -> bool:
        ep = src.endpoint
        if src.server_key is not None and self.s.keys is None:
            self._leave(ep, "it is a CURVE server and this node has no keys", ban=True)
            return False
        assert self.s.ctx is not None
        sock = self.s.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES)
        sock.rcvhwm = sock.sndhwm = 2 * self.s.window + 2
        if src.server_key is not None and self.s.keys is not None:
            sock.curve_publickey, sock.curve_secretkey = self.s.keys.public, self.s.keys.secret
            sock.curve_serverkey = src.server_key
        try:
            monitor = sock.get_monitor_socket(LINK_EVENTS)
            sock.connect(ep)
        except (zmq.ZMQError, ValueError, TypeError) as e:
            sock.close(linger=0)
            self._leave(ep, f"cannot connect: {e}", ban=True)
            return False
        link = _Link(src, sock, monitor, created=now, heard=now)
        loop = asyncio.get_running_loop()
        link.tasks = [loop.create_task(self._read(link)), loop.create_task(self._watch(link))]
        self.links[ep] = link
        self.source_names = tuple(str(lk.source) for lk in self.links.values())
        return True

    def _close_if_retired(self, link: _Link) -> None:
        if link.retiring and not link.closed and not link.inflight and not link.writing:
            self.log.info("source.retired", source=str(link.source))
            self._close(link)

    def _leave(self, ep: str, why: str, *, ban: bool) -> None:
        self.tried[ep] = why
        if ban:
            self.banned.add(ep)
        else:
            self.losses[ep] += 1

    def _drop(self, link: _Link, why: str, *, ban: bool) -> None:
        """Stop using a source: what it had in flight goes back to the queue, to another."""
        if link.closed:
            return
        for item in link.inflight.values():
            self._requeue(item)
            self.pacer.give_back(item.size)
        link.inflight.clear()
        self._leave(link.endpoint, why, ban=ban)
        self.s.count("sources_dropped")
        self.log.warning("source.dropped", source=str(link.source), reason=why, banned=ban)
        self._close(link)
        self.wake.set()

    def _close(self, link: _Link) -> None:
        link.closed = True
        self.links.pop(link.endpoint, None)
        self.source_names = tuple(str(lk.source) for lk in self.links.values())
        current = asyncio.current_task()
        for t in link.tasks:
            if t is not current:
                t.cancel()

        def close() -> None:  # after the handler that dropped it has returned
            with contextlib.suppress(zmq.ZMQError):
                link.sock.disable_monitor()
            link.monitor.close(linger=0)
            link.sock.close(linger=0)

        asyncio.get_running_loop().call_soon(close)

    def _expire(self, now: float) -> None:
        timeout = self.s.timeout_s
        for link in list(self.links.values()):
            if not link.up and now - link.created > timeout:
                self._drop(link, f"no connection within {timeout:g} s", ban=False)
            elif link.inflight and now - link.heard > timeout:
                self._drop(link, f"no answer for {timeout:g} s", ban=False)

    async def _watch(self, link: _Link) -> None:
        """The link's socket events: its handshake done or refused, its connection lost."""
        while not link.closed:
            frames = await link.monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
                kind, value = event["event"], int(event["value"])
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.up, link.heard = True, time.monotonic()
                elif kind == zmq.EVENT_DISCONNECTED:
                    if link.up:
                        self._drop(link, "connection lost", ban=False)
                elif failed := _handshake_failure(kind, value):
                    self._drop(link, failed, ban=True)
            except Exception as e:  # a bug: the fetch fails with it rather than hang
                self.failure = e
            self.wake.set()

    async def _read(self, link: _Link) -> None:
        raw: zmq.Socket[Any] = zmq.Socket.shadow(link.sock.underlying)
        while not link.closed:
            await link.sock.poll(500)
            for inc in pending(raw, BATCH, keep=MAX_FRAMES, metadata=False):
                try:
                    self._reply(link, inc)
                except Exception as e:  # a bug: the fetch fails with it rather than hang
                    self.failure = e
                self.wake.set()
                if link.closed:
                    return

    def _send(self, link: _Link, item: _Item, now: float) -> None:
        msg_id, self.next_id = self.next_id, self.next_id + 1
        msg: Message
        if item.entry is None:
            msg = GetManifest(digest=self.digest, hold_s=self.s.hold_s)
        else:
            msg = GetChunk(sha256=item.entry.sha256, index=item.index, chunk_bytes=self.chunk_bytes, hold_s=self.s.hold_s, digest=self.digest)
        if not link.inflight:
            link.heard = now  # its silence is counted from the first request it owes an answer to
        link.inflight[msg_id] = item
        try:
            link.sock.send_multipart(msg.frames(msg_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._drop(link, f"cannot send to it: {e}", ban=False)

    def _reply(self, link: _Link, inc: Incoming) -> None:
        try:
            msg, msg_id, data = decode(inc.frames, REPLIES, cut=inc.cut)
        except WireError as e:
            self._drop(link, f"sent a malformed reply: {e.code}: {e.message}", ban=True)
            return
        item = link.inflight.pop(msg_id, None)
        if item is None:
            return  # the answer to a request given up on
        now = link.heard = time.monotonic()
        if link.retiring:
            self.wake.set()  # _fill closes it once it is idle
        if isinstance(msg, Error):
            self._refused(link, item, msg, now)
        elif item.entry is None:
            if not isinstance(msg, ManifestData) or data is None:
                self._drop(link, f"answered a manifest request with {msg.OP}", ban=True)
                self._requeue(item)
                return
            got = hashlib.sha256(data).hexdigest()
            if got != self.digest:
                self._drop(link, f"served a manifest whose bytes hash to {got}, not the digest", ban=True)
                self._requeue(item)
                return
            self.manifest_bytes = bytes(data)
            self._done(item, now)
        else:
            if not isinstance(msg, ChunkData) or data is None or len(data) != item.size:
                got = f"{len(data)} bytes" if data is not None else msg.OP
                self._drop(link, f"answered {item} ({item.size} bytes) with {got}", ban=True)
                self._requeue(item)
                return
            link.writing += 1
            assert self.s.io is not None
            fut = asyncio.get_running_loop().run_in_executor(self.s.io, self.s.cache.write_chunk, item.entry, item.index, data, self.chunk_bytes)
            fut.add_done_callback(functools.partial(self._written, link, item))

    def _written(self, link: _Link, item: _Item, fut: asyncio.Future[bool]) -> None:
        link.writing -= 1
        self.wake.set()
        self._close_if_retired(link)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failure = exc
        elif fut.result():
            self._done(item, time.monotonic())
        else:
            self.s.count("corrupt")
            self._requeue(item)
            self._leave_for_garbage(link, f"served {item} whose bytes fail its sha256")

    def _leave_for_garbage(self, link: _Link, why: str) -> None:
        if link.closed:  # dropped meanwhile for another reason: it is never asked again all the same
            self.banned.add(link.endpoint)
            self.tried[link.endpoint] = why
        else:
            self._drop(link, why, ban=True)

    def _refused(self, link: _Link, item: _Item, err: Error, now: float) -> None:
        self.pacer.give_back(item.size)
        self._requeue(item)
        if err.code == Code.NOT_HERE and err.later:
            item.retry[link.endpoint] = now + RETRY_S
            self.progress_at = now  # it is on its way there: that source is not stuck
        elif err.code == Code.NOT_HERE:
            item.lacks.add(link.endpoint)
        elif err.code == Code.BUSY:
            item.retry[link.endpoint] = now + RETRY_S
        else:
            self._drop(link, f"{err.code}: {err.message}", ban=True)

    def _requeue(self, item: _Item) -> None:
        self.queue[id(item)] = item
        self.queue.move_to_end(id(item), last=False)  # first: a chain's next hop asks in order

    def _done(self, item: _Item, now: float) -> None:
        self.left -= 1
        self.progress_at = now
        if item.entry is not None:
            self.done_bytes += item.size
            self.s.count("chunks_fetched")
            self.s.count("bytes_fetched", item.size)
            if self.s.server is not None:
                self.s.server.landed(item.key)
            self.samples.append((now, self.done_bytes))
            while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
                self.samples.popleft()
            t0, b0 = self.samples[0]
            self.rate_bps = (self.done_bytes - b0) / (now - t0) if now > t0 else 0.0
            self.rate_at = now


# -- dpctl's push into a node ---------------------------------------------------------------------


def upload(
    source: Source,
    root: Path,
    manifest: Manifest,
    *,
    keys: ClientKeys | None = None,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 60.0,
    window: int = WINDOW,
) -> int:
    """Push the files of `manifest` under `root` into node `source`'s cache: offer the manifest, send
    the chunks the node lacks (`window` in flight), then offer again so the node builds the tree.
    Returns the bytes sent: 0 when the node holds it already. `progress(sent, to_send)` after each
    chunk. Raises UploadError (the node refused, is full, did not answer within `timeout_s`, or a
    file changed since it was scanned)."""
    ctx = zmq.Context()
    try:
        return _Upload(ctx, source, keys, timeout_s).run(Path(root), manifest, progress, max(1, window))
    finally:
        ctx.destroy(linger=0)


class _Upload:
    def __init__(self, ctx: zmq.Context[Any], source: Source, keys: ClientKeys | None, timeout_s: float) -> None:
        self.source, self.timeout_s = source, timeout_s
        if source.server_key is not None and keys is None:
            raise UploadError(f"{source}: its data channel uses CURVE: give keys (--keys)")
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))  # a refused handshake drops the queue
        if source.server_key is not None and keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.public, keys.secret
            self.sock.curve_serverkey = source.server_key
        self.monitor = self.sock.get_monitor_socket(LINK_EVENTS)
        try:
            self.sock.connect(source.endpoint)
        except zmq.ZMQError as e:
            raise UploadError(f"{source}: cannot connect: {e}") from None
        self.next_id = 1

    def run(self, root: Path, manifest: Manifest, progress: Callable[[int, int], None] | None, window: int) -> int:
        todo = self._offer(manifest)
        total = sum(e.chunk_size(i, manifest.chunk_bytes) for e, i in todo)
        sent = 0
        if progress is not None:
            progress(0, total)
        out: dict[int, tuple[Entry, int, int]] = {}  # request id -> (entry, index, bytes)
        later: collections.deque[tuple[Entry, int]] = collections.deque(todo)
        retry_at = 0.0
        while later or out:
            while later and len(out) < window and time.monotonic() >= retry_at:
                entry, index = later.popleft()
                data = self._chunk(root, manifest, entry, index)
                out[self._send(Put(digest=manifest.digest, sha256=entry.sha256, index=index), data)] = (entry, index, len(data))
            if not out:  # the node was busy: nothing is out, so nothing else will wake this
                time.sleep(max(0.0, retry_at - time.monotonic()))
                continue
            msg_id, msg, _ = self._recv()
            got = out.pop(msg_id, None)
            if got is None:
                continue
            entry, index, size = got
            if isinstance(msg, Error) and msg.code == Code.BUSY:
                later.appendleft((entry, index))
                retry_at = time.monotonic() + RETRY_S
            elif isinstance(msg, Error):
                raise UploadError(f"{self.source}: chunk {index} of {entry.path}: {msg.code}: {msg.message}", msg.code)
            elif isinstance(msg, PutDone):
                sent += size
                if progress is not None:
                    progress(sent, total)
            else:
                raise UploadError(f"{self.source}: answered a put with {msg.OP}", Code.BAD_REQUEST)
        if todo and self._offer(manifest):
            raise UploadError(f"{self.source}: still lacks chunks of {manifest.digest} after they were sent")
        return sent

    def _offer(self, manifest: Manifest) -> list[tuple[Entry, int]]:
        """Offer the manifest; the chunks the node lacks."""
        data = manifest.to_bytes()
        if len(data) > MAX_MANIFEST_BYTES:
            raise UploadError(f"the manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a node takes: stage fewer files at once")
        msg_id = self._send(Offer(digest=manifest.digest), data)
        while True:
            got_id, msg, bitmap = self._recv()
            if got_id == msg_id:
                break
        if isinstance(msg, Error):
            raise UploadError(f"{self.source}: {msg.code}: {msg.message}", msg.code)
        if not isinstance(msg, OfferReply) or bitmap is None:
            raise UploadError(f"{self.source}: answered an offer with {msg.OP}", Code.BAD_REQUEST)
        chunks = [(e, i) for e in manifest.entries for i in range(len(e.chunks))]
        if len(bitmap) != (len(chunks) + 7) // 8:
            raise UploadError(f"{self.source}: its bitmap of missing chunks is {len(bitmap)} bytes for {len(chunks)} chunks", Code.BAD_REQUEST)
        todo = [c for k, c in enumerate(chunks) if bitmap[k // 8] >> (k % 8) & 1]
        if len(todo) != msg.missing:
            raise UploadError(f"{self.source}: says {msg.missing} chunks are missing but marks {len(todo)}", Code.BAD_REQUEST)
        return todo

    def _chunk(self, root: Path, manifest: Manifest, entry: Entry, index: int) -> bytes:
        path = root.joinpath(*entry.path.split("/"))
        size = entry.chunk_size(index, manifest.chunk_bytes)
        try:
            with open(path, "rb") as f:
                f.seek(index * manifest.chunk_bytes)
                data = f.read(size)
        except OSError as e:
            raise UploadError(f"{path}: cannot read it: {e.strerror or e}") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != entry.chunks[index]:
            raise UploadError(f"{path}: changed since it was scanned (chunk {index} differs): scan it again")
        return data

    def _send(self, msg: Message, data: bytes) -> int:
        msg_id, self.next_id = self.next_id, self.next_id + 1
        try:
            self.sock.send_multipart([*msg.frames(msg_id), data], copy=False)
        except zmq.Again:
            raise UploadError(f"{self.source}: could not send within {self.timeout_s:g} s (its handshake refused, or it stopped reading)", Code.REFUSED) from None
        return msg_id

    def _recv(self) -> tuple[int, Message, memoryview | None]:
        """The next reply; UploadError when none comes within the timeout or the handshake fails."""
        deadline = time.monotonic() + self.timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UploadError(f"{self.source}: no answer within {self.timeout_s:g} s (is its data channel at {self.source.endpoint}?)")
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.monitor in ready:
                event = parse_monitor_message(self.monitor.recv_multipart())
                failed = _handshake_failure(event["event"], int(event["value"]))
                if failed:
                    raise UploadError(f"{self.source}: {failed}", Code.REFUSED)
            if self.sock in ready:
                for inc in pending(self.sock, 1, keep=MAX_FRAMES, metadata=False):
                    try:
                        msg, msg_id, data = decode(inc.frames, REPLIES, cut=inc.cut)
                    except WireError as e:
                        raise UploadError(f"{self.source}: sent a malformed reply: {e.code}: {e.message}", Code.BAD_REQUEST) from None
                    return msg_id, msg, data


def _handshake_failure(kind: int, value: int) -> str | None:
    """What a link's monitor event says went wrong with the CURVE handshake, or None."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"refused this key at the handshake (ZAP status {value}): is it in the pool's allow-list?"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return HANDSHAKE_REASONS.get(value, f"CURVE handshake failed (ZMTP error {value:#x})")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "the handshake failed: it closed the connection (another key, or no CURVE?)"
    return None
