"""The coordinator's policy as pure functions: the job state machine, planning, the pool (with an
injected clock: time is whatever the test says), and the store's metric de-duplication."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import pytest

from dpool.daemon import jobstate as js
from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.plan import FreeSlot, Slot, choose_slots, equal_shares
from dpool.daemon.pool import JobChanged, Pool, Record, Refused, Send
from dpool.daemon.store import Store
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import (
    AliveWorker,
    EvalRow,
    ExitedWorker,
    Holding,
    NodeInfo,
    RunningWorker,
    TrainRow,
)

# -- the job state machine ---------------------------------------------------------------------


def launched(world: int = 2, deadline: float = 100.0) -> JobMachine:
    jm = JobMachine()
    jm.handle(js.Admitted(world), 0.0)
    jm.handle(js.GroupLaunched(1, deadline, tuple(f"n{r}" for r in range(world))), 1.0)
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


def test_a_failed_rank_restarts_the_group_using_one_restart() -> None:
    jm = launched(2)
    jm.handle(js.RankUp(1, 0, 0), 2.0)
    jm.handle(js.RankUp(1, 1), 2.0)
    out = jm.handle(js.RankExited(1, 1, "b", -9, False), 3.0)
    assert jm.state is JobState.RECOVERING and jm.restarts == 1 and jm.phase is js.Phase.STOPPING
    assert js.StopGroup(1) in out and js.Blame("b") in out
    assert js.Emit("worker.failed", {"rank": 1, "node": "b", "reason": "exit", "code": -9}) in out
    assert not jm.ready_to_restart(3.5)  # rank 0 may still run
    # Its peer fails too (connection lost): part of the same failure, not a second one.
    assert jm.handle(js.RankExited(1, 0, "a", 1, False), 3.2) == [] and jm.restarts == 1
    assert jm.ready_to_restart(3.2)


def test_the_restart_budget_spent_the_job_fails() -> None:
    jm = launched(1)
    jm.max_restarts = 0
    jm.handle(js.RankUp(1, 0, 0), 2.0)
    out = jm.handle(js.RankExited(1, 0, "a", 1, False), 3.0)
    assert jm.state is JobState.FAILED and "max_restarts = 0" in (jm.error or "")
    # A straggler's exit after the decision changes nothing.
    assert jm.handle(js.RankExited(1, 0, "a", -15, True), 4.0) == [] and jm.state is JobState.FAILED
    assert js.Emit("job.failed", {"error": jm.error}) in out


def test_exit_2_leaves_that_node_out_and_restarts_without_using_the_budget() -> None:
    """A rank that refuses its input (a path missing on its machine) makes its node unfit for the
    job: the group restarts without it, as a membership change."""
    jm = launched(2)
    out = jm.handle(js.RankExited(1, 0, "a", 2, False, "data.source = '~/c': no such directory"), 3.0)
    assert js.Unfit("a", "rank 0: data.source = '~/c': no such directory") in out
    assert jm.state is JobState.RECOVERING and jm.restarts == 0 and jm.cause is js.Cause.MEMBERSHIP and jm.error is None


def test_exit_2_after_its_peers_connection_lost_takes_back_the_restart_they_started() -> None:
    jm = launched(2)
    jm.handle(js.RankExited(1, 1, "b", 1, False), 3.0)  # the peer's "connection lost" arrives first
    assert jm.restarts == 1
    out = jm.handle(js.RankExited(1, 0, "a", 2, False, "files differ"), 3.1)
    assert js.Unfit("a", "rank 0: files differ") in out and jm.restarts == 0


def test_exit_2_of_a_rank_the_first_refusals_stop_reached_still_leaves_its_node_out() -> None:
    """Both ranks refuse the input: the first one's exit stops the group, and the second's exit 2,
    with its reason, arrives marked stopped (the stop reached its dpd as it exited). Its node is
    unfit all the same (before, only the first node was, and the job waited for the second)."""
    jm = launched(2)
    out = jm.handle(js.RankExited(1, 1, "b", 2, False, "the validation split has 0 tokens"), 3.0)
    assert js.Unfit("b", "rank 1: the validation split has 0 tokens") in out
    out = jm.handle(js.RankExited(1, 0, "a", 2, True, "the validation split has 0 tokens"), 3.01)
    assert js.Unfit("a", "rank 0: the validation split has 0 tokens") in out and jm.restarts == 0
    # A stopped rank's exit 2 without a reason is not taken for a refusal.
    jm = launched(2)
    jm.handle(js.RankExited(1, 1, "b", 2, False, "files differ"), 3.0)
    assert not [a for a in jm.handle(js.RankExited(1, 0, "a", 2, True), 3.01) if isinstance(a, js.Unfit)]


def test_events_of_an_old_generation_are_ignored() -> None:
    jm = launched(2)
    assert jm.handle(js.RankUp(0, 0), 2.0) == [] and jm.up == set()
    assert jm.handle(js.RankExited(0, 0, "a", 1, False), 2.0) == [] and jm.state is JobState.STARTING


def test_start_deadline_restarts_a_group_that_never_forms() -> None:
    jm = launched(2, deadline=10.0)
    jm.handle(js.RankUp(1, 0), 2.0)
    assert jm.handle(js.Tick(), 9.9) == []
    out = jm.handle(js.Tick(), 10.0)
    assert jm.state is JobState.RECOVERING and jm.restarts == 1 and js.StopGroup(1) in out
    assert js.Emit("worker.failed", {"rank": 1, "node": "n1", "reason": "stalled", "detail": "start timeout"}) in out  # the node it was placed on


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


class Driven(Pool):
    """The pool as the coordinator drives it: each report a real message from a registered node,
    then admission (the coordinator runs it once per batch of messages; here once per call)."""

    def _then_schedule(self, now: float, actions: list[Any]) -> list[Any]:
        return actions + self.schedule(now)

    def _rank_node(self, job: str, rank: int) -> str:
        plan = self.jobs[job].plan if job in self.jobs else None
        return plan.ranks[rank].node if plan is not None and rank < plan.world_size else next(iter(self.nodes), "?")

    def registered(self, now: float, name: str, inc: str, info: NodeInfo, running: list[Any], exited: list[Any], holdings: list[Any]) -> tuple[str | None, list[Any]]:
        refusal, actions = self.register(now, m.NodeRegister(name=name, incarnation=inc, info=info, running=running, exited=exited, holdings=holdings))
        return refusal, self._then_schedule(now, actions)

    def submit(self, now: float, job_id: str, spec: Any) -> list[Any]:
        return self._then_schedule(now, super().submit(now, job_id, spec))

    def cancel(self, now: float, job: Any) -> list[Any]:
        return self._then_schedule(now, super().cancel(now, job))

    def tick(self, now: float) -> list[Any]:
        return self._then_schedule(now, super().tick(now))

    def bye(self, now: float, name: str) -> list[Any]:
        return self._then_schedule(now, super().bye(now, name))

    def drain(self, now: float, name: str) -> list[Any]:
        return self._then_schedule(now, super().drain(now, name))

    def undrain(self, now: float, name: str) -> list[Any]:
        return self._then_schedule(now, super().undrain(now, name))

    def heartbeat(self, now: float, name: str, workers: list[AliveWorker]) -> list[Any]:
        return self._then_schedule(now, self.from_node(now, name, m.NodeHeartbeat(workers=workers)))

    def prepared(self, now: float, node: str, job: str, gen: int, host: str, ports: list[int], error: str | None) -> list[Any]:
        return self._then_schedule(now, self.from_node(now, node, m.NodePrepared(job=job, generation=gen, host=host, ports=ports, error=error)))

    def worker_hello(self, now: float, node: str, job: str, gen: int, rank: int, pid: int, resume: int) -> list[Any]:
        return self.from_node(now, node, m.NodeWorkerHello(job=job, generation=gen, rank=rank, pid=pid, resume_step=resume))

    def progress(self, now: float, job: str, gen: int, rank: int, step: int, tokens: int, seconds: float, resplit: bool = False, gather: bool = False) -> list[Any]:
        msg = m.NodeProgress(job=job, generation=gen, rank=rank, step=step, loss=None, tokens=tokens, seconds=seconds, resplit=resplit, gather=gather)
        return self.from_node(now, self._rank_node(job, rank), msg)

    def metric(self, now: float, job: str, gen: int, row: Any) -> list[Any]:
        return self.from_node(now, self._rank_node(job, 0), m.NodeMetric(job=job, generation=gen, row=row))

    def checkpoint(self, now: float, node: str, job: str, gen: int, rank: int, slot: int, step: int, seconds: float) -> list[Any]:
        return self.from_node(now, node, m.NodeCheckpoint(job=job, generation=gen, rank=rank, slot=slot, step=step, seconds=seconds))

    def worker_exited(self, now: float, node: str, job: str, gen: int, rank: int, slot: int, code: int, stopped: bool, error: str | None = None) -> list[Any]:
        msg = m.NodeWorkerExited(job=job, generation=gen, rank=rank, slot=slot, code=code, stopped=stopped, error=error)
        return self._then_schedule(now, self.from_node(now, node, msg))


def spec(name: str = "j", lo: int = 1, hi: int = 4, start_timeout: float = 30.0, sync: dict[str, Any] | None = None) -> Any:
    return parse_job(
        {
            "name": name,
            "workers": {"min": lo, "max": hi},
            "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
            "train": {"steps": 20, "global_batch": 6, "warmup_steps": 2},
            "recovery": {"start_timeout_s": start_timeout},
            **({"sync": sync} if sync else {}),
        }
    )


def sends(actions: list[Any], kind: type[m.Message]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.msg, kind)]


def join(pool: Driven, name: str, slots: int, now: float = 0.0) -> list[Any]:
    refusal, actions = pool.registered(now, name, f"inc-{name}", NodeInfo(slots=slots, advertise="127.0.0.1"), [], [], [])
    assert refusal is None
    return actions


def prepare_all(pool: Driven, actions: list[Any], now: float = 1.0) -> list[Any]:
    out: list[Any] = []
    for i, s in enumerate(sends(actions, m.GroupPrepare)):
        msg = s.msg
        assert isinstance(msg, m.GroupPrepare)
        out += pool.prepared(now, s.node, msg.job, msg.generation, "127.0.0.1", [5000 + 10 * i + k for k in range(len(msg.slots))], None)
    return out


def test_a_dpd_that_registers_again_is_sent_the_prepare_it_has_not_answered() -> None:
    """A dpd that gave up waiting on a restarted coordinator registers again on a new connection:
    the group.prepare sent to the first one was lost with it, and the start waited out its
    timeout (5 s, then group.aborted). It is sent again; an answered one is not."""
    pool = Driven()
    join(pool, "a", 1)
    join(pool, "b", 1)
    first = sends(pool.submit(0.5, "j", spec(lo=2, hi=2)), m.GroupPrepare)
    assert sorted(s.node for s in first) == ["a", "b"]
    a_prep = next(s for s in first if s.node == "a").msg
    pool.prepared(0.6, "a", "j", a_prep.generation, "127.0.0.1", [5000], None)  # a answered; b's answer never came
    out = join(pool, "b", 1, now=0.7)  # the same dpd (incarnation), again
    (again,) = sends(out, m.GroupPrepare)
    b_prep = next(s for s in first if s.node == "b").msg
    assert again.node == "b" and (again.msg.job, again.msg.generation, again.msg.slots) == ("j", b_prep.generation, b_prep.slots)
    assert sends(join(pool, "a", 1, now=0.8), m.GroupPrepare) == []  # a answered: nothing to send again


def test_admission_two_phase_start_and_success_free_the_slots() -> None:
    pool = Driven()
    join(pool, "a", 1)
    join(pool, "b", 2)
    actions = pool.submit(0.5, "j-1", spec(hi=2))
    prepares = sends(actions, m.GroupPrepare)
    assert [(s.node, s.msg.slots) for s in prepares] == [("a", [0]), ("b", [0])]  # type: ignore[attr-defined]
    assert pool.jobs["j-1"].state is JobState.STARTING
    assert [n.busy_slots for n in pool.node_rows(0.5)] == [1, 1]

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
    assert pool.jobs["j-1"].status(2.5).step == 7
    pool.worker_exited(3.0, "a", "j-1", 1, 0, 0, 0, False)
    out = pool.worker_exited(3.0, "b", "j-1", 1, 1, 0, 0, False)
    assert pool.jobs["j-1"].state is JobState.SUCCEEDED
    assert any(isinstance(a, Record) and a.kind == "job.succeeded" for a in out) and JobChanged("j-1") in out
    assert [(n.state, n.busy_slots) for n in pool.node_rows(3.0)] == [("idle", 0), ("idle", 0)]


def test_a_second_job_waits_for_room_then_starts() -> None:
    pool = Driven()
    join(pool, "a", 1)
    first = pool.submit(0.0, "first", spec("first"))
    assert sends(pool.submit(0.0, "second", spec("second")), m.GroupPrepare) == []
    prepare_all(pool, first)
    pool.worker_hello(1.0, "a", "first", 1, 0, 1, 0)
    out = pool.worker_exited(2.0, "a", "first", 1, 0, 0, 0, False)
    assert [s.msg.job for s in sends(out, m.GroupPrepare)] == ["second"]  # type: ignore[attr-defined]


def test_a_job_too_big_for_the_pool_does_not_block_the_queue() -> None:
    pool = Driven()
    join(pool, "a", 1)
    pool.submit(0.0, "big", spec("big", lo=2, hi=2))
    out = pool.submit(0.0, "small", spec("small"))
    assert [s.msg.job for s in sends(out, m.GroupPrepare)] == ["small"]  # type: ignore[attr-defined]
    assert pool.jobs["big"].state is JobState.QUEUED


def test_cancel_stops_the_group_and_slots_free_when_workers_exit() -> None:
    pool = Driven()
    join(pool, "a", 1)
    pool.worker_hello(0, "a", "x", 1, 0, 1, 0)  # unknown job: ignored
    prepare_all(pool, pool.submit(0.0, "j", spec()))
    pool.worker_hello(1.0, "a", "j", 1, 0, 42, 0)
    out = pool.cancel(2.0, pool.jobs["j"])
    assert pool.jobs["j"].state is JobState.CANCELLED
    assert [(s.node, s.msg) for s in sends(out, m.GroupStop)] == [("a", m.GroupStop(job="j", generation=1))]
    assert pool.node_rows(2.0)[0].busy_slots == 1  # until the worker is really gone
    pool.worker_exited(3.0, "a", "j", 1, 0, 0, -15, True)
    assert pool.node_rows(3.0)[0].busy_slots == 0 and pool.jobs["j"].state is JobState.CANCELLED


def test_duplicate_names_are_refused_while_the_first_is_alive() -> None:
    pool = Driven(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 1, now=0.0)
    refusal, _ = pool.registered(1.0, "a", "another", NodeInfo(slots=1), [], [], [])
    assert refusal is not None and "'a' is already in the pool" in refusal
    refusal, _ = pool.registered(1.0, "a", "inc-a", NodeInfo(slots=1), [], [], [])  # the same daemon again
    assert refusal is None
    pool.tick(5.0)  # silent for more than 0.5 s x 6
    assert pool.node_rows(5.0)[0].state == "lost"
    refusal, _ = pool.registered(5.5, "a", "another", NodeInfo(slots=1), [], [], [])
    assert refusal is None and pool.node_rows(5.5)[0].state == "idle"


def test_a_lost_node_restarts_its_job_without_it() -> None:
    pool = Driven(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 1)
    join(pool, "b", 1)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=2)))
    for r, node in ((0, "a"), (1, "b")):
        pool.worker_hello(1.0, node, "j", 1, r, r, 0)
    pool.seen(4.0, "a")
    out = pool.tick(4.1)  # b last heard at 1.0 (its hello)
    job = pool.jobs["j"]
    assert job.state is JobState.RECOVERING and job.machine.restarts == 1
    assert [s.node for s in sends(out, m.GroupStop)] == ["a"]
    assert any(isinstance(a, Record) and a.kind == "worker.failed" and a.fields["reason"] == "heartbeat" for a in out)
    out = pool.worker_exited(3.7, "a", "j", 1, 0, 0, 1, False)  # its peer: connection lost
    assert [(s.node, s.msg.generation) for s in sends(out, m.GroupPrepare)] == [("a", 2)]  # type: ignore[attr-defined]


def test_a_lost_node_that_was_alive_gets_its_blame_and_the_jobs_restart_back() -> None:
    """b's link stalled past the heartbeat expiry (Wi-Fi, a paused machine): lost, the job restarts
    without it. Then b's same dpd process reports again: it was alive, so the loss was a membership
    change: the restart is given back and b is not blamed."""
    pool = running_pool(("a", "b"))
    pool.seen(4.3, "a")
    pool.tick(4.4)  # b last heard at 1.4
    job, b = pool.jobs["j"], pool.nodes["b"]
    assert b.lost and job.machine.restarts == 1 and b.fail_streak == 1
    refusal, out = pool.registered(4.6, "b", "inc-b", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [])
    assert refusal is None and not b.lost
    assert job.machine.restarts == 0 and b.fail_streak == 0 and b.lost_blames == 0
    assert records(out, "node.returned") == [{"node": "b", "restarts": 0}]


def test_a_node_silent_after_its_group_failed_is_lost_after_two_heartbeats_not_the_expiry() -> None:
    """A killed dpd takes its trainer with it: its peers' "connection lost" is all the pool hears.
    The group is stopped at once, and each of its nodes must then be heard from within two
    heartbeat intervals (1 s here), not the expiry (3 s)."""
    pool = running_pool(("a", "b", "c"))
    out = pool.worker_exited(1.5, "a", "j", 1, 0, 100, 1, False)  # a's trainer: its peer vanished
    assert records(out, "group.stopped") and {s.node for s in sends(out, m.GroupStop)} == {"a", "b", "c"}
    pool.seen(1.7, "a")
    pool.seen(2.4, "c")  # alive: it heartbeats
    assert not records(pool.tick(2.4), "node.lost")
    out = pool.tick(2.5)
    lost = records(out, "node.lost")
    assert [r["node"] for r in lost] == ["b"] and "no answer for 1.0s to the stop of its failed group" in lost[0]["reason"]
    assert not pool.nodes["a"].lost and not pool.nodes["c"].lost


def test_nodes_heard_from_after_a_stop_are_asked_nothing_more() -> None:
    pool = running_pool(("a", "b"))
    pool.worker_exited(1.5, "a", "j", 1, 0, 100, 1, False)
    pool.seen(1.6, "a")
    pool.seen(1.6, "b")
    pool.seen(2.9, "a")
    assert not records(pool.tick(2.9), "node.lost"), "b answered; its heartbeat expiry is 3 s"
    assert records(pool.tick(4.7), "node.lost") == [{"node": "b", "reason": "no heartbeat for 3.1s"}]


def test_a_node_set_aside_for_missed_heartbeats_alone_takes_work_again_when_it_returns() -> None:
    pool = running_pool(("a", "b"))
    pool.nodes["b"].fail_streak = 2  # two workers failed there before
    pool.seen(4.3, "a")
    pool.tick(4.4)
    assert pool.nodes["b"].hold is not None  # the third failure in a row: set aside
    pool.registered(4.6, "b", "inc-b", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [])
    assert pool.nodes["b"].fail_streak == 2 and pool.nodes["b"].hold is None


def test_an_unanswered_prepare_requeues_and_frees_the_slots() -> None:
    pool = Driven(prepare_timeout_s=5.0)
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
    pool = Driven()
    join(pool, "a", 1)
    prepare_all(pool, pool.submit(0.0, "j", spec()))
    pool.cancel(1.0, pool.jobs["j"])
    pool.heartbeat(1.5, "a", [AliveWorker(job="j", generation=1, slot=0)])
    assert pool.node_rows(1.5)[0].busy_slots == 1  # still running there
    pool.heartbeat(2.0, "a", [])
    assert pool.node_rows(2.0)[0].busy_slots == 0


def test_a_rejoining_node_keeps_its_group_and_orphans_are_stopped() -> None:
    pool = Driven(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 2)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=1)))
    pool.worker_hello(1.0, "a", "j", 1, 0, 42, 0)
    running = [RunningWorker(job="j", generation=1, rank=0, slot=0, pid=42), RunningWorker(job="old", generation=3, rank=0, slot=1, pid=7)]
    refusal, out = pool.registered(2.0, "a", "inc-a", NodeInfo(slots=2), running, [], [])
    assert refusal is None and pool.jobs["j"].state is JobState.RUNNING
    assert [s.msg for s in sends(out, m.GroupStop)] == [m.GroupStop(job="old", generation=3)]
    # Exits that happened while the link was down arrive with the registration.
    exited = [ExitedWorker(job="j", generation=1, rank=0, slot=0, code=0, stopped=False)]
    pool.registered(3.0, "a", "inc-a", NodeInfo(slots=2), [], exited, [])
    assert pool.jobs["j"].state is JobState.SUCCEEDED


def test_checkpoint_step_counts_once_every_rank_saved_it() -> None:
    pool = Driven()
    join(pool, "a", 2)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=2)))
    assert pool.checkpoint(1.0, "a", "j", 1, 0, 0, 5, 0.1) == []
    out = pool.checkpoint(1.1, "a", "j", 1, 1, 1, 5, 0.3)
    assert pool.jobs["j"].checkpoint_step == 5
    assert Record("j", "checkpoint.saved", 1.1, {"step": 5, "seconds": 0.3}) in out
    assert pool.nodes["a"].holdings == {("j", 0): 5, ("j", 1): 5}


def test_state_kept_in_memory_places_rank_0_but_is_no_checkpoint_of_the_record() -> None:
    pool = Driven()
    join(pool, "a", 2)
    prepare_all(pool, pool.submit(0.0, "j", spec(hi=2)))
    pool.from_node(1.0, "a", m.NodeCheckpoint(job="j", generation=1, rank=1, slot=1, step=9, seconds=0.01, memory=True))
    assert pool.jobs["j"].checkpoint_step is None and pool.nodes["a"].holdings == {}
    assert pool.nodes["a"].resumable == {("j", 1): 9}
    # A restart puts rank 0 on the slot that can resume from the newest step.
    free = [FreeSlot("a", i, pool.nodes["a"].resumable.get(("j", i))) for i in (0, 1)]
    assert choose_slots(free, 1, 2)[0] == Slot("a", 1)
    # A node registering offers what it keeps in memory the same way.
    refusal, _ = pool.registered(2.0, "b", "inc-b", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [Holding(job="j", slot=0, step=12, memory=True)])
    assert refusal is None and pool.nodes["b"].resumable == {("j", 0): 12} and pool.nodes["b"].holdings == {}


def test_a_new_generation_never_resumes_past_a_gap_in_the_recorded_metrics() -> None:
    pool = Driven()
    join(pool, "a", 1)
    job_spec = parse_job({
        "name": "j", "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
        "train": {"steps": 100, "global_batch": 6, "log_every_steps": 5}, "eval": {"every_steps": 20},
    })
    out = prepare_all(pool, pool.submit(0.0, "j", job_spec))
    (start,) = [s.msg for s in sends(out, m.GroupStart)]
    assert isinstance(start, m.GroupStart) and start.resume_max == 4  # no row yet: the first is step 5's
    job = pool.jobs["j"]
    pool.metric(1.0, "j", 1, TrainRow(kind="train", step=35, loss=1.0, lr=0.1, tokens=1, tokens_per_s=1.0, world_size=1))
    pool.metric(1.0, "j", 1, EvalRow(kind="eval", step=20, val_loss=1.0))
    assert job.resume_max() == 39  # the eval row of step 40 is the next one due
    pool.metric(1.0, "j", 1, EvalRow(kind="eval", step=40, val_loss=1.0))
    assert job.resume_max() == 39  # train rows of steps 40.. are due


# -- the store ---------------------------------------------------------------------------------


def test_store_keeps_the_newest_generations_metric_rows(tmp_path: Path) -> None:
    def train(step: int, loss: float, generation: int) -> TrainRow:
        return TrainRow(kind="train", step=step, loss=loss, lr=1e-3, tokens=8, tokens_per_s=100.0, world_size=1, generation=generation)

    store = Store(tmp_path / "c.sqlite3")
    store.add_metric("j", 1, train(5, 3.0, 1))
    store.add_metric("j", 2, train(5, 2.9, 2))
    store.add_metric("j", 1, train(5, 3.1, 1))  # late straggler
    store.add_metric("j", 2, EvalRow(kind="eval", step=5, val_loss=3.5))
    store.add_metric("j", 2, train(4, 3.2, 2))
    assert store.metrics("j", 0, 100) == ([train(4, 3.2, 2), train(5, 2.9, 2), EvalRow(kind="eval", step=5, val_loss=3.5)], 3, False)
    assert store.metrics("j", 1, 1) == ([train(5, 2.9, 2)], 2, True)


def test_store_round_trips_jobs_for_a_restarted_coordinator(tmp_path: Path) -> None:
    pool = Driven()
    join(pool, "a", 1)
    prepare_all(pool, pool.submit(0.0, "j", spec()))
    store = Store(tmp_path / "c.sqlite3")
    store.save_job(pool.jobs["j"])
    store.close()
    ((job, saved),) = Store(tmp_path / "c.sqlite3").load_jobs()
    assert job.id == "j" and saved.state is JobState.STARTING and job.plan == pool.jobs["j"].plan
    restarted = Driven()
    restarted.restore(job, saved, 100.0)
    refusal, _ = restarted.registered(101.0, "a", "inc-a", NodeInfo(slots=1), [RunningWorker(job="j", generation=1, rank=0, slot=0, pid=9)], [], [])
    assert refusal is None
    restarted.worker_hello(101.5, "a", "j", 1, 0, 9, 0)
    restarted.progress(199.0, "j", 1, 0, 3, 192, 0.1)
    restarted.seen(200.0, "a")
    restarted.tick(200.0)  # past the reconcile deadline: the rank came back, so the job goes on
    assert restarted.jobs["j"].state is JobState.RUNNING


# -- recovery ----------------------------------------------------------------------------------


def running_pool(nodes: tuple[str, ...] = ("a", "b", "c"), **kw: Any) -> Driven:
    """A pool of one-slot nodes running job "j" (generation 1, one rank per node), steps 1-7 done."""
    pool = Driven(heartbeat_s=0.5, liveness=6)
    for n in nodes:
        join(pool, n, 1)
    prepare_all(pool, pool.submit(0.0, "j", spec(**{"hi": len(nodes), **kw})))
    for r, n in enumerate(nodes):
        pool.worker_hello(1.0, n, "j", 1, r, 100 + r, 0)
    for step in range(1, 8):
        for r in range(len(nodes)):
            pool.progress(1.0 + 0.05 * step, "j", 1, r, step, 192, 0.05)
    for r, n in enumerate(nodes):
        pool.checkpoint(1.3, n, "j", 1, r, 0, 5, 0.01)
    for n in nodes:
        pool.seen(1.4, n)
    return pool


def records(actions: list[Any], kind: str) -> list[dict[str, Any]]:
    return [a.fields for a in actions if isinstance(a, Record) and a.kind == kind]


def restart(pool: Driven, actions: list[Any], now: float, resume: int, *, gen: int = 2) -> list[Any]:
    """Prepare, hello (rank 0 resumes from `resume`) and one step of the next generation."""
    out = prepare_all(pool, actions, now)
    start = sends(out, m.GroupStart)
    assert start and all(s.msg.generation == gen for s in start)  # type: ignore[attr-defined]
    plan = pool.jobs["j"].plan
    assert plan is not None
    for r, slot in enumerate(plan.ranks):
        out += pool.worker_hello(now + 1, slot.node, "j", gen, r, 200 + r, resume)
    assert pool.jobs["j"].state is JobState.RUNNING
    for r in range(plan.world_size):
        out += pool.progress(now + 2, "j", gen, r, resume + 1, 192, 0.05)
    return out


def test_a_killed_trainer_restarts_the_group_from_the_checkpoint() -> None:
    pool = running_pool()
    out = pool.worker_exited(2.0, "b", "j", 1, 1, 0, -9, False)
    job = pool.jobs["j"]
    assert job.state is JobState.RECOVERING
    assert sorted(s.node for s in sends(out, m.GroupStop)) == ["a", "b", "c"]
    assert records(out, "worker.failed") == [{"rank": 1, "node": "b", "reason": "exit", "code": -9}]
    assert sends(out, m.GroupPrepare) == []  # ranks 0 and 2 still run
    pool.worker_exited(2.1, "a", "j", 1, 0, 0, 1, False)
    out = pool.worker_exited(2.1, "c", "j", 1, 2, 0, 1, False)
    # Re-planned with every node; rank 0 where the newest checkpoint is (all hold step 5).
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b", "c"]
    out = restart(pool, out, 3.0, resume=5)
    (resumed,) = records(out, "group.resumed")
    assert resumed == {"from_step": 5, "generation": 2, "seconds_since_failure": 3.0, "steps_recomputed": 2, "cause": "failure"}
    assert job.machine.restarts == 1 and job.status(3.0).generation == 2


def test_the_failure_reported_after_its_peers_is_blamed_on_its_node_without_a_second_restart() -> None:
    """c's checkpoint write failed (a full disk: exit 74), but a's "connection lost" (exit 1) reached
    the pool first and started the restart: c's exit still counts against c, not as a restart."""
    pool = running_pool()
    pool.worker_exited(2.0, "a", "j", 1, 0, 0, 1, False)
    job = pool.jobs["j"]
    assert job.state is JobState.RECOVERING and job.machine.restarts == 1 and pool.nodes["a"].fail_streak == 0
    out = pool.worker_exited(2.1, "c", "j", 1, 2, 0, 74, False, "checkpoint write failed: No space left on device")
    assert records(out, "worker.failed") == [{"rank": 2, "node": "c", "reason": "exit", "code": 74, "error": "checkpoint write failed: No space left on device"}]
    assert job.machine.restarts == 1 and pool.nodes["c"].fail_streak == 1
    pool.worker_exited(2.1, "b", "j", 1, 1, 0, -15, True)  # stopped by its daemon: nobody's fault
    assert pool.nodes["b"].fail_streak == 0


