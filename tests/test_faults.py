"""Faults of one machine cost that machine's rank, never its daemon: a full disk, a worker.log that
cannot be written, a database that cannot commit, a second dpd on the same state dir, a job id
that is a path, files others could read.

The unit tests at the top run in process; the ones below run real `dpd` processes through the
local-pool harness. The disk-full test mounts a small tmpfs and so needs root (it is skipped
without, or where mounting is not permitted).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import LocalPool, Processes, alive, free_port, wait_for
from jobs import job, write_job

from dpool.daemon import agent as agent_mod
from dpool.daemon.agent import Agent
from dpool.daemon.childenv import trainer_command, trainer_env
from dpool.daemon.store import Store
from dpool.daemon.worker import Worker
from dpool.protocol import messages as m
from dpool.protocol.checkpoints import (
    EXIT_DISK,
    listed_steps,
    read_manifest,
    step_dir,
    valid_job_id,
)
from dpool.protocol.logs import RotatingFile
from dpool.protocol.payloads import RankSlot, TrainRow
from dpool.trainer import checkpoint as ckpt

HASH = "job-hash-1"


def snap(step: int, value: float = 1.0, job_hash: str = HASH) -> ckpt.Snapshot:
    w = np.full(64, value, np.float32)
    return ckpt.Snapshot(step=step, model={"w": (w, "F32")}, optimizer={"m": (w * 2, "F32")}, manifest={"job_hash": job_hash})


SHARED_WRITER = """
import sys
from pathlib import Path
import numpy as np
from dpool.trainer import checkpoint as ckpt
w = np.ones(4096, dtype=np.float32)
for step in range(1, 41):
    snap = ckpt.Snapshot(step=step, model={"w": (w * step, "F32")}, optimizer={"m": (w, "F32")}, manifest={"job_hash": "h"})
    ckpt.write_checkpoint(Path(sys.argv[1]), snap, keep=3)
