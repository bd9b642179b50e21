"""Reading ZeroMQ sockets the one right way, shared by every receiver in dpool.

ZeroMQ's file descriptor is edge-triggered: after a wake-up a reader must take every message that
is waiting (until EAGAIN), or what arrived meanwhile sits there until the next message wakes it.

A message is read frame by frame, and only the first `frames + 1` are kept: a peer that sends a
million frames in one message costs the reader a loop, not a list of a million. That loop takes
seconds (a few microseconds a frame), so one call reads a message's frames for at most `DRAIN_S`
and keeps the rest of it for the socket's next read: the loop around it, its timers and its other
sockets run meanwhile (a dpd's own agent heartbeats while its coordinator reads). (ZeroMQ itself
still assembles the whole message before the reader sees it: it caps the bytes of each frame, set
by `zmq.MAXMSGSIZE`, not their number; protocol/peerbudget.py bounds the bytes a peer may have in
flight, with what `pending_from` says of each message: its connection and its bytes on the wire.)
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from dpool.protocol.messages import MAX_FRAMES
from dpool.protocol.peerbudget import wire_size

HWM = 1000  # messages queued per peer, each way, on a socket that serves many peers (see README)
DRAIN_S = 0.01  # the longest one read spends on the frames of one message; the rest waits for the next read
DRAIN_CHECK = 4096  # frames read between two looks at the clock

# A socket -> the message a read left part-read (its first frame taken, its rest not). Weak: a
# socket closed and dropped takes its entry with it.
_unfinished: weakref.WeakKeyDictionary[zmq.Socket[Any], Any] = weakref.WeakKeyDictionary()


def unfinished(sock: zmq.Socket[Any]) -> Any | None:
    """The message the previous read of `sock` left part-read (see `read_rest`), taken; None when
    the previous read ended on a message's end."""
    return _unfinished.pop(sock, None)


def read_rest(sock: zmq.Socket[Any], message: Any, take: Callable[[Any], None], *, copy: bool = True) -> bool:
    """Reads the frames after the first of the message being read on `sock`, each handed to `take`.
    False when `DRAIN_S` passed first: `message` is kept for the socket's next read (`unfinished`),
    whose caller goes on with it. ZeroMQ says POLLIN while a message's frames remain, so a loop that
    polls before it reads comes back at once."""
    until = time.monotonic() + DRAIN_S
    n = 0
    while sock.getsockopt(zmq.RCVMORE):  # (kept only with frames left: a whole message parked would not wake the poll)
        if n and n % DRAIN_CHECK == 0 and time.monotonic() > until:
            _unfinished[sock] = message
            return False
        take(sock.recv(copy=copy))  # the rest of a message is there once its first frame is
        n += 1
    return True


def pending(sock: zmq.Socket[Any], limit: int | None = None, *, frames: int | None = MAX_FRAMES) -> Iterator[list[bytes]]:
    """The multipart messages waiting on `sock`, without blocking (at most `limit` of them). A
    message of more than `frames` frames (a dpool message's two, plus the routing id on a ROUTER)
    comes cut to one frame more, which decoding refuses as too many; None: keep every frame (ZAP
    requests, which come from libzmq itself)."""
    for got, *_ in _read(sock, limit, frames, users=False):
        yield got


def pending_with_users(sock: zmq.Socket[Any], limit: int | None = None, *, frames: int | None = MAX_FRAMES, users: bool = True) -> Iterator[tuple[list[bytes], str | None]]:
    """As `pending`, each message with the User-Id the ZAP handler gave its connection ("node:mac1",
    protocol/security.py); None for a connection without one. `users` False: None for every message,
    without asking (on a socket without CURVE the question costs an exception per message)."""
    for got, user, _, _ in _read(sock, limit, frames, users=users):
        yield got, user


class Incoming(NamedTuple):
    frames: list[bytes]  # the routing id, then the first `frames` of the message (one more when cut)
    user: str | None  # the connection's User-Id (None without CURVE roles)
    fd: int | None  # the connection's file descriptor (ZMQ_SRCFD; None when not known)
    wire: int  # the message's bytes as they travelled (every frame, kept or not; not the routing id)


def pending_from(sock: zmq.Socket[Any], limit: int | None = None, *, frames: int | None = MAX_FRAMES, users: bool = True, curve: bool = False) -> Iterator[Incoming]:
    """As `pending_with_users` on a ROUTER, each message with the connection it came by and its size
    on the wire (`curve`: the connection uses CURVE), which protocol/peerbudget.py counts."""
    for got, user, fd, size in _read(sock, limit, frames, users=users, sources=True, curve=curve):
        yield Incoming(got, user, fd, size)


@dataclass(slots=True)
class _Reading:
    """One message as it is read: the frames kept, its connection, its bytes on the wire."""

    got: list[bytes]
    keep: int | None
    user: str | None = None
    fd: int | None = None
    size: int = 0
    curve: bool | None = None  # None: the wire size is not counted

    def take(self, frame: bytes) -> None:
        if self.curve is not None:
            self.size += wire_size(len(frame), self.curve)
        if self.keep is None or len(self.got) < self.keep:
            self.got.append(frame)


def _read(sock: zmq.Socket[Any], limit: int | None, frames: int | None, *, users: bool, sources: bool = False, curve: bool = False) -> Iterator[tuple[list[bytes], str | None, int | None, int]]:
    keep = None if frames is None else frames + 1
    taken = 0
    while limit is None or taken < limit:
        r = unfinished(sock)
        if r is None:
            r = _Reading([], keep, curve=curve if sources else None)
            try:
                if users or sources:
                    first = sock.recv(flags=zmq.NOBLOCK, copy=False)
                    if users:
                        with contextlib.suppress(zmq.ZMQError):  # EINVAL: the connection has no User-Id
                            r.user = str(first.get("User-Id"))
                    if sources:
                        with contextlib.suppress(zmq.ZMQError):
                            r.fd = int(first.get(zmq.SRCFD))
                    r.got.append(first.bytes)
                else:
                    r.got.append(sock.recv(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
        if not read_rest(sock, r, r.take):
            return
        taken += 1
        yield r.got, r.user, r.fd, r.size
