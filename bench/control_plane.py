"""What the control plane costs, each figure next to a baseline measured in the same run.

    python bench/control_plane.py [--steps 60] [--requests 300] [--progress 50000]

1. status round trip: `status` requests to a running coordinator (a `dpd run --serve`), against a
   bare ZeroMQ DEALER/ROUTER echo in this process.
2. progress absorbed: `node.progress` messages a registered node pushes into the coordinator per
   second (decoded, validated, applied to the pool), against a bare ROUTER that only receives them.
3. trainer tokens/s under the daemon (1-slot pool, progress relayed every step) against the same job
   file run by `python -m dpool.trainer` alone. Goal: under 1% slower.
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
import threading
import time
from pathlib import Path

import zmq

from dpool.client.localpool import LocalPool
from dpool.client.rpc import Client
from dpool.protocol import messages as m
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import JobSpec, load_job, parse_job


def bench_job(steps: int) -> JobSpec:
    """The trainer's job: a 2-layer GPT of width 64, 16 sequences of 64 tokens a step, no
    checkpoints or evaluation to measure."""
    return parse_job({
        "name": "bench",
        "workers": {"min": 1, "max": 1},
        "model": {"layers": 2, "dim": 64, "heads": 4, "context": 64},
        "train": {"steps": steps, "global_batch": 16, "warmup_steps": 2, "log_every_steps": 1},
        "checkpoint": {"every_steps": 1_000_000},
        "eval": {"every_steps": 1_000_000, "batches": 1, "sample_every_steps": 1_000_000},
    }, source="bench/control_plane.py")


def row(name: str, value: float, unit: str, base_name: str, base: float, higher_is_better: bool) -> None:
    ratio = value / base if base else float("nan")
    print(f"{name:<34} {value:>12.1f} {unit:<10} baseline {base_name:<28} {base:>12.1f} {unit:<10} ratio {ratio:.3f}" + ("" if higher_is_better else " (lower is better)"))


def bench_status(addr: str, n: int) -> None:
    with Client(addr, 5.0) as c:
        for _ in range(20):
            c.call(m.Status(), m.StatusReply)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.call(m.Status(), m.StatusReply)
            times.append(time.perf_counter() - t0)
    # Baseline: the same two-frame request and reply through a bare echo ROUTER.
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop_echo = threading.Event()

    def echo() -> None:
        while not stop_echo.is_set():
            if router.poll(100):
                router.send_multipart(router.recv_multipart())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    frames = m.Status().to_frames(1)
    base = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        dealer.send_multipart(frames)
        dealer.recv_multipart()
        if i >= 20:
            base.append(time.perf_counter() - t0)
    stop_echo.set()
    t.join()
    dealer.close(0)
    router.close(0)
    ctx.term()
    row("status round trip (median)", statistics.median(times) * 1e6, "us", "bare zmq echo", statistics.median(base) * 1e6, False)
    p99 = sorted(times)[int(0.99 * len(times))]
    row("status round trip (p99)", p99 * 1e6, "us", "bare zmq echo p99", sorted(base)[int(0.99 * len(base))] * 1e6, False)


def bench_progress(addr: str, n: int) -> None:
    msg = m.NodeProgress(job="nojob", generation=1, rank=0, step=1, loss=2.5, tokens=1024, seconds=0.05).to_frames()
    ctx = zmq.Context()
    node = ctx.socket(zmq.DEALER)
    node.setsockopt(zmq.SNDHWM, 0)
    node.connect(addr)
    node.send_multipart(m.NodeRegister(name="bench-feeder", incarnation="x", info={"slots": 0, "advertise": "127.0.0.1"}).to_frames(1))
    assert node.poll(5000)
    reply, _ = m.decode(node.recv_multipart())
    assert isinstance(reply, m.NodeRegistered), reply
    t0 = time.perf_counter()
    for _ in range(n):
        node.send_multipart(msg)
    # A request queued behind them is answered once they are all absorbed.
    node.send_multipart(m.Status().to_frames(99))
    while True:
        assert node.poll(60_000)
        reply, msg_id = m.decode(node.recv_multipart())
        if msg_id == 99:
            break
    rate = n / (time.perf_counter() - t0)
    node.send_multipart(m.NodeBye().to_frames())
    node.close(linger=1000)
    # Baseline: a ROUTER that only receives the same frames.
    sink = ctx.socket(zmq.ROUTER)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    src = ctx.socket(zmq.DEALER)
    src.setsockopt(zmq.SNDHWM, 0)
    src.connect(f"tcp://127.0.0.1:{port}")

    def feed() -> None:
        for _ in range(n):
            src.send_multipart(msg)

    t0 = time.perf_counter()
    th = threading.Thread(target=feed)
    th.start()
    for _ in range(n):
        sink.recv_multipart()
    base = n / (time.perf_counter() - t0)
    th.join()
    src.close(0)
    sink.close(0)
    ctx.term()
    row("progress absorbed", rate, "msg/s", "bare ROUTER recv", base, True)


def tokens_per_s(rows: list[dict]) -> float:
    train = [r["tokens_per_s"] for r in rows if r.get("kind") == "train" and r["step"] > 5]
    return statistics.median(train)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def run_alone(root: Path, job: Path, i: int) -> float:
    run_dir = root / f"alone-{i}"
    env = dict(os.environ, DPOOL_CACHE_DIR=str(root / "cache"))
    subprocess.run([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir)], check=True, capture_output=True, timeout=900, env=env)
    return tokens_per_s([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


def run_under(addr: str, job: Path, daemon_pid: int) -> tuple[float, float]:
    """tokens/s of the job run by the pool, and the daemon's CPU seconds per second of training."""
    with Client(addr, 5.0) as c:
        job_id = c.call(m.Submit(job=load_job(job).to_dict(), source=str(job)), m.Submitted).job_id
        cpu0, t0 = cpu_seconds(daemon_pid), time.monotonic()
        deadline = t0 + 900
        while time.monotonic() < deadline:
            state = c.call(m.Status(job=job_id), m.StatusReply).jobs[0]["state"]
            if state in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        cpu = (cpu_seconds(daemon_pid) - cpu0) / (time.monotonic() - t0)
        if state != "succeeded":
            raise SystemExit(f"the benchmark job ended {state}")
        rows = c.call(m.Metrics(job=job_id), m.MetricsReply).rows
    return tokens_per_s(rows), cpu


