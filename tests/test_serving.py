"""`dpd run --serve`: the coordinator runs on a thread of its own, so while it is busy the serving
node's own agent goes on heartbeating and the coordinator never declares its own node lost. A real
serving dpd, flooded by raw peers for several times the heartbeat expiry; and SIGTERM still ends a
serving dpd cleanly, a bind error is still said before anything starts, and a coordinator that dies
still ends the dpd with code 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import zmq
from conftest import LocalPool, Processes, alive, pids_with, wait_for
from peers import Peer

from dpool.client.localpool import Daemon
from dpool.daemon import cli
from dpool.daemon.coordinator import Coordinator
from dpool.protocol import messages as m
from dpool.protocol.checkpoints import memory_root
from dpool.protocol.payloads import NodeInfo

# A short heartbeat interval makes the coordinator's work between two of its ticks (a batch of
# frames, the tick, the commit) longer than one interval: a coordinator sharing the agent's loop
# then never waits on its socket, so never lets the agent run, and loses n0 an expiry into the
# flood. 100 intervals make the expiry (1 s): several times what one batch and tick take here.
HB_S, LIVENESS = 0.01, 100
EXPIRY_S = HB_S * LIVENESS
BUSY_S = 3 * EXPIRY_S + 0.5  # how long the flood keeps the coordinator busy
PEERS, NAMES = 4, 10  # raw DEALERs, each registering its own NAMES node names over and over
WINDOW = 400  # registrations each peer keeps unanswered: far more than the 500 frames a batch takes


def serving(processes: Processes, root: Path, *args: str) -> tuple[LocalPool, Daemon]:
    pool = LocalPool(processes, root)
    daemon = pool.start_daemon("n0", serve=True, args=args)
    wait_for("n0 registered", lambda: n0(pool) is not None or daemon.proc.poll() is not None, 60)
    assert daemon.proc.poll() is None, daemon.log.read_text()[-3000:]
    return pool, daemon


def n0(pool: LocalPool) -> Any:
    """The serving node's row in `nodes` (None while the coordinator does not answer)."""
    return next((n for n in pool.nodes() if n.name == "n0"), None)


