"""The coordinator's policy as pure functions: the job state machine, planning, the pool (with an
injected clock: time is whatever the test says), and the store's metric de-duplication."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dpool.daemon import jobstate as js
from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.plan import FreeSlot, Slot, choose_slots, equal_shares
from dpool.daemon.pool import JobChanged, Pool, Record, Send
from dpool.daemon.store import Store
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

# -- the job state machine ---------------------------------------------------------------------


def launched(world: int = 2, deadline: float = 100.0) -> JobMachine:
    jm = JobMachine()
    jm.handle(js.Admitted(world), 0.0)
    jm.handle(js.GroupLaunched(1, deadline), 1.0)
    return jm


def test_a_job_runs_to_success_once_every_rank_is_done() -> None:
    jm = launched(2)
    assert jm.state is JobState.STARTING and jm.generation == 1 and jm.started_at == 1.0
    jm.handle(js.RankUp(1, 0), 2.0)
    assert jm.state is JobState.STARTING
    out = jm.handle(js.RankUp(1, 1), 2.0)
    assert jm.state is JobState.RUNNING and js.Emit("group.started", {"generation": 1, "world_size": 2}) in out
    jm.handle(js.RankExited(1, 0, "a", 0, False), 3.0)
    assert jm.state is JobState.RUNNING
    out = jm.handle(js.RankExited(1, 1, "b", 0, False), 4.0)
    assert jm.state is JobState.SUCCEEDED and jm.finished_at == 4.0 and jm.error is None
    assert not any(isinstance(a, js.StopGroup) for a in out)


def test_a_failed_rank_fails_the_job_and_stops_the_group() -> None:
    jm = launched(2)
    jm.handle(js.RankUp(1, 0), 2.0)
    jm.handle(js.RankUp(1, 1), 2.0)
    out = jm.handle(js.RankExited(1, 1, "b", 1, False), 3.0)
    assert jm.state is JobState.FAILED and "rank 1 on node b" in (jm.error or "")
    assert js.StopGroup(1) in out
    assert js.Emit("worker.failed", {"rank": 1, "node": "b", "reason": "exit", "code": 1}) in out
    # A straggler's exit after the decision changes nothing.
    assert jm.handle(js.RankExited(1, 0, "a", -15, True), 4.0) == [] and jm.state is JobState.FAILED


def test_exit_2_is_reported_as_a_bad_job_file() -> None:
    jm = launched(1)
    jm.handle(js.RankExited(1, 0, "a", 2, False), 3.0)
    assert jm.error == "rank 0 on node a failed: bad job file"


def test_events_of_an_old_generation_are_ignored() -> None:
    jm = launched(2)
    assert jm.handle(js.RankUp(0, 0), 2.0) == [] and jm.up == set()
    assert jm.handle(js.RankExited(0, 0, "a", 1, False), 2.0) == [] and jm.state is JobState.STARTING


def test_start_deadline_fails_a_group_that_never_forms() -> None:
    jm = launched(2, deadline=10.0)
    jm.handle(js.RankUp(1, 0), 2.0)
    assert jm.handle(js.Tick(), 9.9) == []
    out = jm.handle(js.Tick(), 10.0)
    assert jm.state is JobState.FAILED and "ranks [1] never reported" in (jm.error or "") and js.StopGroup(1) in out


def test_an_aborted_prepare_requeues_without_using_a_generation() -> None:
    jm = JobMachine()
    jm.handle(js.Admitted(2), 0.0)
    jm.handle(js.StartAborted("node b lost"), 1.0)
    assert jm.state is JobState.QUEUED and jm.generation == 0


@pytest.mark.parametrize("stage", ["queued", "preparing", "running"])
def test_cancel_from_every_live_state(stage: str) -> None:
    jm = JobMachine()
    if stage != "queued":
        jm.handle(js.Admitted(1), 0.0)
    if stage == "running":
        jm.handle(js.GroupLaunched(1, 100.0), 0.0)
        jm.handle(js.RankUp(1, 0), 0.0)
    out = jm.handle(js.CancelRequested(), 5.0)
    assert jm.state is JobState.CANCELLED and jm.finished_at == 5.0
    assert (js.StopGroup(1) in out) == (stage == "running")
    assert jm.handle(js.CancelRequested(), 6.0) == []  # already decided


# -- planning ----------------------------------------------------------------------------------


def test_equal_shares_split_the_global_batch() -> None:
    assert equal_shares(6, 3) == [2, 2, 2]
    assert equal_shares(7, 3) == [3, 2, 2]
    assert sum(equal_shares(64, 5)) == 64
    with pytest.raises(ValueError):
        equal_shares(2, 3)


def test_rank_0_goes_where_the_newest_checkpoint_is_and_the_rest_in_stable_order() -> None:
    free = [FreeSlot("c", 0, None), FreeSlot("a", 0, 10), FreeSlot("b", 0, 20), FreeSlot("a", 1, None)]
    assert choose_slots(free, 1, 3) == [Slot("b", 0), Slot("a", 0), Slot("c", 0)]
    assert choose_slots(free, 5, 8) is None
    # No checkpoints: one slot per node before a second on any node, ranks by (node, slot).
    free = [FreeSlot("b", 1, None), FreeSlot("b", 0, None), FreeSlot("a", 0, None)]
    assert choose_slots(free, 1, 2) == [Slot("a", 0), Slot("b", 0)]


# -- the pool ----------------------------------------------------------------------------------


def spec(name: str = "j", lo: int = 1, hi: int = 4, start_timeout: float = 30.0) -> Any:
    return parse_job(
        {
            "name": name,
            "workers": {"min": lo, "max": hi},
            "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
            "train": {"steps": 20, "global_batch": 6, "warmup_steps": 2},
            "recovery": {"start_timeout_s": start_timeout},
        }
    )


def sends(actions: list[Any], kind: type[m.Message]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.msg, kind)]


def join(pool: Pool, name: str, slots: int, now: float = 0.0) -> list[Any]:
    refusal, actions = pool.register(now, name, f"inc-{name}", {"slots": slots, "advertise": "127.0.0.1"}, [], [], [])
    assert refusal is None
    return actions


def prepare_all(pool: Pool, actions: list[Any], now: float = 1.0) -> list[Any]:
    out: list[Any] = []
    for i, s in enumerate(sends(actions, m.GroupPrepare)):
        msg = s.msg
        assert isinstance(msg, m.GroupPrepare)
        out += pool.prepared(now, s.node, msg.job, msg.generation, "127.0.0.1", [5000 + 10 * i + k for k in range(len(msg.slots))], None)
    return out


def test_admission_two_phase_start_and_success_free_the_slots() -> None:
    pool = Pool()
    join(pool, "a", 1)
    join(pool, "b", 2)
    actions = pool.submit(0.5, "j-1", spec(hi=2))
    prepares = sends(actions, m.GroupPrepare)
    assert [(s.node, s.msg.slots) for s in prepares] == [("a", [0]), ("b", [0])]  # type: ignore[attr-defined]
    assert pool.jobs["j-1"].state is JobState.STARTING
    assert [n["busy_slots"] for n in pool.node_rows(0.5)] == [1, 1]

    starts = sends(prepare_all(pool, actions), m.GroupStart)
    assert sorted(s.node for s in starts) == ["a", "b"]
    start = starts[0].msg
    assert isinstance(start, m.GroupStart)
    assert start.hostfile == [["127.0.0.1:5000"], ["127.0.0.1:5010"]] and start.shares == [3, 3]
    assert pool.jobs["j-1"].machine.generation == 1

    for rank, node in ((0, "a"), (1, "b")):
        pool.worker_hello(2.0, node, "j-1", 1, rank, 100 + rank, 0)
    assert pool.jobs["j-1"].state is JobState.RUNNING
    pool.progress(2.5, "j-1", 1, 0, 7, 192, 0.1)
    assert pool.jobs["j-1"].status()["step"] == 7
    pool.worker_exited(3.0, "a", "j-1", 1, 0, 0, 0, False)
    out = pool.worker_exited(3.0, "b", "j-1", 1, 1, 0, 0, False)
    assert pool.jobs["j-1"].state is JobState.SUCCEEDED
    assert any(isinstance(a, Record) and a.kind == "job.succeeded" for a in out) and JobChanged("j-1") in out
    assert [(n["state"], n["busy_slots"]) for n in pool.node_rows(3.0)] == [("idle", 0), ("idle", 0)]


def test_a_second_job_waits_for_room_then_starts() -> None:
    pool = Pool()
    join(pool, "a", 1)
    first = pool.submit(0.0, "first", spec("first"))
    assert sends(pool.submit(0.0, "second", spec("second")), m.GroupPrepare) == []
    prepare_all(pool, first)
    pool.worker_hello(1.0, "a", "first", 1, 0, 1, 0)
    out = pool.worker_exited(2.0, "a", "first", 1, 0, 0, 0, False)
    assert [s.msg.job for s in sends(out, m.GroupPrepare)] == ["second"]  # type: ignore[attr-defined]


def test_a_job_too_big_for_the_pool_does_not_block_the_queue() -> None:
    pool = Pool()
    join(pool, "a", 1)
    pool.submit(0.0, "big", spec("big", lo=2, hi=2))
    out = pool.submit(0.0, "small", spec("small"))
    assert [s.msg.job for s in sends(out, m.GroupPrepare)] == ["small"]  # type: ignore[attr-defined]
    assert pool.jobs["big"].state is JobState.QUEUED


def test_cancel_stops_the_group_and_slots_free_when_workers_exit() -> None:
    pool = Pool()
    join(pool, "a", 1)
    pool.worker_hello(0, "a", "x", 1, 0, 1, 0)  # unknown job: ignored
    prepare_all(pool, pool.submit(0.0, "j", spec()))
    pool.worker_hello(1.0, "a", "j", 1, 0, 42, 0)
    out = pool.cancel(2.0, pool.jobs["j"])
    assert pool.jobs["j"].state is JobState.CANCELLED
    assert [(s.node, s.msg) for s in sends(out, m.GroupStop)] == [("a", m.GroupStop(job="j", generation=1))]
    assert pool.node_rows(2.0)[0]["busy_slots"] == 1  # until the worker is really gone
    pool.worker_exited(3.0, "a", "j", 1, 0, 0, -15, True)
    assert pool.node_rows(3.0)[0]["busy_slots"] == 0 and pool.jobs["j"].state is JobState.CANCELLED


def test_duplicate_names_are_refused_while_the_first_is_alive() -> None:
    pool = Pool(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 1, now=0.0)
    refusal, _ = pool.register(1.0, "a", "another", {"slots": 1}, [], [], [])
    assert refusal is not None and "'a' is already in the pool" in refusal
    refusal, _ = pool.register(1.0, "a", "inc-a", {"slots": 1}, [], [], [])  # the same daemon again
    assert refusal is None
    pool.tick(5.0)  # silent for more than 0.5 s x 6
    assert pool.node_rows(5.0)[0]["state"] == "lost"
    refusal, _ = pool.register(5.5, "a", "another", {"slots": 1}, [], [], [])
    assert refusal is None and pool.node_rows(5.5)[0]["state"] == "idle"


def test_a_lost_node_fails_its_job_for_now() -> None:
    pool = Pool(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 1)
    join(pool, "b", 1)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=2)))
    for r, node in ((0, "a"), (1, "b")):
        pool.worker_hello(1.0, node, "j", 1, r, r, 0)
    pool.seen(3.5, "a")
    out = pool.tick(3.6)  # b last heard at 0.0
    job = pool.jobs["j"]
    assert job.state is JobState.FAILED and "node b" in (job.machine.error or "")
    assert [s.node for s in sends(out, m.GroupStop)] == ["a"]
    assert any(isinstance(a, Record) and a.kind == "worker.failed" and a.fields["reason"] == "heartbeat" for a in out)


def test_an_unanswered_prepare_requeues_and_frees_the_slots() -> None:
    pool = Pool(prepare_timeout_s=5.0)
    join(pool, "a", 1)
    pool.submit(0.0, "j", spec())
    pool.seen(4.0, "a")
    pool.tick(4.0)
    assert pool.jobs["j"].state is JobState.STARTING
    pool.seen(5.0, "a")
    out = pool.tick(5.0)
    # Requeued, and since the slot is free again, immediately prepared again.
    assert any(isinstance(a, Record) and a.kind == "group.aborted" for a in out)
    assert len(sends(out, m.GroupPrepare)) == 1 and pool.jobs["j"].state is JobState.STARTING


def test_heartbeats_free_slots_of_finished_jobs_whose_workers_are_gone() -> None:
    pool = Pool()
    join(pool, "a", 1)
    prepare_all(pool, pool.submit(0.0, "j", spec()))
    pool.cancel(1.0, pool.jobs["j"])
    pool.heartbeat(1.5, "a", [{"job": "j", "generation": 1, "slot": 0}])
    assert pool.node_rows(1.5)[0]["busy_slots"] == 1  # still running there
    pool.heartbeat(2.0, "a", [])
    assert pool.node_rows(2.0)[0]["busy_slots"] == 0


def test_a_rejoining_node_keeps_its_group_and_orphans_are_stopped() -> None:
    pool = Pool(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 2)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=1)))
    pool.worker_hello(1.0, "a", "j", 1, 0, 42, 0)
    running = [{"job": "j", "generation": 1, "rank": 0, "slot": 0, "pid": 42}, {"job": "old", "generation": 3, "rank": 0, "slot": 1, "pid": 7}]
    refusal, out = pool.register(2.0, "a", "inc-a", {"slots": 2}, running, [], [])
    assert refusal is None and pool.jobs["j"].state is JobState.RUNNING
    assert [s.msg for s in sends(out, m.GroupStop)] == [m.GroupStop(job="old", generation=3)]
    # Exits that happened while the link was down arrive with the registration.
    exited = [{"job": "j", "generation": 1, "rank": 0, "slot": 0, "code": 0, "stopped": False}]
    pool.register(3.0, "a", "inc-a", {"slots": 2}, [], exited, [])
    assert pool.jobs["j"].state is JobState.SUCCEEDED


def test_checkpoint_step_counts_once_every_rank_saved_it() -> None:
    pool = Pool()
    join(pool, "a", 2)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=2)))
    assert pool.checkpoint(1.0, "a", "j", 1, 0, 0, 5, 0.1) == []
    out = pool.checkpoint(1.1, "a", "j", 1, 1, 1, 5, 0.3)
    assert pool.jobs["j"].checkpoint_step == 5
    assert Record("j", "checkpoint.saved", 1.1, {"step": 5, "seconds": 0.3}) in out
    assert pool.nodes["a"].holdings == {("j", 0): 5, ("j", 1): 5}


# -- the store ---------------------------------------------------------------------------------


def test_store_keeps_the_newest_generations_metric_rows(tmp_path: Path) -> None:
    store = Store(tmp_path / "c.sqlite3")
    store.add_metric("j", 1, {"kind": "train", "step": 5, "loss": 3.0, "generation": 1})
    store.add_metric("j", 2, {"kind": "train", "step": 5, "loss": 2.9, "generation": 2})
    store.add_metric("j", 1, {"kind": "train", "step": 5, "loss": 3.1, "generation": 1})  # late straggler
    store.add_metric("j", 2, {"kind": "eval", "step": 5, "val_loss": 3.5})
    store.add_metric("j", 2, {"kind": "train", "step": 4, "loss": 3.2, "generation": 2})
    assert store.metrics("j", 0, 100) == [
        {"kind": "train", "step": 4, "loss": 3.2, "generation": 2},
        {"kind": "train", "step": 5, "loss": 2.9, "generation": 2},
        {"kind": "eval", "step": 5, "val_loss": 3.5},
    ]
    assert store.metrics("j", 1, 1) == [{"kind": "train", "step": 5, "loss": 2.9, "generation": 2}]


def test_store_round_trips_jobs_for_a_restarted_coordinator(tmp_path: Path) -> None:
    pool = Pool()
    join(pool, "a", 1)
    prepare_all(pool, pool.submit(0.0, "j", spec()))
    store = Store(tmp_path / "c.sqlite3")
    store.save_job(pool.jobs["j"])
    store.close()
    (job,) = Store(tmp_path / "c.sqlite3").load_jobs()
    assert job.id == "j" and job.state is JobState.STARTING and job.plan == pool.jobs["j"].plan
    restarted = Pool()
    restarted.restore(job, 100.0)
    refusal, _ = restarted.register(101.0, "a", "inc-a", {"slots": 1}, [{"job": "j", "generation": 1, "rank": 0, "slot": 0, "pid": 9}], [], [])
    assert refusal is None
    restarted.worker_hello(101.5, "a", "j", 1, 0, 9, 0)
    restarted.seen(200.0, "a")
    restarted.tick(200.0)  # past the reconcile deadline: the rank came back, so the job goes on
    assert restarted.jobs["j"].state is JobState.RUNNING
