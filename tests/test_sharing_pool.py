"""The scheduler's decisions carried out by the pool (daemon/pool.py, pure, injected clock): a
shrink, a preemption, a growth back, a priority changed, the queue's rows. Each resize is a
planned restart: checkpoint at the next step, exit 75, restart from that step."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from jobs import write_job
from test_pool_state import Driven, join, prepare_all, records, running_pool, sends, spec

from dpool.client import cli
from dpool.client import queue as client_queue
from dpool.daemon.jobstate import JobState
from dpool.daemon.sharing import queue_rows
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.sharing import PriorityReply, QueueReply, QueueRow, TakeRow


def prio_spec(name: str, lo: int = 1, hi: int = 4, priority: int = 0) -> Any:
    return parse_job({
        "name": name, "priority": priority, "workers": {"min": lo, "max": hi},
        "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
        "train": {"steps": 20, "global_batch": 6, "warmup_steps": 2},
    })


def up(pool: Driven, job: str, out: list[Any], now: float, resume: int = 0) -> list[Any]:
    """Prepare, hello and one step of `job`'s newest generation."""
    out = prepare_all(pool, [a for a in out if isinstance(getattr(a, "msg", None), m.GroupPrepare) and a.msg.job == job], now)
    plan = pool.jobs[job].plan
    assert plan is not None
    gen = plan.generation
    for r, slot in enumerate(plan.ranks):
        out += pool.worker_hello(now + 0.1, slot.node, job, gen, r, 300 + r, resume)
    for r in range(plan.world_size):
        out += pool.progress(now + 0.2, job, gen, r, resume + 1, 192, 0.05)
    return out


def slots_prepared(out: list[Any]) -> dict[str, int]:
    got: dict[str, int] = {}
    for s in sends(out, m.GroupPrepare):
        assert isinstance(s.msg, m.GroupPrepare)
        got[s.msg.job] = got.get(s.msg.job, 0) + len(s.msg.slots)
    return got


def exit_all(pool: Driven, job: str, now: float, code: int = 75) -> list[Any]:
    plan = pool.jobs[job].plan
    assert plan is not None
    out: list[Any] = []
    for r, slot in enumerate(plan.ranks):
        out += pool.worker_exited(now, slot.node, job, plan.generation, r, slot.index, code, False)
    return out


def test_a_higher_priority_job_shrinks_the_running_one_and_it_grows_back_when_that_ends() -> None:
    pool = running_pool(("a", "b", "c"))  # "j": 1-3 workers, on all three, at step 7
    out = pool.submit(2.0, "h", prio_spec("h", 1, 2, priority=5))
    stops = sends(out, m.GroupStop)
    assert sorted(s.node for s in stops) == ["a", "b", "c"] and all(s.msg.mode == "checkpoint" for s in stops)  # type: ignore[attr-defined]
    assert records(out, "group.stopped")[0]["reason"] == "shrinking from 3 to 1 workers for h"
    assert pool.jobs["h"].status(2.0).waiting == "its 1-2 slot(s): j (shrinking 3->1)"
    pool.progress(2.1, "j", 1, 0, 8, 192, 0.05)  # the step the stop was fused into
    out = exit_all(pool, "j", 2.2)
    assert slots_prepared(out) == {"h": 2, "j": 1}  # h first: it is ahead in the queue
    h_out = up(pool, "h", out, 2.3)
    j_out = up(pool, "j", out, 2.3, resume=8)
    assert pool.jobs["h"].plan.world_size == 2 and pool.jobs["j"].plan.world_size == 1  # type: ignore[union-attr]
    (shrunk,) = records(j_out, "job.shrunk")
    assert shrunk["from"] == 3 and shrunk["to"] == 1 and shrunk["by"] == ["h"] and shrunk["steps_lost"] == 0 and shrunk["restart_s"] > 0
    assert records(h_out, "job.shrunk") == []
    # h ends: j grows back into its slots (no warm trainers asked of a node that says it has none).
    out = exit_all(pool, "h", 3.0, code=0)
    assert pool.jobs["h"].state is JobState.SUCCEEDED
    for n in ("a", "b", "c"):
        out += pool.from_node(3.0, n, m.NodeWarmed(job="j", slots=[], error="warm trainers are off")) + pool.schedule(3.0)
    assert [s.node for s in sends(out, m.GroupStop)] and records(out, "group.growing")[0]["to"] == 3
    pool.progress(3.1, "j", 2, 0, 9, 192, 0.05)
    out = exit_all(pool, "j", 3.2)
    out = up(pool, "j", out, 3.3, resume=9)
    (grown,) = records(out, "job.grown")
    assert grown == {"from": 1, "to": 3, "steps_lost": 0, "restart_s": grown["restart_s"]}


