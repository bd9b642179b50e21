"""The scheduler as pure functions (daemon/scheduler.py): targets, who gives, when, and why a job
waits. Time is whatever the test says; no pool, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from dpool.daemon import scheduler as s
from dpool.daemon.scheduler import How, JobView, Phase, Policy, Resize, Start, Take

WAITING, RUNNING, MOVING = Phase.WAITING, Phase.RUNNING, Phase.MOVING


def job(id: str, lo: int = 1, hi: int = 4, *, p: int = 0, at: float = 0.0, phase: Phase = WAITING, held: int = 0, **kw: Any) -> JobView:
    if phase is RUNNING:
        kw.setdefault("resizable", True)
        kw.setdefault("started_at", at)
        kw.setdefault("resized_at", at)
    return JobView(id=id, priority=p, min=lo, max=hi, submitted_at=at, phase=phase, held=held, **kw)


def plan(capacity: int, *jobs: JobView, now: float = 100.0, free: int | None = None, interval: float = 60.0) -> s.Decision:
    if free is None:
        free = capacity - sum(j.held for j in jobs)
    return s.plan(now, capacity, free, jobs, Policy(resize_interval_s=interval))


# -- targets -----------------------------------------------------------------------------------


def test_equal_jobs_share_max_min_fairly_each_up_to_its_max() -> None:
    order = s.queue_order([job("a", 1, 4, at=0), job("b", 1, 4, at=1)])
    assert s.targets(4, order) == {"a": 2, "b": 2}
    order = s.queue_order([job("a", 1, 1, at=0), job("b", 1, 8, at=1), job("c", 2, 8, at=2)])
    assert s.targets(8, order) == {"a": 1, "b": 4, "c": 3}  # a at its max; b and c level at 3, the odd slot to the earlier
    order = s.queue_order([job("a", 1, 8, at=0), job("b", 1, 8, at=1), job("c", 1, 8, at=2)])
    assert s.targets(8, order) == {"a": 3, "b": 3, "c": 2}  # the odd slots go to the earliest


def test_a_higher_priority_takes_up_to_its_max_before_lower_ones_get_more_than_their_minimum() -> None:
    order = s.queue_order([job("low", 1, 8, at=0), job("high", 1, 8, p=5, at=1)])
    assert s.targets(8, order) == {"high": 7, "low": 1}
    order = s.queue_order([job("low", 1, 8, at=0), job("high", 1, 3, p=5, at=1)])
    assert s.targets(8, order) == {"high": 3, "low": 5}


def test_a_job_whose_minimum_does_not_fit_gets_nothing_and_holds_back_no_one_behind_it() -> None:
    order = s.queue_order([job("a", 3, 3, at=0), job("big", 4, 4, at=1), job("small", 1, 1, at=2)])
    assert s.targets(4, order) == {"a": 3, "big": 0, "small": 1}


def test_a_job_never_gets_more_than_the_slots_that_can_serve_it() -> None:
    order = s.queue_order([job("a", 1, 8, capacity=2), job("b", 1, 8, at=1)])
    assert s.targets(8, order) == {"a": 2, "b": 6}


@pytest.mark.parametrize("capacity", [0, 1, 3, 7, 16, 100])
def test_targets_never_exceed_the_pool_and_respect_each_jobs_bounds(capacity: int) -> None:
    jobs = [job(f"j{k}", 1 + k % 3, 2 + 2 * (k % 4), p=k % 2, at=float(k)) for k in range(9)]
    t = s.targets(capacity, s.queue_order(jobs))
    assert sum(t.values()) <= capacity
    assert all(t[j.id] == 0 or j.min <= t[j.id] <= j.max for j in jobs)
    # Nothing is left idle that some job could still use.
    assert sum(t.values()) == capacity or all(t[j.id] in (0, j.max) for j in jobs)


# -- priorities: shrink, then preempt ----------------------------------------------------------


def test_a_higher_priority_job_shrinks_a_running_one_at_once_and_waits_for_its_slots() -> None:
    d = plan(3, job("low", 1, 3, phase=RUNNING, held=3, resized_at=99.0), job("high", 1, 2, p=5, at=99.5))
    assert d.targets == {"high": 2, "low": 1}
    assert d.resizes == [Resize("low", 1, How.SHRINK, ("high",))]  # resized a second ago: priority is not damped
    assert d.starts == [] and d.takes["high"] == [Take("low", 2, How.SHRINK)]
    assert d.waits["high"] == "its 1-2 slot(s): low (shrinking 3->1)"


def test_once_the_shrunk_job_has_stopped_both_start_the_higher_priority_first() -> None:
    d = plan(3, job("low", 1, 3, at=0, started_at=0.0), job("high", 1, 2, p=5, at=99.5))
    assert d.starts == [Start("high", 2), Start("low", 1)] and d.resizes == []


def test_a_job_at_its_minimum_is_preempted_when_a_higher_one_needs_its_slots() -> None:
    d = plan(2, job("low", 2, 2, phase=RUNNING, held=2), job("high", 1, 1, p=5, at=50))
    assert d.targets == {"high": 1, "low": 0}
    assert d.resizes == [Resize("low", 0, How.PREEMPT, ("high",))]
    assert d.takes["high"] == [Take("low", 1, How.PREEMPT)]
    # Stopped, it waits in the queue, saying for whom.
    d = plan(2, job("low", 2, 2, at=0, started_at=0.0), job("high", 1, 1, p=5, at=50))
    assert d.starts == [Start("high", 1)]
    assert d.waits["low"] == "2 free slot(s) (workers.min); 1 free, the rest held by high (1, priority 5)"


def test_victims_are_the_lowest_priority_first_then_the_most_recently_started() -> None:
    jobs = (
        job("p1-old", 1, 1, p=1, at=0, phase=RUNNING, held=1, started_at=0.0),
        job("p0-old", 1, 1, at=1, phase=RUNNING, held=1, started_at=1.0),
        job("p0-new", 1, 1, at=2, phase=RUNNING, held=1, started_at=2.0),
        job("urgent", 2, 2, p=9, at=50),
    )
    d = plan(3, *jobs)
    assert [r.job for r in d.resizes if r.how is How.PREEMPT] == ["p0-new", "p0-old"]
    assert d.targets["p1-old"] == 1


def test_shrinking_comes_before_preempting() -> None:
    jobs = (job("elastic", 1, 3, at=0, phase=RUNNING, held=3), job("rigid", 1, 1, at=1, phase=RUNNING, held=1), job("high", 2, 2, p=3, at=50))
    d = plan(4, *jobs)
    assert d.resizes == [Resize("elastic", 1, How.SHRINK, ("high",))]


def test_a_running_job_that_cannot_stop_yet_is_resized_once_it_can() -> None:
    low = job("low", 1, 3, phase=RUNNING, held=3, resizable=False)
    d = plan(3, low, job("high", 1, 1, p=5, at=50))
    assert d.resizes == [] and d.starts == [] and "low (shrinking 3->2)" in d.waits["high"]


def test_a_job_already_stopping_gives_its_slots_without_being_asked() -> None:
    d = plan(3, job("low", 1, 3, phase=MOVING, held=3), job("high", 1, 1, p=5, at=50))
    assert d.resizes == [] and d.starts == [] and d.takes["high"] == [Take("low", 1, How.SHRINK)]


# -- fair shares among equals, damped ----------------------------------------------------------


def test_an_equal_job_arriving_takes_its_fair_share_at_once_when_it_cannot_start_otherwise() -> None:
    d = plan(4, job("a", 1, 4, phase=RUNNING, held=4, resized_at=99.0), job("b", 1, 4, at=99.0))
    assert d.resizes == [Resize("a", 2, How.SHRINK, ("b",))]  # b waits below its minimum: not damped
    d = plan(4, job("a", 1, 4, at=0, started_at=0.0), job("b", 1, 4, at=99.0))
    assert d.starts == [Start("a", 2), Start("b", 2)]


def test_rebalancing_among_equals_waits_for_the_damping_interval() -> None:
    # b runs on 1 slot (it started when only one was free); its fair share is 2, a's surplus.
    a = job("a", 1, 4, phase=RUNNING, held=3, resized_at=90.0)
    b = job("b", 1, 4, at=1, phase=RUNNING, held=1)
    assert plan(4, a, b, now=100.0).resizes == []
    d = plan(4, a, b, now=150.0)
    assert d.resizes == [Resize("a", 2, How.SHRINK, ("b",))]
    # b grows once a's slot is free, not before.
    d = plan(4, job("a", 1, 4, phase=MOVING, held=3), b, now=150.0)
    assert d.resizes == []
    d = plan(4, job("a", 1, 4, phase=RUNNING, held=2, resized_at=150.0), b, now=152.0)
    assert d.resizes == [Resize("b", 2, How.GROW)]


def test_an_equal_job_that_can_start_on_free_slots_starts_and_takes_the_rest_later() -> None:
    a = job("a", 1, 4, phase=RUNNING, held=3, resized_at=95.0)
    d = plan(4, a, job("b", 1, 4, at=96.0))
    assert d.starts == [Start("b", 1)] and d.resizes == []
    assert d.targets == {"a": 2, "b": 2}


def test_growth_into_free_slots_is_not_damped() -> None:
    d = plan(4, job("a", 1, 4, phase=RUNNING, held=1, resized_at=99.9))
    assert d.resizes == [Resize("a", 4, How.GROW)]


def test_a_job_that_cannot_be_resized_yet_does_not_grow_and_keeps_its_free_slots() -> None:
    d = plan(4, job("a", 1, 4, phase=RUNNING, held=1, resizable=False), job("c", 1, 1, at=5))
    assert d.resizes == [] and d.starts == [Start("c", 1)]  # c's own share: a's target is 3


# -- backfill ----------------------------------------------------------------------------------


def test_a_small_job_backfills_slots_the_head_of_the_queue_cannot_use() -> None:
    jobs = (job("a", 1, 1, phase=RUNNING, held=1), job("big", 2, 2, at=1), job("small", 1, 1, at=2))
    d = plan(2, *jobs)
    assert d.starts == [Start("small", 1)]
    assert d.waits["big"] == "2 free slot(s) (workers.min); held by a (1) and small (1, behind it: backfill)"


def test_why_a_job_waits_names_every_job_due_its_slots_those_behind_it_too() -> None:
    """The audit's pool of 3: x holds 2, y needs all 3, z (behind y) backfilled the third. Named
    and free, the slots add up to the pool's."""
    jobs = (job("x", 1, 2, phase=RUNNING, held=2), job("y", 3, 3, at=1), job("z", 1, 1, p=-1, at=2, phase=RUNNING, held=1))
    assert plan(3, *jobs).waits["y"] == "3 free slot(s) (workers.min); held by x (2) and z (1, priority -1, behind it: backfill)"
    assert plan(3, job("x", 1, 1, phase=RUNNING, held=1), job("y", 3, 3, at=1)).waits["y"] == "3 free slot(s) (workers.min); 2 free, the rest held by x (1)"
    many = [job(f"j{k}", 1, 1, at=k, phase=RUNNING, held=1) for k in range(7)]
    why = plan(9, *many, job("y", 3, 3, at=10)).waits["y"]
    assert why == "3 free slot(s) (workers.min); 2 free, the rest held by j0 (1), j1 (1), j2 (1), j3 (1) and 3 more (3)"
    # Where only some slots can serve it, the others' slots may lie elsewhere: no sum of free ones.
    assert plan(4, job("x", 2, 2, phase=RUNNING, held=2), job("y", 3, 3, at=1, capacity=3)).waits["y"] == "3 free slot(s) (workers.min); held by x (2)"