def bench_trainer(root: Path, addr: str, steps: int, trials: int, daemon_pid: int) -> None:
    job = root / "bench.toml"
    job.write_text(dump_job(bench_job(steps)))
    run_alone(root, job, -1)  # builds the token cache outside the timed runs
    alone, under, cpu = [], [], []
    for i in range(trials):  # interleaved, so drift in machine load hits both sides
        alone.append(run_alone(root, job, i))
        u, c = run_under(addr, job, daemon_pid)
        under.append(u)
        cpu.append(c)
    a, u = statistics.median(alone), statistics.median(under)
    row("trainer tokens/s under dpd", u, "tok/s", "python -m dpool.trainer alone", a, True)
    print(f"{'':<34} control-plane cost: {100 * (1 - u / a):+.2f}% of the trainer's throughput (goal: < 1%)")
    print(f"{'':<34} trials alone {', '.join(f'{x:.0f}' for x in alone)}; under dpd {', '.join(f'{x:.0f}' for x in under)}")
    print(f"{'':<34} the serving dpd's own CPU while it ran the job: {100 * statistics.median(cpu):.1f}% of one core")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="training steps per trainer run")
    p.add_argument("--trials", type=int, default=3, help="interleaved trainer runs, alone and under dpd")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--progress", type=int, default=50_000)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dpool-bench-"))
    try:
        with LocalPool(root) as pool:
            daemon = pool.start_daemon("bench", serve=True, args=("--log-level", "warning"))
            pool.wait_registered(1)
            bench_status(pool.addr, a.requests)
            bench_progress(pool.addr, a.progress)
            bench_trainer(root, pool.addr, a.steps, a.trials, daemon.pid)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
