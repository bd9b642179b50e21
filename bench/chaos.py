"""Chaos: a 3-worker job under a random fault about every 20 s, against its fault-free twin (issue 10).

    python bench/chaos.py [--steps 400] [--every 20] [--seed 1] [--back 8] [--spares 2] [--twins 2] [--json FILE] [--out DIR]

A local pool of three one-slot daemons (n0 serves) trains one job file three times, one run after
the other: without faults (the twin), under chaos, and without faults again (`--twins 1`: only the
first). The twin's time is the mean of its two runs: this machine's speed drifts by a quarter
within minutes (other work on its host), and a twin run only before would put all of that drift
on one side of the ratio. The job is bench/recovery.py's GPT (4
layers, dim 128, 12 sequences of 64 tokens a step) at the defaults but for what this needs:
`workers` 1..3, `log_every_steps = 1` (a loss per step), `max_restarts = 1000` (the default 10 would
fail a long chaos run), and `warmup_steps` at most half the steps (a short run). Checkpoints and
evaluation are at their defaults.

From the chaos run's first step, a fault is drawn from a seeded RNG (`--seed`) every `--every` x
U(0.5, 1.5) seconds after the previous one, and injected once the job is training (state running,
and a step done since its last interruption), never in the last 10 steps:

- kill:      SIGKILL of a trainer of the group;
- freeze:    SIGSTOP of a trainer of the group (the pool must notice: nothing exits);
- lost_node: SIGKILL of a non-serving dpd that runs a rank; the same dpd is started again `--back`
             seconds later (same name and state dir), so the capacity comes back;
- join:      a new one-slot dpd (s1, s2, ... at most `--spares`): spare capacity, taken into the
             group only while it is short of workers.max (a node lost or drained);
- drain:     `dpctl drain` of a node that runs a rank (the Drain request dpctl sends), undrained
             `--back` seconds later.
A node is lost or drained only while the group has at least 2 workers, so at least one is left.
A drawn fault that cannot be injected then (no spare left to start, a group of one) falls back to
the next kind in the list above, so the sequence of draws stays the seed's alone.

Reported, from the coordinator's records (all on one clock):
- goodput: the job's useful tokens per second under chaos over those of the twin. Useful tokens:
  the job's final curve, steps 1..N, each step's global tokens counted once (its last metrics row);
  the time: from `submitted` to `finished` of the job's status row (the coordinator's clock), the
  same span for both runs. Since both runs train the same useful tokens, this is the twin's wall
  time over the chaos run's. Goal: >= 90%.
- the faults by kind, each with the time from the fault to the first step of the last generation
  it caused (its last `group.resumed`), the time training was paused (to each `group.resumed`
  from the fault itself for kill, freeze and lost_node; from the first interrupting event,
  `group.stopped`, `group.growing`, ..., for a drain or a node given back), and the
  steps recomputed (`group.resumed`'s `steps_recomputed`), summed per fault and in all; each
  `group.resumed` is put down to the last fault (or return of capacity) before the interruption
  that it ends.
- the largest difference between the two runs' loss curves, per step (the last metrics row of each
  step; the coordinator's `metrics`). Goal: <= 1e-3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dpool.client.jobtimes import JobTimes
from dpool.client.localpool import LocalPool, LocalPoolError, wait_for
from dpool.client.rpc import pages
from dpool.protocol import messages as m
from dpool.protocol.jobspec import JobSpec, parse_job
from dpool.protocol.payloads import EventRow, JobStatus, TrainRow

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import recovery  # a sibling script: the event log, the pid lookup, the table
finally:
    sys.path.remove(str(HERE))  # bench/mlx_lm.py would shadow mlx-lm itself

KINDS = ("kill", "freeze", "lost_node", "join", "drain")
STOPS = ("kill", "freeze", "lost_node")  # faults that stop training at once (its peers wait in all_sum)
INTERRUPTS = ("worker.failed", "group.stopped", "group.growing", "group.aborted", "group.starting")
GOODPUT_GOAL = 0.90
LOSS_GOAL = 1e-3
END_MARGIN_STEPS = 10  # no fault this close to the end: the job would be over before it told anything
STUCK_S = 180.0  # the job not back to training this long after an interruption: the bench gives up
POLL_S = 0.1


def chaos_job(name: str, steps: int) -> JobSpec:
    """The job of both runs: bench/recovery.py's GPT at the default settings, but what this needs."""
    return parse_job({
        "name": name,
        "workers": {"min": 1, "max": 3},
        "model": {"layers": 4, "dim": 128, "heads": 4, "context": 64},
        "train": {"steps": steps, "global_batch": 12, "log_every_steps": 1, "warmup_steps": min(100, steps // 2)},
        "recovery": {"max_restarts": 1000},
    }, source="bench/chaos.py")


# -- the pure parts: the draws, the curves, the goodput, the attribution ------------------------------


@dataclass(frozen=True, slots=True)
class Draw:
    """One fault as the RNG drew it: how long after the previous one, which kind, and where in the
    list of the targets eligible when it fires (a fraction)."""

    gap_s: float
    kind: str
    pick: float


def draws(seed: int, every: float) -> Iterator[Draw]:
    """The faults of a seed, without end: the same seed, the same sequence."""
    rng = random.Random(seed)
    while True:
        yield Draw(round(every * rng.uniform(0.5, 1.5), 3), rng.choice(KINDS), rng.random())


def fallback(kind: str, eligible: Iterable[str]) -> str | None:
    """The drawn kind if it can be injected now, else the next one in KINDS (cyclically) that can."""
    ok = set(eligible)
    i = KINDS.index(kind)
    return next((k for k in KINDS[i:] + KINDS[:i] if k in ok), None)


def pick(items: Sequence[Any], fraction: float) -> Any:
    return items[min(len(items) - 1, int(fraction * len(items)))]


def final_curve(rows: Iterable[TrainRow | dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each step's last train row (a step computed again after a restart replaces the first)."""
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        d = r if isinstance(r, dict) else r.to_wire()
        if d.get("kind") == "train":
            out[int(d["step"])] = d
    return out


def loss_difference(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]]) -> tuple[float, int | None, list[int]]:
    """The largest |loss a - loss b| over the steps of both, the step where it is, and the steps
    only one curve has (a step missing from either is a defect in itself)."""
    diffs = {s: float("inf") if a[s]["loss"] is None or b[s]["loss"] is None else abs(a[s]["loss"] - b[s]["loss"]) for s in a.keys() & b.keys()}
    missing = sorted(a.keys() ^ b.keys())
    if not diffs:
        return 0.0, None, missing
    at = max(sorted(diffs), key=lambda s: diffs[s])
    return diffs[at], at, missing


def useful_tokens(curve: dict[int, dict[str, Any]]) -> int:
    return sum(int(r["tokens"]) for r in curve.values())


def goodput(tokens_chaos: int, wall_chaos: float, tokens_free: int, wall_free: float) -> float:
    """Useful tokens per second under chaos over those of the fault-free twin."""
    return (tokens_chaos / wall_chaos) / (tokens_free / wall_free)


@dataclass(slots=True)
class Action:
    """Something this bench did to the pool: a fault, or capacity given back (`restart`, `undrain`)."""

    t: float  # unix seconds, just before it was done
    kind: str
    target: str
    drawn: str = ""  # the kind drawn, when the fault fell back to another
    resumed: list[dict[str, Any]] = field(default_factory=list)  # the group.resumed events it caused

    @property
    def fault(self) -> bool:
        return self.kind in KINDS


def attribute(actions: list[Action], events: Sequence[EventRow], since: float) -> list[EventRow]:
    """Put each `group.resumed` down to the last action before the interruption it ends (the first
    interrupting event after the previous `group.resumed`, and after `since`: the job's first step,
    before which its first group started); returns those that no action precedes."""
    ordered = sorted(actions, key=lambda a: a.t)
    orphans: list[EventRow] = []
    began: float | None = None
    for e in events:
        if e.t < since:
            continue
        if e.kind in INTERRUPTS and began is None:
            began = e.t
        elif e.kind == "group.resumed":
            t = began if began is not None else e.t
            before = [a for a in ordered if a.t <= t + 0.05]
            if before:
                a = before[-1]
                # A fault stops training when it happens; a membership change only once the group stops.
                stopped = min(a.t, t) if a.kind in STOPS and not a.resumed else t
                a.resumed.append({"t": e.t, "paused_s": e.t - stopped, **e.fields})
            else:
                orphans.append(e)
            began = None
    return orphans


# -- the runs -----------------------------------------------------------------------------------


def metric_rows(pool: LocalPool, job: str) -> list[TrainRow]:
    return [r for page in pages(lambda after: pool.call(m.Metrics(job=job, after=after), m.MetricsReply)) for r in page.rows if r.kind == "train"]


def span(status: JobStatus, events: Sequence[EventRow]) -> tuple[float, float]:
    """(submitted, finished), unix seconds: the status row's, else from the events."""
    times = JobTimes().add(events)
    submitted = status.submitted if status.submitted is not None else times.submitted
    finished = status.finished if status.finished is not None else times.finished
    if submitted is None or finished is None:
        raise recovery.BenchError(f"job {status.id}: no submitted or finished time (status {status.submitted}, {status.finished})")
    return submitted, finished


def submit(pool: LocalPool, spec: JobSpec) -> str:
    return pool.call(m.Submit(job=spec.to_dict(), source="bench/chaos.py"), m.Submitted).job_id


def outcome(pool: LocalPool, job: str) -> dict[str, Any]:
    """A finished run: its status, events, final curve and time span."""
    status = pool.status(job)
    assert status is not None
    seen = recovery.events(pool, job)
    rows = metric_rows(pool, job)
    submitted, finished = span(status, seen)
    curve = final_curve(rows)
    return {
        "job": job, "state": status.state, "error": status.error, "wall_s": finished - submitted,
        "useful_tokens": useful_tokens(curve),
        "steps": len(curve), "curve": curve, "events": seen,
    }


def fault_free(pool: LocalPool, spec: JobSpec, timeout: float) -> dict[str, Any]:
    job = submit(pool, spec)
    wait_for(f"the fault-free run ({job}) to end", lambda: (s := pool.status(job)) and s.state in recovery.END_STATES, timeout, every=0.2)
    return outcome(pool, job)


class Chaos:
    """The chaos run: draws faults, injects them while the job trains, gives capacity back."""

    def __init__(self, pool: LocalPool, job: str, steps: int, args: argparse.Namespace) -> None:
        self.pool, self.job, self.steps, self.args = pool, job, steps, args
        self.log = recovery.EventLog(pool, job)
        self.seen = 0
        self.calm = False  # training: a step done since the last interruption
        self.actions: list[Action] = []
        self.later: list[tuple[float, str, str]] = []  # (unix time, "restart" | "undrain", node)
        self.frozen: list[int] = []
        self.spares = 0
        self.first_step: float | None = None
        self.unsettled_since: float | None = None

    def run(self, timeout: float) -> None:
        it = draws(self.args.seed, self.args.every)
        draw = next(it)
        fire_at = float("inf")
        deadline = time.monotonic() + timeout
        while True:
            s = self.pool.status(self.job)
            self.follow_events()
            if s is not None and s.state in recovery.END_STATES:
                return
            now = time.time()
            self.give_back(now)
            if self.first_step is None and s is not None and s.step >= 1:
                self.first_step, self.calm, fire_at = now, True, now + draw.gap_s
            if (self.calm and now >= fire_at and s is not None and s.state == "running" and s.workers
                    and s.step < self.steps - END_MARGIN_STEPS and self.inject(draw, s)):
                draw = next(it)
                fire_at = time.time() + draw.gap_s
            if self.unsettled_since is not None and time.time() - self.unsettled_since > STUCK_S:
                last = self.actions[-1] if self.actions else None
                raise recovery.BenchError(f"job {self.job} not back to training {STUCK_S:.0f} s after an interruption "
                                          f"(last action: {last.kind + ' ' + last.target if last else 'none'}; status {s})")
            if time.monotonic() > deadline:
                raise recovery.BenchError(f"the chaos run ({self.job}) did not end within {timeout:.0f} s (status {s})")
            time.sleep(POLL_S)

    def follow_events(self) -> None:
        rows = self.log.poll()
        for e in rows[self.seen:]:
            if self.first_step is None:
                continue
            if e.kind in INTERRUPTS:
                self.settle(False)
            elif e.kind == "group.resumed":
                self.settle(True)
        self.seen = len(rows)

    def settle(self, calm: bool) -> None:
        self.calm = calm
        self.unsettled_since = None if calm else (self.unsettled_since or time.time())

    def give_back(self, now: float) -> None:
        """Capacity taken by a lost node or a drain comes back `--back` seconds later."""
        for item in [x for x in self.later if x[0] <= now]:
            self.later.remove(item)
            _, kind, node = item
            t = time.time()
            if kind == "restart":
                self.pool.start_daemon(node)
            else:
                self.pool.call(m.Undrain(node=node), m.UndrainReply)
            self.actions.append(Action(t, kind, node))
            print(f"  {t - (self.first_step or t):7.1f} s  {kind} {node}", flush=True)

    def eligible(self, s: JobStatus) -> dict[str, list[str]]:
        """The targets of each kind now: trainers by node, dpds, nodes, spare names."""
        group = sorted({w.node for w in s.workers})
        away = {node for _, _, node in self.later}
        out = {"kill": group, "freeze": group}
        live = [n for n in group if n != "n0" and n in self.pool.daemons and self.pool.daemons[n].proc.poll() is None]
        out["lost_node"] = live if s.world_size >= 2 else []
        out["drain"] = [n for n in group if n not in away] if s.world_size >= 2 else []
        out["join"] = [f"s{self.spares + 1}"] if self.spares < self.args.spares else []
        return out

    def inject(self, draw: Draw, s: JobStatus) -> bool:
        """Inject the draw's fault (or its fallback); False when nothing can be injected right now."""
        targets = self.eligible(s)
        kind = fallback(draw.kind, [k for k, v in targets.items() if v])
        if kind is None:
            return False
        node = pick(targets[kind], draw.pick)
        t = time.time()
        if kind in ("kill", "freeze"):
            try:
                pid = recovery.trainer_pid(self.pool, self.job, node)
            except recovery.BenchError:
                return False  # the group is changing under us: try again at the next poll
            t = time.time()
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            if kind == "freeze":
                self.frozen.append(pid)
            target = f"{node} (trainer pid {pid})"
        elif kind == "lost_node":
            d = self.pool.daemons[node]
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            self.later.append((t + self.args.back, "restart", node))
            target = f"{node} (dpd pid {d.pid})"
        elif kind == "drain":
            self.pool.call(m.Drain(node=node), m.DrainReply)
            self.later.append((t + self.args.back, "undrain", node))
            target = node
        else:
            self.spares += 1
            self.pool.start_daemon(node)
            target = node
        if kind != "join":
            self.settle(False)
        self.actions.append(Action(t, kind, target, drawn=draw.kind if draw.kind != kind else ""))
        print(f"  {t - (self.first_step or t):7.1f} s  {kind} {target}" + (f" (drawn: {draw.kind})" if draw.kind != kind else "")
              + f"  [step {s.step}, {s.world_size} workers]", flush=True)
        return True

    def end_frozen(self) -> list[int]:
        """Frozen trainers the pool did not end (a finding), ended here: SIGKILL by pid."""
        left = [pid for pid in self.frozen if recovery.alive(pid)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return left


# -- the report ---------------------------------------------------------------------------------


def summarize(twins: list[dict[str, Any]], chaos: dict[str, Any], actions: list[Action], orphans: list[EventRow], first_step: float | None) -> tuple[str, dict[str, Any]]:
    free = twins[0] | {"wall_s": statistics.mean(t["wall_s"] for t in twins)}
    worst, at, missing = loss_difference(free["curve"], chaos["curve"])
    for later in twins[1:]:  # the twins must agree too
        w, a, m = loss_difference(free["curve"], later["curve"])
        worst, at, missing = max((worst, at, missing), (w, a, m), key=lambda x: x[0])
    gp = goodput(chaos["useful_tokens"], chaos["wall_s"], free["useful_tokens"], free["wall_s"])
    resumed = [e for e in chaos["events"] if e.kind == "group.resumed"]
    recomputed = sum(int(e.fields.get("steps_recomputed", 0)) for e in resumed)
    faults = [a for a in actions if a.fault]
    per_step = free["useful_tokens"] // max(1, free["steps"])
    lines = []
    rows = [
        ["wall time, submitted -> finished", f"{chaos['wall_s']:.1f} s",
         f"{free['wall_s']:.1f} s" + (" (mean of " + ", ".join(f"{t['wall_s']:.1f}" for t in twins) + ")" if len(twins) > 1 else ""), "", ""],
        ["useful tokens / s (steps 1..N, each once)", f"{chaos['useful_tokens'] / chaos['wall_s']:.0f}", f"{free['useful_tokens'] / free['wall_s']:.0f}", "", ""],
        ["**goodput** (chaos / fault-free)", f"**{100 * gp:.1f}%**", "100%", f"≥ {100 * GOODPUT_GOAL:.0f}%", "yes" if gp >= GOODPUT_GOAL else "**no**"],
        ["**largest loss difference** (per step)", f"**{worst:.2e}**" + (f" (step {at})" if at else ""), "", f"≤ {LOSS_GOAL:g}", "yes" if worst <= LOSS_GOAL and not missing else "**no**"],
        ["faults injected", str(len(faults)), "0", "", ""],
        ["steps recomputed (all group.resumed)", str(recomputed), str(sum(int(e.fields.get("steps_recomputed", 0)) for e in free["events"] if e.kind == "group.resumed")), "", ""],
        ["tokens recomputed (steps recomputed x tokens a step)", str(recomputed * per_step), "0", "", ""],
        ["final state, steps", f"{chaos['state']}, {chaos['steps']}", f"{free['state']}, {free['steps']}", "succeeded", "yes" if chaos["state"] == free["state"] == "succeeded" and not missing else "**no**"],
    ]
    lines += [recovery.markdown(["figure", "chaos", "fault-free", "goal", "met"], rows), ""]

    by_kind: list[list[Any]] = []
    doc_kinds: dict[str, Any] = {}
    for kind in (*KINDS, "restart", "undrain"):
        mine = [a for a in actions if a.kind == kind]
        if not mine:
            continue
        back = [a.resumed[-1]["t"] - a.t for a in mine if a.resumed]
        paused = [sum(r["paused_s"] for r in a.resumed) for a in mine if a.resumed]
        rec = [sum(int(r.get("steps_recomputed", 0)) for r in a.resumed) for a in mine]
        label = kind if kind in KINDS else f"({kind}: capacity back)"
        by_kind.append([label, len(mine), f"{len(back)} of {len(mine)}", f"{statistics.median(back):.2f}" if back else "-", f"{max(back):.2f}" if back else "-",
                        f"{statistics.median(paused):.2f}" if paused else "-", sum(rec), max(rec)])
        doc_kinds[kind] = {"count": len(mine), "back_s": back, "paused_s": paused, "recomputed": rec}
    lines += [recovery.markdown(["action", "count", "caused a new generation", "back to training, median s", "max s",
                                 "training paused, median s", "steps recomputed, sum", "max per action"], by_kind), ""]

    each = []
    for i, a in enumerate(actions, 1):
        last = a.resumed[-1] if a.resumed else None
        note = "spare: the group was full" if a.kind == "join" and not a.resumed else ""
        each.append([i, f"{a.t - (first_step or a.t):.1f}", a.kind + (f" (drawn {a.drawn})" if a.drawn else ""), a.target,
                     f"{last['t'] - a.t:.2f}" if last else "-", ", ".join(f"{r['paused_s']:.2f}" for r in a.resumed) or "-",
                     ", ".join(str(r.get("steps_recomputed")) for r in a.resumed) or "-", ", ".join(str(r.get("cause")) for r in a.resumed) or note or "-"])
    lines += [recovery.markdown(["#", "t after first step (s)", "action", "target", "back to training after (s)", "training paused (s), per generation",
                                 "steps recomputed", "cause"], each)]
    if orphans:
        lines += ["", f"group.resumed events no action of this bench preceded: {[asdict_event(e) for e in orphans]}"]
    doc = {
        "goodput": gp, "loss_difference": worst, "loss_difference_step": at, "steps_missing": missing,
        "steps_recomputed": recomputed, "faults": {k: sum(a.kind == k for a in faults) for k in KINDS},
        "by_kind": doc_kinds, "actions": [asdict(a) for a in actions], "orphan_resumes": [asdict_event(e) for e in orphans],
        "free": {k: v for k, v in free.items() if k not in ("curve", "events")},
        "twins_wall_s": [t["wall_s"] for t in twins],
        "chaos": {k: v for k, v in chaos.items() if k not in ("curve", "events")},
        "losses": {"free": {s: r["loss"] for s, r in free["curve"].items()}, "chaos": {s: r["loss"] for s, r in chaos["curve"].items()}},
        "goals": {"goodput": GOODPUT_GOAL, "loss_difference": LOSS_GOAL},
    }
    return "\n".join(lines), doc


def asdict_event(e: EventRow) -> dict[str, Any]:
    return e.to_wire()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="the job's steps (default 400: ~100 s fault-free on this 2-core machine)")
    ap.add_argument("--every", type=float, default=20.0, help="mean seconds between faults (default 20)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--back", type=float, default=8.0, help="seconds until a lost node's dpd restarts / a drained node is undrained (default 8)")
    ap.add_argument("--spares", type=int, default=2, help="the most dpds `join` starts (default 2)")
    ap.add_argument("--twins", type=int, choices=(1, 2), default=2, help="fault-free runs: before the chaos run, and (2) after it too (default 2)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    ap.add_argument("--out", help="keep the pool's files here (default: a new temporary dir, kept)")
    args = ap.parse_args()
    if args.steps <= END_MARGIN_STEPS + 1 or args.every <= 0:
        ap.error(f"--steps must be above {END_MARGIN_STEPS + 1} and --every positive")
    root = Path(args.out or tempfile.mkdtemp(prefix="dpool-bench-chaos-")).absolute()
    root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    started = time.monotonic()
    spec = chaos_job("chaos", args.steps)
    pool = LocalPool(root)
    chaos: Chaos | None = None
    frozen_left: list[int] = []
    try:
        pool.start(1, 1, 1)
        print(f"fault-free run of {args.steps} steps ...", flush=True)
        free = fault_free(pool, spec, 600 + 2.0 * args.steps)
        print(f"  {free['state']} in {free['wall_s']:.1f} s", flush=True)
        if free["state"] != "succeeded":
            raise recovery.BenchError(f"the fault-free run ended {free['state']}: {free['error']}")
        print(f"chaos run: a fault every ~{args.every:g} s (seed {args.seed}) ...", flush=True)
        job = submit(pool, spec)
        chaos = Chaos(pool, job, args.steps, args)
        try:
            chaos.run(timeout=10 * free["wall_s"] + 600)
        finally:
            frozen_left = chaos.end_frozen()
        result = outcome(pool, job)
        print(f"  {result['state']} in {result['wall_s']:.1f} s", flush=True)
        twins = [free]
        if args.twins > 1:
            print(f"fault-free run of {args.steps} steps again ...", flush=True)
            again = fault_free(pool, spec, 600 + 2.0 * args.steps)
            print(f"  {again['state']} in {again['wall_s']:.1f} s", flush=True)
            if again["state"] != "succeeded":
                raise recovery.BenchError(f"the second fault-free run ended {again['state']}: {again['error']}")
            twins.append(again)
    except (recovery.BenchError, TimeoutError, LocalPoolError) as e:
        print(f"bench/chaos.py: {e}\n  the pool's logs and state are kept in {root}", file=sys.stderr)
        return 1
    finally:
        recovery.stop_pool(pool, root)

    orphans = attribute(chaos.actions, result["events"], chaos.first_step or 0.0)
    table, doc = summarize(twins, result, chaos.actions, orphans, chaos.first_step)
    print()
    print(f"Chaos on a local pool of 3 one-slot daemons (+ up to {args.spares} spares): {args.steps} steps, a fault every ~{args.every:g} s, "
          f"seed {args.seed}, capacity back after {args.back:g} s; load average before {', '.join(f'{x:.2f}' for x in load)}, "
          f"after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.monotonic() - started:.0f} s in all")
    print()
    print(table)
    if frozen_left:
        print(f"\nfrozen trainers the pool left stopped (ended here): {frozen_left}")
    if args.json:
        doc |= {"args": vars(args), "load_before": load, "load_after": os.getloadavg(), "frozen_left": frozen_left, "root": str(root)}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0 if result["state"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
