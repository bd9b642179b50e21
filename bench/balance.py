"""Unlike machines, through the pool: how close the balancer gets to the ideal split, and how fast
(issues 10 and 19).

    python bench/balance.py [--steps 60] [--rounds 1] [--model small|demo] [--direct] [--out FILE]

Two dpds on this 2-core machine, as a user would run them: `taskset -c 0 dpd run --serve ...
--workers 1` (node n0, which also hosts the coordinator) and `taskset -c 1 dpd run --join ...
--workers 2` (node n1), each with its own HOME and state dir. One job of three ranks (a 2-layer GPT
of width 64, 24 sequences of 64 tokens a step, as the trainer's tests train; `workers.min =
workers.max = 3`), submitted with `dpctl submit`: rank 0 has core 0 to itself (beside its dpd and
the coordinator), ranks 1 and 2 share core 1. The dpds keep their defaults (warm trainers on, state
kept in memory, BLAS threads split by the trainer). Rank 0 is about twice as fast as either of the
others, so the ideal split of 24 is [12, 6, 6].

The same job runs three times per round, each in a fresh pool: balanced (the default, from the
coordinator's equal split), fixed at the ideal [12, 6, 6] (`workers.balance = false`, and
DPOOL_SHARES=12,6,6 in the dpds' environment, which the trainer reads only then), and fixed at the
equal [8, 8, 8] (`workers.balance = false`). A step's time is its trained tokens over its tokens/s
(the trainer's metrics row as `dpctl metrics --json` gives it: from the end of one step to the end
of the next, without evaluation or logging). The ideal step time is the median of the fixed ideal
run's steps after its first 5 (compilation); the balanced run's step time "at step 20" is the median
of steps 18..22, "at the end" the median of its last 10 steps; each is given as a ratio to the
ideal. Step 20 is also given against the fixed run's own steps 18..22: the dpds' background work of
a group's first steps (their spares building, the coordinator's records) falls on the same steps of
both runs, so that ratio is the balancer's alone; with several rounds, the median of each ratio
over the rounds is given too. Each rank's compute time per step is its trained tokens over its
tokens/s in the same row.

`--direct` runs the three trainers directly instead (tests/ring.py's launcher, `taskset` on each
rank, OPENBLAS_NUM_THREADS=1): the bench as it was before issue 19, without dpds, spares or the
coordinator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import ring  # noqa: E402  (the tests' ring launcher: MLX_RANK, MLX_HOSTFILE, taskset pins)
from jobs import SMALL, write_job  # noqa: E402

from dpool.client.localpool import LocalPool, tail, wait_for  # noqa: E402
from dpool.trainer.balance import SHARES_ENV  # noqa: E402

PINS = [["taskset", "-c", "0"], ["taskset", "-c", "1"], ["taskset", "-c", "1"]]
CORES = {"n0": "0", "n1": "1"}  # node -> the core its dpd (and so its trainers) may run on
SLOTS = {"n0": 1, "n1": 2}
IDEAL, EQUAL = [12, 6, 6], [8, 8, 8]
RUN_TIMEOUT_S = 600.0
POLL_S = 0.5  # the job's status, asked of the coordinator on core 0: rarely, it shares rank 0's core
END_STATES = ("succeeded", "failed", "cancelled")

MODELS = {"small": SMALL["model"], "demo": {"layers": 4, "dim": 128, "heads": 4, "context": 64}}


class BenchError(Exception):
    """A run did not give figures: which, and why."""


class PinnedPool(LocalPool):
    """Each dpd under `taskset -c CORE` with a HOME of its own: its zygote, spares and trainers
    inherit the core, as they would inherit a machine."""

    def prefix(self, name: str, serve: bool) -> list[str]:
        home = self.root / f"home-{name}"
        home.mkdir(parents=True, exist_ok=True)
        return ["taskset", "-c", CORES[name], "env", f"HOME={home}"]


def job_file(folder: Path, name: str, steps: int, balance: bool, model: str) -> Path:
    return write_job(
        folder, name, base=SMALL, model=MODELS[model], train={"steps": steps},
        workers={"balance": balance, "min": 3, "max": 3}, checkpoint={"every_steps": 10 * steps},
        eval={"every_steps": 10 * steps, "batches": 1, "sample_every_steps": 10 * steps, "sample_tokens": 8},
    )


def dpctl(pool: LocalPool, *args: str) -> str:
    cmd = [sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=pool.root)
    if r.returncode != 0:
        raise BenchError(f"dpctl {' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-1500:]}")
    return r.stdout


def pool_run(tmp: Path, name: str, steps: int, shares: list[int] | None, model: str) -> dict[int, dict]:
    """One job through a fresh pool: `shares` fixed (balancing off), or None to balance."""
    root = tmp / name
    env = {SHARES_ENV: ",".join(map(str, shares))} if shares and shares != EQUAL else {}
    pool = PinnedPool(root, env=env)
    try:
        for node, slots in SLOTS.items():
            pool.start_daemon(node, serve=node == "n0", workers=slots)
        pool.wait_registered(len(SLOTS))
        job = dpctl(pool, "submit", str(job_file(root, name, steps, shares is None, model))).strip().splitlines()[-1]

        def ended() -> Any:
            pool.check_alive()
            s = pool.status(job)
            return s is not None and s.state in END_STATES and s

        status = wait_for(f"job {job} ({name}) to end", ended, RUN_TIMEOUT_S, POLL_S)
        if status.state != "succeeded":
            raise BenchError(f"{name}: job {job} {status.state}; the end of n0's log:\n{tail(pool.daemons['n0'].log)}")
        rows = [r for r in json.loads(dpctl(pool, "metrics", job, "--json")) if r.get("kind") == "train"]
    finally:
        pool.stop()
    out = {r["step"]: r for r in rows}
    restarted = sorted({r.get("generation") for r in rows} - {1})
    if restarted or any(r["world_size"] != 3 for r in rows):
        raise BenchError(f"{name}: the group restarted (generations {restarted}) or ran with fewer ranks; its times are not one run's")
    if shares is not None and any(r["shares"] != shares for r in rows):
        raise BenchError(f"{name}: trained at {sorted({tuple(r['shares']) for r in rows})}, not the fixed {shares}")
    return out


def direct_run(tmp: Path, name: str, steps: int, shares: list[int] | None, model: str) -> dict[int, dict]:
    """One 3-rank run of trainers started directly (no dpd)."""
    job = job_file(tmp, name, steps, shares is None, model)
    env = {"DPOOL_CACHE_DIR": str(tmp / "cache"), "OPENBLAS_NUM_THREADS": "1"}
    run_dir = tmp / name / "r{rank}"
    ring.run(job, str(run_dir), 3, tmp / "logs", timeout=600, env=env, shares=shares, pin=PINS)
    return ring.metrics(tmp / name / "r0")


def step_seconds(row: dict) -> float:
    return row["tokens"] / row["tokens_per_s"]


def rank_ms(row: dict) -> list[float]:
    """Each rank's compute time in the step (ms): its trained tokens over its tokens/s. Every
    sequence of this job trains the same number of tokens."""
    per_seq = row["tokens"] / sum(row["shares"])
    return [1000 * s * per_seq / max(v, 1e-9) for s, v in zip(row["shares"], row["rank_tokens_per_s"], strict=True)]


def median_of(rows: dict[int, dict], steps: range) -> float:
    return statistics.median(step_seconds(rows[s]) for s in steps if s in rows)


def one_round(tmp: Path, steps: int, model: str, direct: bool) -> dict[str, Any]:
    run = direct_run if direct else pool_run
    load = os.getloadavg()
    t0 = time.monotonic()
    balanced = run(tmp, "balanced", steps, None, model)
    ideal = run(tmp, "ideal", steps, IDEAL, model)
    equal = run(tmp, "equal", steps, EQUAL, model)
    n = steps
    t_ideal = median_of(ideal, range(6, n + 1))
    t_equal = median_of(equal, range(6, n + 1))
    at20 = median_of(balanced, range(18, 23))
    ideal20 = median_of(ideal, range(18, 23))  # the same steps of the fixed run: what the machine was doing then, alike
    end = median_of(balanced, range(n - 9, n + 1))
    shares20 = balanced[20]["shares"] if 20 in balanced else None
    # The setup holds only if nothing else runs: another process on core 0 makes rank 0 no faster
    # than the ranks sharing core 1, and then [12, 6, 6] is not the ideal split.
    fast = statistics.median(
        equal[s]["rank_tokens_per_s"][0] / statistics.mean(equal[s]["rank_tokens_per_s"][1:]) for s in range(6, n + 1) if s in equal
    )
    print(f"\n{'direct trainers' if direct else 'through dpds'}: load average (1, 5, 15 min) before the runs: "
          f"{', '.join(f'{x:.2f}' for x in load)}; after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {time.monotonic() - t0:.0f} s")
    print(f"rank 0's speed over ranks 1 and 2's in the equal run (median): {fast:.2f} (the setup wants 2)")
    print("balanced run, per step: shares, step time, ratio to the ideal step time, per-rank compute ms")
    for s in sorted(balanced):
        r = balanced[s]
        times = ", ".join(f"{x:5.1f}" for x in rank_ms(r))
        print(f"  step {s:3d}  {r['shares']!s:14s} {1000 * step_seconds(r):7.1f} ms  {step_seconds(r) / t_ideal:5.2f}  [{times}]")
    print("fixed ideal run, per-rank compute ms (median of steps 6..): "
          f"{[round(statistics.median(rank_ms(ideal[s])[k] for s in range(6, n + 1) if s in ideal), 1) for k in range(3)]}")
    print(f"ideal [12, 6, 6] step time (median of steps 6..{n}): {1000 * t_ideal:.1f} ms")
    print(f"equal [8, 8, 8] step time (median of steps 6..{n}):  {1000 * t_equal:.1f} ms   ratio {t_equal / t_ideal:.2f}")
    print(f"balanced at step 20 (median of steps 18..22):       {1000 * at20:.1f} ms   ratio {at20 / t_ideal:.2f}  (goal <= 1.05)")
    print(f"  against the fixed run's own steps 18..22 ({1000 * ideal20:.1f} ms):     ratio {at20 / ideal20:.2f}")
    print(f"balanced at the end (median of the last 10 steps):  {1000 * end:.1f} ms   ratio {end / t_ideal:.2f}")
    near = shares20 is not None and all(abs(a - b) <= 1 for a, b in zip(shares20, IDEAL, strict=True))
    print(f"balanced shares at step 20: {shares20} ({'within' if near else 'NOT within'} one sequence of {IDEAL}), at the end: {balanced[n]['shares']}")
    changes = [(s, balanced[s]["shares"]) for s in sorted(balanced) if s > 1 and s - 1 in balanced and balanced[s]["shares"] != balanced[s - 1]["shares"]]
    print(f"share changes (first step under the new split): {changes}")
    worst = max(abs(balanced[s]["loss"] - ideal[s]["loss"]) for s in balanced if s in ideal)
    print(f"largest loss difference, balanced vs ideal run: {worst:.2e}")
    return {
        "direct": direct, "ideal_s": t_ideal, "equal_s": t_equal, "at20_s": at20, "end_s": end, "at20_ratio": at20 / t_ideal,
        "ideal20_s": ideal20, "at20_same_steps": at20 / ideal20,
        "end_ratio": end / t_ideal, "shares20": shares20, "within_one_at20": near, "changes": changes, "rank0_over_others": fast,
        "load_before": load, "load_after": os.getloadavg(), "balanced": balanced, "ideal": ideal, "equal": equal,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1, help="balanced, ideal and equal runs, this many times over")
    ap.add_argument("--model", choices=sorted(MODELS), default="small", help="small: the tests' GPT; demo: the demo's 4x128")
    ap.add_argument("--direct", action="store_true", help="start the trainers directly (no dpd), as before issue 19")
    ap.add_argument("--out", help="also write the per-step figures here as JSON")
    args = ap.parse_args()
    if args.steps < 30:
        ap.error("--steps: at least 30 (the figures read steps 18..22 and the last 10)")
    if not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench/balance.py needs taskset and 2 cores")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="dpool-balance-") as t:
        for i in range(args.rounds):
            tmp = Path(t) / f"round-{i + 1}"
            tmp.mkdir()
            rounds.append(one_round(tmp, args.steps, args.model, args.direct))
    if len(rounds) > 1:
        print("\nrounds: step 20 / ideal, step 20 / the fixed run's steps 18..22, end / ideal, shares at step 20")
        for i, r in enumerate(rounds, 1):
            print(f"  {i}: {r['at20_ratio']:.2f}  {r['at20_same_steps']:.2f}  {r['end_ratio']:.2f}  {r['shares20']}")
        mid = {k: statistics.median(r[k] for r in rounds) for k in ("at20_ratio", "at20_same_steps", "end_ratio")}
        print(f"  median: {mid['at20_ratio']:.2f}  {mid['at20_same_steps']:.2f}  {mid['end_ratio']:.2f}  "
              f"({sum(r['within_one_at20'] for r in rounds)} of {len(rounds)} within one sequence of {IDEAL} at step 20)")
    if args.out:
        Path(args.out).write_text(json.dumps(rounds))


if __name__ == "__main__":
    main()
