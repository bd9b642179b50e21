"""A connected peer cannot grow a dpd without bound (issue 21, part 4): what is queued for one peer,
either way, is bounded in bytes, and a peer over its budget is dropped with a log line naming it.

- A client that never reads: 256 requests for a sample page of 1 MiB each once grew the
  coordinator by 263 MiB, which stayed after the client left (the per-peer limit counted messages,
  1,000 of them, not bytes).
- A peer that sends a multipart message and never its last frame (256 parts of 1 MiB) grew it by
  257 MiB until it left: libzmq holds an unfinished message whole, and ZMQ_MAXMSGSIZE caps each
  frame, not the message. The peer here writes ZMTP itself (tests/zmtp.py): pyzmq never sends an
  unfinished message.

A real `dpd run --serve` process (its own node drained, so the job runs on this test's fake node),
its resident memory sampled while the attack runs; meanwhile and afterwards every other client's
`status` is readable.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq
from conftest import Processes, wait_for
from fakenode import FakeRank0
from peers import PeakRss, Peer, Running, Served, raw, rss_mib
from zmtp import RawPeer

from dpool.client.keys import init_keys
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import SampleRow
from dpool.protocol.peerbudget import Conn, PeerBudget, tcp_counts
from dpool.protocol.security import client_keys, server_keys

MIB = 1 << 20
PAGE_TEXT = MIB - 1024  # one sample of about 1 MiB: a page of one is a 1 MiB reply
ATTACK = 256  # requests, or parts: 256 MiB, as the attack run found it


class Pool:
    def __init__(self, served: Served, node: FakeRank0, job: str) -> None:
        self.served, self.node, self.job = served, node, job

    def status_readable(self) -> None:
        jobs = self.served.call(m.Status(), m.StatusReply, 10.0).jobs
        assert any(j.id == self.job and j.state == "running" for j in jobs), jobs

    def dropped(self) -> list[dict[str, Any]]:
        """The `peer.dropped` lines of the dpd's log (JSON lines)."""
        lines = self.served.log.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if '"peer.dropped"' in line]


class Others(threading.Thread):
    """Another client asking `status` over and over while an attack runs: every answer is counted,
    and any failure kept."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(daemon=True)
        self.pool, self.answered = pool, 0
        self.failures: list[str] = []
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.pool.status_readable()
                self.answered += 1
            except Exception as e:  # kept for the assertion in stop()
                self.failures.append(repr(e))

    def stop(self) -> None:
        self.stopping.set()
        self.join(30)
        assert self.answered > 0 and not self.failures, (self.answered, self.failures[:3])


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    root = tmp_path_factory.mktemp("budget")
    procs = Processes(str(root))
    node = None
    try:
        served = Served(procs, root)
        served.call(m.Drain(node=served.name), m.DrainReply)  # the job goes to the fake node
        node = FakeRank0(served.addr)
        doc = parse_job({"name": "pages", "workers": {"min": 1, "max": 1}, "train": {"steps": 100_000, "warmup_steps": 1}}).to_dict()
        job = served.call(m.Submit(job=doc, source="pages.toml"), m.Submitted).job_id
        generation = node.take(job)
        node.progress(1)
        node.report(m.NodeSample(job=job, generation=generation, row=SampleRow(step=1, text="x" * PAGE_TEXT)))
        wait_for("the sample stored", lambda: served.call(m.Samples(job=job, limit=1), m.SamplesReply).rows, 20, every=0.1)
        node.keep_stepping()
        yield Pool(served, node, job)
    finally:
        if node is not None:
            node.close()
        procs.stop_all()


def settle(pid: int, seconds: float = 1.0) -> float:
    """The process's resident memory once it has stopped changing for a while (MiB)."""
    last, since = rss_mib(pid), time.monotonic()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and time.monotonic() - since < seconds:
        time.sleep(0.1)
        now = rss_mib(pid)
        if abs(now - last) > 1:
            last, since = now, time.monotonic()
    return last


