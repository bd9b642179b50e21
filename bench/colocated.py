"""Ranks that share a machine: the step time as shipped against its baselines, in one run (issue 10).

    python bench/colocated.py [--steps 40] [--rounds 1] [--out FILE]

Three ranks of the demo GPT (4 layers of width 128, context 64) on this machine, a ring over
loopback, a global batch of 18 in fixed shares of 6 (balancing off), no pinning: as `dpctl demo`
would place three workers on one laptop. The same job runs in fresh ring groups (tests/ring.py),
once per configuration:

    default          as shipped now: BLAS threads split (cores // 3 each), the ring's sockets
                     blocking and its all_sums one way round (the whole group is on this machine),
                     and the ranks wait for each other asleep before the step's all_sum
                     (trainer/colocate.py)
    no barrier       the default without the barrier (DPOOL_LOCAL_BARRIER=0)
    no quiet ring    the default with MLX's own sockets and all_sums (DPOOL_QUIET_RING=0)
    split only       the thread split alone
    1 thread + shim  OPENBLAS_NUM_THREADS=1, and a measurement shim preloaded that sleeps 50 us
                     whenever a socket call would block, so the ring's busy-polling waits yield the
                     core: the goal's baseline (skipped without a C compiler)
    old              as shipped before: OpenBLAS's own thread count (one per core) in every rank,
                     MLX's ring as it is (OPENBLAS_NUM_THREADS=<cores>)

Before those, the step's all_sum alone: the demo's 3.4 MB of gradients summed by 3 ranks that enter
it together, with MLX's ring as it is, with the shim, and with the quiet ring.

A step's time is its trained tokens over its tokens/s (the trainer's metrics row: from the end of
one step to the end of the next, without evaluation or logging); each configuration's figure is the
median over its steps after the first 5 (compilation), pooled over --rounds (the configurations
run in turn, round after round, so a change in the machine's load falls on all of them). The goal:
the default within 1.1x of the shim's baseline, with the same loss curve.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import ring  # noqa: E402  (the tests' ring launcher: MLX_RANK, MLX_HOSTFILE)
from jobs import SMALL, write_job  # noqa: E402

DEMO = {"layers": 4, "dim": 128, "heads": 4, "context": 64}
SHARES = [6, 6, 6]
GOAL = 1.1
SHIM = "1 thread + shim"

# A socket call that would block sleeps 50 us before it returns, so a busy-polling wait gives its
# core away. Only to measure against: it slows every wait on a fast link by up to 50 us.
SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

static ssize_t (*real_recv)(int, void *, size_t, int);
static ssize_t (*real_send)(int, const void *, size_t, int);

static ssize_t yield_if_blocked(ssize_t r) {
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        int saved = errno;
        usleep(50);
        errno = saved;
    }
    return r;
}

ssize_t recv(int fd, void *buf, size_t n, int flags) {
    if (!real_recv) real_recv = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
    return yield_if_blocked(real_recv(fd, buf, n, flags));
}

ssize_t send(int fd, const void *buf, size_t n, int flags) {
    if (!real_send) real_send = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    return yield_if_blocked(real_send(fd, buf, n, flags));
}
"""


