"""What the data channel's parts share (staging/channel.py's docstring says what the channel is):
its limits, a source, its errors, a fetch's progress and pacer, the keys its holds wait on, the
counters a Stager keeps, and what a failed CURVE handshake means."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from dpool.protocol.security import HANDSHAKE_REASONS

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


def effective(own: float | None, every: float | None) -> float | None:
    """A fetch's rate: its own and the Stager's limit for every fetch, the lower of those set."""
    rates = [r for r in (own, every) if r is not None]
    return min(rates) if rates else None


def shown(key: str | None) -> str:
    return "-" if key is None else key[:12] + "..."


Key = tuple[str, ...]  # what a hold waits for: ("m", digest) or ("c", sha256, str(index))


def chunk_key(sha256: str, index: int) -> Key:
    return ("c", sha256, str(index))


def manifest_key(digest: str) -> Key:
    return ("m", digest)


# -- the Stager: a thread, a loop, a context --------------------------------------------------------


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


def settle(future: concurrent.futures.Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless it is settled already (the caller may cancel it meanwhile)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)


def handshake_failure(kind: int, value: int) -> str | None:
    """What a link's monitor event says went wrong with the CURVE handshake, or None."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"refused this key at the handshake (ZAP status {value}): is it in the pool's allow-list?"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return HANDSHAKE_REASONS.get(value, f"CURVE handshake failed (ZMTP error {value:#x})")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "the handshake failed: it closed the connection (another key, or no CURVE?)"
    return None