def test_a_backfilled_job_yields_once_the_job_it_jumped_can_start() -> None:
    jobs = (job("big", 2, 2, at=1), job("small", 1, 1, at=2, phase=RUNNING, held=1, started_at=5.0))
    d = plan(2, *jobs)
    assert d.resizes == [Resize("small", 0, How.PREEMPT, ("big",))]


def test_a_backfill_never_takes_slots_being_freed_for_a_job_ahead_of_it() -> None:
    # high waits for low's shrink; the one slot free now is kept for it, not given to small.
    jobs = (job("low", 1, 3, phase=RUNNING, held=2), job("high", 2, 2, p=5, at=50), job("small", 1, 1, at=60))
    d = plan(3, *jobs)
    assert d.starts == [] and d.resizes == [Resize("low", 1, How.SHRINK, ("high",))]
    assert d.targets["small"] == 0


def test_a_lower_priority_job_backfills_and_is_shrunk_back_when_needed() -> None:
    d = plan(4, job("a", 3, 3, p=5, phase=RUNNING, held=3), job("b", 2, 2, p=5, at=1), job("c", 1, 2, at=2))
    assert d.starts == [Start("c", 1)] and "b" in d.waits


def test_a_job_that_can_never_fit_says_so() -> None:
    d = plan(4, job("huge", 5, 5))
    assert d.waits["huge"] == "workers.min = 5 is more than the 4 usable slot(s) that can serve it"
    d = plan(4, job("picky", 2, 2, capacity=1))
    assert d.waits["picky"] == "workers.min = 2 is more than the 1 usable slot(s) that can serve it"