def build_shim(tmp: Path) -> Path | None:
    """The shim as a shared library, or None (with the reason printed) where it cannot be built."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if sys.platform != "linux" or cc is None:
        print(f"no 1-thread + sleep-shim baseline: {'no C compiler (cc)' if cc is None else 'the shim is for Linux'}")
        return None
    src, lib = tmp / "sleepshim.c", tmp / "sleepshim.so"
    src.write_text(SHIM_C)
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"no 1-thread + sleep-shim baseline: {cc} failed: {done.stderr.strip()[-500:]}")
        return None
    return lib


def configurations(shim: Path | None) -> dict[str, dict[str, str]]:
    """Each configuration's environment on top of tests/ring.py's. An empty OPENBLAS_NUM_THREADS
    reads as unset (to OpenBLAS and to the trainer); tests/ring.py would otherwise set it to 1."""
    cores = str(os.cpu_count() or 1)
    auto = {"OPENBLAS_NUM_THREADS": ""}
    mlx_ring = {"DPOOL_LOCAL_BARRIER": "0", "DPOOL_QUIET_RING": "0"}
    configs = {
        "default": auto,
        "no barrier": {**auto, "DPOOL_LOCAL_BARRIER": "0"},
        "no quiet ring": {**auto, "DPOOL_QUIET_RING": "0"},
        "split only": {**auto, **mlx_ring},
    }
    if shim is not None:
        # The trainer keeps LD_PRELOAD when it re-executes itself with OpenBLAS (trainer/blas.py).
        configs[SHIM] = {"OPENBLAS_NUM_THREADS": "1", **mlx_ring, "LD_PRELOAD": str(shim)}
    configs["old"] = {"OPENBLAS_NUM_THREADS": cores, **mlx_ring}
    return configs


def run(tmp: Path, name: str, steps: int, env: dict[str, str]) -> dict[int, dict]:
    job = write_job(
        tmp, "colocated", file="job.toml", base=SMALL, model=DEMO, workers={"balance": False},
        train={"steps": steps, "global_batch": sum(SHARES)}, checkpoint={"every_steps": 10 * steps},
        eval={"every_steps": 10 * steps, "batches": 1, "sample_every_steps": 10 * steps, "sample_tokens": 8},
    )
    run_dir = tmp / name.replace(" ", "-")
    shutil.rmtree(run_dir, ignore_errors=True)
    full = {"DPOOL_CACHE_DIR": str(tmp / "cache"), **env}
    ring.run(job, str(run_dir / "r{rank}"), 3, tmp / "logs", timeout=900, env=full, shares=SHARES)
    return ring.metrics(run_dir / "r0")


# One rank of the all_sum measurement: the demo GPT's gradients as one float32 buffer (3.4 MB),
# summed 30 times by 3 ranks that enter each all_sum together (the barrier), as a step's would.
ALLSUM_RANK = """
import json, statistics, time
import mlx.core as mx
from dpool.trainer.dist import Group
g = Group()
x = mx.ones((850_000,), dtype=mx.float32)
seconds = []
for i in range(30):
    g.wait_for_colocated()
    t = time.perf_counter()
    mx.eval(g.all_sum(x * (i + 1)))
    seconds.append(time.perf_counter() - t)
print(json.dumps({"rank": g.rank, "median_ms": 1000 * statistics.median(seconds[5:])}))
"""


def allsum_ms(tmp: Path, env: dict[str, str]) -> float:
    """The median all_sum time of the slowest of 3 local ranks (a barrier before each)."""
    hostfile = tmp / "allsum-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring.free_ports(3)]))
    procs = [
        subprocess.Popen([sys.executable, "-c", ALLSUM_RANK], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=ring.trainer_env({**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}))
        for r in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return max(json.loads(out.strip().splitlines()[-1])["median_ms"] for out in outs)


def step_seconds(row: dict) -> float:
    return row["tokens"] / row["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, in turn")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args()
    load = os.getloadavg()
    times: dict[str, list[float]] = {}
    curves: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        shim = build_shim(tmp)
        configs = configurations(shim)
        allsum = {"MLX's ring": allsum_ms(tmp, {"DPOOL_QUIET_RING": "0"})}
        if shim is not None:
            allsum["MLX's ring + shim"] = allsum_ms(tmp, {"DPOOL_QUIET_RING": "0", "LD_PRELOAD": str(shim)})
        allsum["quiet ring (default)"] = allsum_ms(tmp, {})
        for _ in range(args.rounds):
            for name, env in configs.items():
                rows = run(tmp, name, args.steps, env)
                times.setdefault(name, []).extend(step_seconds(rows[s]) for s in range(6, args.steps + 1))
                curves[name] = {s: r["loss"] for s, r in rows.items()}
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median.get(SHIM)
    print(f"3 ranks of the demo GPT on {os.cpu_count()} cores, global batch {sum(SHARES)} in shares {SHARES}, "
          f"{args.steps} steps x {args.rounds} round(s), medians of steps 6..{args.steps}")
    print(f"load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load)}; after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'configuration':24} {'step ms':>8} {'vs shim':>8} {'vs old':>7}  largest loss difference vs default")
    for name, m in median.items():
        vs_base = f"{m / base:8.2f}" if base else f"{'-':>8}"
        diff = max(abs(curves[name][s] - curves["default"][s]) for s in curves["default"])
        print(f"{name:24} {1000 * m:8.1f} {vs_base} {m / median['old']:7.2f}  {diff:.2e}")
    print("the step's all_sum alone (3.4 MB, 3 ranks entering together), slowest rank's median: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in allsum.items()))
    if base:
        ratio = median["default"] / base
        print(f"default / shim baseline: {ratio:.2f} (goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    result = {
        "cores": os.cpu_count(), "steps": args.steps, "rounds": args.rounds, "load_before": load, "load_after": os.getloadavg(),
        "median_ms": {k: 1000 * v for k, v in median.items()}, "allsum_ms": allsum,
        "default_over_shim": median["default"] / base if base else None,
        "largest_loss_difference_vs_default": {n: max(abs(curves[n][s] - curves["default"][s]) for s in curves["default"]) for n in curves},
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "step_seconds": times, "losses": curves}))


if __name__ == "__main__":
    main()
