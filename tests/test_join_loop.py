"""Joins and freezes, many in a row, on a real local pool with warm trainers: each one completes.

Once, a node that joined never took part (its warm trainer's readiness was lost, and with it the
answer the growth waited for) and a frozen trainer took 33 s, then more than a minute, to be
replaced. Each cycle here: a new dpd starts and joins the running job (the growth waits for its
warm trainer, then the group restarts one wider); the trainers of n0, n1 and the new node are frozen
with SIGSTOP in turn (each time a new generation runs without the frozen process); the new dpd
stops (the group goes on without it). The issue asks for 50 joins and 50 freezes: a cycle takes
about 6-10 s on a busy 2-core machine (a dpd's start is most of it), so the default run takes 2
cycles, 2 joins and 6 freezes, within the suite's time; `DPOOL_JOIN_CYCLES=50 pytest
tests/test_join_loop.py` runs the issue's count (about 6 minutes here). Each join and each freeze must complete within
WITHIN_S, from the new dpd's registration and from the SIGSTOP to the first step of the generation
that completes it; a failure names the iteration and the events since it began.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import LocalPool, Processes, alive, wait_for
from jobs import write_job

from dpool.protocol import messages as m
from dpool.protocol.payloads import EventRow, JobStatus

pytestmark = pytest.mark.slow

JOINS = int(os.environ.get("DPOOL_JOIN_CYCLES", "2"))  # cycles: a join, three freezes, a leave
WITHIN_S = 3.0  # each join and each freeze completes within this
STALLED_S = 60.0  # an iteration not complete by then is not waited for any longer
START_S = 60.0  # a dpd's start (Python and MLX imports on a busy machine): not what is measured


class EventLog:
    """The job's events, read incrementally (the paging cursor)."""

    def __init__(self, pool: LocalPool, job: str) -> None:
        self.pool, self.job, self.after = pool, job, 0
        self.rows: list[EventRow] = []

    def poll(self) -> list[EventRow]:
        try:
            while True:
                reply = self.pool.call(m.Events(job=self.job, after=self.after), m.EventsReply)
                self.rows.extend(reply.events)
                self.after = reply.cursor
                if not reply.more:
                    return self.rows
        except TimeoutError:
            return self.rows  # the coordinator is busy: the next poll reads on

    def since(self, mark: int) -> list[EventRow]:
        """The events read after position `mark` (a length of `poll()` taken before)."""
        return self.poll()[mark:]


