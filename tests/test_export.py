"""`dpctl export` and the reason a failed start gives, end to end: real `dpd` processes on loopback,
real trainers, `dpctl`; and the two halves of the export (the coordinator's relay, a node's
exporter) tested alone with an injected clock or a stand-in trainer.

The pool's two daemons run with their own HOME each, so a job whose data path starts with `~`
names a folder that exists on one node and not on the other, as it would on two machines.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import HomesPool, Processes, free_port, pids_with, wait_for
from jobs import write_job

from dpool.daemon import export_relay as xr
from dpool.daemon import jobstate as js
from dpool.daemon.exporter import Exporter, ExportError
from dpool.protocol import messages as m
from dpool.protocol.payloads import ExportFile, JobStatus

# Two ranks, checkpoints at steps 3 and 6; the model is a few MB, so an export is several chunks.
JOB = {"workers": {"min": 2, "max": 2}, "model": {"dim": 224}, "train": {"steps": 6}, "checkpoint": {"every_steps": 3}, "eval": {"sample_tokens": 4}}
JOB_TIMEOUT = 150.0


def has_export() -> bool:
    r = subprocess.run([sys.executable, "-m", "dpool.trainer", "--help"], capture_output=True, text=True, timeout=60)
    return "--export" in r.stdout


needs_export = pytest.mark.skipif(not has_export(), reason="the trainer has no --export yet")


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HomesPool]:
    root = tmp_path_factory.mktemp("export")
    procs = Processes(str(root))
    try:
        yield HomesPool(procs, root).start(1, 1)
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def trained(pool: HomesPool) -> tuple[str, Path]:
    """A two-rank job trained to the end: checkpoints of steps 3 and 6 on both nodes. (Its model is
    a few MB: several chunks of the export, in flight together.)"""
    path = write_job(pool.root, "tiny", **JOB)
    job_id = pool.submit(path)
    final = pool.wait_end(job_id, JOB_TIMEOUT, every=0.25)
    assert final.state == "succeeded", (final, pool.dpctl("logs", job_id).stdout[-3000:])
    return job_id, path


def local_export(job: Path, run_dir: Path, out: Path, step: int | None = None) -> None:
    cmd = [sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir), "--export", str(out)]
    r = subprocess.run(cmd + (["--step", str(step)] if step is not None else []), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(pool: HomesPool) -> list[str]:
    """Export folders still on a node, and temporary folders dpctl left beside its targets."""
    on_nodes = [str(p) for p in pool.root.glob("state-*/exports/*")]
    return on_nodes + [str(p) for p in pool.root.glob(".*.export-*")]


# -- end to end --------------------------------------------------------------------------------


@needs_export
def test_export_writes_what_the_trainer_writes_from_that_nodes_run_dir(pool: HomesPool, trained: tuple[str, Path]) -> None:
    job_id, job = trained
    out = pool.root / "out"
    r = pool.dpctl("export", job_id, str(out), "--json", timeout=180)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["job"], got["step"], got["dir"]) == (job_id, 6, str(out)) and got["node"] in ("n0", "n1")
    local = pool.root / "local"
    local_export(job, pool.root / f"state-{got['node']}" / "jobs" / job_id / "slot-0", local)
    files = tree(out)
    assert files and files == tree(local)  # byte for byte
    assert sorted(f["name"] for f in got["files"]) == sorted(files)
    assert got["bytes"] == sum(len(b) for b in files.values()) > 2 * m.EXPORT_CHUNK_MAX
    assert all(f["sha256"] == hashlib.sha256(files[f["name"]]).hexdigest() for f in got["files"])
    # and it loads as README says, and generates
    from dpool.trainer.gpt_task import load_exported
    from dpool.trainer.model import generate

    model = load_exported(out)
    assert len(generate(model, b"def ", 8, seed=0)) == 12
    from dpool.trainer.lm import ModelError

    (out / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="not a built-in GPT export"):
        load_exported(out)
    (out / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ModelError, match=re.escape("is not a built-in GPT's (an mlx_lm job's export loads with mlx_lm.load)")):
        load_exported(out)

    # --step picks that checkpoint; the job by its name; a human summary without --json.
    out3 = pool.root / "out3"
    r = pool.dpctl("export", "tiny", str(out3), "--step", "3", timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"job {job_id} step 3 from node " in r.stdout and str(out3) in r.stdout
    node = r.stdout.split("from node ", 1)[1].split()[0]
    local3 = pool.root / "local3"
    local_export(job, pool.root / f"state-{node}" / "jobs" / job_id / "slot-0", local3, step=3)
    assert tree(out3) == tree(local3) != files
    wait_for("the nodes' export folders deleted", lambda: not leftovers(pool), 10)


@needs_export
def test_export_refuses_bad_input_with_exit_2(pool: HomesPool, trained: tuple[str, Path]) -> None:
    job_id, _ = trained
    r = pool.dpctl("export", "no-such-job", str(pool.root / "x"))
    assert r.returncode == 2 and "no-such-job" in r.stderr and "Traceback" not in r.stderr
    r = pool.dpctl("export", job_id, str(pool.root / "x"), "--step", "4", timeout=180)
    assert r.returncode == 2 and "step 4" in r.stderr, r.stderr
    r = pool.dpctl("export", job_id, str(pool.root / "x"), "--step", "99")
    assert r.returncode == 2 and "step 99" in r.stderr and "step 6" in r.stderr, r.stderr
    assert not (pool.root / "x").exists()

    full = pool.root / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    r = pool.dpctl("export", job_id, str(full))
    assert r.returncode == 2 and "not empty" in r.stderr and str(full) in r.stderr
    # Refused before anything is asked of anybody: even with no control plane to reach.
    nobody = f"tcp://127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", nobody, "--timeout", "1", "export", job_id, str(full)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not empty" in r.stderr
    assert tree(full) == {"keep.txt": b"mine"}
    assert not leftovers(pool)


def _dealer(ctx: zmq.Context[Any], addr: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def _ask(sock: zmq.Socket[Any], frames: list[bytes], msg_id: int, timeout_s: float = 10) -> m.Message:
    sock.send_multipart(frames)
    while sock.poll(int(timeout_s * 1000)):
        reply, reply_id = m.decode(sock.recv_multipart())
        if reply_id == msg_id:
            return reply
    raise AssertionError(f"no answer to request {msg_id}")


@needs_export
def test_hostile_export_requests_get_errors_and_the_pool_keeps_working(pool: HomesPool, trained: tuple[str, Path]) -> None:
    job_id, _ = trained
    ctx = zmq.Context()
    a, b = _dealer(ctx, pool.addr), _dealer(ctx, pool.addr)
    try:
        ready = _ask(a, m.Export(job=job_id).to_frames(1), 1, timeout_s=180)
        assert isinstance(ready, m.ExportReply) and ready.step == 6, ready
        eid, name, size = ready.export_id, ready.files[0].name, ready.files[0].bytes
        cases: list[tuple[zmq.Socket[Any], list[bytes], str]] = [
            (a, m.ExportRead(export_id="0" * 32, name=name, offset=0).to_frames(10), "not_found"),
            (b, m.ExportRead(export_id=eid, name=name, offset=0).to_frames(11), "not_found"),  # not b's export
            (b, m.ExportClose(export_id=eid).to_frames(12), "not_found"),
            (a, m.ExportRead(export_id=eid, name="../../../../etc/passwd", offset=0).to_frames(13), "not_found"),
            (a, m.ExportRead(export_id=eid, name="/etc/passwd", offset=0).to_frames(14), "not_found"),
            (a, m.ExportRead(export_id=eid, name=name, offset=2**62).to_frames(15), "bad_request"),
            (a, m.ExportRead(export_id=eid, name=name, offset=-1).to_frames(16), "bad_request"),
            (a, m.ExportRead(export_id=eid, name=name, offset=0, size=0).to_frames(17), "bad_request"),
            (a, m.ExportRead(export_id=eid, name=name, offset=0, size=64 << 20).to_frames(18), "bad_request"),
            (a, [msgpack.packb(["dpool", 1, "export.read", 19]), msgpack.packb({"export_id": eid, "name": name, "offset": "0"})], "bad_body"),
            (a, [msgpack.packb(["dpool", 1, "export.read", 20]), msgpack.packb({"export_id": eid, "name": name, "offset": 0, "path": "/"})], "bad_body"),
            (a, m.NodeExportData(export_id=eid, name=name, offset=0, data=b"x" * 100).to_frames(21), "not_registered"),
            (a, m.ExportPrepare(export_id=eid, job=job_id).to_frames(22), "unexpected"),
            (a, m.Export(job=job_id, step=-3).to_frames(23), "bad_request"),
        ]
        for sock, frames, code in cases:
            msg_id = msgpack.unpackb(frames[0])[3]
            reply = _ask(sock, frames, msg_id)
            assert isinstance(reply, m.Error) and reply.code == code, (msg_id, reply)
        # The export is still whole for its owner: the last bytes of the file, then its end.
        tail = _ask(a, m.ExportRead(export_id=eid, name=name, offset=max(0, size - 10)).to_frames(30), 30)
        assert isinstance(tail, m.ExportData) and len(tail.data) == min(10, size)
        end = _ask(a, m.ExportRead(export_id=eid, name=name, offset=size).to_frames(31), 31)
        assert isinstance(end, m.ExportData) and end.data == b""
        assert isinstance(_ask(a, m.ExportClose(export_id=eid).to_frames(32), 32), m.ExportClosed)
        gone = _ask(a, m.ExportRead(export_id=eid, name=name, offset=0).to_frames(33), 33)
        assert isinstance(gone, m.Error) and gone.code == "not_found"
    finally:
        a.close()
        b.close()
        ctx.term()
    wait_for("the node's export folder deleted", lambda: not leftovers(pool), 10)
    assert all(d.proc.poll() is None for d in pool.daemons.values())
    r = pool.dpctl("export", job_id, str(pool.root / "after-hostile"), timeout=180)
    assert r.returncode == 0, r.stderr


def test_input_every_node_refuses_fails_the_job_at_once_naming_each_node_and_its_reason(pool: HomesPool) -> None:
    """Only n0 has the corpus (n1 fetches it from n0), and it is one document: no validation split,
    on every node alike. Each node sits the job out, and the job fails after that one attempt."""
    corpus = pool.home("n0") / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "text.txt").write_text(inspect.getsource(json) + inspect.getsource(subprocess))  # only n0 has it
    path = write_job(pool.root, "homes", **JOB, data={"source": "~/corpus/*.txt"})
    r = pool.dpctl("submit", str(path), "--follow", timeout=JOB_TIMEOUT)
    assert r.returncode == 1, (r.stdout, r.stderr[-2000:])
    job_id = r.stdout.split()[0]
    status = pool.dpctl_json("status", job_id)
    assert status["state"] == "failed"
    error = status["error"]
    assert error.startswith("no node can serve this job: n0: rank ") and "; n1: rank " in error and "validation split" in error, error
    assert "job.toml" not in error  # the daemon's own copy of the job file is no news to the user
    assert "\n" not in error and len(error) < 1000
    assert error in r.stderr  # what `submit --follow` ends with
    events = pool.dpctl_json("events", job_id)
    failed = [e for e in events if e["kind"] == "worker.failed" and e.get("code") == 2]
    assert {(e["node"], e["reason"]) for e in failed} == {("n0", "exit"), ("n1", "exit")} and "validation split" in failed[0]["error"]
    # Both in the one generation: its ranks refuse together, before either leaves, so the stop the
    # first refusal causes cannot silence the second (which left n0 to be asked again 30 s later).
    assert status["generation"] == 1, status
    assert {e["node"] for e in events if e["kind"] == "node.unfit"} == {"n0", "n1"}  # n1 first for lacking the files, until n0 named them
    kinds = [e["kind"] for e in events]
    assert "group.resumed" not in kinds and kinds[-1] == "job.failed"  # no restart was tried


def test_exit_2_after_a_peers_exit_leaves_its_node_out_without_using_a_restart() -> None:
    jm = js.JobMachine(max_restarts=5)
    jm.handle(js.Admitted(2), 0.0)
    jm.handle(js.GroupLaunched(1, 100.0), 0.0)
    jm.handle(js.RankExited(1, 0, "a", 1, False), 1.0)  # "connection to a peer was lost": a restart begins
    assert jm.state is js.JobState.RECOVERING and jm.restarts == 1
    out = jm.handle(js.RankExited(1, 1, "b", 2, False, "data.source = '~/x': no files"), 1.05)
    assert jm.state is js.JobState.RECOVERING and jm.restarts == 0 and jm.error is None
    assert js.Unfit("b", "rank 1: data.source = '~/x': no files") in out
    assert js.Emit("worker.failed", {"rank": 1, "node": "b", "reason": "exit", "code": 2, "error": "data.source = '~/x': no files"}) in out
    assert not any(isinstance(a, js.StopGroup) for a in out)  # the group was being stopped already


# -- the coordinator's relay, alone ------------------------------------------------------------


def _only(actions: list[xr.Action], kind: type) -> Any:
    assert len(actions) == 1 and isinstance(actions[0], kind), actions
    return actions[0]


def _ready(relay: xr.ExportRelay, client: bytes = b"A") -> tuple[str, int]:
    ask = _only(relay.start(0.0, client, 7, "j-1", None, [("n1", 6), ("n0", 3)]), xr.ToNode)
    assert ask.node == "n1" and ask.msg == m.ExportPrepare(export_id=ask.msg.export_id, job="j-1", step=None)
    files = [ExportFile(name="model.safetensors", bytes=3_000_000, sha256="a" * 64), ExportFile(name="sub/config.json", bytes=10, sha256="b" * 64)]
    reply = _only(relay.from_node(1.0, "n1", ask.msg_id, m.NodeExportReady(export_id=ask.msg.export_id, step=6, files=files)), xr.Reply)
    assert (reply.peer, reply.msg_id) == (client, 7) and isinstance(reply.msg, m.ExportReply)
    assert (reply.msg.node, reply.msg.step, reply.msg.files) == ("n1", 6, files)
    return ask.msg.export_id, ask.msg_id


def test_relay_serves_an_export_only_to_its_connection_and_only_inside_its_files() -> None:
    relay = xr.ExportRelay()
    eid, _ = _ready(relay)
    fetch = _only(relay.read(2.0, b"A", 8, m.ExportRead(export_id=eid, name="model.safetensors", offset=2_000_000)), xr.ToNode)
    assert fetch.msg == m.ExportFetch(export_id=eid, name="model.safetensors", offset=2_000_000, size=m.EXPORT_CHUNK_MAX)
    # Another node answering, or an answer to an unknown request, is ignored; the right one relayed.
    data = m.NodeExportData(export_id=eid, name="model.safetensors", offset=2_000_000, data=b"x" * 1_000_000)  # to the end of the file
    assert relay.from_node(2.1, "n0", fetch.msg_id, data) == [] and relay.from_node(2.1, "n1", 999, data) == []
    reply = _only(relay.from_node(2.1, "n1", fetch.msg_id, data), xr.Reply)
    assert reply.msg_id == 8 and isinstance(reply.msg, m.ExportData) and reply.msg.data == data.data
    refused = [
        (b"B", m.ExportRead(export_id=eid, name="model.safetensors", offset=0), "not_found"),
        (b"A", m.ExportRead(export_id=eid, name="../model.safetensors", offset=0), "not_found"),
        (b"A", m.ExportRead(export_id=eid, name="model.safetensors", offset=3_000_001), "bad_request"),
        (b"A", m.ExportRead(export_id=eid, name="model.safetensors", offset=0, size=m.EXPORT_CHUNK_MAX + 1), "bad_request"),
    ]
    for client, read, code in refused:
        with pytest.raises(m.ProtocolError) as e:
            relay.read(3.0, client, 9, read)
        assert e.value.code == code
    with pytest.raises(m.ProtocolError):
        relay.close(3.0, b"B", 10, eid)
    # A node sending more (or fewer) bytes than asked is an error for the client, not data.
    short = _only(relay.read(3.0, b"A", 11, m.ExportRead(export_id=eid, name="sub/config.json", offset=0)), xr.ToNode)
    bad = _only(relay.from_node(3.1, "n1", short.msg_id, m.NodeExportData(export_id=eid, name="sub/config.json", offset=0, data=b"y" * 11)), xr.Reply)
    assert isinstance(bad.msg, m.Error) and bad.msg.code == "export_failed"
    closed = relay.close(4.0, b"A", 12, eid)
    assert closed == [xr.ToNode("n1", 0, m.ExportRelease(export_id=eid)), xr.Reply(b"A", 12, m.ExportClosed(export_id=eid))]
    assert relay.sessions == {} and relay.waiting == {}


def test_relay_asks_the_next_holder_when_one_holds_nothing_or_is_lost_and_gives_up_in_time() -> None:
    relay = xr.ExportRelay(prepare_timeout_s=100.0, idle_s=50.0)
    with pytest.raises(m.ProtocolError) as e:
        relay.start(0.0, b"A", 1, "j-1", 9, [("n1", 6), ("n0", 3)])
    assert e.value.code == "not_found" and "step 9" in e.value.message and "step 6" in e.value.message
    first = _only(relay.start(0.0, b"A", 2, "j-1", 3, [("n0", 3), ("n1", 6)]), xr.ToNode)
    second = _only(relay.from_node(1.0, "n0", first.msg_id, m.Error(code="not_found", message="node n0 holds no step 3")), xr.ToNode)
    assert second.node == "n1" and second.msg.step == 3
    last = _only(relay.from_node(2.0, "n1", second.msg_id, m.Error(code="not_found", message="node n1 holds no step 3 (it holds steps 2, 4)")), xr.Reply)
    assert last.msg_id == 2 and last.msg.code == "not_found" and "step 3" in last.msg.message
    assert "(asked n0, n1: node n1 holds no step 3 (it holds steps 2, 4))" in last.msg.message, last.msg.message  # which steps exist

    # The node preparing it is lost: the next holder is asked; that one never answers.
    ask = _only(relay.start(10.0, b"A", 3, "j-1", None, [("n0", 6), ("n1", 6)]), xr.ToNode)
    retry = _only(relay.tick(11.0, lambda node: node != "n0"), xr.ToNode)
    assert retry.node == "n1" and retry.msg.export_id == ask.msg.export_id
    assert relay.tick(50.0, lambda node: True) == []
    out = relay.tick(111.0, lambda node: True)
    assert xr.ToNode("n1", 0, m.ExportRelease(export_id=ask.msg.export_id)) in out  # stops its trainer
    timed_out = next(a for a in out if isinstance(a, xr.Reply))
    assert timed_out.msg_id == 3 and timed_out.msg.code == "export_failed" and "did not answer" in timed_out.msg.message

    # A ready export nobody reads is released; a manifest with an unsafe name is refused whole.
    eid, _ = _ready(relay)
    assert relay.tick(40.0, lambda node: True) == []
    assert relay.tick(52.0, lambda node: True) == [xr.ToNode("n1", 0, m.ExportRelease(export_id=eid))]
    ask = _only(relay.start(60.0, b"A", 4, "j-1", None, [("n1", 6)]), xr.ToNode)
    evil = m.NodeExportReady(export_id=ask.msg.export_id, step=6, files=[ExportFile(name="../../.bashrc", bytes=1, sha256="c" * 64)])
    out = relay.from_node(61.0, "n1", ask.msg_id, evil)
    assert out[0] == xr.ToNode("n1", 0, m.ExportRelease(export_id=ask.msg.export_id))
    assert out[1].msg.code == "export_failed" and "unsafe" in out[1].msg.message
    # A node that comes back as a new dpd process has forgotten what it was asked.
    _only(relay.start(70.0, b"A", 5, "j-1", None, [("n1", 6)]), xr.ToNode)
    lost = _only(relay.node_restarted(71.0, "n1"), xr.Reply)
    assert lost.msg_id == 5 and lost.msg.code == "export_failed" and "n1 was lost" in lost.msg.message
    assert relay.sessions == {} and relay.waiting == {}


# -- dpctl against a coordinator that lies -----------------------------------------------------


class LyingCoordinator(threading.Thread):
    """Answers dpctl the way a hostile or broken peer might: the client must check everything."""

    def __init__(self, files: list[dict[str, Any]], data: dict[str, bytes]) -> None:
        super().__init__(daemon=True)
        self.files, self.data, self.closed = files, data, False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stopping = threading.Event()

    def answer(self, msg: m.Message) -> m.Message:
        match msg:
            case m.Status():
                return m.StatusReply(jobs=[JobStatus(id="j-1", name="j", state="succeeded", step=6, steps=6, generation=1, world_size=0, workers=[], checkpoint_step=6, loss=None, val_loss=None, error=None)])
            case m.Export():
                return m.ExportReply(export_id="e", job_id="j-1", node="evil", step=6, files=self.files)
            case m.ExportRead(name=name, offset=offset, size=size):
                return m.ExportData(export_id="e", name=name, offset=offset, data=self.data[name][offset : offset + size])
            case m.ExportClose():
                self.closed = True
                return m.ExportClosed(export_id="e")
        return m.Error(code="unexpected", message=str(msg.TYPE))

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.sock.poll(50):
                peer, *frames = self.sock.recv_multipart()
                msg, msg_id = m.decode(frames)
                self.sock.send_multipart([peer, *self.answer(msg).to_frames(msg_id)])
        self.sock.close()
        self.ctx.term()


@pytest.mark.parametrize(
    ("name", "announced", "sent", "complaint"),
    [
        ("../escaped.txt", b"abc", b"abc", "unusable export manifest"),
        ("/tmp/absolute.txt", b"abc", b"abc", "unusable export manifest"),
        ("a/../../escaped.txt", b"abc", b"abc", "unusable export manifest"),
        ("model.safetensors", b"x" * (m.EXPORT_CHUNK_MAX + 5), b"y" * (m.EXPORT_CHUNK_MAX + 5), "sha256"),
    ],
    ids=["parent", "absolute", "parent-inside", "wrong-bytes"],
)
def test_dpctl_writes_nothing_a_lying_coordinator_sends(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, announced: bytes, sent: bytes, complaint: str) -> None:
    from dpool.client import cli

    files = [{"name": "ok.json", "bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}]
    files.append({"name": name, "bytes": len(announced), "sha256": hashlib.sha256(announced).hexdigest()})
    liar = LyingCoordinator(files, {"ok.json": b"{}", name: sent})
    liar.start()
    try:
        code = cli.main(["--coordinator", liar.addr, "export", "j-1", str(tmp_path / "out" / "dest")])
    finally:
        liar.stopping.set()
        liar.join()
    assert code == 1 and complaint in capsys.readouterr().err
    assert liar.closed  # the node's copy is released at once
    left = [p for p in tmp_path.rglob("*")]
    assert left in ([], [tmp_path / "out"]), left  # no DIR, no temporary folder, nothing outside


# -- a node's exporter, alone, with a stand-in trainer -----------------------------------------


def test_exporter_kills_a_trainer_that_overruns_and_passes_on_its_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "jobs" / "j-1" / "slot-0"
    for step in (3, 6):
        (run_dir / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run_dir / "checkpoints" / f"step-{step}" / "manifest.json").write_text("{}")
    (tmp_path / "jobs" / "j-1" / "job.toml").write_text('name = "j"\n')
    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, sys, time\n"
        "out, step = sys.argv[sys.argv.index('--export') + 1], sys.argv[sys.argv.index('--step') + 1]\n"
        "if step == '3':\n"
        "    print('error: checkpoint step-3 does not fit this job', file=sys.stderr); sys.exit(2)\n"
        "if os.environ.get('SLOW'):\n"
        "    open(os.environ['SLOW'], 'w').write(str(os.getpid())); time.sleep(60)\n"
        "os.makedirs(os.path.join(out, 'sub')); open(os.path.join(out, 'sub', 'a.bin'), 'wb').write(b'z' * 3000)\n"
    )
    monkeypatch.setattr("dpool.daemon.exporter.trainer_command", lambda *args: [sys.executable, str(script), *args])
    exporter = Exporter(tmp_path, "n7", timeout_s=2.0)

    async def scenario() -> None:
        ready = await exporter.prepare(m.ExportPrepare(export_id="e1", job="j-1"))
        assert ready.step == 6 and ready.files == [ExportFile(name="sub/a.bin", bytes=3000, sha256=hashlib.sha256(b"z" * 3000).hexdigest())]
        data = await exporter.fetch(m.ExportFetch(export_id="e1", name="sub/a.bin", offset=2990, size=100))
        assert data.data == b"z" * 10
        for fetch, code in [
            (m.ExportFetch(export_id="e1", name="../../job.toml", offset=0, size=10), "not_found"),
            (m.ExportFetch(export_id="e1", name="sub/a.bin", offset=3001, size=10), "bad_request"),
            (m.ExportFetch(export_id="e2", name="sub/a.bin", offset=0, size=10), "not_found"),
        ]:
            with pytest.raises(ExportError) as e:
                await exporter.fetch(fetch)
            assert e.value.code == code
        with pytest.raises(ExportError) as e:
            await exporter.prepare(m.ExportPrepare(export_id="e3", job="j-1", step=3))
        assert e.value.code == "bad_request" and e.value.message == "node n7: checkpoint step-3 does not fit this job"
        with pytest.raises(ExportError) as e:
            await exporter.prepare(m.ExportPrepare(export_id="e4", job="j-1", step=4))
        assert e.value.code == "not_found" and "step 4" in e.value.message
        with pytest.raises(ExportError) as e:
            await exporter.prepare(m.ExportPrepare(export_id="../e5", job="j-1"))
        assert e.value.code == "bad_request"

    asyncio.run(scenario())
    wait_for("only e1 left", lambda: sorted(p.name for p in (tmp_path / "exports").iterdir()) == ["e1"], 10)  # the failed ones left nothing
    assert exporter.release("e1") and not exporter.release("e1")
    wait_for("e1's files deleted", lambda: not any((tmp_path / "exports").iterdir()), 10)

    monkeypatch.setenv("SLOW", str(tmp_path / "pid"))
    with pytest.raises(ExportError) as e:
        asyncio.run(exporter.prepare(m.ExportPrepare(export_id="e6", job="j-1")))
    assert e.value.code == "export_failed" and "within 2s" in e.value.message
    wait_for("e6's files deleted", lambda: not (tmp_path / "exports" / "e6").exists(), 10)
    assert not pids_with(str(script))  # killed, not left running


def test_a_node_without_the_step_asked_names_the_steps_it_holds(tmp_path: Path) -> None:
    from dpool.daemon.exporter import Exporter, ExportError

    for slot, steps in ((0, (3, 6)), (1, (6,))):
        for step in steps:
            folder = tmp_path / "jobs" / "j-1" / f"slot-{slot}" / "checkpoints" / f"step-{step}"
            folder.mkdir(parents=True)
            (folder / "manifest.json").write_text("{}")
    ex = Exporter(tmp_path, "n0")
    with pytest.raises(ExportError) as e:
        ex._run_dir("j-1", 7)
    assert e.value.message == "node n0 holds no step 7 of job j-1 (it holds steps 3, 6)"
    assert ex._run_dir("j-1", 3)[1] == 3 and ex._run_dir("j-1", None)[1] == 6
