"""Ring start-up: which rank should call `mx.distributed.init(backend="ring")` first, and how early.

    python bench/ringstart.py [--trials 7] [--sizes 2,3,4] [--delays 0,10,25,50,100] [--busy N] [--nice N] [--out FILE]

MLX's ring (mlx/distributed/ring/ring.cpp) connects rank r to rank r+1. Ranks 0..n-2 first listen
and accept their left neighbour, then connect right; the last rank connects to rank 0 first, then
listens. A connect that is refused (the peer is not listening yet) is retried after 1 s, then 2, 4
and 8 s. So a group starts fast only if rank 0 listens before the last rank connects to it, and the
last rank listens before rank n-2 connects to it (that one comes after a chain of accepts).

Each trial starts n local processes that import mlx.core and then wait for a common moment T0;
rank r then sleeps its delay and calls init. A trial's time is from T0 until the last rank's init
returned (so a delay counts against its schedule). Schedules, for each delay d:

    together      every rank at T0
    last-late     ranks 0..n-2 at T0, the last rank at T0 + d
    rank0-early   rank 0 at T0, every other rank at T0 + d
    by-rank       rank r at T0 + r*d
    reverse       rank r at T0 + (n-1-r)*d

Figures: the median and the worst over the trials, and how many trials hit a connect retry (MLX's
own log line "Attempt ... wait ... ms" with MLX_RING_VERBOSE=1), in brackets how many of those were
the last rank's (its connect came before rank 0 listened; the others' come from rank n-2 connecting
before the last rank listens, which no delay orders). `--busy N` runs N busy loops meanwhile: a
machine whose cores are taken, where a rank's way from `init` to `listen` takes longer. `--nice N`
runs every rank but the last at nice N until its init returned, as warm trainers (built at a low
priority) once did (Linux; measured on a busy machine it makes the retry the rule, not the exception).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from ring import free_ports  # noqa: E402  (the tests' helper: free loopback ports)

SCHEDULES = {
    "together": lambda r, n, d: 0.0,
    "last-late": lambda r, n, d: d if r == n - 1 else 0.0,
    "rank0-early": lambda r, n, d: 0.0 if r == 0 else d,
    "by-rank": lambda r, n, d: r * d,
    "reverse": lambda r, n, d: (n - 1 - r) * d,
}


def worker(t0: float, delay: float, nice: int) -> None:
    """One rank: mlx is imported before T0 (a warm process), init is called at T0 + delay; every
    rank but the last at nice `nice` until then."""
    import mlx.core as mx

    last = int(os.environ["MLX_RANK"]) == len(json.loads(Path(os.environ["MLX_HOSTFILE"]).read_text())) - 1
    was = os.getpriority(os.PRIO_PROCESS, 0)
    if nice and not last:
        os.setpriority(os.PRIO_PROCESS, 0, was + nice)
    time.sleep(max(0.0, t0 + delay - time.time()))
    called = time.time()
    group = mx.distributed.init(backend="ring", strict=True)
    done = time.time()
    if nice and not last:
        os.setpriority(os.PRIO_PROCESS, 0, was)  # root, or an RLIMIT_NICE that allows it
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=group))  # the group works
    print(json.dumps({"rank": group.rank(), "called": called - t0, "done": done - t0}), flush=True)


def trial(n: int, delays: list[float], tmp: Path, margin: float = 0.6, nice: int = 0) -> tuple[float, list[int]]:
    """Seconds from T0 until every rank's init returned, and the ranks whose connect was retried."""
    hostfile = tmp / f"hosts-{time.monotonic_ns()}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    t0 = time.time() + margin  # the processes start and import mlx (~0.15 s) well before T0
    procs = []
    for r in range(n):
        env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), MLX_RING_VERBOSE="1")
        cmd = [sys.executable, __file__, "--worker", str(t0), str(delays[r]), str(nice)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done, retried = [], []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"a rank failed (exit {p.returncode}): {err[-2000:]}")
        done.append(json.loads(out.strip().splitlines()[-1])["done"])
        if "Attempt" in err:
            retried.append(r)
    return max(done), retried


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--sizes", default="2,3,4", help="group sizes, comma-separated")
    ap.add_argument("--delays", default="0,10,25,50,100", help="delays d in ms, comma-separated")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="which schedules, comma-separated")
    ap.add_argument("--busy", type=int, default=0, help="busy loops to run meanwhile (a loaded machine)")
    ap.add_argument("--nice", type=int, default=0, help="every rank but the last at this nice value until its init returned")
    ap.add_argument("--out", help="also write every trial's figures here as JSON")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    delays = [float(x) / 1000 for x in args.delays.split(",")]
    names = args.schedules.split(",")
    rows: list[dict] = []
    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores; {args.busy} busy loops; ranks but the last at nice +{args.nice}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run_all(args, sizes, delays, names, rows)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def run_all(args: argparse.Namespace, sizes: list[int], delays: list[float], names: list[str], rows: list[dict]) -> None:
    print(f"{'n':>2} {'schedule':12} {'d ms':>5}  {'median s':>8} {'worst s':>8}  retried  (by the last rank)")
    with tempfile.TemporaryDirectory() as t:
        for n in sizes:
            for name in names:
                for d in delays if name != "together" else [0.0]:
                    if name != "together" and d == 0:
                        continue  # the same as "together"
                    times, retries, by_last = [], 0, 0
                    for _ in range(args.trials):
                        planned = [SCHEDULES[name](r, n, d) for r in range(n)]
                        seconds, retried = trial(n, planned, Path(t), margin=0.6 + 0.7 * args.busy, nice=args.nice)
                        times.append(seconds)
                        retries += bool(retried)
                        by_last += n - 1 in retried
                    med, worst = statistics.median(times), max(times)
                    rows.append({"n": n, "schedule": name, "delay_ms": d * 1000, "median_s": med, "worst_s": worst, "retried": retries, "retried_by_last": by_last, "trials": times})
                    print(f"{n:2d} {name:12} {d * 1000:5.0f}  {med:8.3f} {worst:8.3f}  {retries:2d}/{args.trials}  ({by_last})", flush=True)


if __name__ == "__main__":
    main()