def test_a_node_that_never_reports_its_ranks_exit_is_left_out_after_the_settle_time() -> None:
    pool = running_pool()
    pool.worker_exited(2.0, "a", "j", 1, 0, 0, 1, False)  # b's trainer is stuck (a D state): b heartbeats, but never reports it
    out = pool.worker_exited(2.0, "c", "j", 1, 2, 0, 1, False)
    assert pool.jobs["j"].state is JobState.RECOVERING and sends(out, m.GroupPrepare) == []
    for t in (2.9, 3.9):
        for n in "abc":
            pool.seen(t, n)
        assert sends(pool.tick(t), m.GroupPrepare) == []
    out = pool.tick(4.1)  # past the settle time: go on without b (its slot is still busy)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "c"]


def test_a_stalled_group_is_detected_by_the_progress_deadline() -> None:
    pool = running_pool()
    # Steps took 50 ms: the deadline is the 2 s floor after the last step (at 1.35).
    for n in "abc":
        pool.seen(3.3, n)
    assert pool.tick(3.3) == [] or pool.jobs["j"].state is JobState.RUNNING
    out = pool.tick(3.4)
    job = pool.jobs["j"]
    assert job.state is JobState.RECOVERING and job.machine.restarts == 1
    failed = records(out, "worker.failed")
    assert failed and all(f["reason"] == "stalled" for f in failed)
    assert sorted(s.node for s in sends(out, m.GroupStop)) == ["a", "b", "c"]


