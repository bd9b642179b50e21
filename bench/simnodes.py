"""Simulated dpd nodes for `bench/control_plane.py --scale`: N nodes in one process, each a real
ZeroMQ DEALER speaking the real protocol to a coordinator in another process.

What each simulated node does, as `daemon/agent.py` does it:
- `node.register` (one slot, a NodeInfo, its running workers), waiting max(5 s, heartbeat x
  liveness) for `node.registered` (dpd's `REGISTER_WAIT_S`); without it, a new socket and another try after a jittered
  exponential wait (0.25 s x 2^attempt, at most 5 s). Counted: `register_timeouts`.
- the heartbeat period and liveness `node.registered` carries, adopted; and a new period on
  `coord.heartbeat`, adopted and acknowledged on a `node.heartbeat` sent at once, which from then
  on carries the period (daemon/cadence.py). Counted: `periods_adopted`.
- `node.heartbeat` with its workers every heartbeat period once registered, the first one at a
  random point of the first period; a coordinator silent for heartbeat x liveness is lost: a new
  socket and `node.register` again (`coordinator_lost`), as after `error not_registered`
  (`not_registered`).
- `group.prepare` → `node.prepared` (a made-up port per slot); `group.start` → per rank
  `node.worker_started`, `node.worker_hello` and a `node.progress` every `step_s` (a fake trainer
  at step rate 1/step_s); `group.stop` → `node.worker_exited` (stopped) per worker, and a
  `group.stop now` is answered with a heartbeat at once, as dpd does.

Bodies from the coordinator are unpacked without the schema checks (the simulator trusts it), so
that decoding 2,000 `group.start` bodies does not make the simulator, rather than the coordinator,
the slow side. The process is driven over a multiprocessing pipe by the benchmark (`SimProcess`).

Also here: `CoordinatorProcess`, a coordinator alone in its own process (a tiny script around
`dpool.daemon.coordinator.Coordinator`, with no node of its own), importable from another tree
(`pythonpath`) to measure an older commit against the same simulator.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import multiprocessing
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from dpool.daemon.agent import REGISTER_WAIT_S
from dpool.protocol import messages as m
from dpool.protocol.payloads import AliveWorker, NodeInfo, RunningWorker

TICK_S = 0.05  # the simulator's timer: heartbeats, registration deadlines, fake steps
PORT_BASE = 20_000  # node i's made-up ring port for slot s: PORT_BASE + i (one slot per node)


def raise_fd_limit() -> None:
    """Thousands of sockets: every connection is a file descriptor on both sides."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the coordinator, alone in its own process ----------------------------------------------------

COORDINATOR_SCRIPT = r"""
import asyncio, resource, signal, sys
import zmq, zmq.asyncio
import dpool.daemon.pool
from dpool.daemon.coordinator import Coordinator
from dpool.protocol.logs import configure_logging

addr, state_dir, level = sys.argv[1], sys.argv[2], sys.argv[3]
# The coordinator's own defaults unless given ("heartbeat_s=2" ...): an older tree's keywords too.
settings = {k: float(v) if k != "liveness" else int(v) for k, v in (a.split("=", 1) for a in sys.argv[4:])}
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
configure_logging(level, json=True)

async def main():
    ctx = zmq.asyncio.Context()
    coord = Coordinator(ctx, addr, state_dir, **settings)
    endpoint = coord.bind()
    print(endpoint, dpool.daemon.pool.__file__, flush=True)
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    await coord.run(stopping)
    ctx.destroy(linger=0)

asyncio.run(main())
"""