def logged(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    """The dpd's JSON log lines of `event`."""
    out = []
    for line in daemon.log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            entry = json.loads(line)
            if entry.get("event") == event:
                out.append(entry)
    return out


def flood(addr: str, seconds: float) -> dict[str, float]:
    """Keep the coordinator busy for `seconds`: PEERS raw peers, each with WINDOW node.register
    messages always unanswered, so that over a thousand wait in its queue whenever it reads.
    Returns how many were answered, the longest wait for an answer and how long it lasted."""
    peers = [Peer(addr) for _ in range(PEERS)]
    sent_at: dict[int, float] = {}
    ids = iter(range(1, 10**9))
    answered, longest = 0, 0.0

    def send(i: int) -> None:
        msg_id = next(ids)
        name = f"flood{i}-{msg_id % NAMES}"
        peers[i].send(m.NodeRegister(name=name, incarnation=f"inc-{name}", info=NodeInfo(slots=1)).to_frames(msg_id))
        sent_at[msg_id] = time.monotonic()

    try:
        start = time.monotonic()
        for i in range(PEERS):
            for _ in range(WINDOW):
                send(i)
        poller = zmq.Poller()
        for p in peers:
            poller.register(p.sock, zmq.POLLIN)
        while sent_at:
            assert poller.poll(30_000), f"{len(sent_at)} registrations unanswered for 30 s"
            for i, p in enumerate(peers):
                while p.sock.poll(0):
                    msg, msg_id = m.decode(p.sock.recv_multipart())
                    if msg_id == 0:
                        continue  # the coordinator's heartbeat to a flood node
                    assert isinstance(msg, m.NodeRegistered), msg
                    longest = max(longest, time.monotonic() - sent_at.pop(msg_id))
                    answered += 1
                    if time.monotonic() - start < seconds:
                        send(i)
        return {"answered": answered, "longest_wait_s": round(longest, 2), "busy_s": round(time.monotonic() - start, 2)}
    finally:
        for p in peers:
            p.close()


@pytest.mark.long
def test_a_busy_coordinator_never_loses_its_own_serving_node(processes: Processes, tmp_path: Path) -> None:
    pool, daemon = serving(processes, tmp_path, "--heartbeat-interval", str(HB_S), "--liveness", str(LIVENESS))
    rows: list[Any] = []  # n0's row in every `nodes` answer during the flood
    flooding = threading.Event()
    flooding.set()

    def watch() -> None:  # one request at a time: each waits its turn in the coordinator's queue
        while flooding.is_set():
            row = n0(pool)
            if row is not None:
                rows.append(row)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        load = flood(pool.addr, BUSY_S)
    finally:
        flooding.clear()
        watcher.join(30)
    assert load["busy_s"] > 3 * EXPIRY_S, load  # busy all along: see flood()

    # Once the flood's nodes are expired, the coordinator has ticked an expiry past the flood: a
    # silence of n0 during it would have been noticed too.
    def expired() -> bool:
        flooders = [n for n in pool.nodes() if n.name.startswith("flood")]
        return bool(flooders) and all(n.state == "lost" for n in flooders)

    wait_for("the flood's nodes to expire", expired, 30)
    rows.append(wait_for("n0's row", lambda: n0(pool), 10))
    assert daemon.proc.poll() is None, daemon.log.read_text()[-3000:]
    lost = [e for e in logged(daemon, "node.lost") if e.get("node") == "n0"]
    assert not lost, f"n0 lost ({', '.join(str(e.get('reason')) for e in lost)}) while flooded: {load}"
    states = [r.state for r in rows]
    oldest = max(r.heartbeat_age_s for r in rows)
    assert len(rows) > 1 and "lost" not in states, (states, load)
    assert oldest < EXPIRY_S, (oldest, load)  # its heartbeats kept coming while the coordinator worked


def test_sigterm_stops_a_serving_dpd_cleanly(processes: Processes, tmp_path: Path) -> None:
    """SIGUSR1 first: every thread's stack in its log (what a dpd that will not stop waits on), and
    it runs on; then SIGTERM stops it."""
    _, daemon = serving(processes, tmp_path)
    os.kill(daemon.pid, signal.SIGUSR1)
    # every thread's stack, its main thread's too (in asyncio.run, from daemon/cli.py); written a
    # thread at a time, so the test waits for that one rather than for the dump's first line
    wait_for("its stacks in its log", lambda: f"daemon{os.sep}cli.py" in daemon.log.read_text(errors="replace"), 10)
    assert "most recent call first" in daemon.log.read_text(errors="replace")
    assert daemon.proc.poll() is None
    os.kill(daemon.pid, signal.SIGTERM)
    assert daemon.proc.wait(30) == 0, daemon.log.read_text()[-3000:]
    assert not alive(daemon.pid)
    assert pids_with(f"{tmp_path}{os.sep}") == []  # nothing it started outlives it
    assert logged(daemon, "node.stopped") and logged(daemon, "coordinator.stopped")
    assert not memory_root(daemon.state_dir).exists()  # it kept nothing in RAM: no empty folder left there


def settings(tmp_path: Path, serve: str) -> cli.Settings:
    return cli.Settings(
        join=None, serve=serve, name="n0", advertise="127.0.0.1", workers=1, state_dir=tmp_path / "state", insecure=False,
        heartbeat_interval=0.05, liveness=4, stop_grace=1.0, log_level="info",
    )


def test_an_address_in_use_is_refused_before_the_agent_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with structlog.testing.capture_logs() as logs:
            assert asyncio.run(cli.serve_and_run(settings(tmp_path, addr))) == 1
    assert f"dpd: cannot serve on {addr}: " in capsys.readouterr().err
    events = [e["event"] for e in logs]
    assert "coordinator.bind_failed" in events and "node.registered" not in events, events
    assert "peer_budget.failed" not in events, events  # the socket's guard was stopped with it, not left to a terminated context


def test_a_coordinator_that_dies_ends_the_dpd_with_code_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def dies(self: Coordinator, stopping: asyncio.Event) -> None:
        raise RuntimeError("a bug in the coordinator")

    monkeypatch.setattr(Coordinator, "run", dies)
    with structlog.testing.capture_logs() as logs:
        assert asyncio.run(cli.serve_and_run(settings(tmp_path, "tcp://127.0.0.1:*"))) == 1
    crashed = [e for e in logs if e["event"] == "coordinator.crashed"]
    assert len(crashed) == 1 and "a bug in the coordinator" in crashed[0]["error"], logs