def test_slots_still_held_by_exiting_workers_are_waited_for() -> None:
    d = plan(2, job("a", 2, 2), free=1)  # one slot's worker has not exited yet
    assert d.starts == [] and d.waits["a"] == "its 2 slot(s): 1 slot(s) of exiting workers"


# -- events ------------------------------------------------------------------------------------


def test_resize_events_carry_who_took_the_slots_and_the_cost() -> None:
    note = s.Note(How.SHRINK, 3, ("high",), 10.0)
    assert s.resumed_event(note, 1, {"steps_recomputed": 0, "seconds_since_failure": 1.3}) == (
        "job.shrunk", {"from": 3, "to": 1, "by": ["high"], "steps_lost": 0, "restart_s": 1.3},
    )
    grew = s.Note(How.GROW, 1, (), 10.0)
    assert s.resumed_event(grew, 3, {"steps_recomputed": 0, "seconds_since_failure": 1.1}) == (
        "job.grown", {"from": 1, "to": 3, "steps_lost": 0, "restart_s": 1.1},
    )
    assert s.resumed_event(grew, 1, {}) is None
    pre = s.Note(How.PREEMPT, 2, ("high",), 10.0)
    assert s.preempted_event(pre, 11.25, 40, 40, "1 free slot(s)") == {"by": ["high"], "from": 2, "step": 40, "steps_lost": 0, "stop_s": 1.25}


