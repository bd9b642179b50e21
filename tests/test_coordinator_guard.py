"""The coordinator cannot be stopped by a request: a failing tick or request is undone whole and
logged (a traceback at most once a minute per kind), and nothing it sends leaves before the state it
follows from is committed. A real Coordinator on a real socket, in a thread of this process
(`peers.Running`), so a fault can be put into it."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from peers import Peer, Running

from dpool.client.rpc import RemoteError
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

JOB = parse_job({"name": "g", "workers": {"min": 1, "max": 1}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()


def test_a_tick_that_raises_is_logged_once_and_the_loop_goes_on(coordinator: Running) -> None:
    def broken(now: float, read_to: float | None = None) -> list[Any]:
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
        prepare = node.next(m.GroupPrepare)
        node.send(m.NodePrepared(job=prepare.job, generation=prepare.generation, host="127.0.0.1", ports=[40001]).to_frames())
        start = node.next(m.GroupStart)
    finally:
        node.close()
    assert start.generation == 1 and seen == [(1, True)]


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