def test_a_stall_that_every_rank_reached_blames_no_node() -> None:
    """A rank frozen inside step 8 leaves every rank's last report at step 7: nothing tells which
    one froze. Blaming rank 0's node, as before, set the healthy serving node aside after three
    such stalls while the frozen one kept getting work."""
    pool = running_pool()
    for n in "abc":
        pool.seen(3.4, n)
    pool.tick(3.4)
    assert pool.jobs["j"].state is JobState.RECOVERING
    assert [pool.nodes[n].fail_streak for n in "abc"] == [0, 0, 0]


def waiting(pool: Driven, now: float, node: str, rank: int, step: int, gen: int = 1) -> list[Any]:
    return pool.from_node(now, node, m.NodeWaiting(job="j", generation=gen, rank=rank, step=step))


def test_a_rank_that_froze_inside_a_step_is_told_by_the_ranks_that_wait_for_it() -> None:
    """Every rank reported step 7. Ranks 0 and 2 then said (node.waiting) that their part of step
    8 was done and they had waited on their peers a while; rank 1 (node b) never did: it froze
    inside step 8. b is counted, and named; the waiting ranks are not."""
    pool = running_pool()
    for r, n in ((0, "a"), (2, "c")):
        assert waiting(pool, 1.9, n, r, 8) == []
    waiting(pool, 1.2, "b", 1, 7)  # said for step 7 (before its report of it), not 8
    for n in "abc":
        pool.seen(3.5, n)
    out = pool.tick(3.5)
    assert pool.jobs["j"].state is JobState.RECOVERING
    assert [(f["rank"], f["node"]) for f in records(out, "worker.failed")] == [(1, "b")]
    assert [pool.nodes[n].fail_streak for n in "abc"] == [0, 1, 0]


def test_waiting_said_by_every_rank_or_about_another_generation_or_rank_blames_no_node() -> None:
    """All ranks wait in the all_sum (a link between them broke, not a rank): nothing tells a node
    apart. Nor does a report about a generation that is not the running one, and a node may not
    speak for a rank the plan gave another node."""
    pool = running_pool()
    for r, n in enumerate("abc"):
        waiting(pool, 1.9, n, r, 8)
    for n in "abc":
        pool.seen(3.5, n)
    out = pool.tick(3.5)
    assert len(records(out, "worker.failed")) == 3 and [pool.nodes[n].fail_streak for n in "abc"] == [0, 0, 0]
    pool = running_pool()
    for r, n in ((0, "a"), (2, "c")):
        waiting(pool, 1.9, n, r, 8, gen=2)
    assert isinstance(waiting(pool, 1.9, "a", 1, 8)[0], Refused)  # rank 1 is b's
    for n in "abc":
        pool.seen(3.5, n)
    pool.tick(3.5)
    assert [pool.nodes[n].fail_streak for n in "abc"] == [0, 0, 0]


def test_a_stall_behind_the_other_ranks_blames_its_node() -> None:
    """Ranks 0 and 2 reported step 8, rank 1 (node b) did not: b is the one counted."""
    pool = running_pool()
    for r in (0, 2):
        pool.progress(1.4, "j", 1, r, 8, 192, 0.05)
    for n in "abc":
        pool.seen(3.5, n)
    out = pool.tick(3.5)
    assert pool.jobs["j"].state is JobState.RECOVERING
    assert [f["rank"] for f in records(out, "worker.failed")] == [1]
    assert [pool.nodes[n].fail_streak for n in "abc"] == [0, 1, 0]


def test_the_progress_deadline_allows_for_evaluation_once_measured() -> None:
    from dpool.daemon.watch import StepWatch

    w = StepWatch(steps=100, eval_every=10, sample_every=1000, floor_s=3.0, factor=8.0, start_s=120.0, started_at=0.0)
    assert w.deadline() == 120.0  # nothing reported: the start-up deadline
    t = 10.0
    for step in range(1, 10):
        w.observe(step, t, 0.5)
        t += 0.5
    assert w.allowance() == 8 * 0.5  # 8x the median step beats the 3 s floor
    w.observe(10, t, 0.5)
    assert w.allowance() == 4.0 + 120.0  # evaluation follows step 10; its cost is not known yet
    w.observe(11, t + 2.5, 0.5)  # the eval took 2 s
    assert w.allowance() == 4.0
    for step in range(12, 21):
        w.observe(step, t + 2.5 + 0.5 * (step - 11), 0.5)
    assert w.allowance() == 4.0 + 8 * 2.0 + 3.0


def test_the_eta_comes_from_the_pace_not_from_reports_that_arrive_together() -> None:
    """Steps of 10 ms whose reports reach the coordinator 25 at a time (fast steps, a busy
    coordinator): the intervals between reports are mostly 0, and their median once made a job of
    3,000 steps left look 0.5 s from its end. The pace over the window says 30 s."""
    from dpool.daemon.watch import StepWatch

    w = StepWatch(steps=4000, eval_every=1000, sample_every=1000, floor_s=3.0, factor=8.0, start_s=120.0, started_at=0.0)
    step, t = 0, 100.0
    while step < 1000:
        t += 0.25
        for _ in range(25):
            step += 1
            w.observe(step, t, 0.01)
    eta = w.eta(t)
    assert eta is not None and 29.0 <= eta <= 31.0, eta
    per_step = eta / (4000 - step)  # the pace over the window
    assert w.eta(t + 0.004) == pytest.approx(eta - 0.004)  # time since the last report counts down
    assert w.eta(t + 5.0) == pytest.approx(eta - per_step)  # within one step: a stall never reads as done


def test_a_stalled_group_keeps_its_eta_at_the_steps_after_the_current_one() -> None:
    """A frozen rank after step 48 of 80 at 1 s a step: the group waits out its deadline, and the
    ETA read meanwhile stays at the 31 steps after the one that does not come (it once counted
    down to 0.0 over the two minutes the stall took to find)."""
    from dpool.daemon.watch import StepWatch

    w = StepWatch(steps=80, eval_every=1000, sample_every=1000, floor_s=2.0, factor=8.0, start_s=120.0, started_at=0.0)
    for step in range(1, 49):
        w.observe(step, float(step), 1.0)
    assert w.eta(48.0) == pytest.approx(32.0)
    assert w.eta(48.5) == pytest.approx(31.5)
    assert w.eta(48.0 + 100.0) == pytest.approx(31.0)


def test_after_the_last_step_a_rank_is_allowed_its_end_of_run_work() -> None:
    """After the last step a rank drains its checkpoint writer and may evaluate a test set: the
    start-up deadline, not a stop's margin (CI once saw a rank stalled 12.2 s after its last step,
    against 12 s). A stop asked for mid-run keeps the margin."""
    from dpool.daemon.watch import STOP_MARGIN_S, StepWatch

    w = StepWatch(steps=20, eval_every=1000, sample_every=1000, floor_s=2.0, factor=8.0, start_s=120.0, started_at=0.0)
    for step in range(1, 20):
        w.observe(step, 0.1 * step, 0.1)
    assert w.allowance() == 2.0
    w.stopping = True
    assert w.allowance() == 2.0 + STOP_MARGIN_S
    w.observe(20, 2.0, 0.1)
    assert w.allowance() == 2.0 + 120.0