def test_a_job_at_its_minimum_is_preempted_requeued_with_its_checkpoint_and_resumes() -> None:
    pool = running_pool(("a", "b"), lo=2)
    out = pool.submit(2.0, "h", prio_spec("h", 1, 1, priority=1))
    assert records(out, "group.stopped")[0]["reason"] == "preempted by h: back to the queue with its checkpoint"
    pool.progress(2.1, "j", 1, 0, 8, 192, 0.05)
    for r, n in enumerate(("a", "b")):
        pool.checkpoint(2.15, n, "j", 1, r, 0, 8, 0.01)
    out = exit_all(pool, "j", 2.2)
    job = pool.jobs["j"]
    assert job.state is JobState.QUEUED and job.checkpoint_step == 8
    (pre,) = records(out, "job.preempted")
    assert pre == {"by": ["h"], "from": 2, "step": 8, "steps_lost": 0, "stop_s": 0.2}
    assert records(out, "job.queued") and [s.msg.job for s in sends(out, m.GroupPrepare)] == ["h"]  # type: ignore[attr-defined]
    assert job.waiting == "2 free slot(s) (workers.min); 1 free, the rest held by h (1, priority 1)"
    h_out = up(pool, "h", out, 2.3)
    out = exit_all(pool, "h", 3.0, code=0)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"]
    out = up(pool, "j", out, 3.1, resume=8)
    assert records(out, "group.resumed")[0]["steps_recomputed"] == 0
    assert h_out and job.state is JobState.RUNNING and job.machine.restarts == 0


def test_equal_jobs_split_the_pool_and_a_later_arrival_shrinks_the_first() -> None:
    pool = Driven()
    join(pool, "a", 2)
    join(pool, "b", 2)
    out = pool.submit(0.0, "first", spec("first", hi=4))
    out = up(pool, "first", out, 0.5)
    assert pool.jobs["first"].plan.world_size == 4  # type: ignore[union-attr]
    out = pool.submit(1.0, "second", spec("second", hi=4))
    assert len(sends(out, m.GroupStop)) == 2 and records(out, "group.stopped")[0]["reason"] == "shrinking from 4 to 2 workers for second"
    out = exit_all(pool, "first", 1.5)
    assert slots_prepared(out) == {"first": 2, "second": 2}


def test_backfill_starts_a_small_job_the_big_head_cannot_block() -> None:
    pool = Driven()
    join(pool, "a", 1)
    join(pool, "b", 1)
    up(pool, "first", pool.submit(0.0, "first", spec("first", hi=1)), 0.5)
    pool.submit(1.0, "big", spec("big", lo=2, hi=2))
    out = pool.submit(1.1, "small", spec("small", hi=1))
    assert [s.msg.job for s in sends(out, m.GroupPrepare)] == ["small"]  # type: ignore[attr-defined]
    rows = queue_rows(pool.live.values(), pool.decision)
    assert [(r.position, r.id, r.state, r.target) for r in rows] == [(1, "first", "running", 1), (2, "big", "queued", 0), (3, "small", "starting", 1)]
    assert rows[1].waiting == "2 free slot(s) (workers.min); held by first (1) and small (1, behind it: backfill)"


def test_a_priority_raised_moves_a_queued_job_ahead() -> None:
    pool = Driven()
    join(pool, "a", 1)
    up(pool, "first", pool.submit(0.0, "first", spec("first", hi=1)), 0.5)
    pool.submit(1.0, "second", spec("second", hi=1))
    pool.submit(1.1, "third", spec("third", hi=1))
    out = pool.set_priority(2.0, pool.jobs["third"], 3)
    assert records(out, "job.priority") == [{"priority": 3, "previous": 0}]
    assert pool.jobs["third"].spec.priority == 3 and pool.jobs["third"].doc["priority"] == 3
    assert pool.set_priority(2.0, pool.jobs["third"], 3) == []  # the same again: nothing to record
    out = pool.schedule(2.0)
    assert [r.id for r in queue_rows(pool.live.values(), pool.decision)] == ["third", "first", "second"]
    # first (priority 0) is preempted for third: it runs at its minimum of 1.
    assert records(out, "group.stopped")[0]["reason"] == "preempted by third: back to the queue with its checkpoint"


