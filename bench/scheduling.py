"""Sharing the pool, simulated: the scheduler (daemon/scheduler.py) against the FIFO admission the
pool had before it, on the same synthetic trace.

    python bench/scheduling.py [--jobs 200] [--nodes 8] [--hours 24] [--seeds 1,2,3,4,5] [--load 0.9]
                               [--restart-s 1.3] [--stop-s 0.5] [--interval 60] [--json FILE]

The trace: `--jobs` jobs arrive over `--hours` as a Poisson process on `--nodes` one-slot nodes, a
mix of sizes, lengths and priorities (below), their work scaled so that it would keep the pool
`--load` busy. A job's work is in slot-seconds; on n slots it progresses at n^0.9 of one slot's
rate (data parallelism is not free: the all_sum's share grows with the ring). Every group start
(the first, and each resize) costs `--restart-s` during which the job's slots are held and compute
nothing: 1.3 s is what a planned restart costs in a real pool (bench/recovery.py, BENCHMARKS.md:
a drained or joined node's group back at its first step in 1.29-1.34 s). A resize is asked at a
step boundary: the group goes on computing for `--stop-s`, then frees its slots.

| kind | share | priority | workers | work (one slot), before scaling |
| --- | --- | --- | --- | --- |
| urgent (an evaluation, a quick LoRA) | 10% | 10 | 1-2 | 1-10 min, uniform |
| small | 30% | 0 | 1-2 | lognormal, median 15 min |
| medium | 30% | 0 or 5 (one in four) | 1-4, or 2-4 | lognormal, median 1 h |
| large | 20% | 0 | 2-8, or 4-8 | lognormal, median 4 h |
| rigid | 10% | 0 | 2-2, or 4-4 | lognormal, median 2 h |

Policies, each simulated from the same trace:
- fifo: the pool before sharing (daemon/pool.py at 6b27946): waiting jobs in submission order take
  min(workers.max, free) slots while their workers.min fits; the first one that does not fit (and
  could fit the pool) blocks every job behind it; when nothing is blocked, the earliest running job
  below its workers.max grows into the free slots (one growth a round, at most once a generation).
- shared: `scheduler.plan` every round, its starts and resizes carried out as the pool does.

`--live N` measures instead, on real dpds (three one-slot daemons on this machine, warm trainers
on, a ~0.8M-parameter GPT as in bench/recovery.py), N times each: a priority-5 job submitted to an
idle pool (the baseline: how long a new job takes to start at all), then the same job submitted
while a 1-3 worker job of priority 0 holds all three slots: when it is given its slots, when its
group is up, the running job's pause to shrink and its steps lost, and once the priority job ends,
how soon the other grows back and its pause. Medians, with each trial's figure.

Printed per seed and as the mean over seeds: average and p99 completion time (arrival to end),
makespan (first arrival to last end), utilization while any job waits (the share of slot-time that
computes: held slots that restart do not), resizes per job, and the wait of the priority-10 jobs
(arrival to computing). Goals (issue 22): average completion at least 30% below fifo, utilization
at least 90% while jobs wait, high-priority wait under 5 s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpool.daemon import scheduler as sched

SCALING = 0.9  # throughput on n slots: n ** SCALING of one slot's
URGENT = 10


@dataclass(slots=True)
class SimJob:
    id: str
    arrival: float
    priority: int
    min: int
    max: int
    work: float  # slot-seconds at one slot's rate
    done: float = 0.0
    slots: int = 0  # held
    compute_at: float = math.inf  # holds slots, computes from then on
    stop_at: float | None = None  # stopping: frees its slots then
    started_at: float | None = None  # first admission
    computing_at: float | None = None  # first compute
    resized_at: float | None = None
    finished: float | None = None
    resizes: dict[str, int] = field(default_factory=dict)  # how -> count
    grown_gen: bool = False  # fifo: a growth was asked of this generation

    @property
    def waiting(self) -> bool:
        return self.finished is None and self.slots == 0

    def computing(self, now: float) -> bool:
        return self.slots > 0 and now >= self.compute_at and self.finished is None

    def rate(self) -> float:
        return self.slots**SCALING


def trace(seed: int, jobs: int, nodes: int, hours: float, load: float) -> list[SimJob]:
    rng = random.Random(seed)
    span = hours * 3600
    t, out = 0.0, []
    for k in range(jobs):
        t += rng.expovariate(jobs / span)
        r = rng.random()
        if r < 0.10:
            p, lo, hi, work = URGENT, 1, 2, rng.uniform(60, 600)
        elif r < 0.40:
            p, lo, hi, work = 0, 1, 2, rng.lognormvariate(math.log(900), 1.0)
        elif r < 0.70:
            p, lo, hi, work = 5 if rng.random() < 0.25 else 0, rng.choice((1, 2)), 4, rng.lognormvariate(math.log(3600), 1.0)
        elif r < 0.90:
            p, lo, hi, work = 0, rng.choice((2, 4)), 8, rng.lognormvariate(math.log(14400), 1.0)
        else:
            n = rng.choice((2, 4))
            p, lo, hi, work = 0, n, n, rng.lognormvariate(math.log(7200), 1.0)
        out.append(SimJob(id=f"j{k:03d}", arrival=t, priority=p, min=min(lo, nodes), max=min(hi, nodes), work=work))
    # Scale the non-urgent work so that all of it would keep the pool `load` busy over the span.
    urgent = sum(j.work for j in out if j.priority == URGENT)
    rest = sum(j.work for j in out if j.priority != URGENT)
    scale = max(0.0, load * nodes * span - urgent) / rest
    for j in out:
        if j.priority != URGENT:
            j.work *= scale
    return out


# -- the policies: each returns (starts [(job, slots)], stops [(job, how)]) for this round --------


Round = tuple[list[tuple[SimJob, int]], list[tuple[SimJob, str]]]


def fifo(now: float, jobs: list[SimJob], nodes: int, restart_s: float) -> Round:
    free = nodes - sum(j.slots for j in jobs)
    starts = []
    blocked = False
    for j in sorted((j for j in jobs if j.waiting), key=lambda j: j.arrival):
        if free >= j.min:
            n = min(j.max, free)
            starts.append((j, n))
            free -= n
        elif j.min <= nodes:
            blocked = True  # it waits for busy slots: nothing behind it jumps the queue
            break
    if blocked or free == 0:
        return starts, []
    for j in sorted((j for j in jobs if j.computing(now) and j.stop_at is None), key=lambda j: j.arrival):
        if j.slots < j.max and not j.grown_gen and now >= j.compute_at + 0.1:  # a step of this generation done
            j.grown_gen = True
            return starts, [(j, "grow")]  # the slots go to one job
    return starts, []


def shared(policy: sched.Policy) -> Callable[..., Round]:
    def round_(now: float, jobs: list[SimJob], nodes: int, restart_s: float) -> Round:
        views = []
        for j in jobs:
            if j.waiting:
                phase = sched.Phase.WAITING
            elif j.stop_at is None and j.computing(now):
                phase = sched.Phase.RUNNING
            else:
                phase = sched.Phase.MOVING
            views.append(sched.JobView(
                id=j.id, priority=j.priority, min=j.min, max=j.max, submitted_at=j.arrival, phase=phase, held=j.slots,
                resizable=phase is sched.Phase.RUNNING and j.work - j.done > 0.1 * j.rate(), started_at=j.started_at, resized_at=j.resized_at,
            ))
        d = sched.plan(now, nodes, nodes - sum(j.slots for j in jobs), views, policy)
        by_id = {j.id: j for j in jobs}
        return [(by_id[s.job], s.slots) for s in d.starts], [(by_id[r.job], str(r.how)) for r in d.resizes]

    return round_


# -- the simulation ------------------------------------------------------------------------------


@dataclass(slots=True)
class Stats:
    wait_time: float = 0.0  # time during which some job waited
    computing_while_waiting: float = 0.0  # slot-seconds computing during that time
    samples: list[float] = field(default_factory=list)


def simulate(jobs: list[SimJob], nodes: int, policy: Callable[..., Any], restart_s: float, stop_s: float, interval: float) -> dict[str, Any]:
    pending = sorted(jobs, key=lambda j: j.arrival)
    live: list[SimJob] = []
    done: list[SimJob] = []
    now, st = 0.0, Stats()
    i = 0
    rounds = 0
    while i < len(pending) or live:
        # Next event: an arrival, a group computing, a stop reached, a job done, a damping interval over.
        nxt = pending[i].arrival if i < len(pending) else math.inf
        for j in live:
            if j.slots and j.compute_at > now:
                nxt = min(nxt, j.compute_at)
            if j.stop_at is not None:
                nxt = min(nxt, j.stop_at)
            if j.computing(now):
                nxt = min(nxt, now + (j.work - j.done) / j.rate())
            if j.resized_at is not None and j.resized_at + interval > now:
                nxt = min(nxt, j.resized_at + interval)
        assert nxt > now or nxt == now, (nxt, now)
        # Advance: progress, and the utilization while jobs wait.
        dt = nxt - now
        if dt > 0:
            if any(j.waiting for j in live):
                st.wait_time += dt
                st.computing_while_waiting += dt * sum(j.slots for j in live if j.computing(now))
            for j in live:
                if j.computing(now):
                    j.done = min(j.work, j.done + dt * j.rate())
        now = nxt
        while i < len(pending) and pending[i].arrival <= now:
            live.append(pending[i])
            i += 1
        for j in list(live):
            if j.slots and j.computing(now) and j.done >= j.work - 1e-9:
                j.finished, j.slots, j.stop_at = now, 0, None
                live.remove(j)
                done.append(j)
            elif j.stop_at is not None and now >= j.stop_at:
                j.slots, j.stop_at, j.compute_at = 0, None, math.inf  # stopped: waits for admission again
        # A round of the policy (the pool runs one per batch of messages and per tick).
        rounds += 1
        starts, stops = policy(now, live, nodes, restart_s)
        for j, n in starts:
            j.slots, j.compute_at, j.resized_at, j.grown_gen = n, now + restart_s, now, False
            if j.started_at is None:
                j.started_at = now
                j.computing_at = now + restart_s
        for j, how in stops:
            j.stop_at, j.resized_at = now + stop_s, now
            j.resizes[how] = j.resizes.get(how, 0) + 1
        assert sum(j.slots for j in live) <= nodes, f"{policy} holds more than {nodes} slots at {now}"
    completion = sorted(j.finished - j.arrival for j in done)  # type: ignore[operator]
    urgent = [j.computing_at - j.arrival for j in done if j.priority == URGENT]  # type: ignore[operator]
    return {
        "jobs": len(done),
        "avg_completion_s": statistics.fmean(completion),
        "p99_completion_s": completion[min(len(completion) - 1, math.ceil(0.99 * len(completion)) - 1)],
        "makespan_s": max(j.finished for j in done) - min(j.arrival for j in done),  # type: ignore[type-var]
        "utilization_while_waiting": st.computing_while_waiting / (nodes * st.wait_time) if st.wait_time else None,
        "waiting_share": st.wait_time / (max(j.finished for j in done) - min(j.arrival for j in done)),  # type: ignore[type-var]
        "resizes_per_job": sum(sum(j.resizes.values()) for j in done) / len(done),
        **{f"{how}s_per_job": sum(j.resizes.get(how, 0) for j in done) / len(done) for how in ("shrink", "grow", "preempt")},
        "urgent_wait_avg_s": statistics.fmean(urgent) if urgent else None,
        "urgent_wait_max_s": max(urgent) if urgent else None,
        "rounds": rounds,
    }


def fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s" and v >= 600:
        return f"{v / 3600:.2f} h"
    if unit == "s":
        return f"{v:.2f} s"
    if unit == "%":
        return f"{100 * v:.1f}%"
    return f"{v:.2f}"


ROWS = (
    ("average completion", "avg_completion_s", "s"),
    ("p99 completion", "p99_completion_s", "s"),
    ("makespan", "makespan_s", "s"),
    ("utilization while jobs wait", "utilization_while_waiting", "%"),
    ("time some job waits", "waiting_share", "%"),
    ("resizes per job", "resizes_per_job", ""),
    ("  of which shrinks", "shrinks_per_job", ""),
    ("  of which growths", "grows_per_job", ""),
    ("  of which preemptions", "preempts_per_job", ""),
    ("priority-10 wait, mean (arrival to computing)", "urgent_wait_avg_s", "s"),
    ("priority-10 wait, max", "urgent_wait_max_s", "s"),
)


# -- live: the same decisions on real dpds ---------------------------------------------------------


def live(trials: int, root: Path) -> dict[str, list[float]]:
    from dpool.client.localpool import LocalPool, wait_for
    from dpool.protocol import messages as m
    from dpool.protocol.jobspec import parse_job

    def spec(name: str, lo: int, hi: int, steps: int, priority: int = 0) -> Any:
        return parse_job({
            "name": name, "priority": priority, "workers": {"min": lo, "max": hi},
            "model": {"layers": 4, "dim": 128, "heads": 4, "context": 64},
            "train": {"steps": steps, "global_batch": 12, "warmup_steps": 10, "log_every_steps": 1},
            "eval": {"every_steps": 1_000_000, "batches": 1, "sample_every_steps": 1_000_000},
        }, source="bench/scheduling.py")

    def submit(pool: LocalPool, s: Any) -> str:
        return pool.call(m.Submit(job=s.to_dict(), source="bench"), m.Submitted).job_id

    def events(pool: LocalPool, job: str) -> list[Any]:
        return pool.call(m.Events(job=job), m.EventsReply).events

    def event(pool: LocalPool, job: str, kind: str, timeout: float = 120.0, where: Callable[[Any], bool] = lambda e: True) -> Any:
        return wait_for(f"{job}: {kind}", lambda: next((e for e in events(pool, job) if e.kind == kind and where(e)), None), timeout, every=0.1)

    def ended(pool: LocalPool, job: str) -> Any:
        return wait_for(f"{job} to end", lambda: (st := pool.status(job)) is not None and st.state in ("succeeded", "failed", "cancelled") and st, 600.0, every=0.2)

    out: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        out.setdefault(key, []).append(round(v, 3))

    pool = LocalPool(root)
    try:
        pool.start(1, 1, 1)
        for trial in range(trials):
            alone = submit(pool, spec(f"alone-{trial}", 1, 2, 60, priority=5))
            st = ended(pool, alone)
            add("idle_slots_s", event(pool, alone, "group.starting").t - st.submitted)
            add("idle_up_s", event(pool, alone, "group.started").t - st.submitted)
            low = submit(pool, spec(f"low-{trial}", 1, 3, 1_000_000))
            wait_for("low on 3 slots, 30 steps in", lambda job=low: (s := pool.status(job)) is not None and s.world_size == 3 and s.step >= 30 and s, 300.0, every=0.2)
            high = submit(pool, spec(f"high-{trial}", 1, 2, 60, priority=5))
            hs = ended(pool, high)
            assert hs.state == "succeeded", hs
            add("slots_s", event(pool, high, "group.starting").t - hs.submitted)
            add("up_s", event(pool, high, "group.started").t - hs.submitted)
            shrunk = event(pool, low, "job.shrunk")
            add("shrink_pause_s", shrunk.fields["restart_s"])
            add("shrink_steps_lost", shrunk.fields["steps_lost"])
            grown = event(pool, low, "job.grown")
            ask = next(e for e in events(pool, low) if e.kind == "group.stopped" and "growing" in str(e.fields.get("reason")))
            add("grow_asked_s", ask.t - hs.finished)
            add("grown_s", grown.t - hs.finished)
            add("grow_pause_s", grown.fields["restart_s"])
            add("grow_steps_lost", grown.fields["steps_lost"])
            pool.call(m.Cancel(job=low), m.CancelReply)
            ended(pool, low)
    finally:
        pool.stop()
    return out


LIVE_ROWS = (
    ("idle pool: submitted -> given its slots", "idle_slots_s"),
    ("idle pool: submitted -> its group up", "idle_up_s"),
    ("full pool: submitted -> given its slots", "slots_s"),
    ("full pool: submitted -> its group up", "up_s"),
    ("running job's pause to shrink 3 -> 1", "shrink_pause_s"),
    ("  steps lost", "shrink_steps_lost"),
    ("priority job ended -> growth asked", "grow_asked_s"),
    ("priority job ended -> running job back on 3", "grown_s"),
    ("running job's pause to grow 1 -> 3", "grow_pause_s"),
    ("  steps lost", "grow_steps_lost"),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--load", type=float, default=0.9, help="the trace's work over the pool's capacity for the span")
    ap.add_argument("--restart-s", type=float, default=1.3, help="a group start's pause (bench/recovery.py's planned restart)")
    ap.add_argument("--stop-s", type=float, default=0.5, help="from a resize's request to its group's exit (the next step boundary)")
    ap.add_argument("--interval", type=float, default=sched.RESIZE_INTERVAL_S, help="the scheduler's damping among equals")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--live", type=int, metavar="TRIALS", help="measure a preemption by shrinking on real dpds instead (module docstring)")
    a = ap.parse_args(argv)
    if a.live:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dpool-bench-sched-") as tmp:
            got = live(a.live, Path(tmp))
        width = max(len(r[0]) for r in LIVE_ROWS)
        for label, key in LIVE_ROWS:
            vals = got.get(key, [])
            print(f"{label:{width}}   {statistics.median(vals) if vals else '-':>8}   ({', '.join(map(str, vals))})")
        if a.json:
            a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "live": got}, indent=2))
        return 0
    seeds = [int(s) for s in a.seeds.split(",")]
    results: dict[str, list[dict[str, Any]]] = {"fifo": [], "shared": []}
    policies = {"fifo": fifo, "shared": shared(sched.Policy(resize_interval_s=a.interval))}
    for seed in seeds:
        for name, policy in policies.items():
            jobs = trace(seed, a.jobs, a.nodes, a.hours, a.load)
            results[name].append(simulate(jobs, a.nodes, policy, a.restart_s, a.stop_s, a.interval))
    print(f"{a.jobs} jobs over {a.hours:g} h on {a.nodes} nodes, load {a.load:g}, restart {a.restart_s:g} s, stop {a.stop_s:g} s, "
          f"damping {a.interval:g} s; seeds {a.seeds}")
    width = max(len(r[0]) for r in ROWS)
    print(f"{'':{width}}   {'fifo':>10}   {'shared':>10}   shared / fifo   (per seed: fifo | shared)")
    for label, key, unit in ROWS:
        f = [r[key] for r in results["fifo"] if r[key] is not None]
        s = [r[key] for r in results["shared"] if r[key] is not None]
        fm, sm = (statistics.fmean(f) if f else None), (statistics.fmean(s) if s else None)
        ratio = f"{sm / fm:.3f}" if fm and sm is not None else "-"
        per = "; ".join(f"{fmt(x, unit)} | {fmt(y, unit)}" for x, y in zip([r[key] for r in results["fifo"]], [r[key] for r in results["shared"]], strict=True))
        print(f"{label:{width}}   {fmt(fm, unit):>10}   {fmt(sm, unit):>10}   {ratio:>13}   ({per})")
    f_avg = statistics.fmean(r["avg_completion_s"] for r in results["fifo"])
    s_avg = statistics.fmean(r["avg_completion_s"] for r in results["shared"])
    util = min(r["utilization_while_waiting"] for r in results["shared"] if r["utilization_while_waiting"] is not None)
    worst = max(r["urgent_wait_max_s"] for r in results["shared"] if r["urgent_wait_max_s"] is not None)
    goals = [
        (f"average completion {100 * (1 - s_avg / f_avg):.0f}% below fifo (goal >= 30%)", s_avg <= 0.7 * f_avg),
        (f"utilization while jobs wait >= {100 * util:.1f}% in every seed (goal >= 90%)", util >= 0.9),
        (f"priority-10 wait at most {worst:.2f} s (goal < 5 s)", worst < 5.0),
    ]
    for text, ok in goals:
        print(("ok   " if ok else "MISS ") + text)
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "results": results}, indent=2))
    return 0 if all(ok for _, ok in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