def test_the_first_step_under_a_new_split_is_allowed_a_compile_each_time() -> None:
    """The balancer announced a new split in step 10's all_sum: step 11 has micro batches of new
    shapes (a compile, or none when the shapes were seen before). Its cost is not measured, since
    it differs each time: every such step is allowed 8x the generation's first step (which
    compiled the step), and the steps after it the plain deadline again. (The start-up deadline,
    2 minutes, let a rank frozen there go unnoticed that long.)"""
    from dpool.daemon.watch import StepWatch

    w = StepWatch(steps=100, eval_every=1000, sample_every=1000, floor_s=2.0, factor=8.0, start_s=120.0, started_at=0.0)
    t = 1.0
    w.observe(1, t, 0.0, resplit=True)  # no first step measured yet: the start-up deadline
    assert w.after(1) == ["split"] and w.allowance() == 120.0 + 120.0
    w = StepWatch(steps=100, eval_every=1000, sample_every=1000, floor_s=2.0, factor=8.0, start_s=120.0, started_at=0.0)
    w.observe(1, t, 3.0)  # the first step: 3 s, compiling included
    for step in range(2, 11):
        t += 0.1
        w.observe(step, t, 0.1, resplit=step == 10)
    assert w.after(10) == ["split"] and w.allowance() == pytest.approx(2.0 + 8 * 3.0 + 2.0)
    t += 2.9  # step 11 compiled its new shapes (the stall CI once saw here: 2.9 s against 2.0)
    w.observe(11, t, 3.0)
    assert w.after(11) == [] and w.allowance() == 2.0 and "split" not in w.extra
    assert statistics.median(w.recent) == pytest.approx(0.1)  # the compile is not a step interval either
    for step in range(12, 20):
        t += 0.1
        w.observe(step, t, 0.1, resplit=step == 19)
    assert w.allowance() == pytest.approx(2.0 + 8 * 3.0 + 2.0)  # again a compile's, not 8x the measured 2.9 s
    nxt = StepWatch.start(parse_job({"name": "j"}), 50.0, previous=w)
    nxt.observe(20, 51.0, 0.5)  # a generation whose first step compiled faster keeps the longest
    assert nxt.compile_s == 3.0


def test_a_new_split_reported_by_the_ranks_defers_the_stall() -> None:
    pool = running_pool()
    for r in range(3):
        pool.progress(1.40, "j", 1, r, 8, 192, 0.05, resplit=True)
    for n in "abc":
        pool.seen(4.0, n)
    assert pool.tick(4.0) == [] and pool.jobs["j"].state is JobState.RUNNING  # 2.6 s into step 9: its compile
    for r in range(3):
        pool.progress(4.1, "j", 1, r, 9, 192, 2.7)
    for n in "abc":
        pool.seen(6.2, n)
    pool.tick(6.2)
    assert pool.jobs["j"].state is JobState.RECOVERING  # step 10 is a plain step again: 2 s floor


def test_a_diloco_gather_is_allowed_its_bytes_over_the_outer_all_sums() -> None:
    """3 replicas, bfloat16 outer sums, H = 10: a checkpoint's gather all_sums each replica's two
    AdamW moments in float32, 12x the outer all_sum's bytes. With 0.5 s inner steps and a 6 s outer
    all_sum, the gather takes ~72 s: beyond the 8x the outer step gets (54 s in all), within its own."""
    from dpool.daemon.watch import StepWatch
    from dpool.protocol.jobspec import parse_job

    spec = parse_job({"name": "d", "train": {"steps": 100}, "eval": {"every_steps": 1000, "sample_every_steps": 1000},
                      "sync": {"mode": "diloco", "replicas": 3, "inner_steps": 10, "dtype": "bfloat16"}}, source="test")
    w = StepWatch.start(spec, 0.0)
    t = 1.0
    for step in range(1, 30):
        w.observe(step, t, 0.5)
        t += 6.5 if step % 10 == 0 else 0.5
    plain = w.allowance()  # after step 29
    w.observe(30, t, 0.5)
    assert w.after(30) == ["outer"] and w.allowance() == pytest.approx(8 * 0.5 + 8 * 6.0 + 2.0)
    w.gathers(40)  # rank 0, with step 40: this outer step checkpoints
    for step in range(31, 41):
        t += 6.5 if step == 31 else 0.5
        w.observe(step, t, 0.5)
    assert w.after(40) == ["outer", "gather"]
    assert w.allowance() == pytest.approx(8 * 0.5 + (8 * 6.0 + 2.0) + (8 * 12 * 6.0 + 2.0)) and w.allowance() > 72.0
    t += 72.5
    w.observe(41, t, 0.5)
    assert w.extra["outer"] == pytest.approx(6.0), "a gather's interval is not an outer step's measure"
    assert w.allowance() == plain and w.after(100) == ["outer", "gather"]  # the last step always checkpoints


def test_rank_0s_word_of_a_gather_counts_while_another_rank_is_the_slowest() -> None:
    """diloco, H = 5: rank 0 reaches step 10 first and says its outer step checkpoints; the watch,
    which follows the slowest rank, allows the gather once rank 1 reaches step 10 too."""
    pool = running_pool(("a", "b"), sync={"mode": "diloco", "replicas": 2, "inner_steps": 5})
    for step in (8, 9):
        for r in range(2):
            pool.progress(1.40 + 0.05 * (step - 8), "j", 1, r, step, 192, 0.05)
    pool.progress(1.50, "j", 1, 0, 10, 192, 0.05, gather=True)
    pool.progress(1.52, "j", 1, 1, 10, 192, 0.05)
    watch = pool.jobs["j"].watch
    assert watch is not None and watch.after(10) == ["outer", "gather"]
    for n in "ab":
        pool.seen(6.5, n)
    assert pool.tick(6.5) == [] and pool.jobs["j"].state is JobState.RUNNING  # 5 s into the gather: 6 s allowed
    for n in "ab":
        pool.seen(7.6, n)
    pool.tick(7.6)
    assert pool.jobs["j"].state is JobState.RECOVERING


def test_the_progress_deadline_expects_diloco_outer_steps_where_they_end_after_the_warm_up() -> None:
    """[sync] warmup_steps = 30, inner_steps = 20: outer all_sums after every step to 30 (each a
    step of its own, all_sum included), then after 50, 70, 90. A 6 s outer all_sum after 0.5 s inner
    steps must not read as a stall there, and steps 40 and 60 are plain inner steps."""
    from dpool.daemon.watch import StepWatch
    from dpool.protocol.jobspec import parse_job

    spec = parse_job({"name": "d", "train": {"steps": 200}, "eval": {"every_steps": 1000, "sample_every_steps": 1000},
                      "sync": {"mode": "diloco", "replicas": 2, "inner_steps": 20, "warmup_steps": 30}}, source="test")
    w = StepWatch.start(spec, 0.0)
    assert [w.after(s) for s in (29, 30, 40, 50, 60, 70)] == [[], [], [], ["outer"], [], ["outer"]]
    t = 1.0
    for step in range(1, 101):
        w.observe(step, t, 0.5)
        if step in (50, 70):
            first = step == 50
            assert w.allowance() >= (w.start_s if first else 6.5), (step, w.allowance())  # not a stall
        t += 1.5 if step < 30 else 6.5 if step in (50, 70, 90) else 0.5  # warm steps: 0.5 s and a 1 s all_sum
    assert abs(w.extra["outer"] - 6.0) < 1e-6
    assert w.after(100) == [] and w.allowance() == 8 * 0.5  # inner steps: the median no longer holds warm-up steps


def test_a_joining_node_grows_the_job_at_a_checkpoint_without_using_a_restart() -> None:
    pool = running_pool(("a", "b"), hi=3)
    out = join(pool, "c", 1, now=2.0)
    job = pool.jobs["j"]
    # First a warm trainer on c, while the group trains on; then the checkpoint-stop.
    (warm,) = sends(out, m.JobWarm)
    assert warm.node == "c" and warm.msg.slots == [0] and sends(out, m.GroupStop) == []  # type: ignore[attr-defined]
    assert job.state is JobState.RUNNING and records(out, "group.warming") == [{"nodes": ["c"], "slots": 1}]
    assert pool.tick(2.05) == [] or sends(pool.tick(2.05), m.GroupStop) == []
    out = pool.from_node(2.08, "c", m.NodeWarmed(job="j", slots=[0])) + pool.schedule(2.08)
    stops = sends(out, m.GroupStop)
    assert sorted(s.node for s in stops) == ["a", "b"] and all(s.msg.mode == "checkpoint" for s in stops)  # type: ignore[attr-defined]
    assert job.state is JobState.RECOVERING
    pool.progress(2.1, "j", 1, 0, 8, 192, 0.05)  # the step the stop was fused into
    pool.worker_exited(2.2, "a", "j", 1, 0, 0, 75, False)
    out = pool.worker_exited(2.2, "b", "j", 1, 1, 0, 75, False)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b", "c"]
    out = restart(pool, out, 3.0, resume=8)
    (resumed,) = records(out, "group.resumed")
    assert resumed["steps_recomputed"] == 0 and resumed["cause"] == "membership"
    assert job.machine.restarts == 0 and job.plan is not None and job.plan.world_size == 3
    assert records(out, "rebalanced") == [{"generation": 2, "shares": [2, 2, 2], "previous": [3, 3], "cause": "membership"}]


def test_a_rank_finishing_frees_its_slot_without_growing_the_job() -> None:
    """At the last step the first rank to exit 0 frees a slot of the job's own: not a reason to
    checkpoint and restart wider (it used to cost a pointless generation at the very end)."""
    pool = running_pool(("a", "b"), hi=3)
    pool.worker_exited(2.0, "b", "j", 1, 1, 0, -9, False)
    out = pool.worker_exited(2.1, "a", "j", 1, 0, 0, 1, False)
    out = restart(pool, out, 3.0, resume=5)
    for step in range(7, 21):
        for r in range(2):
            pool.progress(4.0 + 0.05 * step, "j", 2, r, step, 192, 0.05)
    out = pool.worker_exited(6.0, "a", "j", 2, 0, 0, 0, False)
    assert sends(out, m.GroupStop) == [] and records(out, "group.growing") == []
    out = pool.worker_exited(6.1, "b", "j", 2, 1, 0, 0, False)
    assert pool.jobs["j"].state is JobState.SUCCEEDED


def test_the_trainers_own_rebalancing_is_recorded_and_seeds_the_next_plan() -> None:
    pool = running_pool(("a", "b"), hi=2)
    row = TrainRow(kind="train", step=8, loss=3.0, lr=1e-3, tokens=6, tokens_per_s=3000.0, world_size=2, shares=[4, 2], rank_tokens_per_s=[2000.0, 1000.0])
    out = pool.metric(2.0, "j", 1, row)
    assert records(out, "rebalanced") == [{"generation": 1, "step": 8, "shares": [4, 2], "previous": [3, 3], "cause": "speed"}]
    assert [w.share for w in pool.jobs["j"].status(2.0).workers] == [4, 2]
    assert records(pool.metric(2.1, "j", 1, dataclasses.replace(row, step=9)), "rebalanced") == [], "only changes are events"
    # A crash: the next generation starts from the measured split instead of an equal one.
    pool.worker_exited(3.0, "b", "j", 1, 1, 0, -9, False)
    out = pool.worker_exited(3.1, "a", "j", 1, 0, 0, 1, False)
    out = prepare_all(pool, out, 4.0)
    (start, *_) = sends(out, m.GroupStart)
    assert start.msg.shares == [4, 2]  # type: ignore[attr-defined]


def test_drain_moves_the_group_off_the_node_and_undrain_brings_it_back() -> None:
    pool = running_pool()
    out = pool.drain(2.0, "c")
    assert all(s.msg.mode == "checkpoint" for s in sends(out, m.GroupStop))  # type: ignore[attr-defined]
    assert pool.node_rows(2.0)[2].state == "draining"
    pool.worker_exited(2.2, "a", "j", 1, 0, 0, 75, False)
    pool.worker_exited(2.2, "b", "j", 1, 1, 0, 75, False)
    out = pool.worker_exited(2.2, "c", "j", 1, 2, 0, 75, False)
    assert records(out, "node.drained") == [{"node": "c"}]
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"]
    row = pool.node_rows(2.2)[2]
    assert (row.state, row.reason, row.busy_slots) == ("draining", "drained", 0)  # out of service until undrained: not "idle"
    out = restart(pool, out, 3.0, resume=8)
    assert records(out, "group.resumed")[0]["steps_recomputed"] == 0
    (shrunk,) = records(out, "job.shrunk")  # no job took c's slot: the drain is the cause
    assert (shrunk["from"], shrunk["to"], shrunk["by"], shrunk["cause"], shrunk["steps_lost"]) == (3, 2, [], "node c is being drained", 0)
    out = pool.undrain(6.0, "c")
    # The job grows back onto c at the next checkpoint boundary, once c has a warm trainer.
    assert [s.node for s in sends(out, m.JobWarm)] == ["c"] and sends(out, m.GroupStop) == []
    out = pool.from_node(6.5, "c", m.NodeWarmed(job="j", slots=[0])) + pool.schedule(6.5)
    assert sorted(s.node for s in sends(out, m.GroupStop)) == ["a", "b"]
    assert pool.jobs["j"].machine.restarts == 0


