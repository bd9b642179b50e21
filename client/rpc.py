"""dpctl's one way to the pool: a request, its reply, or a clear reason why not."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import zmq

from dpool.protocol import messages as m
from dpool.protocol.messages import Message, ProtocolError
from dpool.protocol.security import ClientKeys, curve_client

T = TypeVar("T", bound=Message)


class Unreachable(Exception):
    """No answer from the coordinator within the timeout (dpctl exits 3)."""


class RemoteError(Exception):
    """The coordinator answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Client:
    def __init__(self, addr: str, timeout_s: float, keys: ClientKeys | None = None) -> None:
        self.addr, self.timeout_s, self.keys = addr, timeout_s, keys
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        if keys is not None:
            curve_client(self._sock, keys)
        self._sock.connect(addr)
        self._ids = itertools.count(1)

    def call(self, request: Message, expect: type[T]) -> T:
        msg_id = next(self._ids)
        self._sock.send_multipart(request.to_frames(msg_id))
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                break
            frames = self._sock.recv_multipart()
            try:
                reply, reply_id = m.decode(frames)
            except ProtocolError as e:
                raise RemoteError(str(e.code), f"unreadable reply from {self.addr}: {e.message}") from None
            if reply_id != msg_id:
                continue  # a late answer to an earlier request
            if isinstance(reply, m.Error):
                raise RemoteError(reply.code, reply.message)
            if not isinstance(reply, expect):
                raise RemoteError("unexpected", f"expected {expect.TYPE} from {self.addr}, got {reply.TYPE}")
            return reply
        hint = f"are {self.keys.source} and its coordinator.key this pool's, and is its public key in the coordinator's allowed/?" if self.keys else "does the pool use CURVE keys? then pass --keys DIR or set $DPOOL_KEYS"
        raise Unreachable(f"no answer from the coordinator at {self.addr} within {self.timeout_s:g}s (is `dpd run --serve` running there? {hint})")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

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
