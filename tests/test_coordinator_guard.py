"""The coordinator cannot be stopped by a request: a failing tick or request is undone whole and
logged (a traceback at most once a minute per kind), and nothing it sends leaves before the state it
follows from is committed. A real Coordinator on a real socket, in a thread of this process, so a
fault can be put into it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq.asyncio
from conftest import wait_for
from peers import Peer

from dpool.client.rpc import Client, RemoteError
from dpool.daemon.coordinator import Coordinator
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

JOB = parse_job({"name": "g", "workers": {"min": 1, "max": 1}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()


class Running:
    """A Coordinator on loopback, its loop in a thread; `logs` holds what it logged."""

    def __init__(self, state: Path) -> None:
        self.logs: list[dict[str, Any]] = []
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
                self.coord = Coordinator(ctx, "tcp://127.0.0.1:*", state, heartbeat_s=0.1)
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
        with Client(self.addr, 5.0) as c:
            return c.call(msg, expect)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in list(self.logs) if e["event"] == name]

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Running]:
    c = Running(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def test_a_tick_that_raises_is_logged_once_and_the_loop_goes_on(coordinator: Running) -> None:
    def broken(now: float) -> list[Any]:
        raise RuntimeError("a bug in the policy")

    coordinator.coord.pool.tick = broken  # type: ignore[method-assign]
    time.sleep(0.6)  # six ticks at 0.1 s
    assert coordinator.call(m.Status(), m.StatusReply).jobs == []  # it still answers
    failed = coordinator.events("tick.failed")
    assert len(failed) == 1 and "a bug in the policy" in failed[0]["error"]  # one traceback a minute
    assert coordinator.coord.stats["failed"] >= 5


def test_a_request_that_raises_is_answered_internal_and_its_writes_are_undone(coordinator: Running, tmp_path: Path) -> None:
    job = coordinator.call(m.Submit(job=JOB, source="g.toml"), m.Submitted).job_id

    def full_disk(*_: Any) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    coordinator.coord.store.save_job = full_disk  # type: ignore[method-assign]
    with pytest.raises(RemoteError) as e:
        coordinator.call(m.Cancel(job=job), m.CancelReply)  # writes its event, then fails saving the job
    assert e.value.code == "internal" and "disk is full" in e.value.message
    time.sleep(0.3)  # committed since
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
    kinds = [k for (k,) in db.execute("SELECT kind FROM events WHERE job = ?", (job,))]
    assert "job.submitted" in kinds and "job.cancelled" not in kinds  # the failed request left nothing
    assert coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].id == job
    assert len(coordinator.events("cancel.failed")) == 1


def test_group_start_leaves_only_once_its_generation_is_committed(coordinator: Running, tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "coordinator.sqlite3", check_same_thread=False)  # read from the coordinator's thread
    seen: list[tuple[int, bool]] = []
    raw = coordinator.coord.raw

    class Spy:
        def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
            msg, _ = m.decode(frames[1:])
            if isinstance(msg, m.GroupStart):  # what another process reads from the database now
                seen.extend((gen, plan is not None) for gen, plan in db.execute("SELECT generation, plan FROM jobs WHERE id = ?", (msg.job,)))
            raw.send_multipart(frames, flags=flags)  # type: ignore[union-attr]

        def __getattr__(self, name: str) -> Any:  # reading goes to the real socket
            return getattr(raw, name)

    coordinator.coord.raw = Spy()  # type: ignore[assignment]
    node = Peer(coordinator.addr)
    try:
        assert isinstance(node.register("a", slots=1, advertise="127.0.0.1"), m.NodeRegistered)
        coordinator.call(m.Submit(job=JOB, source="g.toml"), m.Submitted)
        prepare = wait_for("group.prepare", lambda: _next(node, m.GroupPrepare), 10)
        node.send(m.NodePrepared(job=prepare.job, generation=prepare.generation, host="127.0.0.1", ports=[40001]).to_frames())
        start = wait_for("group.start", lambda: _next(node, m.GroupStart), 10)
    finally:
        node.close()
    assert start.generation == 1 and seen == [(1, True)]


def _next(peer: Peer, kind: type[m.Message]) -> m.Message | None:
    while peer.sock.poll(100):
        msg, _ = m.decode(peer.sock.recv_multipart())
        if isinstance(msg, kind):
            return msg
    return None


@pytest.mark.parametrize("jump", [3600.0, -3600.0])
def test_a_step_of_the_system_clock_loses_no_node_and_stops_no_tick(coordinator: Running, monkeypatch: pytest.MonkeyPatch, jump: float) -> None:
    """An hour forward or back (NTP, a user's `date`): the node stays, and the coordinator's ticks
    (its heartbeats to the node) go on."""
    node = Peer(coordinator.addr)
    try:
        assert isinstance(node.register("a", slots=1, advertise="127.0.0.1"), m.NodeRegistered)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + jump)
        beats, t_end = 0, time.monotonic() + 1.5  # 15 ticks and 3 expiries at 0.1 s x 6... at liveness 6
        while time.monotonic() < t_end:
            node.send(m.NodeHeartbeat().to_frames())
            while node.sock.poll(50):
                msg, _ = m.decode(node.sock.recv_multipart())
                beats += isinstance(msg, m.CoordHeartbeat)
        (row,) = coordinator.call(m.Nodes(), m.NodesReply).nodes
    finally:
        node.close()
    assert row.state != "lost" and not coordinator.events("node.lost")
    assert beats >= 5
