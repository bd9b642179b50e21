"""`dpctl rm JOB`: a finished job's records go from the coordinator's database, and on every node its
run dirs and checkpoints, also on a node that was away when it was removed (it is told when it joins
again). A job that has not finished is refused.

The store's part is checked directly; the rest on a real local pool of two dpds, with dpctl run as
a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import LocalPool, Processes, wait_for
from jobs import job, write_job

from dpool.client import cli
from dpool.daemon.pool import Pool
from dpool.daemon.records import Job, Node
from dpool.daemon.store import Store
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import EvalRow, NodeInfo, RemovedRows, SampleRow, TrainRow


def stored_job(job_id: str, t: float) -> Job:
    name = job_id.rsplit("-", 1)[0]
    return Job(id=job_id, name=name, spec=parse_job(job(name)), submitted_at=t)


def fill(store: Store, job_id: str, t: float) -> None:
    store.save_job(stored_job(job_id, t))
    for step in (1, 2):
        store.add_metric(job_id, 1, TrainRow(kind="train", step=step, loss=1.0, lr=1e-3, tokens=8, tokens_per_s=1.0, world_size=1))
    store.add_metric(job_id, 1, EvalRow(kind="eval", step=2, val_loss=1.5))
    store.add_sample(job_id, 1, SampleRow(step=2, text="hello"))
    store.add_event(job_id, t, "job.submitted", {})
    store.add_event(job_id, t + 1, "job.succeeded", {})
    store.add_logs(job_id, t, 0, 1, ["a", "b", "c"])


def test_the_store_deletes_a_removed_jobs_rows_and_keeps_its_id_until_every_node_deleted_its_folder(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite3"
    store = Store(path)
    fill(store, "gone-aaaaaa", 10.0)
    fill(store, "kept-bbbbbb", 20.0)
    store.add_event(None, 15.0, "node.joined", {"node": "n0"})  # the pool's own event stays
    store.commit()

    store.begin_unit()  # a unit that fails is undone whole, the removal with it
    store.remove_job("gone-aaaaaa", 30.0, ["n0"])
    store.undo_unit()
    assert store.find_job("gone-aaaaaa") is not None and store.removals("n0") == []

    rows = store.remove_job("gone-aaaaaa", 30.0, ["n0", "n1"])
    assert rows == RemovedRows(jobs=1, metrics=3, samples=1, events=2, logs=3)
    store.commit()
    store.close()

    store = Store(path)  # on disk
    assert store.find_job("gone-aaaaaa") is None and store.find_job("gone") is None and store.find_job("gone-a") is None
    assert [j.id for j, _ in store.load_jobs()] == ["kept-bbbbbb"]
    assert [s.id for s in store.statuses(10)] == ["kept-bbbbbb"]
    assert store.metrics("gone-aaaaaa", 0, 100) == ([], 0, False) and store.samples("gone-aaaaaa", 0, 100) == ([], 0, False)
    assert store.logs("gone-aaaaaa", 0, None, 100) == ([], 0, False)
    kept = store.find_job("kept-bbbbbb")
    assert kept is not None
    assert len(store.metrics("kept-bbbbbb", 0, 100)[0]) == 3 and len(store.logs("kept-bbbbbb", 0, None, 100)[0]) == 3
    assert [e.kind for e in store.events(kept, 0, 100)[0]] == ["job.submitted", "job.succeeded"]
    pool_events = store.db.execute("SELECT kind FROM events WHERE job IS NULL").fetchall()
    assert pool_events == [("node.joined",)]

    # Each node has to delete its folder; until the last one did, the id is not given to a new job.
    assert store.removals("n0") == store.removals("n1") == ["gone-aaaaaa"] and store.removals("n2") == []
    assert store.has_job("gone-aaaaaa")
    store.removed_on("gone-aaaaaa", "n0")
    assert store.removals("n0") == [] and store.has_job("gone-aaaaaa")
    store.removed_on("gone-aaaaaa", "n1")
    assert not store.has_job("gone-aaaaaa")
    store.close()


def test_the_pool_forgets_a_removed_job_and_the_checkpoints_held_of_it() -> None:
    pool = Pool()
    for i, job_id in enumerate(("a-aaaaaa", "b-bbbbbb")):
        pool.submit(float(i), job_id, parse_job(job(job_id[0])))
        finished = pool.live.pop(job_id)  # as a job that has ended
        pool._finished.append(finished.id)
    pool.forgotten = 1  # and one more in the store only
    pool.nodes["n0"] = node = Node(name="n0", incarnation="x", info=NodeInfo(), joined_at=0.0, last_seen=0.0)
    node.holdings = {("a-aaaaaa", 0): 20, ("b-bbbbbb", 0): 5}
    pool.remove("a-aaaaaa")
    assert list(pool.jobs) == ["b-bbbbbb"] and list(pool._finished) == ["b-bbbbbb"] and pool.forgotten == 1
    assert node.holdings == {("b-bbbbbb", 0): 5} and pool.resolve("a") is None
    pool.remove("c-cccccc")  # one the store alone had
    assert pool.forgotten == 0


Ctl = Callable[..., tuple[int, str, str]]


@pytest.fixture
def ctl(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Ctl:
    """`dpctl --coordinator ADDR ARGS` in this process (saves an interpreter's start-up a call):
    (code, stdout, stderr)."""
    monkeypatch.delenv("DPOOL_KEYS", raising=False)

    def run(pool: LocalPool, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(["--coordinator", pool.addr, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_rm_deletes_the_records_and_every_nodes_folder_and_refuses_a_live_job(processes: Processes, tmp_path: Path, ctl: Ctl) -> None:
    pool = LocalPool(processes, tmp_path).start(1, 1)
    done = pool.submit(write_job(tmp_path, "done", workers={"min": 2, "max": 2}))
    assert pool.wait_end(done).state == "succeeded"
    folders = {name: tmp_path / f"state-{name}" / "jobs" / done for name in ("n0", "n1")}
    assert all((f / "slot-0" / "checkpoints").is_dir() for f in folders.values())

    # n1 stops: it is told when it joins again.
    n1 = pool.daemons["n1"]
    os.kill(n1.pid, signal.SIGTERM)
    assert n1.proc.wait(timeout=20) == 0
    wait_for("n1 gone", lambda: [n.state for n in pool.nodes() if n.name == "n1"] == ["lost"], 10)

    live = pool.submit(write_job(tmp_path, "live", workers={"min": 1, "max": 1}, train={"steps": 100_000}))
    pool.wait_status(live, "live to run", lambda s: s.state == "running", 60)
    r = pool.dpctl("rm", live)
    assert r.returncode == 1 and "cancel it first" in r.stderr and f"dpctl cancel {live}" in r.stderr, r.stderr
    assert (tmp_path / "state-n0" / "jobs" / live).is_dir()

    r = pool.dpctl("rm", "done", "--json")  # by name, as other commands take it
    assert r.returncode == 0, r.stderr
    removed = json.loads(r.stdout)
    assert removed["id"] == done and removed["state"] == "succeeded" and removed["nodes"] == ["n0"] and removed["later"] == ["n1"]
    rows = removed["rows"]
    assert rows["jobs"] == 1 and rows["metrics"] >= 20 and rows["events"] >= 3 and rows["logs"] > 0, rows
    wait_for("n0's folder of the job gone", lambda: not folders["n0"].exists(), 10)
    assert folders["n1"].exists()
    for cmd in ("status", "events", "logs", "metrics"):
        code, _, err = ctl(pool, cmd, done)
        assert code == 2 and f"no job {done!r}" in err, (cmd, code, err)
    code, out, _ = ctl(pool, "status", "--json")
    assert code == 0 and [j["id"] for j in json.loads(out)] == [live]
    assert ctl(pool, "rm", done)[0] == 2  # gone already

    pool.start_daemon("n1")  # the same state dir: it still has the job's folder, and is told to delete it
    wait_for("n1's folder of the job gone", lambda: not folders["n1"].exists(), 60)
    for name in ("n0", "n1"):
        wait_for(f"{name}'s removed/ emptied", lambda name=name: not any((tmp_path / f"state-{name}" / "removed").iterdir()), 10)

    def removed_events() -> list[list[str]]:
        log = [json.loads(line) for line in (tmp_path / "dpd-n1.2.log").read_text().splitlines() if line.startswith("{")]
        return [e["run_dirs"] for e in log if e.get("event") == "job.removed" and e.get("job") == done]

    wait_for("n1's job.removed logged", removed_events, 10)  # the log's write may trail the folder's rename
    assert removed_events() == [["slot-0"]]

    # A cancelled job whose worker may still be stopping: its folder goes once the worker is gone.
    assert ctl(pool, "cancel", live)[0] == 0
    code, out, err = ctl(pool, "rm", live)
    assert code == 0 and f"removed job {live} (cancelled)" in out, err
    wait_for("the cancelled job's folder gone", lambda: not (tmp_path / "state-n0" / "jobs" / live).exists(), 20)