def test_a_node_yielding_for_memory_pressure_gives_no_rank_and_a_failing_donor_is_tried_twice() -> None:
    pool = running_pool(("a",), hi=1)
    join(pool, "b", 1, now=1.5)
    pool._then_schedule(2.0, pool.owner_yield(2.0, pool.nodes["a"], "memory pressure"))
    pool.checkpoint(2.1, "a", "j", 1, 0, 0, 8, 0.01)
    out = pool.worker_exited(2.2, "a", "j", 1, 0, 0, 75, False)
    assert [s.node for s in sends(out, m.GroupPrepare)] == ["b"]  # from step 0: its owner needs the memory
    pool = running_pool(("a",), hi=1)
    join(pool, "b", 1, now=1.5)
    pool.drain(2.0, "a")
    pool.checkpoint(2.1, "a", "j", 1, 0, 0, 8, 0.01)
    out = pool.worker_exited(2.2, "a", "j", 1, 0, 0, 75, False)
    for gen, t in ((2, 3.0), (3, 5.0)):
        assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"], gen
        out = prepare_all(pool, out, t)
        pool.worker_exited(t + 0.1, "a", "j", gen, 1, 0, 1, False, "out of memory")
        out = pool.worker_exited(t + 0.1, "b", "j", gen, 0, 0, 1, False)
        for n in "ab":
            pool.seen(t + 2.0, n)
        out += pool.tick(t + 2.0)
    assert [s.node for s in sends(out, m.GroupPrepare)] == ["b"]  # twice is enough


@pytest.mark.parametrize("leaves", ["drain", "yield"])
def test_a_leaving_node_with_the_only_checkpoint_gives_it_to_the_next_group_then_leaves(leaves: str) -> None:
    """A one-machine job on a, b idle: checkpoints stay where they were written, so a group on b
    alone started from step 0. a runs one rank of the next group (its state reaches b through the
    group's collective), and at that group's first step the job checkpoints and moves to b alone."""
    pool = running_pool(("a",), hi=1)
    join(pool, "b", 1, now=1.5)
    out = pool.drain(2.0, "a") if leaves == "drain" else pool._then_schedule(2.0, pool.owner_yield(2.0, pool.nodes["a"], "owner active"))
    assert [s.node for s in sends(out, m.GroupStop)] == ["a"]
    pool.checkpoint(2.1, "a", "j", 1, 0, 0, 8, 0.01)
    out = pool.worker_exited(2.2, "a", "j", 1, 0, 0, 75, False)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"]
    out = restart(pool, out, 3.0, resume=8)
    plan = pool.jobs["j"].plan
    assert plan is not None and [s.node for s in plan.ranks] == ["b", "a"]  # the donor last
    assert records(out, "group.resumed")[0]["from_step"] == 8 and records(out, "job.shrunk") == []
    stop = sends(out + pool.schedule(5.0), m.GroupStop)
    assert sorted(s.node for s in stop) == ["a", "b"] and all(s.msg.mode == "checkpoint" for s in stop)  # type: ignore[attr-defined]
    pool.checkpoint(5.1, "b", "j", 2, 0, 0, 9, 0.01)
    pool.checkpoint(5.1, "a", "j", 2, 1, 0, 9, 0.01)
    drained = records(pool.worker_exited(5.2, "a", "j", 2, 1, 0, 75, False), "node.drained")
    assert drained == ([{"node": "a"}] if leaves == "drain" else [])  # said (again) once a's last rank has left
    out = pool.worker_exited(5.2, "b", "j", 2, 0, 0, 75, False)
    assert [s.node for s in sends(out, m.GroupPrepare)] == ["b"]  # b holds step 9 now: no donor
    out = restart(pool, out, 6.0, resume=9, gen=3)
    assert records(out, "group.resumed")[0]["steps_recomputed"] == 0
    assert pool.jobs["j"].machine.restarts == 0 and sends(out, m.GroupStop) == []


def test_a_growth_waits_for_warm_trainers_no_longer_than_a_cold_start_may_take() -> None:
    pool = running_pool(("a", "b"), hi=3, start_timeout=1.0)
    assert sends(join(pool, "c", 1, now=2.0), m.JobWarm)  # c never answers
    for n in "abc":
        pool.seen(2.99, n)
    assert sends(pool.tick(2.99), m.GroupStop) == []
    assert sorted(s.node for s in sends(pool.tick(3.0), m.GroupStop)) == ["a", "b"]


def test_a_node_that_cannot_warm_a_trainer_does_not_hold_the_growth_back() -> None:
    pool = running_pool(("a", "b"), hi=3)
    join(pool, "c", 1, now=2.0)
    out = pool.from_node(2.1, "c", m.NodeWarmed(job="j", slots=[], error="warm trainers are off on node c"))
    assert records(out, "group.warmed") == [{"node": "c", "slots": [0], "error": "warm trainers are off on node c"}]
    assert sorted(s.node for s in sends(pool.schedule(2.1), m.GroupStop)) == ["a", "b"]


def test_below_workers_min_the_job_waits_queued_and_resumes_when_a_node_returns() -> None:
    pool = running_pool(("a", "b"), lo=2)
    for n in "ab":
        pool.seen(4.0, n)
    pool.bye(4.0, "b")
    out = pool.worker_exited(4.1, "a", "j", 1, 0, 0, 1, False)
    job = pool.jobs["j"]
    assert job.state is JobState.QUEUED and records(out, "job.queued")
    assert job.status(2.0).checkpoint_step == 5
    _, out = pool.registered(5.0, "b", "inc-b2", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [Holding(job="j", slot=0, step=5)])
    assert job.state is JobState.RECOVERING  # admitted again: resuming, not a fresh start
    out = restart(pool, out, 6.0, resume=5)
    assert job.machine.generation == 2 and records(out, "group.resumed")


def test_a_node_whose_workers_fail_three_times_in_a_row_is_set_aside() -> None:
    pool = running_pool(("a", "b"))
    for gen in (1, 2, 3):
        pool.worker_exited(2.0 + gen, "b", "j", gen, 1, 0, -11, False)  # b's trainer segfaults
        out = pool.worker_exited(2.0 + gen, "a", "j", gen, 0, 0, 1, False)  # a's: peer lost (not blamed)
        if gen < 3:
            prepare_all(pool, out, 2.5 + gen)
            for r, n in enumerate(("a", "b")):
                pool.worker_hello(2.6 + gen, n, "j", gen + 1, r, 1, 5)
    row = pool.node_rows(6.0)[1]
    assert row.name == "b" and row.reason is not None and row.reason.startswith("set aside")
    assert [s.node for s in sends(out, m.GroupPrepare)] == ["a"]  # the job goes on without b
    assert pool.jobs["j"].machine.restarts == 3
    pool.undrain(7.0, "b")
    assert pool.node_rows(7.0)[1].reason is None and pool.nodes["b"].free() == [0]


def test_an_unrequested_checkpoint_stop_is_a_membership_change() -> None:
    pool = running_pool(("a", "b"))
    out = pool.worker_exited(2.0, "a", "j", 1, 0, 0, 75, False)  # e.g. its dpd vanished (macOS)
    job = pool.jobs["j"]
    assert job.state is JobState.RECOVERING and job.machine.restarts == 0
    assert all(s.msg.mode == "checkpoint" for s in sends(out, m.GroupStop))  # type: ignore[attr-defined]


def reloaded(pool: Driven, tmp_path: Path, now: float, alive_at: float | None = None) -> Driven:
    """A new coordinator's pool, reading the jobs back from a store as the old one saved them
    (`alive_at`: the old one's last mark of life, read back as the coordinator reads it)."""
    store = Store(tmp_path / "restart.sqlite3")
    for job in pool.jobs.values():
        store.save_job(job)
    if alive_at is not None:
        store.mark_alive(alive_at)
    store.commit()
    store.close()
    store = Store(tmp_path / "restart.sqlite3")
    mark = store.alive_at()
    assert mark == alive_at
    restarted = Driven(heartbeat_s=pool.heartbeat_s, liveness=pool.liveness)
    for job, saved in store.load_jobs():
        restarted.restore(job, saved, now, mark)  # Driven's wall time is its clock
    store.close()
    return restarted


def test_after_a_coordinator_restart_ranks_a_new_dpd_does_not_run_are_gone(tmp_path: Path) -> None:
    pool = running_pool(("a", "b"))
    # The serving dpd (a) was SIGKILLed with its trainer and started again: a new coordinator
    # reloads the job, b reconnects still running rank 1, a comes back running nothing.
    restarted = reloaded(pool, tmp_path, 10.0)
    refusal, _ = restarted.registered(10.5, "b", "inc-b", NodeInfo(slots=1), [RunningWorker(job="j", generation=1, rank=1, slot=0, pid=101)], [], [])
    assert refusal is None and restarted.jobs["j"].state is JobState.RUNNING
    refusal, out = restarted.registered(11.0, "a", "inc-a2", NodeInfo(slots=1), [], [], [Holding(job="j", slot=0, step=5)])
    assert refusal is None and restarted.jobs["j"].state is JobState.RECOVERING
    assert records(out, "worker.failed") == [{"rank": 0, "node": "a", "reason": "heartbeat"}]
    assert "b" in [s.node for s in sends(out, m.GroupStop)]


def test_ranks_lost_with_a_crashed_coordinator_are_counted_from_its_last_sign_of_life(tmp_path: Path) -> None:
    """The serving dpd (a) was SIGKILLed at 3 s with its trainer and came back at 10 s. What the
    failure cost counts from the old coordinator's last mark of life (the store's), not from the
    moment the new one found the rank gone: the job trained nothing in between."""
    pool = running_pool(("a", "b"))
    restarted = reloaded(pool, tmp_path, 10.0, alive_at=3.0)
    restarted.registered(10.5, "b", "inc-b", NodeInfo(slots=1, advertise="127.0.0.1"), [RunningWorker(job="j", generation=1, rank=1, slot=0, pid=101)], [], [])
    _, out = restarted.registered(11.0, "a", "inc-a2", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [Holding(job="j", slot=0, step=5)])
    assert records(out, "worker.failed") == [{"rank": 0, "node": "a", "reason": "heartbeat"}]
    out += restarted.worker_exited(11.2, "b", "j", 1, 1, 0, -15, True)  # stopped by the coordinator
    out += restarted.tick(11.5) + restarted.schedule(11.5)
    out = restart(restarted, out, 11.5, resume=5)
    (resumed,) = records(out, "group.resumed")
    assert (resumed["generation"], resumed["cause"]) == (2, "failure")
    assert resumed["seconds_since_failure"] == pytest.approx(13.5 - 3.0)


def test_a_restored_group_that_trains_on_dates_its_next_failure_from_when_it_happens(tmp_path: Path) -> None:
    pool = running_pool(("a", "b"))
    restarted = reloaded(pool, tmp_path, 10.0, alive_at=3.0)  # only the coordinator restarted
    for r, n in enumerate(("a", "b")):
        restarted.registered(10.5, n, f"inc-{n}", NodeInfo(slots=1, advertise="127.0.0.1"), [RunningWorker(job="j", generation=1, rank=r, slot=0, pid=100 + r)], [], [])
    for r in range(2):
        restarted.progress(11.0, "j", 1, r, 8, 192, 0.05)  # the group trains: nothing was lost
    out = restarted.worker_exited(20.0, "b", "j", 1, 1, 0, -9, False)
    out += restarted.worker_exited(20.2, "a", "j", 1, 0, 0, -15, True)
    out += restarted.tick(20.5) + restarted.schedule(20.5)
    out = restart(restarted, out, 20.5, resume=5)
    (resumed,) = records(out, "group.resumed")
    assert resumed["seconds_since_failure"] == pytest.approx(22.5 - 20.0)


def test_a_recovery_under_way_when_the_coordinator_restarts_still_ends_in_group_resumed(tmp_path: Path) -> None:
    """The serving dpd stopped while a job was recovering: the next coordinator reads the
    interruption (wall time, its cause) back from the store, so the new group's first step is a
    group.resumed timed from the failure, the coordinator's downtime included."""
    pool = running_pool(("a", "b"))
    pool.worker_exited(2.0, "b", "j", 1, 1, 0, 1, False)  # rank 1 failed: a restart of the budget
    assert pool.jobs["j"].state is JobState.RECOVERING
    restarted = reloaded(pool, tmp_path, 10.0)  # down from 2 s to 10 s
    out: list[Any] = []
    for n in ("a", "b"):  # both dpds come back, running nothing of the job
        refusal, got = restarted.registered(10.5, n, f"inc-{n}2", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [Holding(job="j", slot=0, step=5)])
        assert refusal is None
        out += got
    out += restarted.tick(11.0) + restarted.schedule(11.0)
    out = restart(restarted, out, 11.0, resume=5)
    (resumed,) = records(out, "group.resumed")
    assert (resumed["generation"], resumed["from_step"], resumed["cause"]) == (2, 5, "failure")
    assert resumed["seconds_since_failure"] == pytest.approx(13.0 - 2.0)


def test_group_starting_says_the_node_of_each_rank_in_rank_order() -> None:
    """`nodes` names each node once (in the order the plan met them); `ranks` pairs with `shares`."""
    pool = Driven(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 1)
    join(pool, "b", 2)
    (starting,) = records(prepare_all(pool, pool.submit(0.0, "j", spec(lo=3, hi=3))), "group.starting")
    plan = pool.jobs["j"].plan
    assert plan is not None and len(starting["ranks"]) == len(starting["shares"]) == 3
    assert starting["ranks"] == [s.node for s in plan.ranks] and sorted(starting["nodes"]) == ["a", "b"]