def test_a_job_requeued_by_no_job_says_why_in_cause() -> None:
    """A node that left it (a drain, its owner) below its minimum: the node, as job.shrunk says it.
    A job stopped to grow whose slots went to others meanwhile: what it now waits for."""
    left = s.Note(How.SHRINK, 2, (), 10.0, cause="node b yields to its owner (on battery)")
    assert s.preempted_event(left, 10.5, 41, 40, "2 free slot(s) (workers.min)") == {
        "by": [], "from": 2, "cause": "node b yields to its owner (on battery)", "step": 40, "steps_lost": 1, "stop_s": 0.5,
    }
    grew = s.Note(How.GROW, 1, (), 10.0)
    assert s.preempted_event(grew, 10.5, 40, 40, "2 free slot(s) (workers.min); held by h (2, priority 3)")["cause"] == "2 free slot(s) (workers.min); held by h (2, priority 3)"


def test_many_jobs_plan_quickly_enough_to_run_every_round() -> None:
    jobs = [job(f"j{k}", 1 + k % 4, 8, p=k % 3, at=float(k), phase=RUNNING if k < 50 else WAITING, held=2 if k < 50 else 0) for k in range(500)]
    d = plan(1000, *jobs)
    assert sum(d.targets.values()) <= 1000 and len(d.order) == 500