"""


def test_ranks_that_share_a_run_dir_write_the_same_steps_without_failing(tmp_path: Path) -> None:
    """Two ranks on one machine with one --run-dir write each step's (identical) checkpoint at the
    same moments: whichever renames its copy into place first stands; the other is not an error."""
    procs = [subprocess.Popen([sys.executable, "-c", SHARED_WRITER, str(tmp_path)], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert sorted(ckpt.listed_steps(tmp_path)) == [38, 39, 40]
    assert json.loads((ckpt.step_dir(tmp_path, 40) / ckpt.MANIFEST).read_text())["step"] == 40


def damage(run_dir: Path, step: int) -> None:
    (step_dir(run_dir, step) / "model.safetensors").write_bytes(b"cut short")


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


# -- checkpoints: pruning, resume, re-saving -------------------------------------------------------


def test_resuming_below_a_damaged_newer_checkpoint_then_pruning_keeps_what_was_written(tmp_path: Path) -> None:
    for step in (10, 12):
        ckpt.write_checkpoint(tmp_path, snap(step), keep=5)
    damage(tmp_path, 12)
    found = ckpt.newest_valid(tmp_path, HASH, Log())
    assert found is not None and found[0] == 10
    # The resume drops what lies above it first ...
    assert ckpt.drop_above(tmp_path, 10, HASH) == ([12], [])
    # ... and the next checkpoint (keep = 1) is the one that stays.
    ckpt.write_checkpoint(tmp_path, snap(11), keep=1)
    assert listed_steps(tmp_path) == [11]
    ckpt.verify(tmp_path, 11, HASH)


def test_only_folders_named_as_the_trainer_names_them_are_checkpoints(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, snap(8), keep=5)
    for name in ("step-08", "step-٣", "step-8a"):  # a copy by hand, a non-ASCII digit, a suffix
        shutil.copytree(step_dir(tmp_path, 8), ckpt.checkpoint_root(tmp_path) / name)
    assert listed_steps(tmp_path) == [8]


def test_pruning_never_deletes_the_step_just_written(tmp_path: Path) -> None:
    """Without the resume's drop (a run dir left so by an older version): the damaged newer step
    is left alone, and keep = 1 keeps the new one, not it."""
    for step in (10, 12):
        ckpt.write_checkpoint(tmp_path, snap(step), keep=5)
    damage(tmp_path, 12)
    _, problems = ckpt.write_checkpoint(tmp_path, snap(11), keep=1)
    assert problems == []
    assert listed_steps(tmp_path) == [12, 11]
    ckpt.verify(tmp_path, 11, HASH)
    assert ckpt.prune(tmp_path, 0, newest=11) == [] and listed_steps(tmp_path) == [12, 11]  # keep 0 still keeps it


def test_drop_above_leaves_another_jobs_checkpoints_for_verify_to_refuse(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, snap(5), keep=5)
    ckpt.write_checkpoint(tmp_path, snap(9, job_hash="another"), keep=5)
    ckpt.write_checkpoint(tmp_path, snap(8), keep=5)
    (step_dir(tmp_path, 7)).mkdir()
    (step_dir(tmp_path, 7) / "manifest.json").write_text("{not json")  # damaged: its job cannot be told
    (step_dir(tmp_path, 7) / "model.safetensors").write_bytes(b"maybe whole")
    dropped, moved = ckpt.drop_above(tmp_path, 5, HASH)
    assert dropped == [8] and len(moved) == 1
    assert listed_steps(tmp_path) == [9, 5]
    with pytest.raises(ckpt.CheckpointMismatch):
        ckpt.verify(tmp_path, 9, HASH)
    # the damaged one is set aside whole, where nothing lists, prunes or resumes it
    assert moved[0].parent == ckpt.checkpoint_root(tmp_path) / "damaged" and (moved[0] / "model.safetensors").read_bytes() == b"maybe whole"


@pytest.mark.parametrize("change", [
    {"files": []}, {"files": {}}, {"files": {"model.safetensors": 5, "optimizer.safetensors": 5}},
    {"files": {"model.safetensors": {}, "optimizer.safetensors": {}}}, {"files": {"../model.safetensors": {"bytes": 1, "sha256": None}}},
    {"job_hash": None}, {"step": "12"},
], ids=["files-list", "files-empty", "files-ints", "files-no-bytes", "files-path", "no-job", "step-str"])
def test_a_manifest_of_the_wrong_shape_is_a_damaged_checkpoint_not_a_crash(tmp_path: Path, change: dict[str, Any]) -> None:
    """Valid JSON that is not a manifest: skipped with a reason, and the checkpoint before it resumed."""
    for step in (10, 12):
        ckpt.write_checkpoint(tmp_path, snap(step), keep=5)
    path = step_dir(tmp_path, 12) / ckpt.MANIFEST
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.verify(tmp_path, 12, HASH)
    assert not isinstance(e.value, ckpt.CheckpointMismatch) and "step-12" in str(e.value)
    log, skipped = Log(), []
    found = ckpt.newest_valid(tmp_path, HASH, log, skipped=skipped)
    assert found is not None and found[0] == 10 and len(skipped) == 1 and log.lines[0][0] == "checkpoint.skipped"


GPT_JOB = {"model": {"layers": 1, "dim": 32, "heads": 2, "context": 32}, "train": {"steps": 4, "global_batch": 2, "warmup_steps": 1},
           "checkpoint": {"every_steps": 2, "keep": 3}, "eval": {"every_steps": 1000, "batches": 1, "sample_every_steps": 1000}}


def test_by_hand_a_run_dir_whose_checkpoints_are_all_damaged_is_refused_and_kept(tmp_path: Path) -> None:
    """Started again by hand, a run whose every checkpoint fails to verify is not trained again
    from step 0 (which would drop them): exit 2 naming each and why; every file stays."""
    job = write_job(tmp_path, "all-damaged", **GPT_JOB)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "DPOOL_WORKER_ADDR"}
    first = subprocess.run([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run)], capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0 and listed_steps(run) == [4, 2], first.stderr
    damage(run, 4)
    (step_dir(run, 2) / ckpt.MANIFEST).write_text("{")
    before = sorted((p.relative_to(run), p.stat().st_size) for p in (run / "checkpoints").rglob("*"))
    again = subprocess.run([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run)], capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in again.stderr.splitlines() if line.startswith("error:")]
    assert again.returncode == 2 and len(errors) == 1, again.stderr
    assert "no checkpoint verifies" in errors[0] and "step-4" in errors[0] and "step-2" in errors[0]
    assert sorted((p.relative_to(run), p.stat().st_size) for p in (run / "checkpoints").rglob("*")) == before


def test_re_saving_a_step_renames_the_old_copy_aside_and_puts_it_back_if_the_new_one_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.write_checkpoint(tmp_path, snap(10, 1.0), keep=3)
    real_rename = os.rename
    calls: list[tuple[str, str]] = []

    def rename(src: Any, dst: Any) -> None:
        calls.append((Path(src).name, Path(dst).name))
        if Path(src).name.startswith(".tmp-step-"):
            raise OSError(errno.EIO, "injected")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        ckpt.write_checkpoint(tmp_path, snap(10, 2.0), keep=3)
    monkeypatch.undo()
    old = f".old-step-10-{os.getpid()}"
    assert calls == [("step-10", old), (f".tmp-step-10-{os.getpid()}", "step-10"), (old, "step-10")]
    ckpt.verify(tmp_path, 10, HASH)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10"]  # no .tmp, no .old
    # Re-saved for real: the new copy replaces it whole.
    ckpt.write_checkpoint(tmp_path, snap(10, 3.0), keep=3)
    weights, _ = ckpt.load_arrays(tmp_path, 10)
    assert float(weights["w"][0]) == 3.0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-10"]


def test_a_resave_cut_between_its_renames_gets_the_old_copy_back_at_resume(tmp_path: Path) -> None:
    ckpt.write_checkpoint(tmp_path, snap(10), keep=3)
    root = tmp_path / "checkpoints"
    os.rename(root / "step-10", root / ".old-step-10-4242")  # the crash: old aside, new not yet in place
    (root / ".tmp-step-10-4242").mkdir()
    (root / "step-15").mkdir()  # a folder a crash mid-deletion left without its manifest
    (root / "step-15" / "model.safetensors").write_bytes(b"x")
    ckpt.clean_partial(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step-10"]
    ckpt.verify(tmp_path, 10, HASH)


def test_a_failed_write_removes_its_tmp_folder_and_leaves_the_earlier_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.write_checkpoint(tmp_path, snap(5), keep=3)
    real = ckpt._write_safetensors

    def full(path: Path, arrays: Any, durable: bool = True) -> Any:
        if path.name == "optimizer.safetensors":
            path.write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, arrays, durable)

    monkeypatch.setattr(ckpt, "_write_safetensors", full)
    writer = ckpt.CheckpointWriter(tmp_path, keep=3)
    writer.submit(snap(10))
    ((step, _, error, problems),) = writer.close()
    assert step == 10 and error is not None and "No space left on device" in error and problems == []
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-5"]
    ckpt.verify(tmp_path, 5, HASH)


# -- logs ------------------------------------------------------------------------------------------


def test_a_rotating_file_stays_within_its_generations(tmp_path: Path) -> None:
    path = tmp_path / "dpd.log"
    with RotatingFile(path, max_bytes=1000, backups=2) as f:
        for i in range(500):
            f.write(b"line %04d %s\n" % (i, b"x" * 40))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["dpd.log", "dpd.log.1", "dpd.log.2"]
    assert all(p.stat().st_size <= 1000 for p in tmp_path.iterdir())
    assert path.read_bytes().splitlines()[-1].startswith(b"line 0499")
    first_kept = int((tmp_path / "dpd.log.2").read_bytes().split()[1])
    assert first_kept > 400  # the oldest lines went
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_rotating_file_that_cannot_be_written_raises_then_writes_again(tmp_path: Path) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    f = RotatingFile(folder / "w.log")
    f.write(b"one\n")
    (folder / "w.log").unlink()
    folder.rmdir()
    f.close()  # the next write opens anew: the folder is gone
    with pytest.raises(FileNotFoundError):
        f.write(b"lost\n")
    folder.mkdir()
    f.write(b"two\n")
    f.close()
    assert (folder / "w.log").read_bytes() == b"two\n" and f.failed == 1
    quiet = RotatingFile(tmp_path / "nowhere" / "q.log", quiet=True)
    assert quiet.write(b"dropped\n") == 0 and quiet.failed == 1


def _agent(state_dir: Path) -> Agent:
    return Agent(zmq.asyncio.Context.instance(), name="n", join="tcp://127.0.0.1:1", state_dir=state_dir, slots=1, advertise="127.0.0.1")


def _watched(agent: Agent, run_dir: Path, script: str) -> Worker:
    """A real child process watched the way the agent watches a trainer; returns once it is reaped."""

    async def go() -> Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True
        )
        w = Worker(job="j-abcdef", generation=1, rank=0, slot=0, run_dir=run_dir, proc=proc)
        agent.workers[0] = w
        w.tasks.append(asyncio.create_task(agent._watch(w)))
        await asyncio.wait_for(w.tasks[0], 60)
        return w

    return asyncio.run(go())


def test_a_worker_log_that_cannot_be_written_loses_lines_not_the_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "slot-0"
    (run_dir / "worker.log").mkdir(parents=True)  # every write fails (EISDIR)
    agent = _agent(tmp_path)
    w = _watched(agent, run_dir, "import sys\nfor i in range(2000): print('line', i)\nprint('error: it said why', file=sys.stderr)\nsys.exit(3)")
    assert w.proc.returncode == 3  # reaped: no zombie
    assert agent.workers == {}  # the slot is free
    (exited,) = agent.exited
    assert (exited.code, exited.error) == (3, "it said why")


def test_worker_logs_are_rotated_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_mod, "WORKER_LOG_BYTES", 20_000)
    run_dir = tmp_path / "slot-0"
    run_dir.mkdir()
    agent = _agent(tmp_path)
    w = _watched(agent, run_dir, "for i in range(5000): print('a trainer line', i)")
    assert w.proc.returncode == 0
    logs = sorted(p.name for p in run_dir.iterdir())
    assert logs == ["worker.log", "worker.log.1", "worker.log.2"]
    assert sum(p.stat().st_size for p in run_dir.iterdir()) <= 3 * 20_000
    assert (run_dir / "worker.log").read_text().splitlines()[-1] == "a trainer line 4999"


# -- the store ---------------------------------------------------------------------------------------


def test_a_store_that_cannot_commit_keeps_its_writes_and_commits_them_later(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "c.sqlite3"
    store = Store(path, clock=lambda: now[0])
    store.add_event("j-abcdef", 1.0, "one", {})
    store.commit()

    # Full: SQLite rolls the whole transaction back; the store keeps its statements.
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")
    store.add_logs("j-abcdef", 2.0, 0, 1, ["x" * 2000] * 50)
    store.add_event("j-abcdef", 2.0, "two", {})
    with pytest.raises(sqlite3.Error, match="full"):
        store.commit()
    assert store.pending_rows == 51
    store.commit()  # within the back-off: not even tried
    store.db.execute("PRAGMA max_page_count = 1000000")
    now[0] += 1.0
    store.commit()
    assert store.pending_rows == 0

    # Locked by another process: the commit gives up after a short wait and is tried again.
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    store.add_event("j-abcdef", 3.0, "three", {})
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        store.commit()
    other.execute("ROLLBACK")
    other.close()
    now[0] += 10.0
    store.commit()
    store.close()

    reopened = Store(path)
    rows = reopened.db.execute("SELECT kind FROM events ORDER BY seq").fetchall()
    assert [k for (k,) in rows] == ["one", "two", "three"]
    assert reopened.db.execute("SELECT count(*) FROM logs").fetchone()[0] == 50
    reopened.close()


def test_a_failed_unit_takes_back_only_its_own_writes(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    store.begin_unit()
    store.add_event(None, 1.0, "kept", {})
    store.end_unit()
    store.begin_unit()
    store.add_event(None, 2.0, "undone", {})
    store.find_job("x")  # a read in the unit executes its write ...
    store.undo_unit()  # ... which is taken back all the same
    store.commit()
    assert [k for (k,) in store.db.execute("SELECT kind FROM events")] == ["kept"]
    store.close()


# -- paths and processes -----------------------------------------------------------------------------


def test_job_ids_are_single_path_components() -> None:
    assert valid_job_id("stdlib-gpt-fbb92c")
    for bad in ("..", "../x-abcdef", "a/b-abcdef", "x-abcdef/..", "/etc-abcdef", "x-abcdef\n", "", "X-ABCDEF"):
        assert not valid_job_id(bad), bad


def test_trainers_run_with_their_run_dir_off_sys_path(tmp_path: Path) -> None:
    """A `dpool` package in the run dir (the trainer's cwd) would shadow the real one; with -P it is
    never imported."""
    (tmp_path / "dpool").mkdir()
    (tmp_path / "dpool" / "__init__.py").write_text("raise SystemExit('imported from the run dir')\n")
    env = trainer_env()
    ok = subprocess.run(trainer_command("--help"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--run-dir" in ok.stdout, ok.stderr
    env.pop("PYTHONSAFEPATH")
    shadowed = subprocess.run([sys.executable, "-m", "dpool.trainer", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert "imported from the run dir" in shadowed.stderr  # what -P prevents


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_under_umask_022_the_state_dir_is_private_and_a_second_dpd_is_refused(processes: Processes, tmp_path: Path) -> None:
    (tmp_path / "state-n0").mkdir(mode=0o755)  # made by hand, world-readable
    pool = LocalPool(processes, tmp_path, env={"DPOOL_CACHE_DIR": str(tmp_path / "cache")})
    with umask(0o022):
        pool.start(1)
        job_id = pool.submit(write_job(tmp_path, "private", train={"steps": 5}))
        assert pool.wait_end(job_id).state == "succeeded"
    state = tmp_path / "state-n0"
    run_dir = state / "jobs" / job_id / "slot-0"
    assert mode(state) == 0o700
    files = [state / "dpd.lock", state / "coordinator.sqlite3", state / "run" / "workers.sock", run_dir / "worker.log",
             run_dir / "metrics.jsonl", step_dir(run_dir, 5) / "model.safetensors", state / "jobs" / job_id / "job.toml"]
    files += list(state.glob("coordinator.sqlite3-*"))
    assert {str(p.relative_to(state)): oct(mode(p)) for p in files} == {str(p.relative_to(state)): oct(0o600) for p in files}
    assert all(mode(p) == 0o700 for p in (state / "run", state / "jobs", run_dir, step_dir(run_dir, 5)))

    # One dpd per state dir: a second one exits 2 and names the first one's pid; the first goes on.
    first = pool.daemons["n0"]
    second = pool.start_daemon("n0")
    assert second.proc.wait(timeout=60) == 2
    said = second.log.read_text()
    assert f"in use by another dpd (pid {first.pid})" in said, said
    assert first.proc.poll() is None and (state / "run" / "workers.sock").exists()
    again = pool.submit(write_job(tmp_path, "after", train={"steps": 5}))
    assert pool.wait_end(again).state == "succeeded"


class FakeCoordinator:
    """A ROUTER that registers one real dpd and sends it what a hostile coordinator would."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.addr)
        self.peer = b""

    def recv(self, kind: type[m.Message], timeout: float = 60) -> tuple[m.Message, int]:
        def one() -> tuple[m.Message, int] | None:
            if not self.sock.poll(100):
                return None
            peer, *frames = self.sock.recv_multipart()
            msg, msg_id = m.decode(frames)
            self.peer = peer
            return (msg, msg_id) if isinstance(msg, kind) else None

        got: tuple[m.Message, int] = wait_for(kind.__name__, one, timeout, every=0)
        return got

    def send(self, msg: m.Message, msg_id: int = 0) -> None:
        self.sock.send_multipart([self.peer, *msg.to_frames(msg_id)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_a_job_id_that_is_a_path_is_refused_by_the_daemon(processes: Processes, tmp_path: Path) -> None:
    coord = FakeCoordinator()
    try:
        pool = LocalPool(processes, tmp_path, addr=coord.addr)
        dpd = pool.start_daemon("x")
        _, reg_id = coord.recv(m.NodeRegister)
        coord.send(m.NodeRegistered(heartbeat_s=0.5, liveness=100), reg_id)
        escape = "../../escape-abcdef"
        coord.send(m.GroupPrepare(job=escape, generation=1, slots=[0]))
        prepared, _ = coord.recv(m.NodePrepared)
        assert isinstance(prepared, m.NodePrepared) and prepared.ports == [] and "is not a job id" in (prepared.error or "")
        spec = job("evil", train={"steps": 5})
        coord.send(m.GroupStart(job="evil/x-abcdef", generation=1, spec=spec, ranks=[RankSlot(slot=0, rank=0)], shares=[6], hostfile=[["127.0.0.1:1"]]))
        exited, _ = coord.recv(m.NodeWorkerExited)
        assert isinstance(exited, m.NodeWorkerExited) and exited.code == 2 and "is not a job id" in (exited.error or "")
        coord.send(m.ExportPrepare(export_id="e1", job=escape), 7)
        error, error_id = coord.recv(m.Error)
        assert isinstance(error, m.Error) and error_id == 7 and "is not a job id" in error.message
        coord.send(m.GroupStop(job="..", generation=0))
        decoy = tmp_path / "decoy-fedcba" / "keep.txt"  # where STATE/jobs/../../decoy-fedcba leads
        decoy.parent.mkdir()
        decoy.write_text("not the daemon's")
        coord.send(m.JobRemove(job="../../decoy-fedcba"))
        # What it still does for a real job id shows that it read all of the above.
        coord.send(m.GroupPrepare(job="real-abcdef", generation=1, slots=[0]))
        ok, _ = coord.recv(m.NodePrepared)
        assert isinstance(ok, m.NodePrepared) and ok.error is None and len(ok.ports) == 1
        assert decoy.read_text() == "not the daemon's"
        assert dpd.proc.poll() is None
        assert not (tmp_path / "escape-abcdef").exists() and not (tmp_path / "state-x" / "jobs").exists()
        assert not list(tmp_path.rglob("*abcdef*"))
        wait_for("the refusals logged", lambda: dpd.log.read_text().count("job_id.refused") == 5, 10)
    finally:
        pool.stop()
        coord.close()


# -- a full disk, for real -------------------------------------------------------------------------


def log_lines(path: Path) -> list[dict[str, Any]]:
    """A dpd log's JSON lines."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                out.append(row)
    return out


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


class Filler(threading.Thread):
    """Keeps a filesystem full: appends to one file until ENOSPC, again every 10 ms (space a
    failed write gives back is taken at once), until stopped; then deletes the file."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.stopping, self.full = path, threading.Event(), threading.Event()

    def run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        block = b"\0" * 4096
        try:
            while not self.stopping.is_set():
                try:
                    while os.write(fd, block):
                        pass
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    self.full.set()
                self.stopping.wait(0.01)
        finally:
            os.close(fd)

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.path.unlink()


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0, reason="mounts a tmpfs: needs root on Linux")
def test_a_full_disk_fails_that_rank_and_the_job_resumes_once_space_returns(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path, env={"DPOOL_CACHE_DIR": str(tmp_path / "cache")})
    pool.start(1)
    # Job A on n0 and n1; its folder on n1 (job file, hostfiles, run dir, checkpoints) is a 4 MB tmpfs.
    a = pool.submit(write_job(tmp_path, "full", workers={"min": 2, "max": 2}, train={"steps": 100_000}, checkpoint={"every_steps": 10, "keep": 3}))
    job_dir = tmp_path / "state-n1" / "jobs" / a
    _mount_tmpfs(job_dir, "4m")
    filler = Filler(job_dir / "filler")
    try:
        pool.start_daemon("n1", workers=2)
        pool.wait_registered(2)
        pool.wait_status(a, "job A running", lambda s: s.state == "running")
        # Job B on n1's other slot, its run dir on the usual disk: the other worker that must stay up.
        b = pool.submit(write_job(tmp_path, "other", workers={"min": 1, "max": 1}, train={"steps": 100_000}, checkpoint={"every_steps": 100_000}))
        # Ahead of A in the queue: when A comes back below its minimum, it takes free slots only. (At
        # equal priority the scheduler may rightly preempt B for A, the earlier job, if n0 misses a
        # heartbeat on a loaded machine just then; this test is about B's worker outliving A's disk.)
        assert pool.dpctl("priority", b, "1").returncode == 0
        pool.wait_status(b, "job B running", lambda s: s.state == "running" and s.step > 0)
        (b_pid,) = pool.trainer_pids("n1", b)
        pool.wait_status(a, "a checkpoint of job A", lambda s: (s.checkpoint_step or 0) >= 10)

        filler.start()
        assert filler.full.wait(10)
        failed = wait_for("job A's rank on n1 failed for lack of space", lambda: [
            e for e in pool.dpctl_json("events", a) if e["kind"] == "worker.failed" and e["node"] == "n1" and "no space left" in e.get("error", "").lower()
        ], 60)
        assert failed[0]["code"] == EXIT_DISK, failed
        # The rank whose checkpoint write failed exited so, with why (its report can come after its
        # peer's, which the pool then takes as the failure).
        n1_log = pool.daemons["n1"].log
        wait_for("n1's rank exited for its checkpoint", lambda: [
            e for e in log_lines(n1_log) if e.get("event") == "worker.exited" and e.get("job") == a
            and e.get("code") == EXIT_DISK and "not written" in (e.get("error") or "") and "no space left" in e["error"].lower()
        ], 30)  # of whichever generation ran when the disk filled (a loaded machine may have restarted one)
        # n1 fails every start of A until it is set aside; A waits below workers.min.
        # (A may be queued for a moment before n1's third failure has been counted: wait for both.)
        n1 = wait_for("n1 set aside and job A queued", lambda: next(
            (n for n in pool.nodes() if n.name == "n1" and "set aside" in (n.reason or "") and (s := pool.status(a)) is not None and s.state == "queued"), None,
        ), 60)
        assert n1.state != "lost", n1
        assert pool.daemons["n1"].proc.poll() is None and pool.daemons["n0"].proc.poll() is None
        assert alive(b_pid) and pool.trainer_pids("n1", b) == [b_pid]
        st = pool.status(b)
        assert st is not None and st.state == "running"
        # The checkpoints written before the disk filled are intact; no half-written one is left.
        (run_dir,) = job_dir.glob("slot-*")
        held = listed_steps(run_dir)
        assert held and max(held) >= 10
        for step in held:
            manifest = read_manifest(run_dir, step)
            assert manifest is not None and ckpt.verify(run_dir, step, manifest["job_hash"])["step"] == step
        assert not [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]

        filler.stop()  # space returns
        assert pool.dpctl("undrain", "n1").returncode == 0
        resumed = wait_for("job A resumed on both nodes", lambda: [e for e in pool.dpctl_json("events", a) if e["kind"] == "group.resumed"], 60)
        assert resumed[-1]["from_step"] >= max(held), (resumed, held)
        pool.wait_status(a, "job A training past its checkpoint on n1 again", lambda s: s.state == "running" and (s.checkpoint_step or 0) > max(held), timeout=60)
        assert max(listed_steps(run_dir)) > max(held)
        assert pool.trainer_pids("n1", b) == [b_pid], (pool.nodes(), pool.dpctl_json("events", b))  # B ran through all of it
        for job_id in (a, b):
            assert pool.dpctl("cancel", job_id).returncode == 0
    finally:
        if filler.is_alive():
            filler.stop()
        pool.stop()
        subprocess.run(["umount", "-l", str(job_dir)], capture_output=True)


def test_output_lines_while_the_coordinator_is_away_are_kept_apart_and_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent while the agent is not registered: `dpctl logs` had a hole for the whole outage. The
    lines are kept (sent on the next registration), apart from the reports, which a chatty
    trainer's output can never push out; past HELD_LOG_BYTES the oldest go, counted as dropped."""
    monkeypatch.setattr(agent_mod, "HELD_LOG_BYTES", 1000)
    a = _agent(tmp_path / "state")
    assert not a.registered
    a._send(m.NodeMetric(job="j-abcdef", generation=1, row=TrainRow(kind="train", step=1, loss=2.0, lr=1e-3, tokens=64, tokens_per_s=1.0, world_size=1)))
    for i in range(30):
        a._send(m.NodeLogs(job="j-abcdef", generation=1, rank=0, lines=[f"line {i:02d} " + "x" * 92]))  # 100 characters each
    assert [type(h).__name__ for h in a.held] == ["NodeMetric"]
    assert [h.lines[0][:7] for h in a.held_logs] == [f"line {i:02d}" for i in range(20, 30)] and a.held_log_bytes == 1000
    assert a.dropped == 20
