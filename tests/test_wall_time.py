"""What people read as times is wall time, whatever the coordinator's clock did meanwhile.

The coordinator keeps liveness and deadlines on a steady clock (wall time at its start, advanced by
the monotonic clock), so a step of the system clock cannot mark every node lost at once. That clock
drifts from wall time by every step the system clock takes and by the time the machine sleeps (the
monotonic clock does not count it): a Mac that hosts the pool and sleeps overnight used to stamp
the next day's events, and the job times, with the evening's clock. Records are now stamped in wall
time (Pool.wall), deadlines stay where they were.

A real Coordinator on a real socket (`peers.Running`) whose wall clock the test steps forward by
eight hours, as a night's sleep or a user setting the date does, and a fake node speaking the real
protocol (`fakenode.FakeRank0`)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for
from fakenode import FakeRank0
from peers import Running

from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import JobStatus

SLEPT = 8 * 3600.0
CLOSE = 30.0  # seconds: the times compared are stamped within a test's run of each other


class Wall:
    """time.time(), plus whatever the test stepped it by."""

    def __init__(self) -> None:
        self.step = 0.0

    def __call__(self) -> float:
        return time.time() + self.step


@pytest.fixture
def wall() -> Wall:
    return Wall()


@pytest.fixture
def coordinator(tmp_path: Path, wall: Wall) -> Iterator[Running]:
    c = Running(tmp_path, wall=wall)
    try:
        yield c
    finally:
        c.stop()


def status(c: Running, job: str) -> JobStatus:
    (row,) = c.call(m.Status(job=job), m.StatusReply).jobs
    return row


def events(c: Running, job: str) -> list[tuple[str, float, dict[str, object]]]:
    reply = c.call(m.Events(job=job), m.EventsReply)
    return [(e.kind, e.t, e.to_wire()) for e in reply.events]


def test_events_and_job_times_follow_the_wall_clock_through_a_step_and_nodes_stay(coordinator: Running, wall: Wall) -> None:
    node = FakeRank0(coordinator.addr)
    try:
        doc = parse_job({"name": "night", "workers": {"min": 1, "max": 1}, "train": {"steps": 100_000, "warmup_steps": 1}}).to_dict()
        before = time.time()
        job = coordinator.call(m.Submit(job=doc, source="night.toml"), m.Submitted).job_id
        submitted = status(coordinator, job).submitted
        assert submitted is not None and before - 1 <= submitted <= time.time() + 1

        wall.step = SLEPT  # the system clock jumps eight hours; the monotonic clock does not
        node.take(job)
        wait_for("the job to run", lambda: status(coordinator, job).state == "running", 20, every=0.05)
        node.keep_stepping()
        wait_for("a step", lambda: status(coordinator, job).step >= 1, 20, every=0.05)
        late = FakeRank0(coordinator.addr, name="late")  # a pool event during the job's life, after the step
        try:
            now = wall()
            row = status(coordinator, job)
            assert row.submitted == submitted  # what was stamped stays as it was
            assert row.started is not None and abs(row.started - now) < CLOSE, (row.started, now)
            assert row.elapsed_s is not None and row.elapsed_s < CLOSE  # not eight hours
            # Liveness is on the steady clock: the step marked no node lost.
            nodes = {n.name: n for n in coordinator.call(m.Nodes(), m.NodesReply).nodes}
            assert nodes["fake"].state == "busy" and nodes["late"].state == "idle", nodes
            assert nodes["fake"].heartbeat_age_s < 5

            assert coordinator.call(m.Cancel(job=job), m.CancelReply)
            wait_for("the job to end", lambda: status(coordinator, job).state == "cancelled", 20, every=0.05)
            row, end = status(coordinator, job), wall()
            assert row.finished is not None and abs(row.finished - end) < CLOSE and row.started is not None and row.finished >= row.started
        finally:
            late.close()
    finally:
        node.close()

    seen = events(coordinator, job)
    kinds = [k for k, _, _ in seen]
    at = {k: t for k, t, _ in reversed(seen)}  # each kind's first
    assert abs(at["job.submitted"] - submitted) < 1
    for kind in ("group.started", "job.cancelled"):
        assert abs(at[kind] - end) < CLOSE, (kind, at[kind], end, seen)  # read the evening's clock before
    # The pool's events are listed with a job by the job's times: both in wall time, so the node
    # that joined after the step is among the job's events.
    assert any(k == "node.joined" and f.get("node") == "late" for k, _, f in seen), kinds
    assert all(t1 <= t2 + 1 for (_, t1, _), (_, t2, _) in itertools.pairwise(seen)), seen