class Iteration:
    """One join, freeze or leave: waits for its events; a failure says which and what happened.

    Its events are those the log reads after it began (a position in the log, not a time): the
    coordinator stamps events with its own steady clock, which a step of the system clock while it
    runs sets apart from this process's (0.94 s, once, on this machine), and an event from before
    the iteration then passed for one after it."""

    def __init__(self, log: EventLog, what: str) -> None:
        self.log, self.what = log, what
        self.mark, self.t0 = len(log.poll()), time.monotonic()

    def events(self) -> list[EventRow]:
        return self.log.since(self.mark)

    def fail(self, why: str) -> None:
        seen = self.events()
        first = seen[0].t if seen else 0.0
        rows = [(round(e.t - first, 2), e.kind, e.fields) for e in seen]
        pytest.fail(f"{self.what}: {why}; events since it began (seconds after the first, kind, fields): {rows}")

    def wait(self, what: str, match: Callable[[EventRow], bool], timeout: float = STALLED_S) -> tuple[EventRow, float]:
        """The first event since the iteration began that matches, and when it was read (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((e for e in self.events() if match(e)), None)
            if found is not None:
                return found, time.monotonic()
            time.sleep(0.05)
        self.fail(f"no {what} within {timeout:.0f} s")
        raise AssertionError  # pytest.fail raised already

    def within(self, took: float, what: str) -> float:
        if took > WITHIN_S:
            self.fail(f"{what} took {took:.2f} s (at most {WITHIN_S} s)")
        return took


def running(pool: LocalPool, job: str, world: int, after: int) -> JobStatus:
    """The job running with `world` workers, in a generation after `after` that has stepped."""
    return pool.wait_status(
        job, f"job {job} running with {world} workers after generation {after}",
        lambda s: s.state == "running" and s.world_size == world and s.generation > after and all(w.pid for w in s.workers),
        timeout=STALLED_S, every=0.05,
    )


def freeze(pool: LocalPool, log: EventLog, job: str, node: str, world: int, label: str, generation: int) -> tuple[int, float]:
    """SIGSTOP the trainer `node` runs for the job; its generation and the time to the first step of
    the next one (which must not be that process)."""
    status = running(pool, job, world, generation - 1)
    (pid,) = [w.pid for w in status.workers if w.node == node and w.pid]
    it = Iteration(log, f"{label}: freeze of {node}'s trainer (pid {pid}, generation {status.generation})")
    os.kill(pid, signal.SIGSTOP)
    # Its peers' "connection lost" exits may reach the coordinator before its own (killed by its
    # dpd): the restart they start is the frozen trainer's replacement all the same.
    resumed, read_at = it.wait(f"a generation after {status.generation} stepping", lambda e: e.kind == "group.resumed" and int(e.fields["generation"]) > status.generation)
    # From the SIGSTOP to the step as this process read it (the read's delay included: at most
    # an events poll late, and never early).
    took = it.within(read_at - it.t0, "the frozen trainer's replacement")
    try:
        wait_for(f"the frozen trainer {pid} gone", lambda: not alive(pid), 10)
    except TimeoutError:
        it.fail(f"the frozen trainer {pid} is still there after the recovery")
    return int(resumed.fields["generation"]), took


def join(pool: LocalPool, log: EventLog, name: str, label: str) -> tuple[int, float]:
    """Start dpd `name`: the generation that takes it in, and the time from its registration to
    that generation's first step. The growth must have waited for its warm trainer."""
    it = Iteration(log, f"{label}: join of {name}")
    pool.start_daemon(name)
    joined, _ = it.wait(f"{name} registered", lambda e: e.kind == "node.joined" and e.fields.get("node") == name, START_S)
    starting, _ = it.wait(f"a generation including {name}", lambda e: e.kind == "group.starting" and name in e.fields.get("nodes", []))
    generation = starting.fields["generation"]
    resumed, _ = it.wait(f"generation {generation} stepping", lambda e: e.kind == "group.resumed" and e.fields.get("generation") == generation)
    took = it.within(resumed.t - joined.t, f"{name}'s join")  # both on the coordinator's clock
    warmed = [e.fields for e in it.events() if e.kind == "group.warmed" and e.fields.get("node") == name]
    if not warmed or "error" in warmed[0]:
        it.fail(f"{name} was taken in without its warm trainer ready: {warmed}")
    return int(generation), took


def leave(pool: LocalPool, log: EventLog, name: str, label: str, generation: int) -> int:
    """Stop dpd `name` (SIGTERM: it stops its trainer): the generation that goes on without it."""
    it = Iteration(log, f"{label}: {name} stops")
    pool.daemons[name].proc.terminate()
    pool.daemons[name].proc.wait(timeout=STALLED_S)
    back, _ = it.wait("a generation without it stepping", lambda e: e.kind == "group.resumed" and int(e.fields["generation"]) > generation)
    return int(back.fields["generation"])


def test_joins_and_freezes_in_a_row_each_complete(processes: Processes, tmp_path: Path) -> None:
    # One token cache for every node: a joining node's warm trainer builds the model, not the data
    # set again (that is work, not a hand-off, and on a new machine it is paid before it joins).
    pool = LocalPool(processes, tmp_path, warm=True, env={"DPOOL_CACHE_DIR": str(tmp_path / "tokens")}).start(1, 1)
    job = pool.submit(write_job(
        tmp_path, "loop", workers={"min": 1, "max": 3}, train={"steps": 1_000_000, "global_batch": 6},
        eval={"every_steps": 1_000_000, "sample_every_steps": 1_000_000}, recovery={"max_restarts": 1000},
    ))
    log = EventLog(pool, job)
    joins: list[float] = []
    freezes: list[float] = []
    try:
        generation = running(pool, job, 2, 0).generation
        for k in range(JOINS):
            name = f"j{k}"
            generation, took = join(pool, log, name, f"cycle {k}")
            joins.append(took)
            for node in ("n0", "n1", name):
                generation, took = freeze(pool, log, job, node, 3, f"cycle {k}", generation)
                freezes.append(took)
            generation = leave(pool, log, name, f"cycle {k}", generation)
    finally:
        print(f"joins: {len(joins)}, slowest {max(joins, default=0):.2f} s; freezes: {len(freezes)}, slowest {max(freezes, default=0):.2f} s")
        pool.stop()  # and the state it kept in RAM
    assert len(joins) == JOINS and len(freezes) == 3 * JOINS