def test_a_client_that_never_reads_is_dropped_and_its_memory_comes_back(pool: Pool) -> None:
    pid = pool.served.proc.pid
    base = settle(pid)
    watch = PeakRss(pid)
    ctx = zmq.Context()
    lazy = ctx.socket(zmq.DEALER)
    lazy.setsockopt(zmq.RCVHWM, 1)
    lazy.setsockopt(zmq.RCVBUF, 4096)  # it takes (almost) nothing off the wire
    lazy.setsockopt(zmq.LINGER, 0)
    lazy.connect(pool.served.addr)
    others = Others(pool)  # answered while the attack runs
    try:
        for i in range(ATTACK):
            lazy.send_multipart(m.Samples(job=pool.job, limit=1).to_frames(i + 1))
        wait_for("the reader dropped", lambda: pool.dropped() or rss_mib(pid) - base > 200, 30, every=0.1)
    finally:
        lazy.close(linger=0)
        ctx.term()
        others.stop()
    grown = watch.stop()
    after = settle(pid) - base
    print(f"{ATTACK} unread 1 MiB replies: dpd peak RSS +{grown:.1f} MiB (from {base:.1f}), +{after:.1f} MiB once the reader left")
    pool.status_readable()
    (line,) = pool.dropped()
    assert line["direction"] == "outbound" and line["peer"].startswith("127.0.0.1:") and line["bytes"] > line["budget"], line
    # The budget (32 MiB), plus the replies of one batch of requests in the making: 274 MiB before.
    assert grown < 80, f"peak +{grown:.1f} MiB"
    # 249 MiB stayed before. The allocator keeps some of what the budget held (+17 MiB seen in a
    # suite on a loaded machine, 5-12 MiB alone); what stays must stay under the budget itself.
    assert after < 32, f"+{after:.1f} MiB stayed"


def test_an_unfinished_multipart_message_is_refused(pool: Pool) -> None:
    pid = pool.served.proc.pid
    host, port = pool.served.addr.removeprefix("tcp://").rsplit(":", 1)
    before = len(pool.dropped())
    base = settle(pid)
    watch = PeakRss(pid)
    raw = RawPeer(host, int(port))
    me = "{}:{}".format(*raw.sock.getsockname())
    others = Others(pool)  # answered while the attack runs
    try:
        sent = raw.send_parts(ATTACK, MIB)
        closed = raw.closed_by_peer()
    finally:
        raw.close()
        others.stop()
    grown = watch.stop()
    after = settle(pid) - base
    print(f"{sent / MIB:.0f} MiB of an unfinished message: dpd peak RSS +{grown:.1f} MiB (from {base:.1f}), +{after:.1f} MiB after")
    pool.status_readable()
    assert closed, "the coordinator kept the connection"
    (line,) = pool.dropped()[before:]
    assert line["direction"] == "inbound" and line["peer"] == me, line  # names the peer by its address
    # The budget (32 MiB), plus what a fast sender adds before the coordinator's guard next looks
    # (every 5 ms; longer on a loaded machine): 256 MiB before, and more with more parts.
    assert sent < ATTACK * MIB / 2 and grown < 96, f"{sent / MIB:.0f} MiB sent, peak +{grown:.1f} MiB"
    # 252 MiB stayed before the budget. Since then about one run in two gives every byte back and
    # the others keep 16-28 MiB for good (measured 2026-12-04 at f08057c and at this commit alike,
    # on an idle machine: not the allocator's timing, the trim runs for 10 s); what holds it is not
    # known yet. The bound is above that, far below the attack.
    assert after < 40, f"+{after:.1f} MiB stayed"


# -- the counts the budget is made of ----------------------------------------------------------------


