"""The state kept in memory after every step (trainer/memstate.py), and warm trainers (`--warm`).

Real trainer processes and real files: a trainer killed mid-run resumes from the state of its last
completed step, not from its last checkpoint on disk, and trains the same curve; the format's
checks refuse a copy cut short. The pool-level scenarios (a warm spare takes the next generation)
are in test_recovery.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import ring
import zmq
from jobs import SMALL, write_job

from dpool.protocol import messages as m
from dpool.protocol.checkpoints import listed_steps
from dpool.trainer import checkpoint as ckpt
from dpool.trainer.memstate import MemoryState, finish_writes

STEPS = 24


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kw) -> None:
        self.lines.append((event, kw))

    info = warning


def snapshot(step: int, value: float) -> ckpt.Snapshot:
    w = {"w": mx.full((64,), value, dtype=mx.float32), "b": mx.full((3,), value, dtype=mx.bfloat16)}
    mx.eval(w)
    views = ckpt.host_views(list(w.items()))
    return ckpt.Snapshot(step=step, model=views, optimizer=views, manifest={"job_hash": "h"})


def test_a_copy_in_memory_verifies_by_size_and_a_cut_one_does_not(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, snapshot(3, 1.5), keep=2, durable=False)
    manifest = ckpt.verify(tmp_path, 3, "h")
    assert manifest["memory"] is True and all(f["sha256"] is None for f in manifest["files"].values())
    weights, _ = ckpt.load_arrays(tmp_path, 3)
    assert weights["w"].tolist() == [1.5] * 64 and weights["b"].dtype == mx.bfloat16
    with open(ckpt.step_dir(tmp_path, 3) / "model.safetensors", "r+b") as f:
        f.truncate(40)
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.verify(tmp_path, 3, "h")


def test_a_disk_checkpoint_without_checksums_is_refused(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, snapshot(4, 2.0), keep=2, durable=False)
    path = ckpt.step_dir(tmp_path, 4) / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["memory"]  # a manifest that claims to be on disk must carry its checksums
    path.write_text(json.dumps(doc))
    with pytest.raises(ckpt.CheckpointError, match="no checksum"):
        ckpt.verify(tmp_path, 4, "h")


def small_state() -> tuple[nn.Module, optim.Optimizer]:
    model = nn.Linear(8, 8)
    opt = optim.AdamW(learning_rate=1e-3)
    opt.init(model.trainable_parameters())
    mx.eval(model.parameters(), opt.state)
    return model, opt


def written(kept: MemoryState) -> list[int]:
    deadline = time.monotonic() + 10
    while not (done := kept.completed()):
        assert time.monotonic() < deadline, "the write never finished"
        time.sleep(0.001)
    return [s for s, _ in done]


def held_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Writes that wait for the `release` event once `started`: a write slow for as long as a test needs."""
    started, release, write = threading.Event(), threading.Event(), ckpt.write_checkpoint

    def slow(*args, **kwargs):
        started.set()
        assert release.wait(10), "the test never released the write"
        return write(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", slow)
    return started, release


def test_memory_state_keeps_the_newest_two_and_the_newest_step_waits_behind_a_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = small_state()
    kept = MemoryState(tmp_path, 10_000, 1 << 34, Log())
    started, release = held_writes(monkeypatch)
    assert kept.offer(1, model, opt, {"job_hash": "h"}) and started.wait(10)
    # Steps that end while step 1 is written never wait; each takes the place of the one waiting.
    assert kept.offer(2, model, opt, {"job_hash": "h"}) and kept.offer(3, model, opt, {"job_hash": "h"})
    assert kept.completed() == []
    release.set()
    done = written(kept)
    if done == [1]:
        done += written(kept)
    assert done == [1, 3], "step 2 was replaced by the newer step 3 before its turn"
    for step in (4, 5):
        assert kept.offer(step, model, opt, {"job_hash": "h"})
        assert written(kept) == [step]
    assert kept.offer(6, model, opt, {"job_hash": "h"})
    assert [s for s, _ in kept.close()] == [6], "a stopping trainer finishes the copy in progress"
    assert listed_steps(tmp_path) == [6, 5]


def test_a_failing_trainer_lets_its_last_kept_step_land_before_it_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's failure exit (`python -m dpool.trainer` returning other than 0 or 75) calls
    finish_writes: the copy in flight, and the newer one waiting behind it, are on disk, complete,
    once it returns."""
    model, opt = small_state()
    kept = MemoryState(tmp_path, 10_000, 1 << 34, Log())
    started, release = held_writes(monkeypatch)
    assert kept.offer(7, model, opt, {"job_hash": "h"}) and started.wait(10) and kept.offer(8, model, opt, {"job_hash": "h"})
    threading.Timer(0.05, release.set).start()
    finish_writes()
    assert listed_steps(tmp_path) == [8, 7]
    assert ckpt.verify(tmp_path, 8, "h")["step"] == 8  # whole: every file of it verifies


def test_keeping_is_spaced_out_when_a_copy_costs_more_than_its_share_of_a_step(tmp_path: Path) -> None:
    model, opt = small_state()
    log = Log()
    kept = MemoryState(tmp_path, 10_000, 1 << 34, log)
    assert kept.offer(1, model, opt, {}, step_s=1e-6)  # a step far shorter than any write
    assert written(kept) == [1] and kept.every > 1
    assert log.lines[-1][0] == "memory_state.interval" and log.lines[-1][1]["every_steps"] == kept.every
    assert not kept.offer(2, model, opt, {}, step_s=1e-6), "within the interval: skipped"
    assert kept.offer(1 + kept.every, model, opt, {}, step_s=1e-6)
    kept.close()


def test_memory_state_stays_off_when_it_would_not_fit(tmp_path: Path) -> None:
    log = Log()
    kept = MemoryState(tmp_path, 1 << 30, 4 << 30, log)  # 3 GiB of copies on a 4 GiB machine
    model, opt = small_state()
    assert not kept.offer(1, model, opt, {}) and kept.off and "machine's memory" in kept.off
    assert log.lines[0][0] == "memory_state.off"


def test_a_failed_write_turns_keeping_off_without_failing_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = Log()
    kept = MemoryState(tmp_path, 10_000, 1 << 34, log)
    model, opt = small_state()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_checkpoint", full)
    assert kept.offer(1, model, opt, {})
    deadline = time.monotonic() + 10
    while kept.writer is not None and time.monotonic() < deadline:
        assert kept.completed() == []
    assert kept.writer is None and "No space left" in (kept.off or "")
    assert not kept.offer(2, model, opt, {})


# -- real trainers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job that checkpoints to disk only at its end: what a kill loses is what memory saved."""
    folder = tmp_path_factory.mktemp("warm")
    return write_job(
        folder, "kept", base=SMALL, train={"steps": STEPS, "global_batch": 12},
        checkpoint={"every_steps": 1000}, eval={"every_steps": 1000, "batches": 1, "sample_every_steps": 1000},
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {"DPOOL_CACHE_DIR": str(tmp_path_factory.mktemp("tokens"))}


@pytest.fixture(scope="module")
def reference(job: Path, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    work = tmp_path_factory.mktemp("reference")
    ring.run(job, str(work / "run"), 1, work / "logs", env=env)
    return {s: r["loss"] for s, r in ring.metrics(work / "run").items()}


def test_a_killed_trainer_resumes_from_its_last_step_kept_in_memory(job: Path, env: dict[str, str], reference: dict[int, float], tmp_path: Path) -> None:
    run_dir, memory = tmp_path / "run", tmp_path / "memory"
    env = {**env, "DPOOL_MEMORY_DIR": str(memory)}
    g = ring.start(job, str(run_dir), 1, tmp_path / "logs", env=env)
    try:
        deadline = time.monotonic() + 120
        while max(ring_steps(run_dir), default=0) < 10:  # step 10 logged: its state is being kept
            assert g.procs[0].poll() is None and time.monotonic() < deadline, g.output(0)[-3000:]
            time.sleep(0.01)
        os.killpg(g.procs[0].pid, signal.SIGKILL)
        g.procs[0].wait(timeout=10)
    finally:
        g.kill()
    last = max(ring_steps(run_dir))
    assert listed_steps(run_dir) == [], "no checkpoint on disk before the end: only memory can save the steps"
    again = ring.run(job, str(run_dir), 1, tmp_path / "logs", env=env)
    started = next(json.loads(line.split("] ", 1)[-1]) for line in again.output(0).splitlines() if "trainer.started" in line)
    assert started["restored"] == "memory"
    assert last - 1 <= started["resume_step"] <= last, (last, started)  # at most one step recomputed
    curve = {s: r["loss"] for s, r in ring.metrics(run_dir).items()}
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert max(abs(curve[s] - reference[s]) for s in curve) == 0.0, "one rank, same steps: bit for bit"
    assert listed_steps(run_dir) == [STEPS] and listed_steps(memory) != []


def ring_steps(run_dir: Path) -> list[int]:
    try:
        return list(ring.metrics(run_dir))
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_a_warm_trainer_waits_for_go_then_trains_the_rank_it_is_given(job: Path, env: dict[str, str], reference: dict[int, float], tmp_path: Path) -> None:
    """The daemon's side played by a ROUTER socket: worker.ready arrives once the model and data
    are built, nothing is trained before worker.go, and after it the trainer is the rank it was
    told, with the shares and generation it was told."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/w.sock"
    sock.bind(addr)
    run_dir = tmp_path / "run"
    g = ring.start(job, str(run_dir), 1, tmp_path / "logs", env={**env, "DPOOL_WORKER_ADDR": addr}, extra_args=["--warm"])
    try:
        assert sock.poll(120_000), g.output(0)[-3000:]
        peer, *frames = sock.recv_multipart()
        ready, _ = m.decode(frames, m.FROM_WORKER)
        assert isinstance(ready, m.WorkerReady) and ready.pid == g.procs[0].pid
        assert not (run_dir / "metrics.jsonl").exists() and g.procs[0].poll() is None
        base = os.getpriority(os.PRIO_PROCESS, 0)
        lowered = sys.platform.startswith("linux") and os.geteuid() == 0  # where it can raise it back (trainer/priority.py)
        if lowered:
            assert os.getpriority(os.PRIO_PROCESS, ready.pid) == base + 10, "a spare builds at a low priority"
        if autogroups():
            # It leads its session, so its thread's nice weighs only inside it: its session's does.
            assert autogroup_nice(ready.pid) == 10, "a spare's session builds at a low priority"
        sock.send_multipart([peer, *m.WorkerGo(rank=0, generation=7, shares=[12]).to_frames()])
        hello = None
        while hello is None:
            assert sock.poll(120_000), g.output(0)[-3000:]
            _, *frames = sock.recv_multipart()
            msg, _ = m.decode(frames, m.FROM_WORKER)
            hello = msg if isinstance(msg, m.WorkerHello) else None
        assert (hello.rank, hello.generation, hello.world_size) == (0, 7, 1)
        if lowered:
            assert os.getpriority(os.PRIO_PROCESS, ready.pid) == base, "and trains at the usual one"
        if autogroups():
            assert autogroup_nice(ready.pid) == 0, "and its session trains at the usual one"
        assert g.wait(300) == [0], g.output(0)[-3000:]
    finally:
        g.kill()
        sock.close()
        ctx.term()
    rows = ring.metrics(run_dir)
    assert {r["generation"] for r in rows.values()} == {7}
    assert np.allclose([rows[s]["loss"] for s in sorted(rows)], [reference[s] for s in sorted(rows)], atol=0, rtol=0)


def autogroups() -> bool:
    """Whether every session is a scheduling group of its own here (Linux, autogroups on)."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def autogroup_nice(pid: int) -> int | None:
    """The nice value of the autogroup of `pid` ("/autogroup-123 nice 10"); None for a process in
    the kernel's default group (a session never set up since boot, as in some containers), whose
    file is empty."""
    _, sep, value = Path(f"/proc/{pid}/autogroup").read_text().partition(" nice ")
    return int(value) if sep else None


LOWER_AND_BACK = """
import json, os
from dpool.trainer import priority
before = priority.autogroup_nice()
back = priority.lower()
low = priority.autogroup_nice()
if back is not None:
    back()
print(json.dumps([before, low, priority.autogroup_nice(), open("/proc/self/autogroup").read()]))
"""


@pytest.mark.skipif(not autogroups(), reason="Linux with autogroups on")
def test_a_process_that_leads_its_session_lowers_the_session_and_takes_it_back() -> None:
    """Where every session is a scheduling group, a spare (which leads its own) lowers its
    session's nice value: at nice 10 alone in its session it took half a busy core from the rank
    beside it. A process in someone else's session (here, pytest's) leaves that session alone."""
    def run(**kw) -> list:
        r = subprocess.run([sys.executable, "-c", LOWER_AND_BACK], capture_output=True, text=True, timeout=60, **kw)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    before, low, after, _ = run(start_new_session=True)
    assert (before, low, after) == (0, 10, 0)
    mine = autogroup_nice(os.getpid())
    before, low, after, group = run()
    assert (before, low, after) == (None, None, None) and group == Path("/proc/self/autogroup").read_text(), "not its session to lower"
    assert autogroup_nice(os.getpid()) == mine
