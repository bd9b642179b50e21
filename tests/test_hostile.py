"""Each attack of issue 8 against a real coordinator (`dpd run --serve`, real sockets): every one is
answered with an error that names the field, the daemon lives on, and the pool still works.

One pool serves the whole module (starting one costs seconds); every test ends by checking that the
daemon answers, still holds its node and takes a new registration, and the last one trains a job.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from conftest import Processes
from peers import PeakRss, Peer, Served, raw, rss_mib

from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

JOB_DOC = parse_job({"name": "ok"}).to_dict()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hostile")
    procs = Processes(str(root))
    try:
        yield Served(procs, root)
    finally:
        procs.stop_all()


@pytest.fixture
def peer(pool: Served) -> Iterator[Peer]:
    p = Peer(pool.addr)
    try:
        yield p
    finally:
        p.close()


def register(info: dict[str, object], msg_id: int = 7) -> list[bytes]:
    return raw("node.register", {"name": "evil", "incarnation": "x", "info": info}, msg_id)


def refused(reply: m.Message, code: str, *words: str) -> str:
    assert isinstance(reply, m.Error) and reply.code == code, reply
    assert all(w in reply.message for w in words), reply.message
    return reply.message


def test_string_slots(pool: Served, peer: Peer) -> None:
    text = refused(peer.ask(register({"slots": "x"})), "bad_body", "info.slots")
    assert "info.slots: must be an integer in [1, 1024], got 'x'" in text
    pool.works()


def test_string_memory_bytes(pool: Served, peer: Peer) -> None:
    refused(peer.ask(register({"slots": 1, "memory_bytes": "x"})), "bad_body", "info.memory_bytes", "got 'x'")
    pool.works()


def test_bytes_platform(pool: Served, peer: Peer) -> None:
    refused(peer.ask(register({"slots": 1, "platform": b".."})), "bad_body", "info.platform", "b'..'")
    pool.works()


def test_chip_nested_300_deep(pool: Served, peer: Peer) -> None:
    chip: object = "x"
    for _ in range(300):
        chip = [chip]
    refused(peer.ask(register({"slots": 1, "chip": chip})), "bad_body", "info.chip", "a list of 1")
    pool.works()


def test_a_billion_slots(pool: Served, peer: Peer) -> None:
    refused(peer.ask(register({"slots": 10**9})), "bad_request", "info.slots", str(10**9))
    pool.works()


@pytest.mark.parametrize("name", ["a/b", "..", "../../etc", "-x", "evil\x1b[31mRED", "nl\nfake   127.0.0.1   lo   idle", "\x00", "tab\tx", " sp ", "Mac1"])
def test_a_node_name_that_is_a_path_a_flag_or_a_control_sequence_is_refused(pool: Served, peer: Peer, name: str) -> None:
    reply = peer.ask(raw("node.register", {"name": name, "incarnation": "x", "info": {"slots": 1}}, 7))
    refused(reply, "bad_request", "name: must be 1-63 lower-case letters, digits, '.', '_' and '-', starting with a letter or a digit")
    pool.works()


def test_control_characters_a_node_reports_are_shown_escaped_by_dpctl_nodes(pool: Served, peer: Peer) -> None:
    """A chip that clears the terminal, an MLX version that sets its title: `dpctl nodes` prints
    each on its row as escapes (it printed them raw, and a newline made a row of its own)."""
    assert isinstance(peer.register("odd", slots=1, chip="\x1b[2J\x1b[31mPWNED", mlx_version="\x1b]0;title\x07", interface="eth\n0"), m.NodeRegistered)
    out = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "nodes"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("odd "))
    assert "\\x1b[2J\\x1b[31mPWNED" in row and "\\x1b]0;title\\x07" in row and "eth\\n0" in row
    assert len(out.stdout.splitlines()) == 1 + len(pool.call(m.Nodes(), m.NodesReply).nodes)  # one line a node
    peer.send(m.NodeBye().to_frames())
    pool.works()


def _as_node(peer: Peer) -> None:
    assert isinstance(peer.register("evil", slots=1), m.NodeRegistered)


def test_a_step_of_2_64_in_progress(pool: Served, peer: Peer) -> None:
    _as_node(peer)
    body = {"job": "j", "generation": 1, "rank": 0, "step": 2**64 - 1, "loss": 1.0, "tokens": 1, "seconds": 0.1}
    refused(peer.ask(raw("node.progress", body, 11)), "bad_request", "node.progress step", str(2**64 - 1))
    time.sleep(1.0)  # two ticks and commits: nothing of it reached the store or the timers
    peer.send(m.NodeBye().to_frames())
    pool.works()


def test_a_step_of_2_64_in_checkpoint(pool: Served, peer: Peer) -> None:
    _as_node(peer)
    body = {"job": "j", "generation": 1, "rank": 0, "slot": 0, "step": 2**64 - 1, "seconds": 0.1}
    refused(peer.ask(raw("node.checkpoint", body, 12)), "bad_request", "node.checkpoint step")
    time.sleep(1.0)
    peer.send(m.NodeBye().to_frames())
    pool.works()


def test_infinite_seconds(pool: Served, peer: Peer) -> None:
    _as_node(peer)
    body = {"job": "j", "generation": 1, "rank": 0, "step": 3, "loss": 1.0, "tokens": 1, "seconds": float("inf")}
    refused(peer.ask(raw("node.progress", body, 13)), "bad_request", "node.progress seconds", "finite", "inf")
    body["seconds"], body["loss"] = 0.1, float("nan")
    refused(peer.ask(raw("node.progress", body, 14)), "bad_request", "node.progress loss", "nan")
    peer.send(m.NodeBye().to_frames())
    pool.works()


def test_metrics_after_2_64_logs_no_traceback(pool: Served, peer: Peer) -> None:
    before = pool.log.stat().st_size
    for i in range(300):
        refused(peer.ask(raw("metrics", {"job": "ok", "after": 2**64 - 1}, 100 + i)), "bad_request", "metrics after")
    grown = pool.log.stat().st_size - before
    print(f"log grew {grown} bytes for 300 bad metrics requests")
    assert pool.tracebacks() == 0
    assert grown < 16 * 1024  # rate-limited: a few lines and a count, not 300 tracebacks (204 KiB before)
    pool.works()


def test_amplification_body_is_refused_before_it_is_built(pool: Served, peer: Peer) -> None:
    # A status request whose 4 MiB body is one list of 4 million empty lists (64 bytes each, built).
    n = m.MAX_BODY_BYTES - 16
    body = b"\x81\xa3job\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    assert len(body) <= m.MAX_BODY_BYTES
    watch = PeakRss(pool.proc.pid)
    t0 = time.monotonic()
    for i in range(10):
        refused(peer.ask(raw("status", body, 200 + i)), "too_large", "more than 100000 objects")
    seconds = time.monotonic() - t0
    grown = watch.stop()
    print(f"10 amplification bodies: {seconds:.2f}s, dpd peak RSS +{grown:.1f} MiB (from {watch.base:.1f})")
    assert grown < 48  # 10 x 4 MiB of frames pass through; 4 million lists (~300 MiB) are never built
    pool.works()


def test_a_client_that_never_reads_costs_bounded_memory(pool: Served, tmp_path: Path) -> None:
    # Rows as large as their bounds allow make each `nodes` reply about 20 KiB.
    fakes = [Peer(pool.addr) for _ in range(24)]
    for i, f in enumerate(fakes):
        info = {"slots": 1024, "platform": "p" * 64, "chip": "c" * 256, "mlx_version": "v" * 64, "backend": "b" * 64, "python": "y" * 64, "advertise": "a" * 255}
        assert isinstance(f.register(f"fake-{i:02d}-" + "x" * 50, **info), m.NodeRegistered)
    reply = pool.call(m.Nodes(), m.NodesReply)
    size = len(reply.to_frames()[1])
    requests = 6000
    lazy = Peer(pool.addr, rcvhwm=1)  # it takes (almost) nothing off the wire
    watch = PeakRss(pool.proc.pid)
    try:
        for i in range(requests):
            lazy.send(m.Nodes().to_frames(i + 1))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # until the coordinator has answered every one it will
            time.sleep(0.5)
            if rss_mib(pool.proc.pid) <= watch.peak and time.monotonic() > deadline - 10:
                break
        grown = watch.stop()
    finally:
        lazy.close()
        for f in fakes:
            f.send(m.NodeBye().to_frames())
            f.close()
    unbounded = requests * size / 2**20
    print(f"{requests} unread replies of {size} bytes ({unbounded:.0f} MiB): dpd peak RSS +{grown:.1f} MiB")
    assert grown < min(48, unbounded / 2)  # at most HWM (1000) replies are queued for one peer
    pool.works()


def test_a_job_name_with_a_trailing_newline(pool: Served, peer: Peer) -> None:
    reply = peer.ask(raw("submit", {"job": {**JOB_DOC, "name": "abc\n"}, "source": "evil.toml"}, 21))
    refused(reply, "bad_job", "evil.toml: name = 'abc\\n'")
    pool.works()


def test_an_infinite_start_timeout(pool: Served, peer: Peer, tmp_path: Path) -> None:
    doc = {**JOB_DOC, "recovery": {**JOB_DOC["recovery"], "start_timeout_s": float("inf")}}
    refused(peer.ask(raw("submit", {"job": doc}, 22)), "bad_request", "submit job.recovery.start_timeout_s", "finite")
    path = tmp_path / "inf.toml"
    path.write_text('name = "inf"\n[recovery]\nstart_timeout_s = inf\n')
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "submit", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "recovery.start_timeout_s = inf" in r.stderr and "Traceback" not in r.stderr, r.stderr
    pool.works()


def test_a_message_of_ten_thousand_frames(pool: Served, peer: Peer) -> None:
    frames = m.Status().to_frames(31)
    refused(peer.ask([*frames, *([b""] * 10_000)]), "bad_frame", "expected 2 frames (header, body), got more than 2")
    pool.works()


def test_a_type_the_coordinator_never_takes_is_not_unpacked(pool: Served, peer: Peer) -> None:
    rows = msgpack.packb({"jobs": [[] for _ in range(150_000)]})  # a status.reply is dpctl's to read
    refused(peer.ask(raw("status.reply", rows, 32)), "unexpected", "status.reply is not accepted here")
    pool.works()


def test_an_error_from_a_peer_that_never_registered_is_not_answered(pool: Served, peer: Peer) -> None:
    """It was answered `error unexpected`: two such peers would answer each other forever. The
    next reply the peer gets is the one to its next request."""
    peer.send(raw("error", {"code": "x", "message": "y"}, 41))
    reply, reply_id = peer.next_reply(m.Nodes().to_frames(42))
    assert reply_id == 42 and isinstance(reply, m.NodesReply), reply
    pool.works()


def test_after_all_that_the_pool_trains_a_job(pool: Served) -> None:
    job = pool.submit("after-hostile")
    final = pool.wait_end(job)
    assert final.state == "succeeded", pool.log.read_text()[-3000:]
    assert pool.tracebacks() == 0


def test_a_daemon_with_more_slots_than_a_node_may_have_exits_1_saying_why(pool: Served, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dpool.daemon.cli", "run", "--name", "wide", "--workers", "2000", "--state-dir", str(tmp_path / "wide"), "--join", pool.addr]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "info.slots: must be an integer in [1, 1024], got 2000" in r.stderr, r.stderr[-2000:]
    pool.works()