def test_a_node_lost_while_its_failed_group_stops_is_named_in_the_record() -> None:
    """A dpd SIGKILLed takes its trainer along unreported; a peer's "connection lost" (exit 1)
    stops the group first. The node that went is then named too, not its peer alone."""
    pool = running_pool(("a", "b", "c"))
    out = pool.worker_exited(2.0, "b", "j", 1, 1, 0, 1, False, "[ring] connection to a peer was lost")
    assert records(out, "worker.failed") == [{"rank": 1, "node": "b", "reason": "exit", "code": 1, "error": "[ring] connection to a peer was lost"}]
    out = pool.bye(2.1, "c")
    assert records(out, "worker.failed") == [{"rank": 2, "node": "c", "reason": "heartbeat"}]
    assert pool.jobs["j"].machine.restarts == 1  # one failure, one restart of the budget


def test_after_a_coordinator_restart_a_running_group_grows_onto_a_free_slot(tmp_path: Path) -> None:
    """Rank 0's hello (where the generation started) went to the coordinator that died; the group
    must still count as resizable once it reports a step, or a freed slot waits for a failure."""
    pool = running_pool(("a", "b"), hi=3)
    restarted = reloaded(pool, tmp_path, 10.0)
    for r, n in enumerate(("a", "b")):
        refusal, _ = restarted.registered(10.5, n, f"inc-{n}", NodeInfo(slots=1, advertise="127.0.0.1"),
                                          [RunningWorker(job="j", generation=1, rank=r, slot=0, pid=100 + r)], [], [])
        assert refusal is None
    join(restarted, "c", 1, now=11.0)
    for r in range(2):
        restarted.progress(11.5, "j", 1, r, 8, 192, 0.05)
    out = restarted.schedule(12.0)  # as the coordinator runs it after each batch of messages
    assert restarted.jobs["j"].state is JobState.RUNNING
    assert [s.node for s in sends(out, m.JobWarm)] == ["c"] and records(out, "group.warming"), out  # the growth onto c begins


# -- who writes what ---------------------------------------------------------------------------


def test_finished_jobs_leave_memory_and_stay_in_the_store(tmp_path: Path) -> None:
    from dpool.daemon.pool import RECENT_FINISHED

    pool, store = Driven(), Store(tmp_path / "c.sqlite3")
    n = RECENT_FINISHED + 10
    for i in range(n):
        pool.submit(float(i), f"j-{i}", spec(f"job{i}"))
        pool.cancel(float(i) + 0.5, pool.jobs[f"j-{i}"])
        store.save_job(pool.jobs[f"j-{i}"])
    assert len(pool.jobs) == RECENT_FINISHED and not pool.live and "j-0" not in pool.jobs and pool.forgotten == 10
    found = store.find_job("job0")
    assert found is not None and found.id == "j-0" and found.state is JobState.CANCELLED
    assert store.find_job("j-1") is not None and store.find_job("j-") is None  # a prefix of many
    rows = store.statuses(1000)
    assert len(rows) == n and rows[0].id == f"j-{n - 1}" and rows[-1].steps == 20
    assert [r.id for r in store.statuses(2, skip={f"j-{n - 1}"})] == [f"j-{n - 2}", f"j-{n - 3}"]


def test_a_hold_written_as_reason_text_by_an_older_version_is_read_as_a_hold(tmp_path: Path) -> None:
    import sqlite3

    from dpool.daemon.records import Hold

    db = sqlite3.connect(tmp_path / "c.sqlite3")
    db.execute(
        "CREATE TABLE nodes (name TEXT PRIMARY KEY, incarnation TEXT NOT NULL, info TEXT NOT NULL, "
        "joined_at REAL NOT NULL, last_seen REAL NOT NULL, state TEXT NOT NULL, reason TEXT)"
    )
    for name, reason in (("a", "drained"), ("b", "set aside: its workers failed 3 times in a row"), ("c", "dpd stopped")):
        db.execute("INSERT INTO nodes VALUES (?, 'i', '{}', 0, 0, 'idle', ?)", (name, reason))
    db.commit()
    db.close()
    held = Store(tmp_path / "c.sqlite3").held_nodes()
    assert held == {"a": (Hold.DRAINED, "drained"), "b": (Hold.SET_ASIDE, "set aside: its workers failed 3 times in a row")}


def test_only_the_job_machine_writes_its_fields() -> None:
    """The pool, the store and the coordinator read a JobMachine; its own methods write it."""
    import ast

    daemon = Path(js.__file__).parent
    fields = set(JobMachine.__dataclass_fields__)

    def pairs(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
        out = []
        for t in node.targets:
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                out += list(zip(t.elts, node.value.elts, strict=False))
            else:
                out.append((t, node.value))
        return out

    writes = []
    for path in sorted(daemon.glob("*.py")):
        if path.name == "jobstate.py":
            continue
        tree = ast.parse(path.read_text())
        assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
        # Names bound to a machine (`jm = job.machine`, `plan, jm = job.plan, job.machine`).
        aliases = {t.id for n in assigns for t, v in pairs(n) if isinstance(t, ast.Name) and ast.unparse(v).endswith("machine")}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for t in targets:
                for leaf in ast.walk(t):
                    if not isinstance(leaf, ast.Attribute) or leaf.attr not in fields:
                        continue
                    base = ast.unparse(leaf.value)
                    if base.endswith("machine") or base in aliases:
                        writes.append(f"{path.name}:{leaf.lineno}: {ast.unparse(leaf)}")
    assert writes == []


# -- who may report what (issue 9: a node key reports its own ranks only) ------------------------


def placed_pair(pool: Driven, job: str = "j-1") -> dict[int, str]:
    """Nodes a and b, one slot each, and a two-rank job launched on them: rank -> its node."""
    join(pool, "a", 1)
    join(pool, "b", 1)
    prepare_all(pool, pool.submit(0.5, job, spec(lo=2, hi=2)))
    plan = pool.jobs[job].plan
    assert plan is not None and pool.jobs[job].state is JobState.STARTING
    return {r: s.node for r, s in enumerate(plan.ranks)}


def test_a_node_cannot_report_a_rank_the_plan_gave_another_node() -> None:
    pool = Driven()
    owner = placed_pair(pool)
    theirs = next(r for r, n in owner.items() if n == "b")  # node a forges node b's rank
    forged: list[Any] = [
        m.NodeWorkerStarted(job="j-1", generation=1, rank=theirs, slot=0, pid=666),
        m.NodeWorkerHello(job="j-1", generation=1, rank=theirs, pid=666, resume_step=0),
        m.NodeProgress(job="j-1", generation=1, rank=theirs, step=5, loss=None, tokens=10, seconds=0.1),
        m.NodeCheckpoint(job="j-1", generation=1, rank=theirs, slot=0, step=5, seconds=0.1),
        m.NodeWorkerExited(job="j-1", generation=1, rank=theirs, slot=0, code=1, stopped=False),
    ]
    for msg in forged:
        assert pool.from_node(1.0, "a", msg) == [Refused("a", msg.TYPE.value, f"rank {theirs} of job j-1 generation 1 runs on node b")]
    beyond = m.NodeWorkerExited(job="j-1", generation=1, rank=7, slot=0, code=1, stopped=False)
    assert pool.from_node(1.0, "a", beyond) == [Refused("a", "node.worker_exited", "rank 7 of job j-1 generation 1 does not exist (world size 2)")]
    job = pool.jobs["j-1"]
    assert job.state is JobState.STARTING and job.machine.restarts == 0 and job.step == 0 and not job.saved
    assert job.ranks[theirs].pid is None and ("j-1", 0) not in pool.nodes["a"].holdings  # nothing of it was taken

    # Metrics and samples are rank 0's: only its node's are taken.
    not_rank0 = "b" if owner[0] == "a" else "a"
    row = TrainRow(kind="train", step=1, loss=9.0, lr=1e-3, tokens=8, tokens_per_s=100.0, world_size=2)
    out = pool.from_node(1.0, not_rank0, m.NodeMetric(job="j-1", generation=1, row=row))
    assert out == [Refused(not_rank0, "node.metric", f"rank 0 of job j-1 generation 1 runs on node {owner[0]}")] and job.loss is None

    # The node the plan gave the rank is heard.
    pool.worker_exited(1.5, "b", "j-1", 1, theirs, 0, 1, False)
    assert job.state is JobState.RECOVERING and job.machine.restarts == 1


def test_exits_a_registering_node_lists_are_taken_for_its_own_ranks_only() -> None:
    pool = Driven()
    owner = placed_pair(pool)
    theirs = next(r for r, n in owner.items() if n == "b")
    lie = ExitedWorker(job="j-1", generation=1, rank=theirs, slot=0, code=1)
    refusal, actions = pool.registered(2.0, "a", "inc-a", NodeInfo(slots=1), [], [lie], [])
    assert refusal is None
    assert Refused("a", "node.register exited", f"rank {theirs} of job j-1 generation 1 runs on node b") in actions
    assert pool.jobs["j-1"].state is JobState.STARTING and pool.jobs["j-1"].machine.restarts == 0


def test_a_prepare_answer_from_a_node_not_asked_is_refused() -> None:
    pool = Driven()
    join(pool, "a", 1)
    join(pool, "c", 1)
    pool.submit(0.5, "j-1", spec(lo=1, hi=1))  # one slot: on a (stable order)
    assert pool.jobs["j-1"].pending is not None and "c" not in pool.jobs["j-1"].pending.nodes
    out = pool.prepared(1.0, "c", "j-1", 1, "6.6.6.6", [666], None)
    assert out == [Refused("c", "node.prepared", "job j-1 generation 1 is being prepared on a, not on node c")]
    assert pool.jobs["j-1"].plan is None  # no group.start with c's address


def test_rows_are_taken_from_the_nodes_of_their_generation_while_it_is_remembered() -> None:
    pool = Driven()
    owner = placed_pair(pool)
    assert pool.report_refused(owner[0], "node.metric", "j-1", 1, None, stored=True) is None
    # A generation the pool never placed: its rows are refused (they would be stored as its).
    refused = pool.report_refused(owner[0], "node.metric", "j-1", 9, None, stored=True)
    assert refused is not None and "not a generation this coordinator placed" in refused.reason
    # The next generation moves the ranks; late rows of generation 1 are checked against it.
    job = pool.jobs["j-1"]
    job.placed[1] = ("b", "a")  # as if generation 1 had put rank 0 on b
    job.plan = dataclasses.replace(job.plan, generation=2)  # type: ignore[type-var]
    assert pool.report_refused("b", "node.logs", "j-1", 1, 0, stored=True) is None
    assert pool.report_refused("a", "node.logs", "j-1", 1, 0, stored=True) == Refused("a", "node.logs", "rank 0 of job j-1 generation 1 runs on node b")
    # A report about a job this pool does not hold changes nothing: ignored, not refused.
    assert pool.report_refused("a", "node.progress", "other-000000", 1, 0) is None


def test_a_restarted_dpd_with_its_own_key_replaces_its_old_process_at_once() -> None:
    pool = Driven()
    owner = placed_pair(pool)
    mine = tuple(r for r, n in owner.items() if n == "a")
    again = m.NodeRegister(name="a", incarnation="inc-a-2", info=NodeInfo(slots=1, advertise="127.0.0.1"))  # on a's machine
    refusal, _ = pool.register(1.2, again)  # without keys: a duplicate until the old one is lost
    assert refusal is not None and "already in the pool" in refusal and pool.nodes["a"].incarnation == "inc-a"

    # Its own name-bound key, on a's machine, while a's dpd still heartbeats: a second dpd there
    # (the two took turns under a service manager), refused.
    refusal, _ = pool.register(1.2, again, bound=True)
    assert refusal is not None and "held by a live dpd with the same key on this machine" in refusal and pool.nodes["a"].incarnation == "inc-a"
    # Once a's dpd has been silent two periods (a restart after a crash or a hang): a's new dpd.
    t = pool.nodes["a"].last_seen + pool.cadence.expiry_s("a") / 3 + 0.01
    refusal, actions = pool.register(t, again, bound=True)
    assert refusal is None and pool.nodes["a"].incarnation == "inc-a-2" and not pool.nodes["a"].lost
    assert Record(None, "node.lost", t, {"node": "a", "reason": "replaced by a new dpd process"}) in actions
    job = pool.jobs["j-1"]
    assert job.state is JobState.RECOVERING and not set(mine) & job.machine.live  # its ranks died with the old dpd


def test_one_nodes_key_on_two_machines_never_takes_the_node_from_its_live_dpd() -> None:
    """Two machines given node a's bundle: each registration replaced the other, 108 times in 14 s,
    and a running job used up its ten restarts in two seconds with no error from either dpd. Now
    a dpd with a's key at another address is refused while a's dpd lives (a restart on a's own
    machine still replaces it at once); and a replaced process that comes back is refused too."""
    pool = Driven()
    placed_pair(pool)
    elsewhere = m.NodeRegister(name="a", incarnation="inc-x", info=NodeInfo(slots=1, pid=42, advertise="10.0.0.7"))
    refusal, actions = pool.register(1.2, elsewhere, bound=True)
    assert refusal is not None and "held by a live dpd with the same key at 127.0.0.1" in refusal and "two machines hold node a's key" in refusal
    assert actions == [] and pool.nodes["a"].incarnation == "inc-a" and pool.jobs["j-1"].state is JobState.STARTING
    restarted = m.NodeRegister(name="a", incarnation="inc-a-2", info=NodeInfo(slots=1, pid=43, advertise="127.0.0.1"))
    t = pool.nodes["a"].last_seen + pool.cadence.expiry_s("a") / 3 + 0.01  # a's dpd silent two periods: restarted
    assert pool.register(t, restarted, bound=True)[0] is None and pool.nodes["a"].incarnation == "inc-a-2"
    # The process it replaced, alive after all (it hung): refused, it exits.
    refusal, _ = pool.register(t + 0.1, m.NodeRegister(name="a", incarnation="inc-a", info=NodeInfo(slots=1, advertise="127.0.0.1")), bound=True)
    assert refusal is not None and "another dpd with this node's key replaced this one (dpd pid 43 at 127.0.0.1)" in refusal, refusal
    assert pool.nodes["a"].incarnation == "inc-a-2" and not pool.nodes["a"].lost


def test_pages_of_long_log_lines_and_large_samples_stay_under_the_message_cap(tmp_path: Path) -> None:
    """2,000 log lines of 8,000 characters (16 MB) and six 1 MiB samples: every page is a message
    that can be sent, and paging through them returns each row once."""
    from dpool.protocol.payloads import SampleRow

    store = Store(tmp_path / "c.sqlite3")
    store.add_logs("j", 1.0, 0, 1, [f"{i:05d} " + "x" * 7994 for i in range(2000)])
    store.commit()
    seen, after, pages = [], 0, 0
    while True:
        lines, after, more = store.logs("j", after, None, m.PAGE_LIMIT)
        m.LogsReply(job_id="j", lines=lines, cursor=after, more=more, state="running").to_frames()  # raises when too large
        seen += [int(x.text[:5]) for x in lines]
        pages += 1
        if not more:
            break
    assert seen == list(range(2000)) and pages > 1
    for step in range(1, 7):
        store.add_sample("j", 1, SampleRow(step=step, text="y" * (1 << 20)))
    store.commit()
    steps, after = [], 0
    while True:
        rows, after, more = store.samples("j", after, m.PAGE_LIMIT)
        m.SamplesReply(job_id="j", rows=rows, cursor=after, more=more).to_frames()
        steps += [r.step for r in rows]
        if not more:
            break
    assert steps == [1, 2, 3, 4, 5, 6]


# -- fitness: which nodes can serve a job (daemon/fitness.py) --------------------------------------


def files_spec(name: str = "j", lo: int = 1, hi: int = 4) -> Any:
    return parse_job({**spec(name, lo, hi).to_dict(), "data": {"source": "~/corpus/*.txt"}})


def staged(pool: Driven, now: float, node: str, state: str, reason: str | None = None, **kw: Any) -> list[Any]:
    from dpool.protocol.stage_messages import NodeStaged

    return pool._then_schedule(now, pool.from_node(now, node, NodeStaged(job="j", state=state, reason=reason, **kw)))


def test_a_job_that_names_files_starts_only_on_nodes_that_said_they_can_serve_it() -> None:
    from dpool.protocol.stage_messages import JobStage

    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    out = pool.submit(0.0, "j", files_spec())
    assert sorted(s.node for s in sends(out, JobStage)) == ["a", "b"] and sends(out, m.GroupPrepare) == []
    out = staged(pool, 0.5, "a", "ready")
    assert sends(out, m.GroupPrepare) == []  # b is still checking: the first group waits for it, briefly
    out = staged(pool, 0.6, "b", "unfit", "data.source: corpus/a.txt: content differs")
    assert records(out, "node.unfit") == [{"node": "b", "reason": "data.source: corpus/a.txt: content differs"}]
    assert [s.node for s in sends(out, m.GroupPrepare)] == ["a"]
    assert "unfit for j: data.source: corpus/a.txt: content differs" in (pool.node_rows(1.0)[1].reason or "")
    assert [r.state for r in pool.staging_rows("j", 1.0)] == ["unfit"]


def test_an_unfit_reason_said_again_with_other_figures_is_one_event() -> None:
    """A cache without room says how many bytes each time; asked again at once (new sources), the
    node said node.unfit twice within 0.1 s."""
    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec())
    staged(pool, 0.1, "a", "ready")
    full = "the cache at /s/cache has no room for 2eef70da248b: {} more bytes needed, a budget of 200000 bytes"
    assert len(records(staged(pool, 0.2, "b", "unfit", full.format(23999000)), "node.unfit")) == 1
    assert records(staged(pool, 0.3, "b", "unfit", full.format(23998112)), "node.unfit") == []
    # asked again (new sources), it tries a fetch and finds no room again: the same reason, unsaid
    assert records(staged(pool, 0.35, "b", "staging", total_bytes=24_000_000), "node.unfit") == []
    assert records(staged(pool, 0.36, "b", "unfit", full.format(23997000)), "node.unfit") == []
    assert len(records(staged(pool, 0.4, "b", "unfit", "data.source: corpus/a.txt: content differs"), "node.unfit")) == 1
    # digits inside a name are the name's: another file is another reason
    assert len(records(staged(pool, 0.5, "b", "unfit", "data.source: corpus/part-0001.txt: content differs"), "node.unfit")) == 1
    assert len(records(staged(pool, 0.6, "b", "unfit", "data.source: corpus/part-0002.txt: content differs"), "node.unfit")) == 1


