"""Reading ZeroMQ sockets the one right way, shared by every receiver in dpool.

ZeroMQ's file descriptor is edge-triggered: after a wake-up a reader must take every message that
is waiting (until EAGAIN), or what arrived meanwhile sits there until the next message wakes it.

A message is read frame by frame, and only the first `frames + 1` are kept: a peer that sends a
million frames in one message costs the reader a loop, not a list of a million. (ZeroMQ itself
still assembles the whole message before the reader sees it: it caps the bytes of each frame, set
by `zmq.MAXMSGSIZE`, not their number; protocol/peerbudget.py bounds the bytes a peer may have in
flight, with what `pending_from` says of each message: its connection and its bytes on the wire.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import zmq

from dpool.protocol.messages import MAX_FRAMES
from dpool.protocol.peerbudget import wire_size

HWM = 1000  # messages queued per peer, each way, on a socket that serves many peers (see README)


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


def _read(sock: zmq.Socket[Any], limit: int | None, frames: int | None, *, users: bool, sources: bool = False, curve: bool = False) -> Iterator[tuple[list[bytes], str | None, int | None, int]]:
    keep = None if frames is None else frames + 1
    taken = 0
    while limit is None or taken < limit:
        user, fd, size = None, None, 0
        try:
            if users or sources:
                first = sock.recv(flags=zmq.NOBLOCK, copy=False)
                if users:
                    with contextlib.suppress(zmq.ZMQError):  # EINVAL: the connection has no User-Id
                        user = str(first.get("User-Id"))
                if sources:
                    with contextlib.suppress(zmq.ZMQError):
                        fd = int(first.get(zmq.SRCFD))
                got = [first.bytes]
            else:
                got = [sock.recv(flags=zmq.NOBLOCK)]
        except zmq.Again:
            return
        while sock.getsockopt(zmq.RCVMORE):
            frame = sock.recv()  # the rest of a message is there once its first frame is
            if sources:
                size += wire_size(len(frame), curve)
            if keep is None or len(got) < keep:
                got.append(frame)
        taken += 1
        yield got, user, fd, size
