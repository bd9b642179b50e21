"""Ten thousand hostile frames against a real coordinator, then a job trained to success.

Half come from an anonymous peer, half from a peer registered as a node that plays along with what
the coordinator asks of a node (group.prepare, group.start, group.stop: read `daemon/agent.py`), so
they reach the pool's policy with a registered name, real job ids and generations. The frames are
random bytes, valid messages mutated (bytes flipped, cut, fields of the wrong type or out of bound,
headers of other types), and schema-driven: valid messages of every type made from the protocol's
own types at their bounds. Afterwards no dpd process has died, the coordinator's memory stayed
bounded, nothing was logged as a traceback, and the pool runs a small job to success.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import Processes
from peers import PeakRss, Peer, Served
from wire_samples import sample

from dpool.protocol import messages as m
from dpool.protocol.payloads import AliveWorker, NodeInfo

FRAMES = 10_000  # in all: half anonymous, half from the fake node
CLIENT_TYPES = sorted(m.FROM_CLIENT)
NODE_TYPES = sorted(m.FROM_NODE)


class Fuzz:
    """Hostile frames, reproducibly from a seed. `known` holds ids a registered peer should hit."""

    def __init__(self, seed: int, types: list[m.MsgType], known: dict[str, Any]) -> None:
        self.rng, self.types, self.known = random.Random(seed), types, known

    def frames(self) -> list[bytes]:
        pick = self.rng.random()
        if pick < 0.15:
            return [self.rng.randbytes(self.rng.randrange(0, 48)) for _ in range(self.rng.randrange(1, 4))]
        msg = self.message()
        frames = msg.to_frames(self.rng.randrange(1, 2**31))
        if pick < 0.5:
            return frames  # schema-driven: valid, at its bounds
        return self.mutate(frames, msg)

    def message(self) -> m.Message:
        cls = m.REGISTRY[self.rng.choice(self.types)]
        msg = sample(cls, self.rng, edge=self.rng.random() < 0.5)
        if self.known and self.rng.random() < 0.6:  # aim at what exists: a job, its generation, slot 0
            fields = {f: v for f, v in self.known.items() if hasattr(msg, f)}
            msg = type(msg)(**{**msg.to_body(), **fields})
        return msg

    def mutate(self, frames: list[bytes], msg: m.Message) -> list[bytes]:
        header, body = frames
        kind = self.rng.randrange(7)
        if kind == 0:  # bytes flipped
            b = bytearray(body)
            for _ in range(self.rng.randrange(1, 4)):
                if b:
                    b[self.rng.randrange(len(b))] = self.rng.randrange(256)
            return [header, bytes(b)]
        if kind == 1:  # cut short
            return [header, body[: self.rng.randrange(len(body) + 1)]]
        if kind == 2:  # the body of another type under this header
            other = sample(m.REGISTRY[self.rng.choice(self.types)], self.rng)
            return [header, other.to_frames()[1]]
        if kind == 3:  # one field of the wrong type, or far out of its bound
            fields = msg.to_body()
            if not fields:
                return [header, msgpack.packb({"x": 1})]
            name = self.rng.choice(sorted(fields))
            fields[name] = self.rng.choice([2**64 - 1, -(2**63), float("inf"), float("nan"), "x" * 70_000, b"\x00", [[[[]]]], {"k": {}}, None, True, -1, 10**9])
            return [header, msgpack.packb(fields, use_bin_type=True, default=lambda r: r.to_wire())]
        if kind == 4:  # a header of another type, version or shape
            return [msgpack.packb(self.rng.choice([["dpool", 1, str(self.rng.choice(list(m.MsgType))), 5], ["dpool", 2, "status", 5], ["dpool", 1, "reboot", 5], ["dpool", 1, "status", -1], ["dpool", 1]])), body]
        if kind == 5:  # frames too many
            return [header, body, *([b""] * self.rng.randrange(1, 50))]
        return [header, msgpack.packb([[] for _ in range(self.rng.randrange(100, 5000))])]  # a body of lists


class FakeNode(threading.Thread):
    """A registered node that answers the coordinator as a dpd would, and between its answers sends
    the fuzz frames it is given. Its 'workers' run in no time: hello, every step, a checkpoint, exit 0."""

    def __init__(self, addr: str, fuzz: Fuzz, count: int) -> None:
        super().__init__(daemon=True)
        self.addr, self.fuzz, self.count = addr, fuzz, count
        self.workers: dict[int, tuple[str, int]] = {}  # slot -> (job, generation)
        self.answered: dict[str, int] = {}
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.addr)
        try:
            self._serve(sock)
        except BaseException as e:
            self.error = e
        finally:
            sock.close(linger=0)
            ctx.term()
            self.done.set()

    def _serve(self, sock: zmq.Socket[Any]) -> None:
        send: Callable[[m.Message], None] = lambda msg: sock.send_multipart(msg.to_frames())  # noqa: E731
        register = m.NodeRegister(name="fake", incarnation="fake-1", info=NodeInfo(slots=1, advertise="127.0.0.1"))
        sock.send_multipart(register.to_frames(1))
        sent, next_beat = 0, 0.0
        while sent < self.count:
            if time.monotonic() >= next_beat:
                send(m.NodeHeartbeat(workers=[AliveWorker(job=j, generation=g, slot=s) for s, (j, g) in self.workers.items()]))
                next_beat = time.monotonic() + 0.4
            while sock.poll(0):
                try:
                    msg, _ = m.decode(sock.recv_multipart(), m.TO_NODE)
                except m.ProtocolError:
                    continue
                self.answered[str(msg.TYPE)] = self.answered.get(str(msg.TYPE), 0) + 1
                for reply in self._answer(msg):
                    send(reply)
                if isinstance(msg, m.Error) and msg.code == "not_registered":
                    sock.send_multipart(register.to_frames(1))  # a fuzzed node.bye or register moved it
            for _ in range(20):
                sock.send_multipart(self.fuzz.frames())
                sent += 1
            time.sleep(0.002)
        send(m.NodeBye())
        time.sleep(0.2)

    def _answer(self, msg: m.Message) -> list[m.Message]:
        match msg:
            case m.GroupPrepare(job=job, generation=g, slots=slots):
                return [m.NodePrepared(job=job, generation=g, host="127.0.0.1", ports=[40000 + s for s in slots])]
            case m.GroupStart(job=job, generation=g, ranks=ranks, spec=spec):
                out: list[m.Message] = []
                steps = int(spec["train"]["steps"]) if isinstance(spec.get("train"), dict) else 1
                for r in ranks:
                    self.workers[r.slot] = (job, g)
                    out += [m.NodeWorkerStarted(job=job, generation=g, rank=r.rank, slot=r.slot, pid=4242), m.NodeWorkerHello(job=job, generation=g, rank=r.rank, pid=4242, resume_step=0)]
                    out += [m.NodeProgress(job=job, generation=g, rank=r.rank, step=s, loss=2.0, tokens=64, seconds=0.01) for s in range(1, min(steps, 50) + 1)]
                    out += [m.NodeCheckpoint(job=job, generation=g, rank=r.rank, slot=r.slot, step=min(steps, 50), seconds=0.01)]
                    if steps <= 50:
                        out.append(m.NodeWorkerExited(job=job, generation=g, rank=r.rank, slot=r.slot, code=0, stopped=False))
                        self.workers.pop(r.slot, None)
                return out
            case m.GroupStop(job=job, generation=g):
                gone = [(s, w) for s, w in self.workers.items() if w[0] == job and (g == 0 or w[1] == g)]
                for s, _ in gone:
                    del self.workers[s]
                return [m.NodeWorkerExited(job=job, generation=w[1], rank=0, slot=s, code=-15, stopped=True) for s, w in gone]
        return []


@pytest.fixture
def served(processes: Processes, tmp_path: Path) -> Iterator[Served]:
    yield Served(processes, tmp_path)


def test_ten_thousand_hostile_frames_then_a_job_succeeds(served: Served) -> None:
    target = served.submit("fuzz-target", steps=20)  # a job for the fuzz to hit while it runs
    known = {"job": target, "generation": 1, "rank": 0, "slot": 0, "node": "fake"}
    watch = PeakRss(served.proc.pid)
    t0 = time.monotonic()
    fake = FakeNode(served.addr, Fuzz(1, NODE_TYPES + CLIENT_TYPES[:3], known), FRAMES // 2)
    fake.start()
    anonymous, replies = Peer(served.addr), 0
    fuzz = Fuzz(2, CLIENT_TYPES + NODE_TYPES + [m.MsgType.GROUP_STOP, m.MsgType.STATUS_REPLY], {"job": target})
    try:
        for i in range(FRAMES // 2):
            anonymous.send(fuzz.frames())
            if i % 50 == 0:
                while anonymous.sock.poll(0):
                    anonymous.sock.recv_multipart()
                    replies += 1
        assert fake.done.wait(120), "the fake node did not finish"
        while anonymous.sock.poll(1000):
            anonymous.sock.recv_multipart()
            replies += 1
    finally:
        anonymous.close()
    seconds = time.monotonic() - t0
    grown = watch.stop()
    print(f"{FRAMES} frames in {seconds:.1f}s; {replies} replies to the anonymous peer; the fake node was asked {fake.answered}; dpd peak RSS +{grown:.1f} MiB (from {watch.base:.1f})")
    assert fake.error is None, repr(fake.error)
    assert served.proc.poll() is None, served.log.read_text()[-3000:]
    assert replies > FRAMES // 4  # every frame with a readable header is answered (some replies are dropped past the HWM)
    assert grown < 64, f"dpd grew {grown:.1f} MiB"

    # Whatever the fuzz queued or left half-started is cancelled; the node takes work again.
    for job in served.call(m.Status(), m.StatusReply).jobs:
        if job.state not in ("succeeded", "failed", "cancelled"):
            served.call(m.Cancel(job=job.id), m.CancelReply)
    served.call(m.Undrain(node=served.name), m.UndrainReply)
    job = served.submit("after-fuzz")
    final = served.wait_end(job, timeout=180)
    assert final.state == "succeeded", (final, served.log.read_text()[-3000:])
    assert served.proc.poll() is None
    assert served.tracebacks() == 0, served.log.read_text()[-5000:]


def test_every_fuzz_kind_decodes_or_is_a_protocol_error() -> None:
    """The generator's frames, decoded in process: nothing but a ProtocolError ever escapes."""
    fuzz = Fuzz(3, list(m.MsgType), {"job": "j-1", "generation": 1})
    decoded = 0
    for _ in range(1000):
        try:
            m.decode(fuzz.frames()[:3])
            decoded += 1
        except m.ProtocolError:
            pass
    assert 100 < decoded < 900  # both kinds are exercised

