"""Reading a message of very many frames (protocol/sockets.py, staging/wire.py) on real sockets:
one read takes a bounded slice of it and the next read goes on where it stopped, so the loop around
the reader runs between; nothing of the message or of the ones after it is lost or reordered."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from dpool.protocol import sockets
from dpool.protocol.peerbudget import wire_size
from dpool.staging import wire

FRAMES = 20_000


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    # Every look at the clock finds the time spent: each read takes DRAIN_CHECK frames and stops.
    monkeypatch.setattr(sockets, "DRAIN_S", 0.0)
    monkeypatch.setattr(sockets, "DRAIN_CHECK", 1000)
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield router, dealer
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()


def send_flood_then_hello(router: zmq.Socket[Any], dealer: zmq.Socket[Any]) -> None:
    dealer.send_multipart([b"head", *([b""] * FRAMES)])
    dealer.send_multipart([b"hello", b"world"])
    assert router.poll(10_000)


def test_a_message_of_many_frames_is_read_over_several_reads(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, dealer = pair
    send_flood_then_hello(router, dealer)
    reads: list[list[sockets.Incoming]] = []
    while sum(len(r) for r in reads) < 2:
        assert router.getsockopt(zmq.EVENTS) & zmq.POLLIN  # a part-read message keeps the socket readable
        reads.append(list(sockets.pending_from(router, 500, frames=2)))
        assert len(reads) < 100
    assert len(reads) == FRAMES // 1000 + 1  # about a thousand frames a read, then the message's end
    assert all(r == [] for r in reads[:-1])
    flood, hello = reads[-1]
    assert flood.frames[1:] == [b"head", b""]  # the routing id and `frames` + 1 kept, which decoding refuses
    assert flood.wire == wire_size(len(b"head"), False) + FRAMES * wire_size(0, False)  # every frame counted
    assert hello.frames[1:] == [b"hello", b"world"] and hello.frames[0] == flood.frames[0]
    assert sockets.unfinished(router) is None


def test_the_data_channel_reads_a_message_of_many_frames_over_several_reads(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, dealer = pair
    send_flood_then_hello(router, dealer)
    got: list[wire.Incoming] = []
    reads = 0
    while len(got) < 2:
        got += wire.pending(router, 500, keep=3, metadata=False)
        reads += 1
        assert reads < 100
    assert reads == FRAMES // 1000 + 1
    flood, hello = got
    assert flood.cut and [f.bytes for f in flood.frames[1:]] == [b"head", b""]
    assert not hello.cut and [f.bytes for f in hello.frames[1:]] == [b"hello", b"world"]


def test_a_message_that_ends_where_a_read_would_stop_is_read_whole(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    """1,000 frames after the routing id, reads of 1,000: the message ends where the read looks at
    the clock. It was parked as unfinished, with nothing left to read, so no poll woke for it."""
    router, dealer = pair
    dealer.send_multipart([b"head", *([b""] * 999)])
    assert router.poll(10_000)
    (got,) = list(sockets.pending_from(router, 500))
    assert got.frames[1:] == [b"head", b""] and sockets.unfinished(router) is None


def test_short_messages_are_read_whole_and_in_order(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]]) -> None:
    router, dealer = pair
    for i in range(3):
        dealer.send_multipart([b"n", str(i).encode()])
    assert router.poll(10_000)
    got: list[sockets.Incoming] = []
    for _ in range(100):
        got += sockets.pending_from(router, 500)
        if len(got) == 3:
            break
        router.poll(1000)
    assert [g.frames[2] for g in got] == [b"0", b"1", b"2"]
