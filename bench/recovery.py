"""How fast a dpool job gets back to training after a fault, against its own figures before issue 10
and against torchrun's and Ray Train's.

    python bench/recovery.py [--trials 5] [--overhead-steps 100] [--json FILE] [--out DIR]

A local pool of three one-slot daemons (n0 serves) trains a ~0.8M-parameter GPT (4 layers, dim
128, 12 sequences of 64 tokens per step) with the default checkpoint settings (`every_steps =
"auto"`), and one cycle of faults is injected per trial, each once the group has been training for
a few steps at full strength, and (but for the join) once every node keeps a warm trainer that is
done building, as it does once a job has trained a while:

1. SIGKILL of n1's trainer                -> first completed step of the next generation
2. SIGSTOP of n1's trainer                -> failure detected (progress deadline), -> first step
3. SIGKILL of the non-serving dpd n2      -> first completed step (without n2)
4. n2's dpd started again (a node joins)  -> `node.joined` (registered) -> the first completed step
                                             of the first generation whose nodes include n2

Times are between the fault (taken here, just before the signal) and the coordinator's events
(`worker.failed`; `group.resumed`, whose `t` is when the first step of the new generation reached
the coordinator; `node.joined`, when the dpd registered), all on one clock. Steps recomputed are
each `group.resumed`'s `steps_recomputed`, per fault kind. Each figure is the median of the trials.

Then the checkpoint overhead of the default settings, in the same pool: the same job (N steps, no
fault) with `checkpoint.every_steps` at its default ("auto") and with checkpoints off (an interval
past the last step: only the final checkpoint, which both take), trials interleaved with the order
alternating. A run's time is from step 1 done (compiled) to the last step done, from rank 0's own
`step.done` log timestamps; its tokens/s is the window's tokens over that time. The overhead is
1 - (median tokens/s with "auto") / (median tokens/s off). On a busy 2-core machine that pair
varies by more than the goal, so the bench also gives what the checkpoints cost by account, as
CheckFreq profiles it: for each "auto" run, rank 0's checkpoints' own time (the copy to host memory
on the step path plus the writer thread's CPU time, from `checkpoint.saved`) over the run's time.

Anchors (issue 4, measured on this same machine: 3 workers, ~1M-parameter models, checkpoints every
5 steps): torchrun recovers from a killed worker in 6.0 s, from a lost node in 44 s, admits a new
node in 8.9 s and never notices a frozen worker; Ray Train recovers from a killed worker in 10.7 s
with 8 steps recomputed and has a 600 s hang timeout. "Before" is dpool at issue 10's start
(BENCHMARKS.md, a checkpoint every 5 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from dpool.client.localpool import LocalPool, LocalPoolError, processes_with, wait_for
from dpool.client.rpc import pages
from dpool.protocol import messages as m
from dpool.protocol.jobspec import JobSpec, parse_job
from dpool.protocol.payloads import EventRow, JobStatus

FAULT_TIMEOUT_S = 60.0  # a fault's events; far above any recovery the pool has shown (~5 s)
JOIN_TIMEOUT_S = 90.0  # a dpd started: Python + MLX imports on a busy machine, then a new generation
RUN_TIMEOUT_S = 180.0  # the group back at full strength and a few steps on
END_STATES = ("succeeded", "failed", "cancelled")


def bench_job(name: str, steps: int, every: int | str | None = None) -> JobSpec:
    """The benchmark's job: a ~0.8M-parameter GPT, 12 sequences of 64 tokens a step, every step
    logged, no evaluation, restarts without limit; checkpoints at the defaults unless `every` is
    given."""
    doc: dict[str, Any] = {
        "name": name,
        "workers": {"min": 1, "max": 3},
        "model": {"layers": 4, "dim": 128, "heads": 4, "context": 64},
        "train": {"steps": steps, "global_batch": 12, "warmup_steps": 10, "log_every_steps": 1},
        "eval": {"every_steps": 1_000_000, "batches": 1, "sample_every_steps": 1_000_000},
        "recovery": {"max_restarts": 1000},
    }
    if every is not None:
        doc["checkpoint"] = {"every_steps": every}
    return parse_job(doc, source="bench/recovery.py")


# (label, before issue 10, goal, torchrun, Ray Train); `goal` is (op, value) on the median.
FIGURES: dict[str, tuple[str, str, tuple[str, float] | None, str, str]] = {
    "kill_trainer": ("SIGKILL trainer -> first step of the next generation", "2.75 s", ("<=", 1.0), "6.0 s", "10.7 s"),
    "stop_detected": ("SIGSTOP trainer -> detected", "3.18 s", None, "never", "600 s"),
    "stop_resumed": ("SIGSTOP trainer -> first step of the next generation", "5.46 s", ("<=", 4.0), "never", "600 s"),
    "kill_dpd": ("SIGKILL non-serving dpd (lost node) -> first step", "4.46 s", ("<=", 2.5), "44 s", "-"),
    "join": ("node joins (registered) -> first step including it", "3.28 s", ("<=", 1.5), "8.9 s", "-"),
    "join_from_start": ("node joins (dpd started) -> first step including it", "4.51 s", None, "8.9 s", "-"),
}
RECOMPUTED = {  # fault kind -> (label, before, goal on the largest value)
    "kill_trainer": ("steps recomputed, killed trainer", "up to the checkpoint interval", 1),
    "stop": ("steps recomputed, frozen trainer", "up to the checkpoint interval", 1),
    "kill_dpd": ("steps recomputed, lost node", "up to the checkpoint interval", 1),
    "join": ("steps recomputed, node joins", "0", 0),
}
OVERHEAD_GOAL = 0.02
RAY_RECOMPUTED = "8"
# Kept for scripts that read the anchors by key: (torchrun, Ray Train, goal).
ANCHORS = {k: (v[3], v[4], f"{v[2][0]} {v[2][1]} s" if v[2] else "-") for k, v in FIGURES.items()}


class BenchError(Exception):
    """A figure could not be measured: which trial and figure, and why."""


# -- the coordinator's view ------------------------------------------------------------------------


class EventLog:
    """A job's events (and the pool's during its life), read incrementally with the paging cursor,
    so that waiting for one more event does not read them all again."""

    def __init__(self, pool: LocalPool, job: str) -> None:
        self.pool, self.job = pool, job
        self.after = 0
        self.rows: list[EventRow] = []

    def poll(self) -> list[EventRow]:
        """Every event so far; a coordinator that does not answer now is asked again at the next poll."""
        with contextlib.suppress(Exception):
            while True:
                reply = self.pool.call(m.Events(job=self.job, after=self.after), m.EventsReply)
                self.rows.extend(reply.events)
                self.after = reply.cursor
                if not reply.more:
                    break
        return self.rows

    def wait(self, kind: str, t0: float, timeout: float = FAULT_TIMEOUT_S, where: Callable[[EventRow], bool] = lambda e: True) -> EventRow:
        """The first `kind` event at or after `t0` (unix seconds) for which `where` holds."""
        return wait_for(
            f"a {kind} event after t={t0:.3f}",
            lambda: next((e for e in self.poll() if e.kind == kind and e.t >= t0 - 0.01 and where(e)), None),
            timeout, every=0.05,
        )


def events(pool: LocalPool, job: str) -> list[EventRow]:
    return EventLog(pool, job).poll()


def nodes(pool: LocalPool) -> dict[str, str]:
    return {n.name: n.state for n in pool.nodes()}


def running(pool: LocalPool, job: str, world: int, steps: int = 5) -> JobStatus:
    """Running with `world` workers, `steps` steps past where this wait found its generation."""
    def at_strength() -> JobStatus | None:
        s = pool.status(job)
        if s is not None and s.state in END_STATES:
            raise BenchError(f"job {job} ended ({s.state}: {s.error}) while the bench waited for it to run")
        return s if s is not None and s.state == "running" and s.world_size == world else None

    start = wait_for(f"job {job} running with {world} workers", at_strength, RUN_TIMEOUT_S, every=0.05)
    return wait_for(
        f"job {job} {steps} steps on in generation {start.generation}",
        lambda: (s := at_strength()) and s.generation == start.generation and s.step >= start.step + steps and s,
        RUN_TIMEOUT_S, every=0.05,
    )


def steady(pool: LocalPool, job: str, names: Sequence[str]) -> None:
    """Steady state, as a job that has trained a while is in: every node of the group keeps a
    warm trainer that is done building (a fault in the first seconds after a restart, before
    those are ready, pays part of a cold start; the trials say how much is left then)."""
    wait_for(
        f"warm trainers ready on {', '.join(names)}",
        lambda: all(pool.spare_pids(n, job, ready=True) for n in names),
        RUN_TIMEOUT_S, every=0.1,
    )


def trainer_pid(pool: LocalPool, job: str, node: str) -> int:
    """The pid of the trainer on `node` of the job's running generation: the status row's, else the
    one process whose command line names the node's run dir for the job."""
    s = pool.status(job)
    found = [w.pid for w in (s.workers if s else []) if w.node == node and w.pid]
    if len(found) == 1:
        return int(found[0])
    pids = pool.trainer_pids(node, job, s.generation if s else None) or pool.trainer_pids(node, job)
    if len(pids) != 1:
        raise BenchError(f"expected one trainer of job {job} on {node}, found pids {pids}")
    return pids[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(Exception), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waits only for its parent
    return True


def stop_pool(pool: LocalPool, root: Path) -> None:
    """End the pool's daemons (and with them their trainers); say what still runs under `root`."""
    pool.stop(report=lambda line: print(f"  stopping the pool: {line}", file=sys.stderr))
    left = processes_with(f"{root}{os.sep}")
    if left:
        print(f"  still running under {root} after the pool stopped: {[p.pid for p in left]}", file=sys.stderr)


@contextlib.contextmanager
def figure(what: str) -> Iterator[None]:
    """Name the figure in any timeout, so a failed run says which fault was not recovered."""
    try:
        yield
    except (TimeoutError, BenchError) as e:
        raise BenchError(f"{what}: {e}") from e


# -- the fault cycle ----------------------------------------------------------------------------


def signal_trainer(pool: LocalPool, job: str, sig: signal.Signals) -> tuple[int, float]:
    """In steady state at full strength, `sig` to n1's trainer: (its pid, when it was sent)."""
    running(pool, job, 3)
    steady(pool, job, ("n0", "n1", "n2"))
    pid = trainer_pid(pool, job, "n1")
    t0 = time.time()
    os.kill(pid, sig)
    return pid, t0


def one_cycle(pool: LocalPool, job: str, log: EventLog, fig: dict[str, list[float]], recomputed: dict[str, list[int]], trial: str) -> None:
    # 1. a killed trainer
    with figure(f"{trial}, killed trainer"):
        pid, t0 = signal_trainer(pool, job, signal.SIGKILL)
        resumed = log.wait("group.resumed", t0)
        fig["kill_trainer"].append(resumed.t - t0)
        recomputed["kill_trainer"].append(int(resumed.fields["steps_recomputed"]))

    # 2. a frozen trainer: nothing exits, its peers wait inside all_sum; the progress deadline
    # catches it and the daemon kills it (SIGKILL reaches a stopped process)
    with figure(f"{trial}, frozen trainer"):
        pid, t0 = signal_trainer(pool, job, signal.SIGSTOP)
        try:
            fig["stop_detected"].append(log.wait("worker.failed", t0).t - t0)
            resumed = log.wait("group.resumed", t0)
            fig["stop_resumed"].append(resumed.t - t0)
            recomputed["stop"].append(int(resumed.fields["steps_recomputed"]))
            with contextlib.suppress(TimeoutError):
                wait_for(f"the frozen trainer (pid {pid}) ended by the pool", lambda: not alive(pid), 10)
        finally:
            if alive(pid):  # the pool did not end it: a finding, and this bench's own process to end
                print(f"  {trial}: the frozen trainer (pid {pid}) is still there after the recovery: SIGKILL", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    # 3. a lost node (its dpd killed; its trainer dies with it)
    with figure(f"{trial}, lost node"):
        running(pool, job, 3)
        steady(pool, job, ("n0", "n1"))
        t0 = time.time()
        pool.daemons["n2"].proc.send_signal(signal.SIGKILL)
        pool.daemons["n2"].proc.wait()
        resumed = log.wait("group.resumed", t0)
        fig["kill_dpd"].append(resumed.t - t0)
        recomputed["kill_dpd"].append(int(resumed.fields["steps_recomputed"]))

    # 4. the node joins again: the group grows to include it
    with figure(f"{trial}, node joins"):
        running(pool, job, 2, steps=3)
        wait_for("n2 lost", lambda: nodes(pool).get("n2") == "lost", 30)
        t0 = time.time()
        pool.start_daemon("n2")
        joined = log.wait("node.joined", t0, JOIN_TIMEOUT_S, where=lambda e: e.fields.get("node") == "n2")
        starting = log.wait("group.starting", joined.t, JOIN_TIMEOUT_S, where=lambda e: "n2" in e.fields.get("nodes", ["n2"]))
        resumed = log.wait("group.resumed", starting.t, JOIN_TIMEOUT_S, where=lambda e: e.fields.get("generation") == starting.fields.get("generation"))
        fig["join"].append(resumed.t - joined.t)
        fig["join_from_start"].append(resumed.t - t0)
        recomputed["join"].append(int(resumed.fields["steps_recomputed"]))


# -- checkpoint overhead --------------------------------------------------------------------------


def rank0_log(pool: LocalPool, job: str) -> tuple[dict[int, float], dict[int, float]]:
    """From rank 0's log in the coordinator's store: its `step.done` timestamps (unix seconds) by
    step, and each disk checkpoint's own cost by step: the host copy on the step path plus the
    writer thread's CPU time (`copy_s` + `cpu_s` of `checkpoint.saved`)."""
    at: dict[int, float] = {}
    cost: dict[int, float] = {}
    for reply in pages(lambda after: pool.call(m.Logs(job=job, after=after, rank=0), m.LogsReply)):
        for line in reply.lines:
            text = line.text.strip()
            if not text.startswith("{"):
                continue
            with contextlib.suppress(ValueError, KeyError, TypeError):
                e = json.loads(text)
                if e.get("event") == "step.done" and "timestamp" in e:
                    at[int(e["step"])] = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                elif e.get("event") == "checkpoint.saved" and "copy_s" in e:
                    cost[int(e["step"])] = float(e["copy_s"]) + float(e.get("cpu_s", 0.0))
    return at, cost


def run_to_end(pool: LocalPool, spec: JobSpec, timeout: float) -> JobStatus:
    job = pool.call(m.Submit(job=spec.to_dict(), source="bench"), m.Submitted).job_id
    final = wait_for(f"job {spec.name} ({job}) to end", lambda: (s := pool.status(job)) and s.state in END_STATES and s, timeout, every=0.2)
    if final.state != "succeeded":
        raise BenchError(f"job {spec.name} ({job}) ended {final.state}: {final.error}")
    return final


def overhead_run(pool: LocalPool, spec: JobSpec) -> dict[str, Any]:
    """One fault-free run to its end: its window (step 1 done -> last step done) and tokens/s."""
    steps = spec.train.steps
    final = run_to_end(pool, spec, 120 + 5.0 * steps)
    at, cost = rank0_log(pool, final.id)
    if 1 not in at or steps not in at:
        raise BenchError(f"job {spec.name} ({final.id}): rank 0's log has no step.done for step 1 or {steps} (found {len(at)} steps)")
    rows = {r.step: r for page in pages(lambda after: pool.call(m.Metrics(job=final.id, after=after), m.MetricsReply)) for r in page.rows if r.kind == "train"}
    tokens = sum(rows[s].tokens for s in range(2, steps + 1) if s in rows)
    wall = at[steps] - at[1]
    intervals = sorted({r.checkpoint_every for r in rows.values() if r.checkpoint_every})
    saved = [e for e in events(pool, final.id) if e.kind == "checkpoint.saved" and 1 < int(e.fields.get("step", 0)) < steps]
    spent = sum(c for step, c in cost.items() if 1 < step < steps)  # the last one: both variants write it
    return {"job": final.id, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "intervals": intervals, "checkpoints": len(saved),
            "checkpoint_s": spent, "accounted": spent / wall}


def checkpoint_overhead(pool: LocalPool, steps: int, trials: int) -> dict[str, Any]:
    """The same job with default checkpoints and without, interleaved; medians and the overhead."""
    variants = {"auto": bench_job("ckpt-auto", steps), "off": bench_job("ckpt-off", steps, steps + 1)}
    got: dict[str, list[dict[str, Any]]] = {"auto": [], "off": []}
    for trial in range(trials):
        for name in ("auto", "off") if trial % 2 == 0 else ("off", "auto"):
            with figure(f"checkpoint overhead trial {trial + 1}, {name}"):
                r = overhead_run(pool, variants[name])
            got[name].append(r)
            print(f"  checkpoints {name:4s} trial {trial + 1}/{trials}: {r['wall_s']:.2f} s for steps 2..{steps}, "
                  f"{r['tokens_per_s']:.0f} tokens/s, {r['checkpoints']} checkpoints ({r['checkpoint_s']:.2f} s of their own, "
                  f"{100 * r['accounted']:.1f}%), intervals {r['intervals']}", flush=True)
    auto = statistics.median(r["tokens_per_s"] for r in got["auto"])
    off = statistics.median(r["tokens_per_s"] for r in got["off"])
    accounted = statistics.median(r["accounted"] for r in got["auto"])
    return {"steps": steps, "auto_tokens_per_s": auto, "off_tokens_per_s": off, "overhead": 1 - auto / off, "accounted": accounted, "runs": got}


# -- the report ---------------------------------------------------------------------------------


def markdown(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def meets(value: float, goal: tuple[str, float] | None) -> str:
    if goal is None:
        return ""
    op, limit = goal
    return "yes" if (value <= limit if op == "<=" else value >= limit) else "**no**"


def report(fig: dict[str, list[float]], recomputed: dict[str, list[int]], overhead: dict[str, Any] | None, trials: int) -> tuple[str, dict[str, Any]]:
    """The markdown table and the JSON document of the figures."""
    rows: list[list[Any]] = []
    doc: dict[str, Any] = {"trials": trials, "figures": {}, "recomputed": {}, "overhead": None}
    for key, (label, before, goal, torchrun, ray) in FIGURES.items():
        values = fig.get(key) or []
        if not values:
            continue
        med = statistics.median(values)
        goal_text = f"{goal[0].replace('<=', '≤')} {goal[1]:.1f} s" if goal else ""
        rows.append([label, f"**{med:.2f} s**", ", ".join(f"{v:.2f}" for v in values), before, goal_text, meets(med, goal), torchrun, ray])
        doc["figures"][key] = {"label": label, "median_s": med, "trials_s": values, "before": before, "goal": goal, "torchrun": torchrun, "ray": ray}
    for key, (label, before, goal) in RECOMPUTED.items():
        values = recomputed.get(key) or []
        if not values:
            continue
        rows.append([label, f"**{max(values)}** (max), median {statistics.median(values):g}", ", ".join(map(str, values)), before,
                     f"≤ {goal}", "yes" if max(values) <= goal else "**no**", "-", RAY_RECOMPUTED if key != "join" else "-"])
        doc["recomputed"][key] = {"label": label, "max": max(values), "median": statistics.median(values), "trials": values, "goal_max": goal}
    if overhead is not None:
        pct = 100 * overhead["overhead"]
        runs = overhead["runs"]
        per = ", ".join(f"{100 * (1 - a['tokens_per_s'] / o['tokens_per_s']):+.1f}%" for a, o in zip(runs["auto"], runs["off"], strict=True))
        rows.append([f"checkpoint overhead, default settings ({overhead['steps']} steps, tokens/s vs off)", f"**{pct:+.1f}%**",
                     f"pairs: {per}", "", f"≤ {100 * OVERHEAD_GOAL:g}%", "yes" if overhead["overhead"] <= OVERHEAD_GOAL else "**no**", "-", "-"])
        acc = [f"{100 * r['accounted']:.1f}%" for r in runs["auto"]]
        rows.append([f"checkpoint overhead, default settings ({overhead['steps']} steps, rank 0's copy + writer CPU time over the run's time)",
                     f"**{100 * overhead['accounted']:.1f}%**", ", ".join(acc), "", f"≤ {100 * OVERHEAD_GOAL:g}%",
                     "yes" if overhead["accounted"] <= OVERHEAD_GOAL else "**no**", "-", "-"])
        doc["overhead"] = overhead | {"goal": OVERHEAD_GOAL}
    table = markdown(["figure", f"dpool (median of {trials})", "trials", "before (issue 10)", "goal", "met", "torchrun", "Ray Train"], rows)
    return table, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="fault cycles, and checkpoint-overhead pairs (default 5)")
    ap.add_argument("--overhead-steps", type=int, default=100, help="steps of each checkpoint-overhead run; 0: skip it (default 100)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    ap.add_argument("--out", help="keep the pool's files here (default: a new temporary dir, kept)")
    args = ap.parse_args()
    if args.trials < 1:
        ap.error("--trials must be at least 1")
    root = Path(args.out or tempfile.mkdtemp(prefix="dpool-bench-recovery-")).absolute()
    root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    fig: dict[str, list[float]] = {k: [] for k in FIGURES}
    recomputed: dict[str, list[int]] = {k: [] for k in RECOMPUTED}
    overhead = None
    t_start = time.monotonic()
    pool = LocalPool(root)
    try:
        pool.start(1, 1, 1)
        job = pool.call(m.Submit(job=bench_job("bench", 1_000_000).to_dict(), source="bench/recovery.py"), m.Submitted).job_id
        log = EventLog(pool, job)
        for trial in range(args.trials):
            one_cycle(pool, job, log, fig, recomputed, f"trial {trial + 1}")
            print(f"trial {trial + 1}/{args.trials}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in fig.items() if v)
                  + ", recomputed " + ", ".join(f"{k} {v[-1]}" for k, v in recomputed.items()), flush=True)
        pool.call(m.Cancel(job=job), m.CancelReply)
        wait_for(f"job {job} cancelled", lambda: (s := pool.status(job)) and s.state in END_STATES, 60)
        if args.overhead_steps > 0:
            overhead = checkpoint_overhead(pool, args.overhead_steps, args.trials)
    except (BenchError, TimeoutError, LocalPoolError) as e:
        print(f"bench/recovery.py: {e}\n  the pool's logs and state are kept in {root}", file=sys.stderr)
        return 1
    finally:
        stop_pool(pool, root)

    table, doc = report(fig, recomputed, overhead, args.trials)
    print()
    print(f"Recovery on a local pool of 3 one-slot daemons, default checkpoint settings; load average before "
          f"{', '.join(f'{x:.2f}' for x in load)}, after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.monotonic() - t_start:.0f} s in all")
    print()
    print(table)
    med = {k: statistics.median(v) for k, v in fig.items() if v}
    print()
    print(f"Ratios: a killed worker is back {6.0 / med['kill_trainer']:.1f}x faster than under torchrun and "
          f"{10.7 / med['kill_trainer']:.1f}x faster than under Ray Train; a lost node {44 / med['kill_dpd']:.1f}x faster than torchrun; "
          f"a new node takes part {8.9 / med['join_from_start']:.1f}x sooner (from dpd start). "
          f"Against before: killed trainer {2.75 / med['kill_trainer']:.1f}x, frozen {5.46 / med['stop_resumed']:.1f}x, "
          f"lost node {4.46 / med['kill_dpd']:.1f}x, join {3.28 / med['join']:.1f}x.")
    if args.json:
        doc |= {"load_before": load, "load_after": os.getloadavg(), "seconds": time.monotonic() - t_start, "root": str(root)}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