@pytest.mark.parametrize("curve", [False, True], ids=["null", "curve"])
def test_bytes_in_flight_are_counted_exactly_with_and_without_curve(tmp_path: Path, curve: bool) -> None:
    """After 600 messages of every size class (a 1- and an 8-byte ZMTP length, with CURVE's box
    or not), what the budget counts as in flight either way is the handshake's few hundred bytes:
    the count does not drift with the traffic, so a long-lived node is never taken for an attacker."""
    if curve:
        init_keys(tmp_path / "keys", nodes=[], clients=[])
    coordinator = Running(tmp_path, keys=server_keys(tmp_path / "keys") if curve else None)
    peer = Peer(coordinator.addr, keys=client_keys(tmp_path / "keys", "client") if curve else None)
    try:
        for i in range(600):
            size = (0, 100, 222, 300, 5000, 70_000)[i % 6]  # around 255 bytes with and without the box
            reply = peer.ask(raw("status", {"job": "x" * size or "y"}, 10 + i))
            assert isinstance(reply, m.Error) and reply.code in ("not_found", "bad_request"), reply
        budget = coordinator.coord.peers
        assert budget is not None
        (fd,) = {fd for fd in budget.routes.values()}
        conn = budget.conns[fd]

        def in_flight() -> tuple[int, int]:
            received, taken = tcp_counts(fd) or (0, 0)
            return received - (budget.read_bytes[fd] - conn.read0), budget.sent_bytes[fd] - conn.sent0 - taken

        wait_for("the last reply acknowledged (TCP may delay its ACK)", lambda: in_flight()[1] <= 0, 5, every=0.01)
        inbound, outbound = in_flight()
        print(f"{'curve' if curve else 'null'}: in flight after 600 requests: in {inbound} bytes, out {outbound} bytes")
        # The handshake's bytes (NULL: 107 each way; CURVE: about 560 in, 300 out) and no more: one
        # byte miscounted per frame would be 1,200 bytes here.
        assert 0 <= inbound < 1024 and -1024 < outbound <= 0
    finally:
        peer.close()
        coordinator.stop()


def test_only_a_dropped_connections_own_routing_ids_are_refused() -> None:
    """A dropped connection's descriptor can be given to the next connection before the socket's
    monitor says so: that peer is served, and only the dropped one's messages are refused (another
    client's `status` once timed out behind a dropped reader this way)."""
    ctx: zmq.Context[bytes] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    budget = PeerBudget(ctx, router, structlog.get_logger(), curve=False)
    try:
        budget.conns[40] = Conn(40, "127.0.0.1:5555", read0=0, sent0=0, dropped=True, rids={b"old"})
        assert not budget.read(b"old", 40, 100)  # the dropped peer's request: not served
        assert budget.read(b"new", 40, 100)  # the next connection on descriptor 40: served
        sent: list[list[bytes]] = []

        class Raw:
            def send_multipart(self, frames: list[bytes], flags: int = 0, copy: bool = True) -> None:
                sent.append(frames)

        assert not budget.send(Raw(), [b"old", b"h", b"b"])  # type: ignore[arg-type]
        assert budget.send(Raw(), [b"new", b"h", b"b"])  # type: ignore[arg-type]
        assert sent == [[b"new", b"h", b"b"]]
    finally:
        budget.close()
        router.close(linger=0)
        ctx.term()


def test_messages_read_before_the_accept_event_count_for_that_connection() -> None:
    """The loop can read a new connection's first messages before the socket monitor's accept
    event reaches the guard's thread: they are that connection's bytes (counting them as an
    earlier one's once showed 5,880 bytes "in flight" that the coordinator had read), and the
    next connection that gets the same descriptor starts where this one ended."""
    ctx: zmq.Context[bytes] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    budget = PeerBudget(ctx, router, structlog.get_logger(), curve=False)
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    fd = server.fileno()

    def event(kind: int) -> list[bytes]:  # as libzmq's monitor frames it: event, value; endpoint
        return [struct.pack("=HI", kind, fd), b"tcp://127.0.0.1:1"]

    try:
        assert budget.read(b"first", fd, 5_880)  # read before the accept was seen
        budget._event(event(zmq.EVENT_ACCEPTED))
        assert budget.read(b"first", fd, 120)
        assert budget.read_bytes[fd] - budget.conns[fd].read0 == 6_000  # all of it this connection's
        budget._event(event(zmq.EVENT_DISCONNECTED))
        budget._event(event(zmq.EVENT_CLOSED))  # its second event: changes nothing
        assert budget.read(b"next", fd, 70)  # the next connection on the descriptor, read before its accept
        budget._event(event(zmq.EVENT_ACCEPTED))
        assert budget.read_bytes[fd] - budget.conns[fd].read0 == 70
    finally:
        for s in (client, server, listener):
            s.close()
        budget.close()
        router.close(linger=0)
        ctx.term()
