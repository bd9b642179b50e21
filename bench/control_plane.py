"""What the control plane costs, each figure next to a baseline measured in the same run.

    python bench/control_plane.py [--steps 60] [--requests 300] [--progress 50000] [--keys] [--no-trainer]
    python bench/control_plane.py --scale 10,100,1000,2000 [--json FILE] [--coordinator-pythonpath DIR]

1. status round trip: `status` requests to a running coordinator (a `dpd run --serve`), against a
   bare ZeroMQ DEALER/ROUTER echo in this process.
2. progress absorbed: `node.progress` messages a registered node pushes into the coordinator per
   second (decoded, validated, applied to the pool), against a bare ROUTER that only receives them.
3. trainer tokens/s under the daemon (1-slot pool, progress relayed every step) against the same job
   file run by `python -m dpool.trainer` alone. Goal: under 1% slower.
With `--keys` the pool runs with CURVE keys (`dpctl keys init` in the bench's folder) and each
baseline uses CURVE too: what the coordinator's own work per message costs with keys (roles, the
allow-list's check). `--no-trainer` leaves out the third, which takes minutes.

`--scale N,...` runs instead, for each N, one coordinator in a process of its own (no node of its
own) and N simulated nodes in another (`bench/simnodes.py`: one DEALER each, the real protocol), and
prints each figure next to its goal:
1. registration: N `node.register` sent at once → the last `node.registered` (goal at 1,000: ≤ 0.5 s);
2. planning: a job of workers.min = workers.max = N (one rank per node) submitted, prepared and
   started, then cancelled, while a probe sends `nodes` back to back: the longest round trip of
   any request during each (goal at 1,000: ≤ 100 ms), and how long each took;
3. convergence: all N not lost in `nodes` once a heartbeat period for several periods, with the
   registration timeouts and re-registrations the nodes needed (goal: 2,000 converge);
4. past jobs: `nodes` round trip with 0 and with 3,000 finished jobs in the pool (goal: flat).
   The 3,000 are submitted and cancelled once, through the protocol, into a coordinator without
   nodes (where that is cheapest); for each N the coordinator is then restarted on a copy of that
   state, on the same address, and the N nodes register again (after `not_registered`, as dpd
   does), which is timed too.
Each N line says the machine's load average: on 2 cores other work shows in every figure.
Heartbeats are dpd's defaults unless flags say otherwise: 0.25 s and liveness 6, the period grown
with the pool by the coordinator (1,000 heartbeats a second in all: 1 s at 1,000 nodes, 2 s at
2,000; daemon/cadence.py), told to the simulated nodes, which adopt it as dpd does; before that
change a coordinator heartbeats every node every 0.25 s. `--coordinator-pythonpath DIR` runs
the coordinator from another checkout's package root (a `dpool/` folder linking its packages), to
measure an older commit against the same simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
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
from typing import Any

import msgpack
import zmq
from simnodes import CoordinatorProcess, SimProcess

from dpool.client.keys import init_keys
from dpool.client.localpool import LocalPool, free_port
from dpool.client.rpc import Client, RemoteError
from dpool.protocol import messages as m
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import JobSpec, load_job, parse_job
from dpool.protocol.payloads import NodeInfo
from dpool.protocol.security import ClientKeys, client_keys, curve_client


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


def curve_pair(server: zmq.Socket, client: zmq.Socket, keys: ClientKeys | None) -> None:
    """A baseline's sockets, with CURVE when the pool has keys (no ZAP handler here: any key is
    admitted, as the pool's own handshake admits the bench's)."""
    if keys is not None:
        server.curve_server = True
        public, secret = zmq.curve_keypair()
        server.curve_secretkey, server.curve_publickey = secret, public
        curve_client(client, ClientKeys(public=keys.public, secret=keys.secret, server_public=public, source=keys.source))


def bench_status(addr: str, n: int, keys: ClientKeys | None = None) -> None:
    with Client(addr, 5.0, keys) as c:
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
    dealer = ctx.socket(zmq.DEALER)
    curve_pair(router, dealer, keys)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop_echo = threading.Event()

    def echo() -> None:
        while not stop_echo.is_set():
            if router.poll(100):
                router.send_multipart(router.recv_multipart())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
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


def bench_progress(addr: str, n: int, keys: ClientKeys | None = None) -> None:
    """`keys`: node bench-feeder's pair, with keys."""
    msg = m.NodeProgress(job="nojob", generation=1, rank=0, step=1, loss=2.5, tokens=1024, seconds=0.05).to_frames()
    ctx = zmq.Context()
    node = ctx.socket(zmq.DEALER)
    if keys is not None:
        curve_client(node, keys)
    node.setsockopt(zmq.SNDHWM, 0)
    node.connect(addr)
    node.send_multipart(m.NodeRegister(name="bench-feeder", incarnation="x", info=NodeInfo(slots=1, advertise="127.0.0.1")).to_frames(1))
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
    src = ctx.socket(zmq.DEALER)
    curve_pair(sink, src, keys)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
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


