"""The pool end to end: real `dpd` processes, real sockets on loopback, real trainers, and `dpctl`.

Jobs are tiny (1 layer, dim 32, 20 steps) and pools small (at most three trainer processes), so the
whole module runs in a minute or two on two CPU cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import conftest
import msgpack
import pytest
import zmq
from conftest import Processes, free_port, pids_with, wait_for
from jobs import write_job

from dpool.protocol import messages as m
from dpool.protocol.payloads import JobStatus

JOB_TIMEOUT = 120.0


def job_file(dir: Path, name: str, *, lo: int = 1, hi: int = 3, steps: int = 20) -> Path:
    return write_job(dir, name, workers={"min": lo, "max": hi}, train={"steps": steps})


class LocalPool(conftest.LocalPool):
    def status(self, job: str) -> JobStatus:
        st = super().status(job)
        assert st is not None, f"the coordinator at {self.addr} did not answer"
        return st

    def wait_state(self, job: str, *states: str, timeout: float = JOB_TIMEOUT) -> JobStatus:
        return self.wait_status(job, f"job {job} in {states}", lambda s: s.state in states, timeout, every=0.25)


@pytest.fixture
def local_pool(processes: Processes, tmp_path: Path) -> LocalPool:
    return LocalPool(processes, tmp_path)


def test_three_daemons_train_a_job_like_the_trainer_alone(local_pool: LocalPool, processes: Processes, tmp_path: Path) -> None:
    pool = local_pool.start(1, 1, 1)
    job = job_file(tmp_path, "three")
    job_id = pool.submit(job)
    # Meanwhile, the same job file in one process, without any daemon.
    alone_dir = tmp_path / "alone"
    alone = processes.start([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(alone_dir)], tmp_path / "alone.log")

    final = pool.wait_state(job_id, "succeeded", "failed", "cancelled")
    assert final.state == "succeeded", (final, pool.dpctl("logs", job_id).stdout[-3000:])
    assert final.step == 20 and final.generation == 1 and final.world_size == 3
    assert final.checkpoint_step == 20

    rows = pool.dpctl_json("metrics", job_id)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21))
    assert all(r["world_size"] == 3 and r["generation"] == 1 for r in train)

    assert alone.wait(timeout=JOB_TIMEOUT) == 0, (tmp_path / "alone.log").read_text()[-2000:]
    alone_rows = [json.loads(line) for line in (alone_dir / "metrics.jsonl").read_text().splitlines()]
    alone_loss = {r["step"]: r["loss"] for r in alone_rows if r["kind"] == "train"}
    assert sorted(alone_loss) == list(range(1, 21))
    for r in train:
        assert abs(r["loss"] - alone_loss[r["step"]]) < 1e-4, (r["step"], r["loss"], alone_loss[r["step"]])

    # Each node kept its rank's checkpoints in its own state dir.
    for name in ("n0", "n1", "n2"):
        assert list((tmp_path / f"state-{name}" / "jobs" / job_id).glob("slot-0/checkpoints/step-20/manifest.json"))
    status = pool.dpctl_json("status", job_id)
    assert set(status) == {  # every key whatever the job ("comm": what comm_share was predicted from, null before a probe)
        "id", "name", "state", "step", "steps", "generation", "world_size", "workers", "checkpoint_step", "loss", "val_loss", "error",
        "submitted", "started", "finished", "elapsed_s", "eta_s", "staging", "comm_share", "comm", "test_loss", "priority", "waiting",
    }
    assert status["priority"] == 0 and status["waiting"] is None
    assert status["test_loss"] is None  # no [eval] test in this job
    assert status["comm_share"] is None  # a finished job has no running group to predict for
    assert status["submitted"] <= status["started"] <= status["finished"] and status["eta_s"] is None
    assert status["elapsed_s"] == round(status["finished"] - status["started"], 3)
    kinds = [e["kind"] for e in pool.dpctl_json("events", job_id)]
    assert kinds.index("group.started") < kinds.index("checkpoint.saved") < kinds.index("job.succeeded")
    logs = pool.dpctl("logs", job_id, "--rank", "2")
    assert logs.returncode == 0 and logs.stdout and all(line.startswith("[rank 2] ") for line in logs.stdout.splitlines())


def test_jobs_queue_for_room_and_cancel_frees_slots(local_pool: LocalPool, tmp_path: Path) -> None:
    pool = local_pool.start(1, 1)
    first = pool.submit(job_file(tmp_path, "first", lo=2, hi=2, steps=300))  # long enough to be seen running
    second = pool.submit(job_file(tmp_path, "second", lo=2, hi=2, steps=100000))

    pool.wait_state(first, "running", timeout=60)
    assert pool.status(second).state == "queued"  # no room while the first one runs
    done = pool.wait_state(first, "succeeded", "failed")
    assert done.state == "succeeded"
    running = pool.wait_state(second, "running", timeout=60)
    assert running.world_size == 2

    nodes = pool.dpctl_json("nodes")
    assert [(n["name"], n["state"], n["busy_slots"], n["job"]) for n in nodes] == [("n0", "busy", 1, second), ("n1", "busy", 1, second)]
    assert set(nodes[0]) >= {"name", "address", "state", "platform", "chip", "memory_bytes", "mlx_version", "slots", "busy_slots", "job", "heartbeat_age_s", "reason"}
    trainers = pool.trainer_pids("n0", second) + pool.trainer_pids("n1", second)
    assert len(trainers) == 2

    r = pool.dpctl("cancel", second)
    assert r.returncode == 0, r.stderr
    assert pool.status(second).state == "cancelled"
    wait_for("slots idle", lambda: [(n.state, n.busy_slots) for n in pool.nodes()] == [("idle", 0), ("idle", 0)], 30)
    wait_for("trainers gone, warm ones too (job.ended)", lambda: not pids_with(f"jobs/{second}/"), 10)
    kinds = [e["kind"] for e in pool.dpctl_json("events", second)]
    assert "job.cancelled" in kinds
    # Its checkpoints stay.
    assert list(tmp_path.glob(f"state-n*/jobs/{second}/slot-0"))


def test_bad_job_file_exits_2_and_queues_nothing(local_pool: LocalPool, tmp_path: Path) -> None:
    pool = local_pool.start(1)
    bad = tmp_path / "bad.toml"
    bad.write_text(job_file(tmp_path, "bad").read_text().replace("global_batch = 6", "global_batch = 0"))
    r = pool.dpctl("submit", str(bad))
    assert r.returncode == 2
    assert "train.global_batch" in r.stderr and str(bad) in r.stderr
    assert "Traceback" not in r.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(job_file(tmp_path, "unknown").read_text() + "bogus = 1\n")  # lands in the last table
    r = pool.dpctl("submit", str(unknown))
    assert r.returncode == 2 and "bogus" in r.stderr
    assert pool.dpctl_json("status") == []
    r = pool.dpctl("status", "no-such-job")
    assert r.returncode == 2 and "no-such-job" in r.stderr


def _garbage(rng: random.Random, good: list[bytes]) -> list[bytes]:
    kind = rng.randrange(6)
    if kind == 0:  # random bytes, any number of frames
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind == 1:  # a good message truncated
        header, body = good
        return [header[: rng.randrange(len(header))], body] if rng.random() < 0.5 else [header, body[: rng.randrange(len(body))]]
    if kind == 2:  # a valid header with a body of the wrong shape
        return [good[0], msgpack.packb(rng.choice([[1, 2], {"job": 5}, {1: 2}, "x", None, {"job": "a" * 50, "extra": 1}]))]
    if kind == 3:  # another version, another protocol, an unknown type
        return [msgpack.packb(rng.choice([["dpool", 99, "status", 1], ["other", 1, "status", 1], ["dpool", 1, "explode", 1], ["dpool", 1, "status"]])), b"\x80"]
    if kind == 4:  # a message the coordinator does not accept from a client
        return m.GroupStop(job="x", generation=1).to_frames(rng.randrange(1000))
    return [good[0], good[1], rng.randbytes(8)]  # one frame too many


def test_coordinator_survives_garbage_and_still_runs_jobs(local_pool: LocalPool, tmp_path: Path) -> None:
    pool = local_pool.start(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pool.addr)
    try:
        # An unknown version gets an explicit error reply carrying the request's id.
        sock.send_multipart([msgpack.packb(["dpool", 2, "status", 41]), msgpack.packb({})])
        assert sock.poll(5000)
        reply, msg_id = m.decode(sock.recv_multipart())
        assert isinstance(reply, m.Error) and reply.code == "bad_version" and msg_id == 41

        rng = random.Random(7)
        good = m.Submit(job={"name": "x"}, source="fuzz").to_frames(3)
        # Every frame set with a header frame gets an error reply (or, for the odd well-formed
        # one, a reply); none is left unanswered and none took the coordinator down. The client
        # keeps at most WINDOW requests unanswered, as a client must: the coordinator queues at
        # most a thousand replies for a peer that does not read (tests/test_hostile.py).
        window, sent, replies = 500, 0, 0
        while sent < 10_000:
            for _ in range(window):
                sock.send_multipart(_garbage(rng, good))
                sent += 1
            while replies < sent and sock.poll(3000):
                msg, _ = m.decode(sock.recv_multipart())
                assert isinstance(msg, m.Error | m.StatusReply | m.Submitted)
                replies += 1
            assert replies == sent, f"{sent - replies} of {sent} requests unanswered"
        assert replies == sent
    finally:
        sock.close()
        ctx.term()
    assert pool.daemons["n0"].proc.poll() is None
    job_id = pool.submit(job_file(tmp_path, "after-fuzz", hi=1))
    assert pool.wait_state(job_id, "succeeded", "failed", "cancelled").state == "succeeded"


def test_status_without_a_coordinator_exits_3_within_its_timeout() -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", addr, "--timeout", "1", "status"], capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.returncode == 3
    assert addr in r.stderr and r.stdout == ""
    assert elapsed < 1 + 10  # the timeout plus interpreter start-up, never an endless wait


def test_duplicate_name_and_insecure_bind_are_refused(local_pool: LocalPool, tmp_path: Path) -> None:
    pool = local_pool.start(1)
    # Joins under the serving daemon's name, from a state dir of its own (one in use is refused
    # before it could ask: test_faults.py).
    dup = pool.start_daemon("n0", args=("--state-dir", str(tmp_path / "state-dup")))
    assert dup.proc.wait(timeout=30) == 1
    assert "node name 'n0' is already in the pool" in dup.log.read_text()
    assert pool.daemons["n0"].proc.poll() is None
    assert [(n.name, n.state) for n in pool.nodes()] == [("n0", "idle")]
    r = subprocess.run(
        [sys.executable, "-m", "dpool.daemon.cli", "run", "--serve", f"tcp://0.0.0.0:{free_port()}", "--state-dir", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "--insecure" in r.stderr


def test_sigterm_stops_workers_and_exits_0(local_pool: LocalPool, tmp_path: Path) -> None:
    pool = local_pool.start(1)
    job_id = pool.submit(job_file(tmp_path, "long", hi=1, steps=100000))
    pool.wait_state(job_id, "running", timeout=60)
    wait_for("the trainer process", lambda: pids_with(f"jobs/{job_id}/"), 10)
    daemon = pool.daemons["n0"]
    os.kill(daemon.pid, signal.SIGTERM)
    assert daemon.proc.wait(timeout=20) == 0
    assert not pids_with(f"jobs/{job_id}/")