def test_a_job_no_node_can_serve_fails_at_once_with_every_reason() -> None:
    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec())
    staged(pool, 0.5, "a", "unfit", "no such directory")
    assert pool.jobs["j"].state is JobState.QUEUED  # b has not answered yet
    staged(pool, 0.6, "b", "unfit", "no such directory")
    job = pool.jobs["j"]
    assert job.state is JobState.FAILED and job.machine.restarts == 0
    assert job.machine.error == "no node can serve this job: a: no such directory; b: no such directory"


def test_a_rank_that_refuses_its_input_leaves_its_node_out_and_the_job_goes_on_elsewhere() -> None:
    pool = running_pool()
    out = pool.worker_exited(2.0, "b", "j", 1, 1, 0, 2, False, "model.path: no such directory on this machine")
    assert records(out, "node.unfit") == [{"node": "b", "reason": "rank 1: model.path: no such directory on this machine"}]
    pool.worker_exited(2.1, "a", "j", 1, 0, 0, 1, False)
    out = pool.worker_exited(2.1, "c", "j", 1, 2, 0, 1, False)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "c"]
    assert pool.jobs["j"].machine.restarts == 0


def held_by_a_fetched_by_b(nodes: str) -> tuple[Driven, str, list[Any]]:
    """A pool of `nodes` and job "j" naming its data's content: node a holds it, b begins to fetch
    it (what b's answer returned is the third item)."""
    pool = Driven()
    for n in nodes:
        join(pool, n, 1)
    digest = "d" * 64
    pool.submit(0.0, "j", parse_job({**files_spec().to_dict(), "content": {"data": digest}}))
    staged(pool, 0.1, "a", "ready", holds=[digest], endpoint="tcp://10.0.0.1:7400")
    return pool, digest, staged(pool, 0.2, "b", "staging", total_bytes=100, endpoint="tcp://10.0.0.2:7400")


def test_an_unfit_node_is_asked_again_later_and_a_fetching_node_reads_from_the_one_ahead() -> None:
    from dpool.daemon.fitness import RECHECK_S
    from dpool.protocol.stage_messages import JobStage

    pool, digest, out = held_by_a_fetched_by_b("abc")
    assert records(out, "node.staging") == [{"node": "b", "bytes": 100}]
    # c fetches too: it reads from b, ahead of it in the chain (not from a, whose uplink b uses)
    out = staged(pool, 0.3, "c", "staging", total_bytes=100, endpoint="tcp://10.0.0.3:7400")
    (to_c,) = [s.msg for s in sends(out, JobStage) if s.node == "c"]
    assert [(s.node, s.partial) for s in to_c.sources] == [("b", True)]
    (to_b,) = [s.msg for s in sends(out, JobStage) if s.node == "b"]
    assert [(s.node, s.partial) for s in to_b.sources] == [("a", False)]  # first in line: the holder
    out = staged(pool, 1.0, "b", "ready", total_bytes=100, done_bytes=100, holds=[digest], endpoint="tcp://10.0.0.2:7400")
    assert records(out, "node.staged")[0]["node"] == "b"
    out = staged(pool, 1.1, "c", "unfit", "the disk is full")
    asked = []
    for t in (1.1 + RECHECK_S - 1, 1.1 + RECHECK_S):
        for n in "abc":
            pool.seen(t, n)  # alive all along
        asked.append([s.node for s in sends(pool.tick(t), JobStage)])
    assert asked == [[], ["c"]]


def test_an_unfit_node_asked_again_says_so_once_per_reason_and_stays_out_while_it_checks() -> None:
    from dpool.daemon.fitness import RECHECK_S
    from dpool.protocol.stage_messages import JobStage

    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec())
    staged(pool, 0.1, "a", "ready")
    out = staged(pool, 0.2, "b", "unfit", "data.source: corpus/a.txt: content differs")
    assert records(out, "node.unfit") == [{"node": "b", "reason": "data.source: corpus/a.txt: content differs"}]
    t = 0.2 + RECHECK_S
    for n in "ab":
        pool.seen(t, n)
    assert [s.node for s in sends(pool.tick(t), JobStage)] == ["b"]
    out = staged(pool, t + 0.1, "b", "checking")
    assert records(out, "node.unfit") == [] and [r.state for r in pool.staging_rows("j", t + 0.1)] == ["unfit"]  # still out while it checks
    out = staged(pool, t + 0.2, "b", "unfit", "data.source: corpus/a.txt: content differs")
    assert records(out, "node.unfit") == []  # the same verdict: nothing new to say
    out = staged(pool, t + 0.3, "b", "unfit", "data.source: no such directory")
    assert records(out, "node.unfit") == [{"node": "b", "reason": "data.source: no such directory"}]
    staged(pool, t + 0.4, "b", "ready")
    assert pool.staging_rows("j", t + 0.4) == []


def test_a_node_whose_fetch_failed_is_asked_again_when_a_node_comes_to_hold_the_content() -> None:
    """A fetch that fails (its source went away, a peer timed out on a busy machine) left the node
    out for RECHECK_S (30 s) although the next holder was a moment away: it is asked again as soon
    as one appears, once per failure. A node unfit for another reason waits as before, and a
    failure elsewhere asks no failed node again (two failing fetchers would ask each other for ever)."""
    from dpool.protocol.stage_messages import JobStage

    pool, digest, _ = held_by_a_fetched_by_b("abcd")
    staged(pool, 0.3, "c", "staging", total_bytes=100, endpoint="tcp://10.0.0.3:7400")
    staged(pool, 0.3, "d", "unfit", "data.source: no room in this node's cache", endpoint="tcp://10.0.0.4:7400")
    out = staged(pool, 0.4, "c", "unfit", "data.source: could not fetch the job's files: b went away")
    assert [s.node for s in sends(out, JobStage)] == ["b"]  # b reads elsewhere now; nothing new for c (or d)
    out = staged(pool, 0.5, "b", "unfit", "data.source: could not fetch the job's files: timed out")
    assert "c" not in [s.node for s in sends(out, JobStage)]  # a failure elsewhere is no new source
    out = staged(pool, 1.0, "a", "ready", holds=[digest], endpoint="tcp://10.0.0.1:7400")  # nothing new from a
    assert [s.node for s in sends(out, JobStage)] == []
    # A fifth node joins and comes to hold the content: b and c fetch again at once; d waits its 30 s.
    join(pool, "e", 1, now=2.0)
    out = staged(pool, 2.5, "e", "ready", holds=[digest], endpoint="tcp://10.0.0.5:7400")
    assert sorted(s.node for s in sends(out, JobStage)) == ["b", "c"]
    out = staged(pool, 2.6, "c", "checking")
    assert [r.state for r in pool.staging_rows("j", 2.6) if r.node == "c"] == ["unfit"]
    out = staged(pool, 2.7, "c", "staging", total_bytes=100, endpoint="tcp://10.0.0.3:7400")
    assert records(out, "node.staging") == [{"node": "c", "bytes": 100}]
    # Once: the next holder asks b again only if it fails again (c, fetching, gets its new sources).
    join(pool, "f", 1, now=3.0)
    out = staged(pool, 3.5, "f", "ready", holds=[digest], endpoint="tcp://10.0.0.6:7400")
    assert sorted(s.node for s in sends(out, JobStage)) == ["c"]