def test_a_requeued_job_waits_a_while_for_a_slot_that_holds_its_checkpoint() -> None:
    pool = running_pool(("a", "b"), lo=2)
    join(pool, "c", 1, now=1.5)
    out = pool.submit(2.0, "h", prio_spec("h", 2, 2, priority=1))
    pool.progress(2.1, "j", 1, 0, 8, 192, 0.05)
    for r, n in enumerate(("a", "b")):
        pool.checkpoint(2.15, n, "j", 1, r, 0, 8, 0.01)
    out = exit_all(pool, "j", 2.2)
    assert pool.jobs["j"].state is JobState.QUEUED
    up(pool, "h", out, 2.3)
    out = pool.submit(2.5, "k", prio_spec("k", 1, 1, priority=1))  # takes the slot h left free
    up(pool, "k", out, 2.6)
    busy = {s.node for job in ("h", "k") for s in pool.jobs[job].plan.ranks}  # type: ignore[union-attr]
    assert busy == {"a", "b", "c"}
    # Two slots free, on d and e: neither holds step 8, which a and b (busy) do.
    join(pool, "d", 1, now=3.0)
    out = join(pool, "e", 1, now=3.0)
    assert sends(out, m.GroupPrepare) == []
    assert pool.jobs["j"].waiting == "a free slot on a node holding its newest checkpoint (a, b), for at most 60 s"
    for n in "abcde":
        pool.seen(62.0, n)
    assert sends(pool.tick(62.0), m.GroupPrepare) == []
    for n in "abcde":
        pool.seen(63.1, n)
    out = pool.tick(63.1)  # a minute on: it starts where it can (from the newest step those slots hold)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["d", "e"]


# -- dpctl's side (cli.main in this process, no pool) -----------------------------------------


def test_submit_priority_goes_into_the_job_and_a_bad_one_is_refused_by_name(tmp_path: Any, capsys: Any) -> None:
    job = write_job(tmp_path, "p")
    assert cli.main(["submit", str(job), "--priority", "7", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "priority = 7" in out.out
    assert cli.main(["submit", str(job), "--priority", "2000000000", "--dry-run"]) == 2
    assert "--priority 2000000000: must be an integer from -1000000000 to 1000000000" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('priority = "high"\n' + job.read_text())
    assert cli.main(["submit", str(bad), "--dry-run"]) == 2
    assert f"{bad}: priority = 'high': must be an integer" in capsys.readouterr().err


def test_the_queue_table_says_what_each_job_waits_for_and_takes(capsys: Any) -> None:
    rows = [
        QueueRow(position=1, id="high-1", name="high", priority=5, state="queued", workers=0, target=2, min=1, max=2, submitted=0.0,
                 waiting="its 1-2 slot(s): low-1 (shrinking 3->1)", takes=[TakeRow(job="low-1", slots=2, how="shrink")]),
        QueueRow(position=2, id="low-1", name="low", priority=0, state="running", workers=3, target=1, min=1, max=3, submitted=0.0),
    ]

    class Stub:
        def call(self, msg: Any, expect: Any) -> Any:
            return QueueReply(rows=rows) if expect is QueueReply else PriorityReply(job_id="low-1", priority=4, previous=0, state="running")

    assert client_queue.cmd_queue(Stub(), SimpleNamespace(json=False)) == 0  # type: ignore[arg-type]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["#", "JOB", "PRIORITY", "STATE"] and "WAITS FOR" in lines[0] and "TAKES" in lines[0]
    assert "its 1-2 slot(s): low-1 (shrinking 3->1)" in lines[1] and "2 from low-1 (shrinking it)" in lines[1]
    assert client_queue.cmd_queue(Stub(), SimpleNamespace(json=True)) == 0  # type: ignore[arg-type]
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == ["high-1", "low-1"]
    assert client_queue.cmd_priority(Stub(), SimpleNamespace(job="low", priority=4, json=False)) == 0  # type: ignore[arg-type]
    assert capsys.readouterr().out.startswith("job low-1 (running): priority 0 -> 4")


def test_a_start_leaves_a_requeued_job_the_slot_that_holds_its_checkpoint() -> None:
    """j was preempted with its newest checkpoint (step 8) on a. When slots free up, k, ahead of
    it, needs one: it takes another than a, so j resumes on a from step 8 at once, instead of
    waiting out HOLDER_WAIT_S and then starting from step 0 elsewhere."""
    pool = running_pool(("a",), hi=1)
    for n in "bc":
        join(pool, n, 1, now=1.5)
    out = pool.submit(2.0, "h", prio_spec("h", 3, 3, priority=5))  # needs every slot: j goes back to the queue
    pool.checkpoint(2.1, "a", "j", 1, 0, 0, 8, 0.01)
    out = exit_all(pool, "j", 2.2)
    assert pool.jobs["j"].state is JobState.QUEUED and slots_prepared(out) == {"h": 3}
    up(pool, "h", out, 2.3)
    pool.submit(3.0, "k", prio_spec("k", 1, 1, priority=9))  # preempts h in turn
    for r, n in enumerate("ab"):  # h's ranks exit together: the coordinator schedules once for the batch
        pool.from_node(3.2, n, m.NodeWorkerExited(job="h", generation=1, rank=r, slot=0, code=75, stopped=False))
    out = pool.worker_exited(3.2, "c", "h", 1, 2, 0, 75, False)
    prepared = {s.msg.job: s.node for s in sends(out, m.GroupPrepare)}  # type: ignore[attr-defined]
    assert prepared["j"] == "a" and prepared["k"] != "a", prepared
