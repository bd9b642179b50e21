"""dpctl's one way to the pool: a request, its reply, or a clear reason why not."""

from __future__ import annotations

import collections
import itertools
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import tenacity
import zmq

from dpool.protocol import messages as m
from dpool.protocol.messages import Message, ProtocolError
from dpool.protocol.payloads import JobStatus
from dpool.protocol.security import ClientKeys, curve_client

T = TypeVar("T", bound=Message)
R = TypeVar("R")
RIDE_OUT_S = 120.0  # how long a follower (watch, logs -f, submit --follow) waits for a coordinator to come back
RETRY_WAIT_MAX_S = 5.0  # the longest pause between two tries, before jitter


class Unreachable(Exception):
    """No answer from the coordinator within the timeout (dpctl exits 3)."""


class RemoteError(Exception):
    """The coordinator answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _release(sock: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # linger 0, then destroy, not term: nothing left in this context can make dpctl's exit wait (a
    # refused CURVE handshake leaves libzmq reconnecting in the background)
    sock.close(linger=0)
    ctx.destroy(linger=0)


class Client:
    def __init__(self, addr: str, timeout_s: float, keys: ClientKeys | None = None) -> None:
        self.addr, self.timeout_s, self.keys = addr, timeout_s, keys
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_HEADER_BYTES + m.REPLY_BODY_BYTES)  # a reply that lists rows may be larger than a request
        # a send waits for the connection's queue at most this long: libzmq drops the queue when
        # the coordinator refuses the CURVE handshake, and a send would otherwise wait forever
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        if keys is not None:
            curve_client(self._sock, keys)
        self._sock.connect(addr)
        self._ids = itertools.count(1)
        # Closes the socket, then the context, once: on close() or when the client is dropped
        # unclosed. Left to pyzmq, a client freed in a reference cycle could have its context's
        # __del__ run term() while its socket was still open, and wait forever in whichever thread
        # ran the collection (a dpd's event loop among them).
        self._release = weakref.finalize(self, _release, self._sock, self._ctx)

    def call(self, request: Message, expect: type[T], timeout_s: float | None = None) -> T:
        """The reply to `request`; `timeout_s` (default: the client's) bounds the wait."""
        msg_id = self._send(request)
        return self._reply(msg_id, expect, {msg_id: None}, timeout_s or self.timeout_s)

    def stream(self, requests: Iterable[Message], expect: type[T], window: int = 4, timeout_s: float | None = None) -> Iterator[T]:
        """The replies to `requests`, in their order, keeping up to `window` of them in flight (a
        round trip per request would leave the link idle). Each reply must come within `timeout_s`
        (default: the client's)."""
        todo = iter(requests)
        in_flight: collections.deque[int] = collections.deque()
        early: dict[int, Message | None] = {}  # replies that came before the one awaited

        def send_next() -> None:
            request = next(todo, None)
            if request is not None:
                msg_id = self._send(request)
                in_flight.append(msg_id)
                early[msg_id] = None

        for _ in range(window):
            send_next()
        while in_flight:
            msg_id = in_flight.popleft()
            yield self._reply(msg_id, expect, early, timeout_s or self.timeout_s)
            send_next()

    def _send(self, request: Message) -> int:
        msg_id = next(self._ids)
        try:
            self._sock.send_multipart(request.to_frames(msg_id))
        except zmq.Again:
            raise self._unreachable(self.timeout_s) from None
        return msg_id

    def _reply(self, msg_id: int, expect: type[T], waiting: dict[int, Message | None], timeout_s: float) -> T:
        """Wait for the reply to `msg_id`, keeping replies to the other ids in `waiting`."""
        deadline = time.monotonic() + timeout_s
        while (reply := waiting.get(msg_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise self._unreachable(timeout_s)
            frames = self._sock.recv_multipart()
            try:
                got, got_id = m.decode(frames, m.TO_CLIENT)
            except ProtocolError as e:
                raise RemoteError(str(e.code), f"unreadable reply from {self.addr}: {e.message}") from None
            if got_id in waiting:
                waiting[got_id] = got  # else a late answer to an earlier request
        del waiting[msg_id]
        if isinstance(reply, m.Error):
            raise RemoteError(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise RemoteError("unexpected", f"expected {expect.TYPE} from {self.addr}, got {reply.TYPE}")
        return reply

    def _unreachable(self, timeout_s: float) -> Unreachable:
        hint = f"are {self.keys.source} and its coordinator.key this pool's, and is its public key in the coordinator's allowed/?" if self.keys else "does the pool use CURVE keys? then pass --keys DIR or set $DPOOL_KEYS"
        return Unreachable(f"no answer from the coordinator at {self.addr} within {timeout_s:g}s (is `dpd run --serve` running there? {hint})")

    def close(self) -> None:
        self._release()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pages(fetch: Callable[[int], Any]) -> Iterator[Any]:
    """Every page of a paged query (metrics, events, samples, logs)."""
    after = 0
    while True:
        reply = fetch(after)
        yield reply
        if not reply.more:
            return
        after = reply.cursor


def all_jobs(c: Client, page: int = m.PAGE_LIMIT) -> list[JobStatus]:
    """Every job the pool holds, newest first, `page` jobs a call (Status with `limit`): the
    coordinator keeps only its live and most recently finished jobs in memory, the rest in its
    database, and a page is cut from both in submission order."""
    jobs: list[JobStatus] = []
    before: str | None = None
    while True:
        reply = c.call(m.Status(limit=page, before=before), m.StatusReply)
        jobs += reply.jobs
        if not reply.more or not reply.jobs:
            return jobs
        before = reply.jobs[-1].id


def ride_out(poll: Callable[[], R], *, for_s: float = RIDE_OUT_S, on_retry: Callable[[Unreachable, float], None] | None = None) -> R:
    """`poll()`, tried again while the coordinator does not answer (it restarts; training goes on
    without it): bounded by `for_s` seconds, with jittered exponential pauses (so many followers
    do not come back in step). `on_retry(error, seconds_since_the_first_miss)` is told before
    each pause. Raises the last Unreachable when the coordinator stays away."""
    started = time.monotonic()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        if on_retry is not None and isinstance(error, Unreachable):
            on_retry(error, time.monotonic() - started)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(Unreachable),
        stop=tenacity.stop_after_delay(for_s),
        wait=tenacity.wait_random_exponential(multiplier=0.5, max=RETRY_WAIT_MAX_S),
        before_sleep=before_sleep,
        reraise=True,
    )
    return retrying(poll)


class RideOut:
    """Polls that ride out a coordinator restart (`ride_out`) once the coordinator has answered
    one of them (a wrong address still fails within --timeout). By default it says so on stderr,
    once when the coordinator stops answering and once when it answers again; `on_retry` replaces
    that (a live view shows it in place)."""

    def __init__(self, c: Client, who: str = "dpctl", *, reached: bool = False, on_retry: Callable[[Unreachable, float], None] | None = None) -> None:
        self.addr, self.who, self.reached, self.on_retry = c.addr, who, reached, on_retry
        self.missing = False

    def __call__(self, poll: Callable[[], R]) -> R:
        if not self.reached:
            result = poll()
            self.reached = True
            return result
        result = ride_out(poll, on_retry=self._missed)
        if self.missing:
            print(f"{self.who}: the coordinator at {self.addr} answers again", file=sys.stderr, flush=True)
            self.missing = False
        return result

    def _missed(self, e: Unreachable, waited: float) -> None:
        if self.on_retry is not None:
            self.on_retry(e, waited)
        elif not self.missing:
            print(f"{self.who}: {e}; retrying for up to {RIDE_OUT_S:.0f}s (training goes on without it)", file=sys.stderr, flush=True)
            self.missing = True
