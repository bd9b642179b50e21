"""A node that is a test's own DEALER: it registers, heartbeats, takes a job's group as a dpd would
(answers group.prepare, reports its worker started and up) and then sends whatever the test makes
its "trainer" report, valid messages of the real protocol. Used by test_bounded_replies.py and
test_peer_budget.py: reports a real trainer would never send (a step of 115 days, a rate that
overflows, samples of a megabyte each) reach a real coordinator this way.

One thread owns the socket (ZeroMQ sockets are not thread-safe): it heartbeats, sends what the
test queued and files what the coordinator sent, which the test takes with `next`."""

from __future__ import annotations

import queue
import threading
import time
from typing import TypeVar

import zmq

from dpool.protocol import messages as m
from dpool.protocol.payloads import AliveWorker, NodeInfo

T = TypeVar("T", bound=m.Message)
BEAT_S = 0.05  # well inside the 0.6 s expiry of a test coordinator (0.1 s x 6)


class FakeRank0(threading.Thread):
    """Registered as `name` with one slot; `take(job)` answers the group of `job` and returns its
    generation, with this node as rank 0."""

    def __init__(self, addr: str, name: str = "fake") -> None:
        super().__init__(daemon=True)
        self.addr, self.name = addr, name
        self.outbox: queue.Queue[list[bytes]] = queue.Queue()
        self.inbox: queue.Queue[m.Message] = queue.Queue()
        self.stopping = threading.Event()
        self.job, self.generation, self.slot = "", 0, 0
        self.running = False  # listed in heartbeats once its worker started
        self.stepping = False  # a step with every heartbeat (`keep_stepping`), so the job never stalls
        self.step = 0
        self.start()
        reply = self.next(m.NodeRegistered)
        assert isinstance(reply, m.NodeRegistered), reply

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.addr)
        sock.send_multipart(m.NodeRegister(name=self.name, incarnation=f"inc-{self.name}", info=NodeInfo(slots=1, advertise="127.0.0.1")).to_frames(1))
        next_beat = 0.0
        try:
            while not self.stopping.is_set():
                if time.monotonic() >= next_beat:
                    workers = [AliveWorker(job=self.job, generation=self.generation, slot=self.slot)] if self.running else []
                    sock.send_multipart(m.NodeHeartbeat(workers=workers).to_frames())
                    if self.stepping:
                        self.step += 1
                        sock.send_multipart(m.NodeProgress(job=self.job, generation=self.generation, rank=0, step=self.step, loss=2.0, tokens=64, seconds=BEAT_S).to_frames())
                    next_beat = time.monotonic() + BEAT_S
                while True:
                    try:
                        sock.send_multipart(self.outbox.get_nowait())
                    except queue.Empty:
                        break
                if sock.poll(10):
                    while sock.poll(0):
                        msg, _ = m.decode(sock.recv_multipart(), m.TO_NODE)
                        if not isinstance(msg, m.CoordHeartbeat):
                            self.inbox.put(msg)
        finally:
            while not self.outbox.empty():  # a last node.bye
                sock.send_multipart(self.outbox.get_nowait())
            sock.close(linger=1000)
            ctx.term()

    def send(self, msg: m.Message) -> None:
        self.outbox.put(msg.to_frames())

    def next(self, kind: type[T], timeout: float = 20.0) -> T:
        """The next message of type `kind` the coordinator sent (others are skipped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.inbox.get(timeout=left)
            except queue.Empty:
                break
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.TYPE} within {timeout}s")

    def take(self, job: str, timeout: float = 20.0) -> int:
        prepare = self.next(m.GroupPrepare, timeout)
        assert prepare.job == job, prepare
        self.send(m.NodePrepared(job=job, generation=prepare.generation, host="127.0.0.1", ports=[41000 + s for s in prepare.slots]))
        start = self.next(m.GroupStart, timeout)
        (rank,) = start.ranks
        self.job, self.generation, self.slot = job, start.generation, rank.slot
        self.send(m.NodeWorkerStarted(job=job, generation=start.generation, rank=0, slot=rank.slot, pid=4242))
        self.running = True
        self.send(m.NodeWorkerHello(job=job, generation=start.generation, rank=0, pid=4242, resume_step=0))
        return start.generation

    def progress(self, step: int, *, tokens: int = 64, seconds: float = 0.01, loss: float = 2.0) -> None:
        self.step = step
        self.send(m.NodeProgress(job=self.job, generation=self.generation, rank=0, step=step, loss=loss, tokens=tokens, seconds=seconds))

    def keep_stepping(self) -> None:
        """From now on a step with every heartbeat, from the step after the last one reported."""
        self.stepping = True

    def report(self, msg: m.Message) -> None:
        """Any report of this node's rank 0 (a metric, a sample)."""
        self.send(msg)

    def close(self, bye: bool = True) -> None:
        if bye:
            self.send(m.NodeBye())
        self.stopping.set()
        self.join(5)
