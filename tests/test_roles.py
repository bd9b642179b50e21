"""Roles and robust keys (issue 9), on real CURVE sockets: a key does only its role's work, a node
key is bound to its name and to its ranks, a restarted dpd with its own key replaces its old
process at once, and a bad file in allowed/ never stops the coordinator's handshakes. Every refusal
is logged.

A real Coordinator with `dpctl keys init` keys, on loopback, its loop in a thread of this process
(`peers.Running`, whose `logs` are what it logged); the peers are DEALERs holding the keys a node,
a client or a viewer holds (their bundles). The allow-list's reading rules are checked directly.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq.auth
from conftest import wait_for
from peers import Peer, Running

from dpool.client.keys import Pair, add_key, init_keys
from dpool.client.rpc import Client, Unreachable
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import TrainRow
from dpool.protocol.security import AllowList, KeysError, client_keys, server_keys
from dpool.protocol.sharing import Queue, QueueReply, SetPriority

JOB = parse_job({"name": "two", "workers": {"min": 2, "max": 2}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """Nodes a and b, dpctl's default client, client alice and viewer dash."""
    d = tmp_path / "keys"
    init_keys(d, nodes=["a", "b"], clients=["alice"])
    add_key(d, Pair("viewer", "dash"))
    return d


@pytest.fixture
def coord(tmp_path: Path, keys: Path) -> Iterator[Running]:
    c = Running(tmp_path, keys=server_keys(keys), client=client_keys(keys, "client"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def connect(coord: Running, keys: Path) -> Iterator[Callable[..., Peer]]:
    """A peer holding the keys of node NAME (`connect("node", "a")`), of the default client
    (`connect("client")`), or of bundle NAME's client (`connect("client", "alice")`)."""
    made: list[Peer] = []

    def peer(role: str, name: str | None = None) -> Peer:
        if role == "node":
            pair = client_keys(keys / "bundles" / str(name), "node", name)
        else:
            pair = client_keys(keys / "bundles" / name if name else keys, "client")
        made.append(Peer(coord.addr, keys=pair))
        return made[-1]

    try:
        yield peer
    finally:
        for p in made:
            p.close()


def forbidden(reply: m.Message, *words: str) -> None:
    assert isinstance(reply, m.Error) and reply.code == "forbidden", reply
    assert all(w in reply.message for w in words), reply.message


def logged(coord: Running, event: str, **fields: Any) -> list[dict[str, Any]]:
    return [e for e in coord.events(event) if all(e.get(k) == v for k, v in fields.items())]


def public(path: Path) -> bytes:
    return zmq.auth.load_certificate(path)[0]


def test_the_client_key_cannot_register_and_a_node_key_cannot_send_client_requests(coord: Running, connect: Callable[..., Peer]) -> None:
    client = connect("client")
    forbidden(client.register("a", slots=1), "node.register", "client key (client:client)")
    node = connect("node", "a")
    for msg in (m.Submit(job=JOB, source="x.toml"), m.Cancel(job="x"), m.Drain(node="b"), m.Status(), m.Rm(job="x")):
        forbidden(node.message(msg), str(msg.TYPE), "node key (node:a)")
    viewer = connect("client", "dash")  # a read-only client: it reads, and changes nothing
    assert isinstance(viewer.message(m.Status()), m.StatusReply) and isinstance(viewer.message(m.Nodes()), m.NodesReply)
    for msg in (m.Submit(job=JOB, source="x.toml"), m.Cancel(job="x"), m.Drain(node="a"), m.Export(job="x"), m.Rm(job="x")):
        forbidden(viewer.message(msg), str(msg.TYPE), "viewer key (viewer:dash)")

    assert coord.call(m.Nodes(), m.NodesReply).nodes == [] and coord.call(m.Status(), m.StatusReply).jobs == []
    seen = {(e["user"], e["type"]) for e in coord.events("auth.forbidden")}
    assert seen == {
        ("client:client", "node.register"),
        *(("node:a", t) for t in ("submit", "cancel", "drain", "status", "rm")),
        *(("viewer:dash", t) for t in ("submit", "cancel", "drain", "export", "rm")),
    }


def test_a_node_key_registers_under_its_own_name_only(coord: Running, connect: Callable[..., Peer]) -> None:
    a = connect("node", "a")
    forbidden(a.register("b", slots=1), "may register as 'a' only, not as 'b'")
    assert logged(coord, "auth.forbidden", user="node:a", type="node.register")
    assert isinstance(a.register("a", slots=1), m.NodeRegistered)
    assert [n.name for n in coord.call(m.Nodes(), m.NodesReply).nodes] == ["a"]


def test_a_node_cannot_report_another_nodes_ranks(coord: Running, connect: Callable[..., Peer]) -> None:
    a, b = connect("node", "a"), connect("node", "b")
    for name, peer in (("a", a), ("b", b)):
        assert isinstance(peer.register(name, slots=1, advertise="127.0.0.1"), m.NodeRegistered)
    job = coord.call(m.Submit(job=JOB, source="two.toml"), m.Submitted).job_id
    ranks = {}
    for port, peer in enumerate((a, b), 40001):
        prepare = peer.next(m.GroupPrepare)
        peer.send(m.NodePrepared(job=prepare.job, generation=prepare.generation, host="127.0.0.1", ports=[port]).to_frames())
    for name, peer in (("a", a), ("b", b)):
        ranks[name] = peer.next(m.GroupStart).ranks[0].rank
    rank0 = "a" if ranks["a"] == 0 else "b"
    other = "b" if rank0 == "a" else "a"
    liar, victim = {"a": a, "b": b}[other], ranks[rank0]

    # The node without rank 0 claims it exited, sends its log lines, and rank 0's metrics.
    liar.send(m.NodeWorkerExited(job=job, generation=1, rank=victim, slot=0, code=1, stopped=False).to_frames())
    liar.send(m.NodeLogs(job=job, generation=1, rank=victim, lines=["forged"]).to_frames())
    row = TrainRow(kind="train", step=1, loss=9.0, lr=1e-3, tokens=8, tokens_per_s=1.0, world_size=2)
    liar.send(m.NodeMetric(job=job, generation=1, row=row).to_frames())
    kinds = ("node.worker_exited", "node.logs", "node.metric")
    refusals = wait_for("the refusals logged", lambda: [e for e in coord.events("report.refused") if e["node"] == other] if len(coord.events("report.refused")) >= 3 else None, 10)
    assert sorted(e["type"] for e in refusals) == sorted(kinds)
    assert all(f"rank {victim} of job {job} generation 1 runs on node {rank0}" in e["reason"] for e in refusals)
    status = coord.call(m.Status(job=job), m.StatusReply).jobs[0]
    assert status.state == "starting" and status.generation == 1 and status.loss is None
    assert coord.call(m.Logs(job=job), m.LogsReply).lines == [] and coord.call(m.Metrics(job=job), m.MetricsReply).rows == []

    # The node the plan gave that rank is heard: its exit fails the group.
    {"a": a, "b": b}[rank0].send(m.NodeWorkerExited(job=job, generation=1, rank=victim, slot=0, code=1, stopped=False).to_frames())
    wait_for("the owner's report to restart the job", lambda: coord.call(m.Status(job=job), m.StatusReply).jobs[0].state == "recovering", 10)


def test_a_restarted_dpd_with_its_own_key_replaces_its_old_process_once_that_is_silent(coord: Running, connect: Callable[..., Peer]) -> None:
    old = connect("node", "a")
    assert isinstance(old.register("a", incarnation="first", slots=1), m.NodeRegistered)
    second = connect("node", "a").register("a", incarnation="second", slots=1)  # while the old one was just heard
    assert isinstance(second, m.Error) and second.code == "node_busy" and "held by a live dpd with the same key on this machine" in second.message, second
    assert not logged(coord, "node.replaced", node="a")
    # The old process heartbeats no more (it crashed, or hangs): two periods on, the same machine's
    # new dpd replaces it.
    def registered() -> Peer | None:
        peer = connect("node", "a")
        return peer if isinstance(peer.register("a", incarnation="second", slots=1), m.NodeRegistered) else None

    wait_for("the new dpd registered", registered, 10, every=0.2)
    wait_for("node.replaced logged", lambda: logged(coord, "node.replaced", node="a"), 10)
    (row,) = coord.call(m.Nodes(), m.NodesReply).nodes
    assert row.name == "a" and row.state == "idle"
    # The old connection is no longer node a's: it is told to register again.
    reply = old.message(m.NodeHeartbeat())
    assert isinstance(reply, m.Error) and reply.code == "not_registered"


def test_a_malformed_allowed_file_does_not_stop_other_handshakes(coord: Running, connect: Callable[..., Peer], keys: Path) -> None:
    allowed = keys / "allowed"
    (allowed / "nodes" / "garbage.key").write_text("public-key")  # zmq.auth raises IndexError on it
    (allowed / "clients" / "binary.key").write_bytes(os.urandom(200))
    assert coord.call(m.Status(), m.StatusReply).jobs == []  # a handshake, with both files there
    skipped = {Path(e["file"]).name for e in coord.events("auth.key_skipped")}
    assert {"garbage.key", "binary.key"} <= skipped

    # Node b's file damaged: b is refused (logged with its key), the others are not; once the file
    # is good again b is admitted, with no restart.
    good = (allowed / "nodes" / "b.key").read_bytes()
    replace(allowed / "nodes" / "b.key", b"public-key = \"not a key\"\n")
    refused_b = connect("node", "b")
    refused_b.send(m.NodeRegister(name="b", incarnation="x", info=m.NodeInfo(slots=1)).to_frames())
    b_key = public(keys / "node-b.key").decode()
    wait_for("b's key refused", lambda: logged(coord, "auth.refused", key=b_key), 10)
    assert isinstance(connect("node", "a").register("a", slots=1), m.NodeRegistered)
    replace(allowed / "nodes" / "b.key", good)
    assert isinstance(connect("node", "b").register("b", slots=1), m.NodeRegistered)

    # The ZAP handler itself failing (a bug, a disk error) costs one handshake, not the next ones.
    curve = coord.coord.curve
    assert curve is not None
    real, failed = curve.allowed.get, list[bytes]()

    def broken(key: bytes) -> str | None:
        if not failed:
            failed.append(key)
            raise RuntimeError("the disk is on fire")
        return real(key)

    curve.allowed.get = broken  # type: ignore[method-assign]
    with contextlib.suppress(Unreachable), Client(coord.addr, 1.0, client_keys(keys, "client")) as c:
        c.call(m.Status(), m.StatusReply)  # its handshake meets the fault, answered 500 (ZeroMQ may try again)
    assert failed and "the disk is on fire" in logged(coord, "auth.handler_failed")[0]["error"]
    assert coord.call(m.Status(), m.StatusReply).jobs == []  # the handshakes after it are served


def replace(path: Path, data: bytes) -> None:
    """Write a file the way `dpctl keys` does: a new file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def test_revoking_a_key_takes_effect_for_new_connections_without_a_restart(coord: Running, keys: Path) -> None:
    alice = client_keys(keys / "bundles" / "alice", "client")
    with Client(coord.addr, 5.0, alice) as c:
        assert c.call(m.Nodes(), m.NodesReply).nodes == []
    (keys / "allowed" / "clients" / "alice.key").unlink()  # at once: the read before is not trusted for SETTLED_S
    with pytest.raises(Unreachable), Client(coord.addr, 1.0, alice) as c:
        c.call(m.Nodes(), m.NodesReply)
    assert logged(coord, "auth.refused", key=public(keys / "client-alice.key").decode())
    assert coord.call(m.Nodes(), m.NodesReply).nodes == []  # the default client is still admitted


# -- the allow-list's rules ----------------------------------------------------------------------


def test_the_allow_list_is_read_again_only_when_a_folder_changes(keys: Path) -> None:
    warned: list[tuple[str, dict[str, Any]]] = []
    allowed = keys / "allowed"
    a, alice = public(keys / "node-a.key"), public(keys / "client-alice.key")
    settled = AllowList(allowed, lambda event, what, **f: warned.append((event, f)), settled_s=-1.0)  # trusts its cache at once
    assert settled.get(a) == "node:a" and settled.get(alice) == "client:alice" and settled.get(b"x" * 40) is None
    assert settled.reads == 1  # three handshakes, one read
    (allowed / "nodes" / "a.key").unlink()
    assert settled.get(a) is None and settled.reads == 2
    assert settled.get(alice) == "client:alice" and settled.reads == 2

    fresh = AllowList(allowed, lambda *_, **__: None)  # folders changed a moment ago: not trusted yet
    fresh.get(alice)
    fresh.get(alice)
    assert fresh.reads == 2

    # A folder that group or others can write admits nobody; a stray file or a key in two places is skipped.
    (allowed / "clients").chmod(0o770)
    assert settled.get(alice) is None
    assert ("auth.allow_list_refused", {"folder": str(allowed / "clients"), "reason": f"writable by group or others (mode 770); run `chmod go-w {allowed / 'clients'}`"}) in warned
    (allowed / "clients").chmod(0o700)
    (allowed / "stray.key").write_bytes((keys / "node-b.key").read_bytes())
    (allowed / "viewers" / "b.key").write_bytes((keys / "node-b.key").read_bytes())
    assert settled.get(public(keys / "node-b.key")) is None and settled.get(alice) == "client:alice"
    reasons = {Path(f["file"]).name: f["reason"] for e, f in warned if e == "auth.key_skipped"}
    assert "outside the role folders" in reasons["stray.key"] and "the same key is also in" in reasons["b.key"]


def test_a_key_directory_that_others_can_write_is_refused(keys: Path) -> None:
    for folder in (keys, keys / "allowed", keys / "allowed" / "nodes"):
        folder.chmod(0o777)
        with pytest.raises(KeysError, match="writable by group or others"):
            server_keys(keys)
        folder.chmod(0o700)
    bundle = keys / "bundles" / "a"
    bundle.chmod(0o775)
    with pytest.raises(KeysError, match=f"{bundle}: key directory writable by group or others"):
        client_keys(bundle, "node", "a")


def test_a_viewer_reads_the_queue_and_cannot_change_a_priority(coord: Running, connect: Callable[..., Peer]) -> None:
    viewer = connect("client", "dash")
    assert isinstance(viewer.message(Queue()), QueueReply)
    forbidden(viewer.message(SetPriority(job="x", priority=3)), "priority", "viewer key (viewer:dash)")
    reply = connect("client").message(SetPriority(job="x", priority=3))
    assert isinstance(reply, m.Error) and reply.code == "not_found"  # a client may; there is no job x


def test_dpctl_test_with_a_viewer_key_is_refused_naming_the_command(coord: Running, keys: Path) -> None:
    """`dpctl test` asks a node for the checkpoint through the export relay; refused for a viewer,
    it says so about `test` (the coordinator names the request it refused: an export)."""
    job = coord.call(m.Submit(job=JOB, source="two.toml"), m.Submitted).job_id
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", coord.addr, "--keys", str(keys / "bundles" / "dash"), "test", job],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.startswith("dpctl: test: a node runs the checkpoint for it, which this key may not ask for"), r.stderr
    assert "viewer key (viewer:dash)" in r.stderr, r.stderr