class CoordinatorProcess:
    """`Coordinator` in a process of its own, its state in `root/state` and its log in
    `root/coordinator.log`, on `addr` (default: a random loopback port); `pythonpath` is put first
    on its PYTHONPATH (another checkout's package root), `pool_file` says which tree it runs.
    `heartbeat_s`, `liveness`, `heartbeat_rate`: the coordinator's own defaults where None (as
    `dpd run --serve` without flags)."""

    def __init__(
        self, root: Path, heartbeat_s: float | None = None, liveness: int | None = None, *, heartbeat_rate: float | None = None,
        addr: str = "tcp://127.0.0.1:*", pythonpath: str | None = None, log_level: str = "info",
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        given = {"heartbeat_s": heartbeat_s, "liveness": liveness, "heartbeat_rate": heartbeat_rate}
        settings = [f"{k}={v}" for k, v in given.items() if v is not None]
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        self.log, self.state_dir = root / "coordinator.log", root / "state"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", COORDINATOR_SCRIPT, addr, str(self.state_dir), log_level, *settings],
                stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True, text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            self.stop()
            raise RuntimeError(f"the coordinator did not start: {self.log.read_text()[-2000:]}")
        self.addr, self.pool_file = line
        self.pid = self.proc.pid

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 10 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


# -- the simulator (runs in its own process) -----------------------------------------------------


class Node:
    __slots__ = (
        "attempt", "beat_s", "fd", "index", "last_heard", "liveness", "name", "next_beat", "reg_deadline", "register_frames", "registered",
        "retry_at", "sock", "told", "workers",
    )

    def __init__(self, index: int, heartbeat_s: float, liveness: int) -> None:
        self.index, self.name = index, f"sim-{index:05d}"
        self.sock: zmq.Socket[Any] | None = None
        self.fd = -1
        self.registered = False
        self.reg_deadline: float | None = None
        self.retry_at: float | None = None
        self.attempt = 0
        self.last_heard = self.next_beat = 0.0
        self.workers: dict[int, list[Any]] = {}  # slot -> [job, generation, rank, step]
        self.register_frames: list[bytes] | None = None
        self.beat_s, self.liveness = heartbeat_s, liveness  # as told by the coordinator
        self.told = False  # the coordinator tells periods on coord.heartbeat: heartbeats carry ours

    @property
    def expiry_s(self) -> float:
        return self.beat_s * self.liveness


class Simulator:
    def __init__(self, conn: Any, addr: str, n: int, heartbeat_s: float, liveness: int, step_s: float) -> None:
        self.conn, self.addr, self.n = conn, addr, n
        self.step_s = step_s
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 2 * n + 1024)  # closed sockets are reaped a little later
        self.nodes = [Node(i, heartbeat_s, liveness) for i in range(n)]
        self.counts: collections.Counter[str] = collections.Counter()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done = asyncio.Event()
        self.reg_t0: float | None = None
        self.first_registered = 0  # nodes registered at least once since `register`
        self.ever: set[int] = set()
        self.watch: dict[str, list[Any]] = {}  # message type -> [count, first, last]
        self.next_step = 0.0
        self.incarnation = f"{os.getpid():x}-{random.getrandbits(32):08x}"

    # sockets

    def open(self, node: Node) -> None:
        self.close(node)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        sock.connect(self.addr)
        node.sock, node.fd = sock, sock.getsockopt(zmq.FD)
        assert self.loop is not None
        self.loop.add_reader(node.fd, self.drain, node)

    def close(self, node: Node) -> None:
        if node.sock is not None:
            assert self.loop is not None
            self.loop.remove_reader(node.fd)
            node.sock.close(linger=0)
            node.sock, node.fd = None, -1

    def send(self, node: Node, frames: list[bytes]) -> None:
        if node.sock is None:
            return
        try:
            node.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.counts["send_dropped"] += 1
            return
        # ZeroMQ's descriptor is edge-triggered: a send can take the edge a reply would have made.
        assert self.loop is not None
        self.loop.call_soon(self.drain, node)

    def drain(self, node: Node) -> None:
        sock = node.sock
        while sock is not None and node.sock is sock and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.handle(node, sock.recv_multipart(zmq.NOBLOCK))

    # the node's side of the protocol

    def register(self, node: Node, now: float, *, reopen: bool = True) -> None:
        node.registered, node.retry_at = False, None
        if reopen or node.sock is None:
            try:
                self.open(node)
            except zmq.ZMQError:  # out of descriptors: this node tries again in a second
                self.counts["socket_errors"] += 1
                node.retry_at = now + 1.0
                return
        node.reg_deadline = now + max(REGISTER_WAIT_S, node.expiry_s)
        self.counts["registrations"] += 1
        if node.workers or node.register_frames is None:
            info = NodeInfo(slots=1, platform="linux", chip="sim", cpus=1, memory_bytes=1 << 30, backend="cpu", python="3.11", advertise="127.0.0.1", pid=os.getpid())
            running = [RunningWorker(job=w[0], generation=w[1], rank=w[2], slot=s, pid=100_000 + node.index) for s, w in node.workers.items()]
            frames = m.NodeRegister(name=node.name, incarnation=self.incarnation, info=info, running=running).to_frames(1)
            if not node.workers:
                node.register_frames = frames
        else:
            frames = node.register_frames
        self.send(node, frames)

    def handle(self, node: Node, frames: list[bytes]) -> None:
        now = time.monotonic()
        try:
            msg_type, _ = m.decode_header(frames[0])
            body = msgpack.unpackb(frames[1], raw=False) if len(frames) == 2 else None
        except (m.ProtocolError, ValueError, msgpack.UnpackException):
            self.counts["bad_frames"] += 1
            return
        if not isinstance(body, dict):
            self.counts["bad_frames"] += 1
            return
        node.last_heard = now
        t = m.MsgType
        if msg_type is t.NODE_REGISTERED:
            if not node.registered:
                node.registered, node.reg_deadline, node.attempt, node.told = True, None, 0, False
                node.beat_s, node.liveness = float(body["heartbeat_s"]), int(body["liveness"])
                node.next_beat = now + random.uniform(0, node.beat_s)
                if node.index not in self.ever:
                    self.ever.add(node.index)
                    if len(self.ever) == self.n and self.reg_t0 is not None:
                        self.conn.send(("registered", self.reg_t0, now))
        elif msg_type is t.COORD_HEARTBEAT:
            if "heartbeat_s" in body and "liveness" in body and node.registered:
                if body["heartbeat_s"] != node.beat_s:
                    self.counts["periods_adopted"] += 1
                node.beat_s, node.liveness, node.told = float(body["heartbeat_s"]), int(body["liveness"]), True
                self.beat(node, now)
        elif msg_type is t.GROUP_PREPARE:
            ports = [PORT_BASE + (node.index * 1024 + s) % 40_000 for s in body["slots"]]
            self.send(node, m.NodePrepared(job=body["job"], generation=body["generation"], host="127.0.0.1", ports=ports).to_frames())
            self.mark("group.prepare", now)
        elif msg_type is t.GROUP_START:
            job, gen = body["job"], body["generation"]
            for rs in body["ranks"]:
                slot, rank = rs["slot"], rs["rank"]
                node.workers[slot] = [job, gen, rank, 1]
                pid = 100_000 + node.index
                self.send(node, m.NodeWorkerStarted(job=job, generation=gen, rank=rank, slot=slot, pid=pid).to_frames())
                self.send(node, m.NodeWorkerHello(job=job, generation=gen, rank=rank, pid=pid, resume_step=0).to_frames())
                self.send(node, m.NodeProgress(job=job, generation=gen, rank=rank, step=1, loss=5.0, tokens=1024, seconds=self.step_s).to_frames())
            self.mark("group.start", time.monotonic())
        elif msg_type is t.GROUP_STOP:
            job, gen = body["job"], body["generation"]
            code = -int(signal.SIGTERM) if body.get("mode", "now") == "now" else 75
            for slot, w in list(node.workers.items()):
                if w[0] == job and (gen == 0 or w[1] == gen):
                    del node.workers[slot]
                    self.send(node, m.NodeWorkerExited(job=job, generation=w[1], rank=w[2], slot=slot, code=code, stopped=True).to_frames())
            if body.get("mode", "now") == "now":
                self.beat(node, now)
            self.mark("group.stop", time.monotonic())
        elif msg_type is t.ERROR:
            code = str(body.get("code"))
            self.counts[f"error.{code}"] += 1
            if code == m.ErrorCode.NOT_REGISTERED:
                self.counts["not_registered"] += 1
                self.register(node, now)
        else:
            self.counts[f"other.{msg_type}"] += 1

    def beat(self, node: Node, now: float) -> None:
        alive = [AliveWorker(job=w[0], generation=w[1], slot=s) for s, w in node.workers.items()]
        self.send(node, m.NodeHeartbeat(workers=alive, heartbeat_s=node.beat_s if node.told else None).to_frames())
        node.next_beat = now + node.beat_s

    def mark(self, kind: str, now: float) -> None:
        w = self.watch.setdefault(kind, [0, now, now])
        w[0] += 1
        w[2] = now
        if w[0] == self.n:
            self.conn.send(("all", kind, w[1], w[2]))

    def tick(self) -> None:
        now = time.monotonic()
        step = now >= self.next_step
        if step:
            self.next_step = now + self.step_s
        for node in self.nodes:
            if node.registered:
                if now - node.last_heard > node.expiry_s:
                    self.counts["coordinator_lost"] += 1
                    self.register(node, now)
                    continue
                if now >= node.next_beat:
                    self.beat(node, now)
                if step:
                    for w in node.workers.values():
                        w[3] += 1
                        self.send(node, m.NodeProgress(job=w[0], generation=w[1], rank=w[2], step=w[3], loss=5.0, tokens=1024, seconds=self.step_s).to_frames())
            elif node.retry_at is not None:
                if now >= node.retry_at:
                    self.register(node, now)
            elif node.reg_deadline is not None and now > node.reg_deadline:
                self.counts["register_timeouts"] += 1
                node.reg_deadline = None
                node.retry_at = now + random.uniform(0, min(5.0, 0.25 * 2**node.attempt))
                node.attempt += 1

    async def ticker(self) -> None:
        while not self.done.is_set():
            self.tick()
            await asyncio.sleep(TICK_S)

    # commands from the benchmark

    def command(self) -> None:
        while self.conn.poll():
            cmd, *_ = self.conn.recv()
            if cmd == "register":
                now = time.monotonic()
                self.reg_t0 = now
                for node in self.nodes:  # all at once, on the sockets connected beforehand
                    self.register(node, now, reopen=False)
            elif cmd == "watch":
                self.watch = {}
                self.conn.send(("watching",))
            elif cmd == "stats":
                running = sum(len(n.workers) for n in self.nodes)
                registered = sum(n.registered for n in self.nodes)
                periods = collections.Counter(n.beat_s for n in self.nodes if n.registered)
                self.conn.send(("stats", dict(self.counts), registered, running, dict(periods)))
            elif cmd == "stop":
                self.done.set()

    async def main(self) -> None:
        self.loop = asyncio.get_running_loop()
        for node in self.nodes:
            self.open(node)
        await asyncio.sleep(1.0 + self.n / 2000)  # TCP and ZMTP handshakes done before `register`
        self.loop.add_reader(self.conn.fileno(), self.command)
        ticker = asyncio.create_task(self.ticker())
        self.conn.send(("ready",))
        await self.done.wait()
        await ticker
        self.loop.remove_reader(self.conn.fileno())
        for node in self.nodes:
            self.close(node)
        self.ctx.term()
        self.conn.send(("stopped",))