def run_under(addr: str, job: Path, daemon_pid: int, keys: ClientKeys | None) -> tuple[float, float]:
    """tokens/s of the job run by the pool, and the daemon's CPU seconds per second of training."""
    with Client(addr, 5.0, keys) as c:
        job_id = c.call(m.Submit(job=load_job(job).to_dict(), source=str(job)), m.Submitted).job_id
        cpu0, t0 = cpu_seconds(daemon_pid), time.monotonic()
        deadline = t0 + 900
        while time.monotonic() < deadline:
            state = c.call(m.Status(job=job_id), m.StatusReply).jobs[0].state
            if state in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        cpu = (cpu_seconds(daemon_pid) - cpu0) / (time.monotonic() - t0)
        if state != "succeeded":
            raise SystemExit(f"the benchmark job ended {state}")
        rows = [r.to_wire() for r in c.call(m.Metrics(job=job_id), m.MetricsReply).rows]
    return tokens_per_s(rows), cpu


def bench_trainer(root: Path, addr: str, steps: int, trials: int, daemon_pid: int, keys: ClientKeys | None = None) -> None:
    job = root / "bench.toml"
    job.write_text(dump_job(bench_job(steps)))
    run_alone(root, job, -1)  # builds the token cache outside the timed runs
    alone, under, cpu = [], [], []
    for i in range(trials):  # interleaved, so drift in machine load hits both sides
        alone.append(run_alone(root, job, i))
        u, c = run_under(addr, job, daemon_pid, keys)
        under.append(u)
        cpu.append(c)
    a, u = statistics.median(alone), statistics.median(under)
    row("trainer tokens/s under dpd", u, "tok/s", "python -m dpool.trainer alone", a, True)
    print(f"{'':<34} control-plane cost: {100 * (1 - u / a):+.2f}% of the trainer's throughput (goal: < 1%)")
    print(f"{'':<34} trials alone {', '.join(f'{x:.0f}' for x in alone)}; under dpd {', '.join(f'{x:.0f}' for x in under)}")
    print(f"{'':<34} the serving dpd's own CPU while it ran the job: {100 * statistics.median(cpu):.1f}% of one core")


# -- scale: one coordinator, N simulated nodes ---------------------------------------------------

GOAL_N = 1000  # the size the latency goals are set at
DPD_HEARTBEAT_S, DPD_LIVENESS = 0.25, 6  # what a dpd heartbeats at before a coordinator tells it otherwise
REGISTER_GOAL_S = 0.5
PROBE_GOAL_S = 0.100


