"""Peers that speak the control plane the way an attacker or a broken daemon would: raw frames on a
real socket to a real coordinator (a `dpd run --serve` process, or a `Coordinator` on a thread of
the test's own process), and what its process costs.

Used by test_hostile.py (one attack per test), test_fuzz.py (ten thousand frames),
test_coordinator_guard.py and test_roles.py."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import structlog
import zmq
import zmq.asyncio
from conftest import Processes, wait_for

from dpool.client.localpool import LocalPool
from dpool.client.rpc import Client, RemoteError, Unreachable
from dpool.daemon.coordinator import Coordinator
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import JobStatus, NodeInfo
from dpool.protocol.security import ClientKeys, ServerKeys, curve_client

TERMINAL = ("succeeded", "failed", "cancelled")
T = TypeVar("T", bound=m.Message)


def raw(msg_type: str, body: Any, msg_id: int = 1) -> list[bytes]:
    """The two frames of a message of `msg_type` whose body is `body` as given (packed when not bytes)."""
    packed = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return [msgpack.packb(["dpool", 1, msg_type, msg_id]), packed]


def rss_mib(pid: int) -> float:
    """Resident memory of a process, in MiB."""
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * 4096 / 2**20


class PeakRss(threading.Thread):
    """Samples a process's resident memory every 20 ms until stopped; `peak` is the highest seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.base = pid, rss_mib(pid)
        self.peak = self.base
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.wait(0.02):
            self.peak = max(self.peak, rss_mib(self.pid))

    def stop(self) -> float:
        """Stop sampling; the growth of the peak over the start, in MiB."""
        self.stopping.set()
        self.join()
        self.peak = max(self.peak, rss_mib(self.pid))
        return self.peak - self.base


class Peer:
    """A DEALER on the coordinator's socket that sends whatever it is given."""

    def __init__(self, addr: str, *, rcvhwm: int = 1000, keys: ClientKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if keys is not None:  # a CURVE client with this key pair
            curve_client(self.sock, keys)
        self.sock.connect(addr)
        self.ids = itertools.count(1000)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def ask(self, frames: list[bytes], timeout: float = 10.0) -> m.Message:
        """Send `frames`, return the reply carrying their id (other messages, heartbeats, skipped)."""
        msg_id = msgpack.unpackb(frames[0])[3]
        self.send(frames)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            reply, reply_id = m.decode(self.sock.recv_multipart())
            if reply_id == msg_id and not isinstance(reply, m.CoordHeartbeat):
                return reply
        raise AssertionError(f"no reply to message {msg_id} within {timeout}s")

    def next_reply(self, frames: list[bytes], timeout: float = 10.0) -> tuple[m.Message, int]:
        """Send `frames`; the first message back that is not a heartbeat, whatever its id."""
        self.send(frames)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
            reply, reply_id = m.decode(self.sock.recv_multipart())
            if not isinstance(reply, m.CoordHeartbeat):
                return reply, reply_id
        raise AssertionError(f"nothing came back within {timeout}s")

    def message(self, msg: m.Message) -> m.Message:
        return self.ask(msg.to_frames(next(self.ids)))

    def register(self, name: str, incarnation: str = "", **info: Any) -> m.Message:
        return self.message(m.NodeRegister(name=name, incarnation=incarnation or f"inc-{name}", info=NodeInfo(**info)))

    def next(self, kind: type[T], timeout: float = 10.0) -> T:
        """The next message of type `kind` the coordinator sends (others are skipped)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and self.sock.poll(int(left * 1000) + 1):
            msg, _ = m.decode(self.sock.recv_multipart())
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.TYPE} within {timeout}s")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class Running:
    """A Coordinator on loopback, its loop in a thread; `logs` holds what it logged."""

    def __init__(self, state: Path, *, keys: ServerKeys | None = None, client: ClientKeys | None = None, wall: Callable[[], float] = time.time) -> None:
        """`keys`: CURVE with this pair and allow-list; `client`: the keys `call` uses; `wall`: the
        coordinator's wall clock (a test steps it)."""
        self.keys, self.client, self.wall = keys, client, wall
        self.logs: list[Any] = []  # structlog's captured events
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, args=(state,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _main(self, state: Path) -> None:
        async def main() -> None:
            ctx = zmq.asyncio.Context()
            stop = asyncio.Event()
            with structlog.testing.capture_logs() as self.logs:
                self.coord = Coordinator(ctx, "tcp://127.0.0.1:*", state, heartbeat_s=0.1, keys=self.keys, wall=self.wall)
                self.addr = self.coord.bind()
                task = asyncio.create_task(self.coord.run(stop))
                self.ready.set()
                while not self.stopping.is_set():
                    await asyncio.sleep(0.02)
                stop.set()
                await task
            ctx.destroy(linger=0)

        asyncio.run(main())

    def call(self, msg: m.Message, expect: type[Any]) -> Any:
        with Client(self.addr, 5.0, self.client) as c:
            return c.call(msg, expect)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in list(self.logs) if e["event"] == name]

    def dpctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """dpctl as users run it, against this coordinator."""
        return subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", self.addr, *args], capture_output=True, text=True, timeout=60)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)


class Served:
    """One `dpd run --serve` process with `slots` slots: the coordinator and a node, as users run it."""

    def __init__(self, procs: Processes, root: Path, *, slots: int = 1, name: str = "n0") -> None:
        self.root, self.name = root, name
        pool = LocalPool(root, procs=procs)
        daemon = pool.start_daemon(name, serve=True, workers=slots)
        self.addr, self.proc, self.log = pool.addr, daemon.proc, daemon.log
        wait_for(f"{name} registered", lambda: self.node_state() == "idle", 60, every=0.2)

    def call(self, msg: m.Message, expect: type[T], timeout: float = 10.0) -> T:
        with Client(self.addr, timeout) as c:
            return c.call(msg, expect)

    def node_state(self) -> str | None:
        try:
            rows = self.call(m.Nodes(), m.NodesReply, 2.0).nodes
        except (Unreachable, RemoteError):
            return None
        return next((n.state for n in rows if n.name == self.name), None)

    def works(self) -> None:
        """The daemon lives, answers, still holds its own node, and takes a new node's registration."""
        assert self.proc.poll() is None, f"dpd exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
        assert self.node_state() in ("idle", "busy"), self.log.read_text()[-3000:]
        peer = Peer(self.addr)
        try:
            assert isinstance(peer.register("probe", slots=1), m.NodeRegistered)
            peer.send(m.NodeBye().to_frames())
        finally:
            peer.close()

    def submit(self, name: str, steps: int = 5, **sections: dict[str, Any]) -> str:
        doc: dict[str, Any] = {
            "name": name,
            "workers": {"min": 1, "max": 1},
            "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
            "train": {"steps": steps, "global_batch": 4, "warmup_steps": 1, "log_every_steps": 1},
            "checkpoint": {"every_steps": 5},
            "eval": {"every_steps": 1000, "batches": 1, "sample_every_steps": 1000},
            **sections,
        }
        return str(self.call(m.Submit(job=parse_job(doc).to_dict(), source="test"), m.Submitted).job_id)

    def wait_end(self, job: str, timeout: float = 120.0) -> JobStatus:
        def ended() -> JobStatus | None:
            try:
                s = self.call(m.Status(job=job), m.StatusReply, 2.0).jobs[0]
            except (Unreachable, RemoteError):
                return None
            return s if s.state in TERMINAL else None

        return wait_for(f"job {job} to end", ended, timeout, every=0.25)

    def tracebacks(self) -> int:
        return self.log.read_text(errors="replace").count("Traceback")

