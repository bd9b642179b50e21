"""The coordinator cannot be stopped by a request: a failing tick or request is undone whole and
logged (a traceback at most once a minute per kind), and nothing it sends leaves before the state it
follows from is committed. A real Coordinator on a real socket, in a thread of this process
(`peers.Running`), so a fault can be put into it."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio
from peers import Peer, Running

from dpool.client.rpc import RemoteError
from dpool.daemon import pool
from dpool.daemon.agent import Agent
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


def test_a_pool_of_its_most_nodes_forgets_the_longest_lost_to_take_a_new_one(coordinator: Running, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer registering fresh names in a loop once grew the pool without end (20,000 names: a
    `nodes` reply no dpctl could read, every node told to heartbeat every 32 s). A pool holds
    MAX_NODES; past it the node lost longest that holds nothing is forgotten (its saved row too),
    and with none such a new name is refused `pool_full`, which a dpd asks again after."""
    monkeypatch.setattr(pool, "MAX_NODES", 3)
    peers = {n: Peer(coordinator.addr) for n in ("a", "b", "c", "d")}
    try:
        for n in "abc":
            assert isinstance(peers[n].register(n, slots=1, advertise="127.0.0.1"), m.NodeRegistered)
        refused = peers["d"].register("d", slots=1, advertise="127.0.0.1")
        assert isinstance(refused, m.Error) and refused.code == "pool_full" and "3 nodes" in refused.message
        for n in "ba":  # b is lost first, then a (each seen lost before the next: another batch)
            peers[n].send(m.NodeBye().to_frames())
            deadline = time.monotonic() + 10
            while next(r for r in coordinator.call(m.Nodes(), m.NodesReply).nodes if r.name == n).state != "lost":
                assert time.monotonic() < deadline, f"{n} not lost after its node.bye"
        assert isinstance(peers["d"].register("d", slots=1, advertise="127.0.0.1"), m.NodeRegistered)
        names = sorted(r.name for r in coordinator.call(m.Nodes(), m.NodesReply).nodes)
        assert names == ["a", "c", "d"]
        assert [e["node"] for e in coordinator.events("node.forgotten")] == ["b"]
        time.sleep(0.3)  # committed since
        db = sqlite3.connect(tmp_path / "coordinator.sqlite3")
        assert sorted(n for (n,) in db.execute("SELECT name FROM nodes")) == ["a", "c", "d"]
        assert isinstance(peers["b"].register("b", incarnation="again", slots=1, advertise="127.0.0.1"), m.NodeRegistered)  # a forgotten node may come back
        assert sorted(r.name for r in coordinator.call(m.Nodes(), m.NodesReply).nodes) == ["b", "c", "d"]
    finally:
        for p in peers.values():
            p.close()


def test_a_nodes_reply_for_a_full_pool_of_long_rows_is_read_by_dpctl() -> None:
    """4,096 nodes whose address, platform, chip, versions and interface are as long as a node may
    report them: 4.1 MB of rows, over the 4 MiB a request may have; a reply that lists rows may
    have 16 MiB (dpctl read `nodes.reply body is 10992946 bytes, cap 4194304` and exited 1)."""
    from dpool.daemon.pool import MAX_NODES
    from dpool.protocol.payloads import NodeRow

    row = {
        "address": "a" * 255, "state": "idle", "platform": "p" * 64, "chip": "c" * 256, "memory_bytes": 1 << 40, "mlx_version": "v" * 64,
        "backend": "b" * 64, "slots": 1, "busy_slots": 0, "job": None, "ranks": [], "heartbeat_age_s": 1.0, "reason": "r" * 200, "interface": "i" * 64,
    }
    reply = m.NodesReply(nodes=[NodeRow(name=f"{i:063d}", **row) for i in range(MAX_NODES)])  # type: ignore[arg-type]
    frames = reply.to_frames(5)
    assert len(frames[1]) > m.MAX_BODY_BYTES
    back, msg_id = m.decode(frames, m.TO_CLIENT)
    assert msg_id == 5 and isinstance(back, m.NodesReply) and len(back.nodes) == MAX_NODES
    with pytest.raises(m.ProtocolError, match="cap 4194304"):  # a request is still held to 4 MiB
        m.decode([m.Nodes().to_frames(1)[0], frames[1]])


def test_a_dpd_refused_pool_full_says_so_as_it_retries(coordinator: Running, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An answer to ask again after (pool_full) is named in the dpd's retry line, without the hint
    for a coordinator that does not answer (is it running? are the keys this pool's?)."""
    monkeypatch.setattr(pool, "MAX_NODES", 0)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        agent = Agent(ctx, name="late", join=coordinator.addr, state_dir=tmp_path / "state", slots=1, advertise="127.0.0.1")
        stopping = asyncio.Event()
        run = asyncio.create_task(agent.run(stopping))
        try:
            for _ in range(400):
                if any(e["event"] == "coordinator.retry" for e in list(coordinator.logs)) or run.done():
                    break
                await asyncio.sleep(0.025)
        finally:
            stopping.set()
            await asyncio.wait_for(run, 15)
            ctx.destroy(linger=0)

    asyncio.run(main())
    (retry, *_) = [e for e in coordinator.logs if e["event"] == "coordinator.retry"]
    assert retry["error"].startswith("pool_full: the pool holds 0 nodes") and "hint" not in retry, retry