class Probe:
    """A dpctl-like DEALER: round trips timed from the send to the reply's arrival, its body
    unpacked only when asked (a 2,000-row `nodes.reply` costs this process, not the coordinator)."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        self.sock.connect(addr)
        self.ids = itertools.count(1)

    def rtt(self, msg: m.Message, timeout: float = 120.0) -> tuple[float, str, bytes]:
        msg_id = next(self.ids)
        t0 = time.perf_counter()
        self.sock.send_multipart(msg.to_frames(msg_id))
        while True:
            left = timeout - (time.perf_counter() - t0)
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"no reply to {msg.TYPE} within {timeout}s")
            header, body = self.sock.recv_multipart()
            dt = time.perf_counter() - t0
            msg_type, got_id = m.decode_header(header)
            if got_id == msg_id:
                return dt, str(msg_type), body

    def ask(self, msg: m.Message, timeout: float = 120.0) -> tuple[float, dict]:
        dt, msg_type, body = self.rtt(msg, timeout)
        reply = msgpack.unpackb(body, raw=False)
        if msg_type == "error":
            raise RemoteError(reply["code"], reply["message"])
        return dt, reply

    def pipelined(self, requests: list[m.Message], window: int = 32, timeout: float = 120.0) -> list[str]:
        """Send `requests` in order, `window` in flight; the types of the replies, in order."""
        todo, sent, types = iter(requests), 0, []
        first = next(self.ids)
        self.ids = itertools.count(first + len(requests))
        for msg in itertools.islice(todo, window):
            self.sock.send_multipart(msg.to_frames(first + sent))
            sent += 1
        while len(types) < sent:
            if not self.sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"no reply within {timeout}s ({len(types)} of {len(requests)} answered)")
            header, _ = self.sock.recv_multipart()
            types.append(str(m.decode_header(header)[0]))
            msg = next(todo, None)
            if msg is not None:
                self.sock.send_multipart(msg.to_frames(first + sent))
                sent += 1
        return types

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def scale_job(name: str, workers: int) -> dict:
    """One rank per simulated node, nothing to time out while a big group is being started."""
    return parse_job({
        "name": name,
        "workers": {"min": workers, "max": workers},
        "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
        "train": {"steps": 1_000_000, "global_batch": workers, "warmup_steps": 1},
        "checkpoint": {"every_steps": 1_000_000},
        "eval": {"every_steps": 1_000_000, "batches": 1, "sample_every_steps": 1_000_000},
        "recovery": {"start_timeout_s": 600.0, "step_timeout_floor_s": 600.0},
    }, source="bench/control_plane.py --scale").to_dict()


def summary(latencies: list[tuple[str, float]]) -> dict:
    """The worst round trip of a phase (and of which request), the median and the count."""
    if not latencies:
        return {"worst_s": None, "worst_of": None, "median_s": None, "requests": 0}
    kind, worst = max(latencies, key=lambda x: x[1])
    return {"worst_s": worst, "worst_of": kind, "median_s": statistics.median(x for _, x in latencies), "requests": len(latencies)}


def nodes_latency(probe: Probe, k: int) -> dict:
    probe.rtt(m.Nodes())
    times = [probe.rtt(m.Nodes())[0] for _ in range(k)]
    return {"median_s": statistics.median(times), "max_s": max(times), "requests": k}


def alive_nodes(probe: Probe) -> int:
    _, reply = probe.ask(m.Nodes())
    return sum(row["state"] != "lost" for row in reply["nodes"])


def plan_and_cancel(probe: Probe, sim: SimProcess, n: int, timeout: float) -> dict:
    """Submit a job of N ranks, probe `nodes` back to back until it runs; cancel it, probe until
    every slot is free again. Times from the submit (the cancel) to the last group.prepare, the
    last group.start (hellos sent) and `running` (the last group.stop, every slot idle)."""
    out: dict[str, Any] = {}
    sim.events.clear()
    sim.send("watch")
    sim.wait("watching", 30)
    lat: list[tuple[str, float]] = []
    t0 = time.monotonic()
    dt, reply = probe.ask(m.Submit(job=scale_job("scale", n), source="bench"))
    lat.append(("submit", dt))
    job_id = reply["job_id"]
    running_at, checked, state = None, 0.0, "?"
    while time.monotonic() - t0 < timeout:
        lat.append(("nodes", probe.rtt(m.Nodes())[0]))
        sim.poll()
        if "group.start" in sim.events and time.monotonic() - checked > 0.2:
            dt, reply = probe.ask(m.Status(job=job_id))
            lat.append(("status", dt))
            checked, state = time.monotonic(), reply["jobs"][0]["state"]
            if state == "running":
                running_at = checked
                break
    ev = sim.events
    out["plan"] = {
        "prepare_all_s": ev["group.prepare"][1] - t0 if "group.prepare" in ev else None,
        "start_all_s": ev["group.start"][1] - t0 if "group.start" in ev else None,
        "running_s": running_at - t0 if running_at else None,
        "state": state if running_at else probe.ask(m.Status(job=job_id))[1]["jobs"][0]["state"],
        **summary(lat),
    }
    sim.events.clear()
    sim.send("watch")
    sim.wait("watching", 30)
    lat = []
    t0 = time.monotonic()
    dt, reply = probe.ask(m.Cancel(job=job_id))
    lat.append(("cancel", dt))
    idle_at = None
    while time.monotonic() - t0 < timeout:
        dt, _, body = probe.rtt(m.Nodes())
        lat.append(("nodes", dt))
        sim.poll()
        if "group.stop" in sim.events and all(r["busy_slots"] == 0 for r in msgpack.unpackb(body, raw=False)["nodes"]):
            idle_at = time.monotonic()
            break
    ev = sim.events
    out["cancel"] = {
        "reply_s": lat[0][1],
        "stop_all_s": ev["group.stop"][1] - t0 if "group.stop" in ev else None,
        "idle_s": idle_at - t0 if idle_at else None,
        "state": probe.ask(m.Status(job=job_id))[1]["jobs"][0]["state"],
        **summary(lat),
    }
    return out


def past_jobs(probe: Probe, count: int) -> dict:
    """`count` jobs submitted and cancelled, pipelined, into a pool without nodes (each waits in
    the queue, alone, until its cancel ends it)."""
    base = scale_job("past", 1)
    requests: list[m.Message] = []
    for i in range(count):
        requests += [m.Submit(job={**base, "name": f"past-{i}"}, source="bench"), m.Cancel(job=f"past-{i}")]
    t0 = time.monotonic()
    types = probe.pipelined(requests)
    return {"count": count, "seconds": time.monotonic() - t0, "errors": sum(t == "error" for t in types)}


def prefill(root: Path, a: argparse.Namespace) -> dict:
    """A coordinator state dir holding `--past-jobs` finished jobs, made once through the protocol
    by a coordinator without nodes (where a submit is cheapest); each size's second coordinator
    starts from a copy of it."""
    coord = CoordinatorProcess(root, a.heartbeat_interval, a.liveness, heartbeat_rate=a.heartbeat_rate, pythonpath=a.coordinator_pythonpath, log_level="warning")
    probe = Probe(coord.addr)
    try:
        return past_jobs(probe, a.past_jobs)
    finally:
        probe.close()
        coord.stop()


def wait_alive(probe: Probe, n: int, timeout: float) -> float | None:
    """Seconds until `nodes` shows all n not lost (None: not within timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if alive_nodes(probe) == n:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def scale_run(n: int, a: argparse.Namespace, past_state: Path | None) -> dict:
    """Coordinator A (fresh): registration, convergence, `nodes` with no past jobs, planning and
    cancel. Then A stops and coordinator B starts on the same address from a copy of the
    past-jobs state dir (a coordinator restart): the nodes re-register, as dpd does after
    `not_registered`, and `nodes` is timed again."""
    out: dict[str, Any] = {"n": n, "load_avg_1m": os.getloadavg()[0]}
    root = Path(tempfile.mkdtemp(prefix=f"dpool-scale-{n}-"))
    coord = sim = probe = None
    addr = f"tcp://127.0.0.1:{free_port()}"

    def coordinator(where: str) -> CoordinatorProcess:
        return CoordinatorProcess(
            root / where, a.heartbeat_interval, a.liveness, heartbeat_rate=a.heartbeat_rate, addr=addr, pythonpath=a.coordinator_pythonpath, log_level=a.log_level
        )

    try:
        coord = coordinator("a")
        out["coordinator"] = coord.pool_file
        # The nodes start as dpd does (its defaults, or the flags it was given) and adopt what the coordinator tells them.
        sim = SimProcess(addr, n, a.heartbeat_interval or DPD_HEARTBEAT_S, a.liveness or DPD_LIVENESS, a.step_s)
        sim.wait("ready", 60 + n / 20)
        probe = Probe(addr)
        # 1. registration
        sim.send("register")
        deadline = time.monotonic() + a.register_timeout
        while sim.registered_at is None and time.monotonic() < deadline:
            sim.poll(0.2)
        if sim.registered_at is not None:
            out["register_s"] = sim.registered_at[1] - sim.registered_at[0]
        else:
            out["register_s"] = None
            out["registered_in_time"] = sim.stats()["registered"]
        # 3. convergence, once a heartbeat period (and the coordinator's CPU under heartbeats alone):
        # the longest period a node was told (a pool's period grows with it: daemon/cadence.py)
        cpu0, t0 = cpu_seconds(coord.pid), time.monotonic()
        alive = []
        periods = sim.stats()["periods"]
        hb = max(periods, default=DPD_HEARTBEAT_S)
        for _ in range(a.converge_periods):
            time.sleep(hb)
            alive.append(alive_nodes(probe))
        out["period_s"] = max(sim.stats()["periods"], default=hb)
        out["converge"] = {"periods": a.converge_periods, "period_s": hb, "min_alive": min(alive), "samples": alive}
        out["heartbeat_cpu"] = (cpu_seconds(coord.pid) - cpu0) / (time.monotonic() - t0)
        out["nodes_0"] = nodes_latency(probe, a.nodes_requests)
        # 2. planning and cancel
        out.update(plan_and_cancel(probe, sim, n, a.plan_timeout))
        out["alive_at_end"] = alive_nodes(probe)
        c = sim.stats()["counts"]
        out["converge"].update(
            converged=out["register_s"] is not None and min(alive) == n and out["alive_at_end"] == n,
            register_timeouts=c.get("register_timeouts", 0),
            reregistrations=c.get("registrations", 0) - n,
            coordinator_lost=c.get("coordinator_lost", 0),
            not_registered=c.get("not_registered", 0),
        )
        out["coordinator_cpu_s"] = cpu_seconds(coord.pid)
        # 4. past jobs: a restart into a state with them
        if past_state is not None:
            coord.stop()
            shutil.copytree(past_state, root / "b" / "state")
            t0 = time.monotonic()
            coord = coordinator("b")
            back = wait_alive(probe, n, a.register_timeout)
            out["restart"] = {"all_back_s": None if back is None else time.monotonic() - t0}
            out["nodes_past"] = nodes_latency(probe, max(1, a.nodes_requests // 2))
            out["nodes_past"]["past_jobs"] = a.past_jobs
        out["sim"] = sim.stats()["counts"]
    except (TimeoutError, RuntimeError, RemoteError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if probe is not None:
            probe.close()
        if sim is not None:
            sim.stop()
        if coord is not None:
            coord.stop()
        tb = sum(f.read_text(errors="replace").count("Traceback") for f in root.glob("*/coordinator.log"))
        if tb:
            out["coordinator_tracebacks"] = tb
        shutil.rmtree(root, ignore_errors=True)
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def sec(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def show_scale(r: dict, a: argparse.Namespace) -> None:
    n, at_goal = r["n"], " (goal set at 1,000)" if r["n"] != GOAL_N else ""
    print(f"\nN = {n} simulated nodes; coordinator {r.get('coordinator', '?')}; load average {r['load_avg_1m']:.1f}")

    def line(name: str, value: str, goal: str = "") -> None:
        print(f"  {name:<58} {value:<34} {goal}".rstrip())

    line("registration: N node.register → all node.registered", sec(r.get("register_s")) if r.get("register_s") is not None else f"not all in {a.register_timeout:.0f} s ({r.get('registered_in_time', '?')} of {n})", f"goal ≤ {REGISTER_GOAL_S} s{at_goal}")
    cv = r.get("converge")
    if cv:
        conv = "yes" if cv.get("converged") else "NO"
        line(f"convergence: not lost in `nodes` over {cv['periods']} periods", f"{conv}: min {cv['min_alive']}/{n}, end {r.get('alive_at_end', '?')}/{n}", "goal: yes (2,000 must)")
        line("  registration timeouts / re-registrations / coord. lost", f"{cv.get('register_timeouts', '?')} / {cv.get('reregistrations', '?')} / {cv.get('coordinator_lost', '?')}")
        line("  period told (longest) / coord. CPU, heartbeats alone", f"{r.get('period_s', 0):g} s / {100 * r['heartbeat_cpu']:.0f}% of a core")
    for phase, title in (("plan", "planning"), ("cancel", "cancel")):
        p = r.get(phase)
        if not p:
            continue
        line(f"{title}: worst request round trip ({p['requests']} requests)", f"{ms(p['worst_s'])} ({p['worst_of']}), median {ms(p['median_s'])}", f"goal ≤ {PROBE_GOAL_S * 1000:.0f} ms{at_goal}")
        if phase == "plan":
            line("  submit → all group.prepare / all group.start / running", f"{sec(p['prepare_all_s'])} / {sec(p['start_all_s'])} / {sec(p['running_s'])}", f"state {p['state']}")
        else:
            line("  cancel → cancel.reply / all group.stop / all slots idle", f"{ms(p['reply_s'])} / {sec(p['stop_all_s'])} / {sec(p['idle_s'])}", f"state {p['state']}")
    if "nodes_0" in r:
        line("nodes round trip, no past jobs (median, max)", f"{ms(r['nodes_0']['median_s'])}, {ms(r['nodes_0']['max_s'])}")
    if "coordinator_cpu_s" in r:
        line("coordinator CPU, start to cancelled", f"{r['coordinator_cpu_s']:.1f} s")
    if "restart" in r:
        line("restart with past jobs → all N registered again", sec(r["restart"]["all_back_s"]))
    if "nodes_past" in r:
        p, ratio = r["nodes_past"], r["nodes_past"]["median_s"] / r["nodes_0"]["median_s"]
        line(f"nodes round trip, {p['past_jobs']} past jobs (median, max)", f"{ms(p['median_s'])}, {ms(p['max_s'])}", f"ratio {ratio:.2f} (goal: flat, ~1)")
    if r.get("coordinator_tracebacks"):
        line("coordinator log: tracebacks", str(r["coordinator_tracebacks"]))
    if "error" in r:
        line("stopped early", r["error"])


def bench_scale(a: argparse.Namespace) -> None:
    sizes = [int(x) for x in a.scale.split(",") if x.strip()]
    given = [f"{k} {getattr(a, k):g}" for k in ("heartbeat_interval", "liveness", "heartbeat_rate") if getattr(a, k) is not None]
    print(f"control plane at scale: {', '.join(given) if given else 'dpd defaults'} (heartbeat period grown with the pool), "
          f"fake trainer step {a.step_s:g} s, {os.cpu_count()} CPUs")
    runs: list[dict] = []
    filled: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="dpool-scale-"))
    try:
        if a.past_jobs:
            filled = prefill(root / "past", a)
            print(f"{a.past_jobs} past jobs submitted and cancelled (no nodes): {filled['seconds']:.1f} s, {filled['errors']} errors")
        for n in sizes:
            r = scale_run(n, a, root / "past" / "state" if a.past_jobs else None)
            show_scale(r, a)
            runs.append(r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if a.json:
        config = {k: getattr(a, k) for k in ("scale", "heartbeat_interval", "liveness", "heartbeat_rate", "step_s", "past_jobs", "converge_periods", "coordinator_pythonpath")}
        text = json.dumps({"config": config, "prefill": filled, "runs": runs}, indent=2)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text + "\n")


def wait_registered(pool: LocalPool, keys: ClientKeys | None, timeout: float = 60.0) -> None:
    """The bench's daemon registered (LocalPool's own wait asks without keys)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool.check_alive()
        with contextlib.suppress(Exception), Client(pool.addr, 1.0, keys) as c:
            if c.call(m.Nodes(), m.NodesReply).nodes:
                return
        time.sleep(0.2)
    raise SystemExit(f"the bench's daemon did not register within {timeout:.0f}s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="training steps per trainer run")
    p.add_argument("--trials", type=int, default=3, help="interleaved trainer runs, alone and under dpd")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--progress", type=int, default=50_000)
    p.add_argument("--keys", action="store_true", help="run the pool with CURVE keys (and the baselines with CURVE)")
    p.add_argument("--no-trainer", dest="trainer", action="store_false", help="leave out the trainer's tokens/s")
    s = p.add_argument_group("--scale: one coordinator and N simulated nodes (instead of the benches above)")
    s.add_argument("--scale", metavar="N,N,...", help="simulated pool sizes, e.g. 10,100,1000,2000")
    s.add_argument("--heartbeat-interval", dest="heartbeat_interval", type=float, help="the coordinator's and the nodes' (default: dpd's, 0.25)")
    s.add_argument("--liveness", type=int, help="the coordinator's and the nodes' (default: dpd's, 6)")
    s.add_argument("--heartbeat-rate", dest="heartbeat_rate", type=float, help="the coordinator's budget of heartbeats a second (default: dpd's, 1000)")
    s.add_argument("--step-s", dest="step_s", type=float, default=1.0, help="the fake trainer's step time: a node.progress per rank this often (default 1)")
    s.add_argument("--past-jobs", dest="past_jobs", type=int, default=3000, help="finished jobs in the restarted coordinator of the second `nodes` timing (default 3000; 0: skip)")
    s.add_argument("--converge-periods", dest="converge_periods", type=int, default=8, help="heartbeat periods `nodes` is sampled for (default 8: past a node's expiry, liveness 6 x its period)")
    s.add_argument("--nodes-requests", dest="nodes_requests", type=int, default=6, help="timed `nodes` round trips with no past jobs (half as many with them)")
    s.add_argument("--register-timeout", dest="register_timeout", type=float, default=120.0)
    s.add_argument("--plan-timeout", dest="plan_timeout", type=float, default=180.0, help="the most a start (a cancel) is waited for")
    s.add_argument("--coordinator-pythonpath", dest="coordinator_pythonpath", metavar="DIR", help="put DIR first on the coordinator's PYTHONPATH (another checkout's package root)")
    s.add_argument("--log-level", dest="log_level", default="info", help="the coordinator's (default info, as dpd's)")
    s.add_argument("--json", metavar="FILE", help="also write the figures as JSON (- : stdout)")
    a = p.parse_args()
    if a.scale:
        bench_scale(a)
        return 0
    root = Path(tempfile.mkdtemp(prefix="dpool-bench-"))
    try:
        keys = root / "keys"
        if a.keys:
            init_keys(keys, nodes=["bench", "bench-feeder"])
        client, feeder = (client_keys(keys, "client"), client_keys(keys, "node", "bench-feeder")) if a.keys else (None, None)
        with LocalPool(root) as pool:
            daemon = pool.start_daemon("bench", serve=True, args=("--log-level", "warning", *(("--keys", str(keys)) if a.keys else ())))
            wait_registered(pool, client)
            bench_status(pool.addr, a.requests, client)
            bench_progress(pool.addr, a.progress, feeder)
            if a.trainer:
                bench_trainer(root, pool.addr, a.steps, a.trials, daemon.pid, client)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