def test_a_fetch_from_nodes_that_train_is_paced_and_every_node_learns_the_keys_that_may_read() -> None:
    from dpool.daemon.fitness import TRAINING_RATE_BPS
    from dpool.protocol.stage_messages import JobStage, NodeStaged, StagePeers

    pool = running_pool(("a", "b"))  # a and b train job "j"
    join(pool, "c", 1, now=2.0)
    digest = "e" * 64
    # a's data channel, and what it holds, as a dpd says after it registers (about no job)
    out = pool.from_node(2.0, "a", NodeStaged(job="*", state="ready", holds=[digest], endpoint="tcp://a:1", key="A" * 40))
    assert [(s.node, s.msg) for s in sends(out, StagePeers)] == [("a", StagePeers(peers=["A" * 40]))]
    out = pool.from_node(2.0, "c", NodeStaged(job="*", state="ready", endpoint="tcp://c:1", key="C" * 40))
    assert sorted(s.node for s in sends(out, StagePeers)) == ["a", "c"] and sends(out, StagePeers)[0].msg.peers == ["A" * 40, "C" * 40]
    out = pool.submit(2.1, "k", parse_job({**files_spec("k").to_dict(), "content": {"data": digest}}))
    (to_c,) = [s.msg for s in sends(out, JobStage) if s.node == "c"]
    assert isinstance(to_c, JobStage) and to_c.rate_bps == TRAINING_RATE_BPS


def test_a_jobs_first_group_waits_for_nodes_still_checking_but_not_for_long() -> None:
    from dpool.daemon.fitness import CHECK_WAIT_S

    pool = Driven()
    for n in "abc":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec(hi=3))
    staged(pool, 0.2, "a", "ready")
    out = staged(pool, 0.3, "b", "checking")  # hashing its copy
    assert sends(out, m.GroupPrepare) == []
    out = staged(pool, 0.4, "c", "staging", total_bytes=10**9)  # fetching a GiB: not waited for
    assert sends(out, m.GroupPrepare) == []  # b still checks
    out = staged(pool, 1.0, "b", "ready")
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"]
    # another job: a node that never answers holds its start back CHECK_WAIT_S at most
    pool2 = Driven()
    for n in "ab":
        join(pool2, n, 1)
    pool2.submit(0.0, "j", files_spec())
    staged(pool2, 0.1, "a", "ready")
    for n in "ab":
        pool2.seen(CHECK_WAIT_S - 0.1, n)
    assert sends(pool2.tick(CHECK_WAIT_S - 0.1), m.GroupPrepare) == []
    for n in "ab":
        pool2.seen(CHECK_WAIT_S + 0.1, n)
    assert [s.node for s in sends(pool2.tick(CHECK_WAIT_S + 0.1), m.GroupPrepare)] == ["a"]


def test_a_node_names_a_jobs_content_and_an_answer_about_other_files_given_before_that_does_not_count() -> None:
    from dpool.protocol.stage_messages import JobStage

    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec())  # from a machine without the files: no [content]
    out = staged(pool, 0.1, "a", "ready", found_data="a" * 64)
    assert records(out, "job.content") == [{"node": "a", "data": "a" * 64}]
    assert pool.jobs["j"].spec.content.data == "a" * 64
    assert sorted(s.node for s in sends(out, JobStage)) == ["a", "b"]  # asked again, against it
    out = staged(pool, 0.2, "b", "ready", found_data="b" * 64)  # b's answer to the first question
    assert records(out, "job.content") == [] and sends(out, m.GroupPrepare) == []
    (again,) = sends(out, JobStage)  # b may have dropped the second question while it checked: asked at once
    assert again.node == "b" and again.msg.spec["content"]["data"] == "a" * 64
    assert not pool.fitness.eligible("j", pool.jobs["j"].spec, "b")
    out = staged(pool, 0.3, "b", "unfit", "data.source: doc05.txt: content differs")
    staged(pool, 0.4, "a", "ready", found_data=None)
    assert pool.fitness.eligible("j", pool.jobs["j"].spec, "a") and not pool.fitness.eligible("j", pool.jobs["j"].spec, "b")


def test_a_node_lacking_files_another_node_may_yet_name_says_unfit_only_once_every_node_answered() -> None:
    """Submitted from a machine without the files: a answers first that it has none. b and c still
    check theirs; b finds them, and a then fetches. a said `node.unfit` (then `node.staged`, and
    trained): now its unfit waits for the others, and is said only if none names the content."""
    pool = Driven()
    for n in "abc":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec())
    seen = staged(pool, 0.1, "a", "unfit", "data.source = '~/corpus/*.txt': no such files on this machine")
    assert records(seen, "node.unfit") == []
    out = staged(pool, 0.2, "b", "ready", found_data="b" * 64)
    assert records(out, "job.content") == [{"node": "b", "data": "b" * 64}]
    seen += out + staged(pool, 0.3, "c", "ready", found_data=None)
    seen += staged(pool, 0.4, "a", "staging", done_bytes=0, total_bytes=100)
    out = staged(pool, 0.5, "a", "ready", total_bytes=100)
    assert records(out, "node.staged") and records(seen + out, "node.unfit") == []

    other = Driven()
    for n in "abc":
        join(other, n, 1)
    other.submit(0.0, "j", files_spec())
    staged(other, 0.1, "a", "unfit", "no such files on a")
    assert records(staged(other, 0.2, "b", "unfit", "no such files on b"), "node.unfit") == []
    out = staged(other, 0.3, "c", "unfit", "no such files on c")  # the last answer: no node names it
    assert records(out, "node.unfit") == [{"node": n, "reason": f"no such files on {n}"} for n in "abc"]

    # The node still checking is lost instead of answering: the held ones are said then.
    third = Driven()
    for n in "abc":
        join(third, n, 1)
    third.submit(0.0, "j", files_spec())
    staged(third, 0.1, "a", "unfit", "no such files on a")
    staged(third, 0.2, "b", "checking")
    assert records(staged(third, 0.3, "a", "unfit", "no such files on a"), "node.unfit") == []  # said again, still held
    assert records(staged(third, 0.4, "c", "unfit", "no such files on c"), "node.unfit") == []  # b still checks
    out = third.bye(0.5, "b")
    assert records(out, "node.unfit") == [{"node": n, "reason": f"no such files on {n}"} for n in "ac"]


def test_unfit_about_the_job_before_it_named_its_content_does_not_count() -> None:
    """b lacks the files and says so about the job as submitted; its answer arrives after a named
    them (the node echoes what it was asked). It is asked again at once, not after the recheck,
    and fetches."""
    from dpool.protocol.stage_messages import JobStage

    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    pool.submit(0.0, "j", files_spec())
    staged(pool, 0.1, "a", "ready", found_data="a" * 64, asked=[])
    out = staged(pool, 0.2, "b", "unfit", "data.source = '~/corpus/*.txt': no such files on this machine", asked=[])
    assert records(out, "node.unfit") == []
    (again,) = sends(out, JobStage)
    assert again.node == "b" and again.msg.spec["content"]["data"] == "a" * 64
    staged(pool, 0.25, "b", "checking", asked=[])  # progress of the old check: ignored
    assert pool.fitness.fits["j"]["b"].state.value == "asked"
    staged(pool, 0.3, "a", "ready", asked=["a" * 64], holds=["a" * 64], endpoint="tcp://a:1")
    staged(pool, 0.35, "b", "staging", total_bytes=10, asked=["a" * 64])
    assert pool.fitness.fits["j"]["b"].state.value == "staging"
    out = staged(pool, 0.4, "b", "ready", total_bytes=10, done_bytes=10, holds=["a" * 64], asked=["a" * 64])
    assert records(out, "node.staged") == [{"node": "b", "bytes": 10, "seconds": 0.05}]
    (row,) = [r for r in pool.staging_rows("j", 0.4) if r.node == "b"]
    assert (row.state, row.bytes, row.total, row.eta_s) == ("ready", 10, 10, None) and row.rate_bps == pytest.approx(200.0)  # 10 bytes in 0.05 s
    assert pool.fitness.eligible("j", pool.jobs["j"].spec, "b")  # 0.3 s after it lacked the files, not 30


def test_an_upload_goes_to_a_node_with_a_data_channel_and_another_when_that_one_could_not_take_it() -> None:
    from dpool.protocol.stage_messages import NodeStaged

    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
        pool.from_node(0.1, n, NodeStaged(job="*", state="ready", endpoint=f"tcp://{n}:1"))
    digest = "f" * 64
    first = pool.fitness.offer([digest], ["a", "b"])
    assert (first.held, first.target, first.endpoint) == ([], "a", "tcp://a:1")
    assert pool.fitness.offer([digest], ["a", "b"], exclude=["a"]).target == "b"
    assert pool.fitness.offer([digest], ["a", "b"], exclude=["a", "b"]).target == ""
    pool.from_node(0.2, "b", NodeStaged(job="*", state="ready", endpoint="tcp://b:1", holds=[digest]))
    assert pool.fitness.offer([digest], ["a", "b"]).held == [digest]  # nothing to send


def b_begins_a_fetch_of_what_a_holds() -> tuple[Driven, str, list[Any]]:
    """Nodes a and b, job "j" naming content a holds; b's first "staging" answer, before its fetch
    has read the content's manifest (0 bytes), and what it returned."""
    pool = Driven()
    for n in "ab":
        join(pool, n, 1)
    digest = "e" * 64
    pool.submit(0.0, "j", parse_job({**files_spec().to_dict(), "content": {"data": digest}}))
    staged(pool, 0.1, "a", "ready", holds=[digest], endpoint="tcp://10.0.0.1:7400")
    return pool, digest, staged(pool, 0.2, "b", "staging", endpoint="tcp://10.0.0.2:7400")


def test_node_staging_says_the_bytes_to_fetch_once_the_fetch_knows_them() -> None:
    """The event waits for the first answer with the size, and is recorded once."""
    pool, _, first = b_begins_a_fetch_of_what_a_holds()
    assert records(first, "node.staging") == []
    assert records(staged(pool, 0.7, "b", "staging", total_bytes=600, done_bytes=100), "node.staging") == [{"node": "b", "bytes": 500}]
    assert records(staged(pool, 1.2, "b", "staging", total_bytes=600, done_bytes=300), "node.staging") == []


def test_a_fetch_done_before_it_reported_a_size_still_says_node_staging() -> None:
    pool, digest, _ = b_begins_a_fetch_of_what_a_holds()
    out = staged(pool, 0.4, "b", "ready", total_bytes=600, done_bytes=600, holds=[digest])
    assert records(out, "node.staging") == [{"node": "b", "bytes": 600}] and [r["node"] for r in records(out, "node.staged")] == ["b"]
    # dated when said, not back to when the fetch began: listed after events of the meantime, it
    # would break the job's time order
    assert [a.t for a in out if isinstance(a, Record) and a.kind == "node.staging"] == [0.4]


def test_a_node_back_after_its_job_ended_is_told_so_for_the_state_it_keeps_in_memory() -> None:
    """b was lost while job j ran; j was cancelled meanwhile (a lost node is sent no job.ended).
    When b's dpd registers again offering j's state in memory, it is told j ended, so the RAM it
    holds and a warm trainer go now, not after ten idle minutes; a checkpoint on disk is not news."""
    pool = running_pool(("a", "b"))
    pool.bye(2.0, "b")
    pool.cancel(2.1, pool.jobs["j"])
    assert pool.jobs["j"].machine.terminal
    _, out = pool.registered(3.0, "b", "inc-b2", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [Holding(job="j", slot=0, step=7, memory=True)])
    assert [s.msg for s in sends(out, m.JobEnded)] == [m.JobEnded(job="j")]
    _, out = pool.registered(4.0, "b", "inc-b3", NodeInfo(slots=1, advertise="127.0.0.1"), [], [], [Holding(job="j", slot=0, step=5)])
    assert sends(out, m.JobEnded) == []


def test_a_diloco_group_is_planned_in_whole_replicas() -> None:
    """Two equal nodes, 4 replicas of a global batch of 6 (2, 2, 1, 1 sequences): each rank runs two
    replicas, 4 and 2 sequences. The shares say so, where they said 3, 3 while the ranks computed
    otherwise."""
    pool = Driven(heartbeat_s=0.5, liveness=6)
    for n in "ab":
        join(pool, n, 1)
    out = prepare_all(pool, pool.submit(0.0, "j", spec(hi=2, sync={"mode": "diloco", "replicas": 4, "inner_steps": 2})))
    starts = sends(out, m.GroupStart)
    assert starts and all(s.msg.shares == [4, 2] for s in starts)  # type: ignore[attr-defined]


def test_steps_reported_while_the_coordinator_was_away_count_as_recomputed(tmp_path: Path) -> None:
    """The serving dpd was SIGKILLed while its job ran step 10 (the coordinator had saved step 7);
    the ranks died and the next generation resumed from the checkpoint at step 5. Steps 6-10 were
    done twice: b's dpd says its rank reached step 10 as it registers again (it said 0 or 2)."""
    pool = running_pool(("a", "b"))
    restarted = reloaded(pool, tmp_path, 10.0, alive_at=3.0)
    info = NodeInfo(slots=1, advertise="127.0.0.1")
    restarted.registered(10.5, "b", "inc-b2", info, [], [ExitedWorker(job="j", generation=1, rank=1, slot=0, code=1, step=10)], [Holding(job="j", slot=0, step=5)])
    out = restarted.registered(11.0, "a", "inc-a2", info, [], [], [Holding(job="j", slot=0, step=5)])[1]
    out += restarted.tick(11.5) + restarted.schedule(11.5)
    out = restart(restarted, out, 11.5, resume=5)
    (resumed,) = records(out, "group.resumed")
    assert (resumed["from_step"], resumed["steps_recomputed"]) == (5, 5), resumed