def simulate(conn: Any, addr: str, n: int, heartbeat_s: float, liveness: int, step_s: float) -> None:
    """The simulator process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the benchmark stops it, in order
    raise_fd_limit()
    asyncio.run(Simulator(conn, addr, n, heartbeat_s, liveness, step_s).main())


class SimProcess:
    """The simulator process, seen from the benchmark: commands down the pipe, replies and `all`
    events (the last of N group.prepare/start/stop arrived, with the first and last times) back."""

    def __init__(self, addr: str, n: int, heartbeat_s: float, liveness: int, step_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=simulate, args=(child, addr, n, heartbeat_s, liveness, step_s), daemon=True)
        self.proc.start()
        child.close()
        self.events: dict[str, tuple[float, float]] = {}
        self.registered_at: tuple[float, float] | None = None

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def poll(self, timeout: float = 0.0) -> Any:
        """The next reply (not an `all` event or the registration's end, which are kept), or None."""
        deadline = time.monotonic() + timeout
        while self.conn.poll(max(0.0, deadline - time.monotonic())):
            got = self.conn.recv()
            if got[0] == "all":
                self.events[got[1]] = (got[2], got[3])
            elif got[0] == "registered":
                self.registered_at = (got[1], got[2])
            else:
                return got
        return None

    def wait(self, kind: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self.poll(left)
            if got is not None and got[0] == kind:
                return got
            if got is not None:
                raise RuntimeError(f"simulator: expected {kind}, got {got!r}")
            if not self.proc.is_alive():
                raise RuntimeError(f"the simulator exited ({self.proc.exitcode})")
        raise TimeoutError(f"simulator: no {kind} within {timeout}s")

    def stats(self) -> dict[str, Any]:
        self.send("stats")
        _, counts, registered, running, periods = self.wait("stats", 30)
        return {"counts": counts, "registered": registered, "running": running, "periods": periods}

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                self.send("stop")
                self.wait("stopped", 20)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()
