"""How fast the pool stages a job's files, on links shaped like 1 GbE: into one node, onto four, a
second submit, a source killed half way, and staging beside a training group.

    sudo python bench/staging.py [--size 1GiB] [--stage-rate RATE] [--window-steps 30] [--rounds 2] [--json FILE] [--keep]
    python bench/staging.py --loopback --size 8MiB    (every host on loopback, nothing shaped)

The hosts: a network namespace each for the submitting laptop and for every node (n0 serves the
coordinator), each joined to one bridge by a veth pair whose two ends are shaped (both directions)
to 1 Gbit/s with 0.2 ms of delay (netem), or to 1 Gbit/s alone (tbf) where the kernel has no
netem; every dpd runs in its namespace (`ip netns exec`) with `--advertise` its address and
`--insecure` (no keys on these addresses), and its own HOME. The job's files are a folder of a few
files of random bytes (`--size` in all, made once) under the laptop's HOME alone, named
`~/blob` in the job: `dpctl submit`, run in the laptop's namespace as a user runs it, hashes them
and sends them into n0 (the pool's only node then); every other node fetches them from the nodes
that hold them. A staging job is parked (workers.min above the pool's slots): every node stages
its files, none trains it. Times are the coordinator's events: a node's `node.staging` (it began
fetching) and `node.staged` (its `seconds` and `bytes`).

Each figure beside its baseline, measured in the same run:

1. The files to one node (n1 fetches from n0): the pool's time against a raw TCP copy of the same
   files over the same links (a Python sender's sendfile and a receiver that writes them, in n0's
   and n1's namespaces; the mean of one just before and one just after); raw / pool, goal >= 0.9.
   Beside it, dpctl's upload into n0 (laptop -> n0) against raw copies laptop -> n0 the same way:
   the first submit's wall time less the second's (which sends nothing: the same start-up, offer
   and submit; the files are hashed beforehand into the laptop's hash cache, so neither hashes
   them).
2. The files to 4 nodes at once (n3..n6, one submit once all four are up): from the first
   `node.staging` to the last `node.staged`, against the one-node time of figure 1; goal <= 1.5x (a
   star from one source would be ~4x). The bytes each host sent say whether the fetchers chained.
3. A second submit of the same files: dpctl's "sending ..." line (printed only when it sends) and
   the bytes that crossed the laptop's link, against the first submit's; goal 0 bytes of files.
4. The source killed half way: n2 fetches from n0 and n1 (both hold the files); once half the
   files have crossed n2's link, n1's dpd is SIGKILLed. It must complete; the bytes re-sent are
   n2's received bytes less n1's in figure 1 (the same files, no kill), against what was in flight
   from n1 (at most a window of 8 chunks of 4 MiB).
5. Staging beside training: a 3-rank GPT group (n0, n3, n4, which hold the files) trains while a
   fresh node stages the files from them (paced by the coordinator while its sources train:
   `--stage-rate`, the dpd default when not given); `--rounds` fresh nodes (n7, n8, ...) do so one
   after the other, each after a window of `--window-steps` steps without staging, and one more
   window ends it (a new dpd's start-up falls in no window). The median step time of the steps
   done while a node staged against those of the windows without; goal <= 1.1x. A step's time is
   its metrics row's tokens over its tokens/s; when it reached the coordinator, from the job's
   status polled every 50 ms.

Every namespace, link and process is ended at the end (processes by PID), on failure, Ctrl-C and
SIGTERM too; the temporary folder (files, logs) is kept with --keep or when a figure fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from dpool.client.localpool import STOP_TIMEOUT_S, LocalPool, LocalPoolError, free_port, wait_for
from dpool.client.rpc import pages
from dpool.daemon.fitness import TRAINING_RATE_BPS
from dpool.protocol import messages as m
from dpool.protocol.config import parse_size
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import parse_job
from dpool.protocol.stage_messages import StageOffer, StageOfferReply
from dpool.staging.channel import WINDOW
from dpool.staging.manifest import CHUNK_BYTES, HashCache, scan

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import netns  # a sibling script: the hosts' namespaces and shaped links
    import recovery  # a sibling script: the event log, the training job, the pool's end
finally:
    sys.path.remove(str(HERE))  # bench/mlx_lm.py would shadow mlx-lm itself

LAPTOP = "laptop"  # the host dpctl runs on: it alone has the files
NODES = ("n0", "n1", "n2", "n3", "n4", "n5", "n6")
FANOUT = ("n3", "n4", "n5", "n6")  # figure 2's fetchers
TRAINERS = ("n0", "n3", "n4")  # figure 5's group, holders of the files by then
RATE, DELAY = "1gbit", "0.2ms"
COORDINATOR_PORT = 7340
RAW_GOAL, FANOUT_GOAL, STEP_GOAL = 0.9, 1.5, 1.1
PARKED = 64  # a staging job's workers.min: above the pool's slots, so it stages and never trains
FILES = 4  # the files the job's data is split into
QUIET_CPU = 0.05  # a new dpd is settled once it uses less than this share of a core
GIB, MIB = 1 << 30, 1 << 20

RECEIVER = r"""
import json, os, socket, sys, time
host, port, out, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
server = socket.create_server((host, port))
print("listening", flush=True)
conn, _ = server.accept()
t0 = time.perf_counter()
buf = memoryview(bytearray(4 << 20))
for i, size in enumerate(sizes):
    with open(os.path.join(out, f"part-{i}"), "wb") as f:
        left = size
        while left:
            n = conn.recv_into(buf, min(left, len(buf)))
            if not n:
                sys.exit(f"the sender closed after {sum(sizes[:i]) + size - left} bytes")
            f.write(buf[:n])
            left -= n
print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
"""
SENDER = r"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    for path in sys.argv[3:]:
        with open(path, "rb") as f:
            s.sendfile(f)
"""


BenchError = recovery.BenchError  # a figure could not be measured: which, and why


def size_arg(text: str) -> int:
    try:
        return parse_size(text) or 0
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 1GiB, 64MiB or 8MB") from None


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= 0.1 * GIB else f"{n / MIB:.1f} MiB" if abs(n) >= 0.1 * MIB else f"{n / 1024:.1f} KiB"


# -- the hosts -----------------------------------------------------------------------------------


class Namespaces(netns.Namespaces):
    """A namespace per host (bench/netns.py), shaped to RATE and DELAY at each end unless asked not to;
    `counters(host)` reads the host's link from the bridge side."""

    def __init__(self, hosts: Sequence[str], *, shape: bool = True) -> None:
        super().__init__(hosts, rate=RATE if shape else None, delay=DELAY if shape else None, name="dpsb", veth="sb")

    def daemon_args(self, host: str) -> list[str]:
        return ["--insecure", "--advertise", self.addrs[host]]


class Loopback:
    """Every host on 127.0.0.1, nothing shaped, no per-host link to count: the bench's smallest form."""

    tag = ""
    shaping = "none: every host on loopback"

    def up(self) -> None:
        pass

    def down(self) -> None:
        pass

    def prefix(self, host: str) -> list[str]:
        return []

    def address(self, host: str) -> str:
        return "127.0.0.1"

    def daemon_args(self, host: str) -> list[str]:
        return []

    def counters(self, host: str) -> tuple[int, int] | None:
        return None


Net = Namespaces | Loopback


class Link:
    """A host's link counters from now on (None where the hosts share loopback)."""

    def __init__(self, net: Net, host: str) -> None:
        self.net, self.host = net, host
        self.start = net.counters(host)

    def into(self) -> int | None:
        now = self.net.counters(self.host)
        return None if now is None or self.start is None else now[0] - self.start[0]

    def out_of(self) -> int | None:
        now = self.net.counters(self.host)
        return None if now is None or self.start is None else now[1] - self.start[1]


# -- the pool ------------------------------------------------------------------------------------


class StagingPool(LocalPool):
    """Real dpds, each in its host's namespace with its own HOME (ROOT/home-NAME), and dpctl run in
    the laptop's namespace with the laptop's HOME, which alone holds the job's files."""

    def __init__(self, root: Path, net: Net, *, stage_rate: str | None) -> None:
        port = COORDINATOR_PORT if isinstance(net, Namespaces) else free_port()
        super().__init__(root, addr=f"tcp://{net.address('n0')}:{port}", env={"DPOOL_WARM": "0"})
        self.net, self.stage_rate = net, stage_rate

    def home(self, host: str) -> Path:
        return self.root / f"home-{host}"

    def prefix(self, name: str, serve: bool) -> list[str]:
        self.home(name).mkdir(parents=True, exist_ok=True)
        return [*self.net.prefix(name), "env", f"HOME={self.home(name)}"]

    def start_node(self, name: str) -> None:
        serving = name == "n0"
        rate = ["--stage-rate", self.stage_rate] if serving and self.stage_rate is not None else []
        self.start_daemon(name, serve=serving, args=[*self.net.daemon_args(name), *rate])

    def stop_node(self, name: str, sig: signal.Signals = signal.SIGTERM) -> None:
        """End one dpd (its process group) by its PID: SIGTERM (it says bye) or SIGKILL (it is lost)."""
        d = self.daemons.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(d.pid, sig)
        try:
            d.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(d.pid, signal.SIGKILL)
            d.proc.wait()

    def wait_nodes(self, names: Sequence[str], timeout: float = 90.0) -> None:
        def up() -> bool:
            self.check_alive()
            return set(names) <= {n.name for n in self.nodes() if n.state != "lost"}
        wait_for(f"nodes {', '.join(names)} registered", up, timeout, every=0.2)

    def dpctl(self, *args: str, timeout: float = 900.0) -> tuple[subprocess.CompletedProcess[str], float]:
        """dpctl as the laptop's user runs it: (its result, its wall time)."""
        env = {k: v for k, v in os.environ.items() if k not in ("DPOOL_COORDINATOR", "DPOOL_KEYS", "XDG_CACHE_HOME")}
        cmd = [*self.net.prefix(LAPTOP), sys.executable, "-m", "dpool.client.cli", "--coordinator", self.addr, *args]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env | {"HOME": str(self.home(LAPTOP))}, cwd=self.root)
        return r, time.monotonic() - t0

    def submit_files(self, job_file: Path) -> tuple[str, bool, float]:
        """`dpctl submit` from the laptop: (the job's id, whether it sent files, its wall time)."""
        r, wall = self.dpctl("submit", str(job_file))
        if r.returncode != 0:
            raise BenchError(f"dpctl submit {job_file.name} exited {r.returncode}: {r.stderr.strip()[-1500:]}")
        return r.stdout.strip().splitlines()[-1], "sending " in r.stderr, wall

    def cancel(self, job: str) -> None:
        self.call(m.Cancel(job=job), m.CancelReply)


@dataclasses.dataclass(frozen=True, slots=True)
class Staged:
    """One node's fetch of a job's files, as the coordinator recorded it."""

    node: str
    began: float  # node.staging's time
    ended: float  # node.staged's time
    seconds: float
    bytes: int


def wait_staged(pool: StagingPool, job: str, names: Sequence[str], timeout: float) -> dict[str, Staged]:
    """Each of `names` done fetching the job's files (`node.staged`); a node.unfit for one fails."""
    def check() -> dict[str, Staged] | None:
        pool.check_alive()
        rows = recovery.events(pool, job)
        for e in rows:
            if e.kind == "node.unfit" and e.fields.get("node") in names:
                raise BenchError(f"{e.fields['node']} cannot stage job {job}: {e.fields.get('reason')}")
        began = {e.fields["node"]: e.t for e in rows if e.kind == "node.staging"}
        done = {e.fields["node"]: e for e in rows if e.kind == "node.staged"}
        if not all(n in done for n in names):
            return None
        return {
            n: Staged(n, began.get(n, done[n].t), done[n].t, float(done[n].fields.get("seconds") or 0.0), int(done[n].fields.get("bytes") or 0))
            for n in names
        }
    return wait_for(f"{', '.join(names)} to stage job {job}", check, timeout, every=0.1)


def stagers(rounds: int) -> list[str]:
    """Figure 5's fresh nodes, one a round: n7, n8, ..."""
    return [f"n{len(NODES) + i}" for i in range(rounds)]


def parked(name: str) -> dict[str, Any]:
    """A job whose data is `~/blob` (the laptop's files), parked: every node stages it, none trains it."""
    return {"name": name, "workers": {"min": PARKED, "max": PARKED}, "data": {"source": "~/blob"}, "train": {"global_batch": PARKED}}


def staging_job(folder: Path, name: str) -> Path:
    """`parked(name)` as a job file, for dpctl."""
    path = folder / f"{name}.toml"
    path.write_text(dump_job(parse_job(parked(name), source=str(path), base_dir=str(folder))))
    return path


def make_files(folder: Path, size: int) -> list[Path]:
    """`size` random bytes in FILES files (fewer when smaller), written once."""
    folder.mkdir(parents=True)
    n = max(1, min(FILES, size))
    paths = []
    for i in range(n):
        path = folder / f"part-{i}.txt"
        with open(path, "wb") as f:
            left = size // n + (1 if i < size % n else 0)
            while left:
                piece = os.urandom(min(left, 16 * MIB))
                f.write(piece)
                left -= len(piece)
        paths.append(path)
    return paths


def raw_copy(net: Net, src: str, dst: str, files: Sequence[Path], out: Path) -> float:
    """Seconds a raw TCP copy of `files` takes from host `src` to host `dst` (a Python sender's
    sendfile, a receiver that writes them to `out`), from the receiver's accept to its last byte."""
    out.mkdir(parents=True)
    port = free_port()
    sizes = json.dumps([p.stat().st_size for p in files])
    recv = subprocess.Popen([*net.prefix(dst), sys.executable, "-c", RECEIVER, net.address(dst), str(port), str(out), sizes],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "listening":
            raise BenchError(f"the raw receiver on {dst} did not start: {recv.communicate(timeout=10)[1].strip()[-500:]}")
        sent = subprocess.run([*net.prefix(src), sys.executable, "-c", SENDER, net.address(dst), str(port), *map(str, files)],
                              capture_output=True, text=True, timeout=600)
        if sent.returncode != 0:
            raise BenchError(f"the raw sender on {src} failed: {sent.stderr.strip()[-500:]}")
        got, err = recv.communicate(timeout=600)
        if recv.returncode != 0:
            raise BenchError(f"the raw receiver on {dst} failed: {err.strip()[-500:]}")
        return float(json.loads(got.strip().splitlines()[-1])["seconds"])
    finally:
        if recv.poll() is None:
            os.killpg(recv.pid, signal.SIGKILL)
            recv.wait()
        shutil.rmtree(out, ignore_errors=True)


def settle(pid: int, timeout: float = 60.0) -> None:
    """Until the process and its children use less than QUIET_CPU of a core (a new dpd's imports)."""
    def cpu() -> float:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            return sum(sum(q.cpu_times()[:2]) for q in [p, *p.children(recursive=True)])
        return 0.0
    last = [cpu(), time.monotonic()]

    def quiet() -> bool:
        now_cpu, now = cpu(), time.monotonic()
        share = (now_cpu - last[0]) / max(1e-6, now - last[1])
        last[:] = [now_cpu, now]
        return share < QUIET_CPU
    wait_for(f"pid {pid} to settle", quiet, timeout, every=1.0)


class CpuMeter:
    """The CPU time processes (not their children: a dpd's trainers are its children) use from now."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.procs = [psutil.Process(pid) for pid in pids]
        self.start, self.at = self.used(), time.monotonic()

    def used(self) -> float:
        total = 0.0
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def seconds(self) -> float:
        return self.used() - self.start

    def share(self) -> float:
        """Of one core, on average since the meter was made."""
        return self.seconds() / max(1e-6, time.monotonic() - self.at)


def children_cpu() -> float:
    """CPU seconds this process's ended children used (the raw copies, dpctl)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class StepClock(threading.Thread):
    """When each step of a job reached the coordinator: its status polled every 50 ms."""

    def __init__(self, pool: StagingPool, job: str) -> None:
        super().__init__(daemon=True)
        self.pool, self.job = pool, job
        self.seen: dict[int, float] = {}
        self.stopping = threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            s = self.pool.status(self.job)
            if s is not None and s.step:
                self.seen.setdefault(s.step, time.time())

    def step(self) -> int:
        return max(self.seen, default=0)

    def times(self) -> dict[int, float]:
        """Each step's time: the first poll that showed it or a later one (a step between polls)."""
        out, t = {}, float("inf")
        for step in range(self.step(), 0, -1):
            t = min(t, self.seen.get(step, t))
            out[step] = t
        return out

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def step_seconds(pool: StagingPool, job: str) -> dict[int, float]:
    """Each step's time from its (last) metrics row: its tokens over its tokens/s."""
    rows = [r for page in pages(lambda after: pool.call(m.Metrics(job=job, after=after), m.MetricsReply)) for r in page.rows if r.kind == "train"]
    return {r.step: r.tokens / r.tokens_per_s for r in rows if r.tokens_per_s > 0}


# -- the figures -----------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Figure:
    key: str
    label: str
    value: str
    baseline: str
    ratio: str
    goal: str
    met: bool | None  # None: not measured here (the line says why)
    notes: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    def lines(self) -> list[str]:
        verdict = "n/a" if self.met is None else "met" if self.met else "NOT met"
        out = [f"{self.key:3} {self.label}", f"      {self.value}   vs   {self.baseline}   ->   {self.ratio}   (goal {self.goal}: {verdict})"]
        return out + [f"      {n}" for n in self.notes]


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, net: Net) -> None:
        self.args, self.root, self.net = args, root, net
        self.size: int = args.size
        self.pool = StagingPool(root / "pool", net, stage_rate=args.stage_rate)
        self.figures: list[Figure] = []
        self.files: list[Path] = []
        self.digest = ""
        self.raws = 0
        self.raw_cpu = 0.0  # the last raw copy's
        self.one_node: Staged | None = None
        self.one_node_into: int | None = None

    def say(self, line: str) -> None:
        print(line, flush=True)

    def run(self) -> None:
        pool = self.pool
        self.files = make_files(pool.home(LAPTOP) / "blob", self.size)
        # hashed here into the laptop's hash cache, as a first dpctl submit would: its time is the upload's
        hashes = HashCache(pool.home(LAPTOP) / ".cache" / "dpool" / "hashes.sqlite")
        self.digest = digest = scan(self.files[0].parent, self.files, hashes=hashes).digest
        self.say(f"{gib(self.size)} in {len(self.files)} files under the laptop's home (content {digest[:12]}); links: {self.net.shaping}")

        pool.start_node("n0")
        pool.wait_nodes(["n0"])
        wait_for("n0's data channel known to the coordinator",
                 lambda: pool.call(StageOffer(digests=[digest]), StageOfferReply).target == "n0", 30, every=0.1)
        if self.args.training_only:
            job, _, _ = pool.submit_files(staging_job(self.root, "stage-first"))
            wait_held(pool, digest)
            pool.cancel(job)
            self.stage_to([n for n in TRAINERS if n != "n0"], "stage-trainers")  # nothing trains yet: unpaced
        else:
            with recovery.figure("figure 3 (two submits of the same files)"):
                self.submits()
            with recovery.figure("figure 1 (one node)"):
                job = self.one()
            with recovery.figure("figure 4 (a source killed half way)"):
                self.killed(job)
            pool.cancel(job)
            pool.stop_node("n2")
            with recovery.figure("figure 2 (four nodes)"):
                self.fanout()
            for name in FANOUT:
                if name not in TRAINERS:
                    pool.stop_node(name)
        with recovery.figure("figure 5 (staging beside training)"):
            self.beside_training()

    def raw(self, src: str, dst: str) -> float:
        """A raw TCP copy of the files from `src` to `dst`: its seconds, also said."""
        self.raws += 1
        cpu = children_cpu()
        seconds = raw_copy(self.net, src, dst, self.files, self.root / f"raw-{self.raws}")
        self.raw_cpu = children_cpu() - cpu
        self.say(f"raw TCP copy {src} -> {dst}: {seconds:.2f} s ({self.raw_cpu:.2f} s of CPU, sender and receiver)")
        return seconds

    def submits(self) -> None:
        """Figure 3, and figure 1's upload: the first submit sends the files into n0, the second
        nothing. A raw copy laptop -> n0 just before the first and just after it: their mean is
        the upload's baseline (this machine's speed drifts within minutes)."""
        raws = [self.raw(LAPTOP, "n0")]
        laptop, cpu, n0 = Link(self.net, LAPTOP), children_cpu(), CpuMeter([self.pool.daemons["n0"].pid])
        first, sent, wall1 = self.pool.submit_files(staging_job(self.root, "stage-first"))
        first_bytes, dpctl_cpu, n0_cpu = (laptop.into(), laptop.out_of()), children_cpu() - cpu, n0.seconds()
        if not sent:
            raise BenchError("the first submit sent no files (no 'sending' line): n0 held them already?")
        raws.append(self.raw(LAPTOP, "n0"))
        raw_upload = statistics.mean(raws)
        wait_held(self.pool, self.digest)
        laptop, cpu = Link(self.net, LAPTOP), children_cpu()
        second, sent2, wall2 = self.pool.submit_files(staging_job(self.root, "stage-second"))
        out2, dpctl_cpu2 = laptop.out_of(), children_cpu() - cpu
        for job in (first, second):
            self.pool.cancel(job)
        upload = wall1 - wall2
        self.figures.append(Figure(
            "1b", f"dpctl's upload of {gib(self.size)} into one node (laptop -> n0)",
            f"{upload:.2f} s (first submit {wall1:.2f} s less the second's {wall2:.2f} s)", f"raw TCP copy {raw_upload:.2f} s",
            f"raw/upload {raw_upload / upload:.2f}" if upload > 0 else "-", f">= {RAW_GOAL}",
            raw_upload / upload >= RAW_GOAL if upload > 0 else None,
            notes=[
                f"raw copies just before and just after: {raws[0]:.2f} s, {raws[1]:.2f} s",
                f"CPU: the first dpctl {dpctl_cpu:.2f} s (the second, which sent nothing, {dpctl_cpu2:.2f} s), n0's dpd {n0_cpu:.2f} s; "
                f"the raw copy {self.raw_cpu:.2f} s",
            ],
            data={"upload_s": upload, "first_submit_s": wall1, "second_submit_s": wall2, "raw_s": raws,
                  "cpu_s": {"dpctl": dpctl_cpu, "dpctl_second": dpctl_cpu2, "n0": n0_cpu, "raw": self.raw_cpu}},
        ))
        out1 = first_bytes[1]
        self.figures.append(Figure(
            "3", "a second submit of the same files: bytes sent",
            f"'sending' line: {'printed' if sent2 else 'none'}; {gib(out2) if out2 is not None else 'n/a'} out of the laptop",
            f"first submit: 'sending' printed, {gib(out1) if out1 is not None else 'n/a'} out of the laptop",
            f"{out2 / out1:.5f}" if out1 and out2 is not None else "-", "0 bytes of files",
            not sent2 and (out2 is None or out2 < CHUNK_BYTES),
            notes=["the node's own counters (the Stager's bytes_put) are not exposed by any command: the link's stand in"],
            data={"second_sent": sent2, "second_link_bytes": out2, "first_link_bytes": out1},
        ))

    def one(self) -> str:
        """Figure 1: n1 fetches the files from n0, between two raw copies n0 -> n1. The job stays
        live: n2 stages it in figure 4."""
        pool = self.pool
        pool.start_node("n1")
        pool.wait_nodes(["n1"])
        raws = [self.raw("n0", "n1")]
        link, dpds = Link(self.net, "n1"), CpuMeter([pool.daemons["n0"].pid, pool.daemons["n1"].pid])
        job, _, _ = pool.submit_files(staging_job(self.root, "stage-one"))
        got = wait_staged(pool, job, ["n1"], self.timeout(1))["n1"]
        self.one_node, self.one_node_into, cpu = got, link.into(), dpds.seconds()
        raws.append(self.raw("n0", "n1"))
        raw_node = statistics.mean(raws)
        self.figures.append(Figure(
            "1", f"{gib(self.size)} to one node (n0 -> n1)", f"staged in {got.seconds:.2f} s ({gib(got.bytes)})",
            f"raw TCP copy {raw_node:.2f} s", f"raw/staged {raw_node / got.seconds:.2f}", f">= {RAW_GOAL}", raw_node / got.seconds >= RAW_GOAL,
            notes=[
                f"raw copies just before and just after: {raws[0]:.2f} s, {raws[1]:.2f} s",
                f"CPU: n0's and n1's dpds {cpu:.2f} s; the raw copy {self.raw_cpu:.2f} s",
                f"bytes into n1's link: {gib(self.one_node_into)}" if self.one_node_into is not None else "no per-host link counters on loopback",
            ],
            data={"staged_s": got.seconds, "raw_s": raws, "bytes": got.bytes, "link_bytes": self.one_node_into, "cpu_s": {"dpds": cpu, "raw": self.raw_cpu}},
        ))
        return job

    def killed(self, job: str) -> None:
        """Figure 4: n2 fetches from n0 and n1; n1's dpd is SIGKILLed once half the files crossed."""
        pool = self.pool
        link = Link(self.net, "n2")
        pool.start_node("n2")

        def half() -> bool:
            into = link.into()
            if into is not None:
                return into >= self.size // 2
            s = pool.status(job)
            rows = [r for r in (s.staging if s else []) if r.node == "n2"]
            return bool(rows) and rows[0].total > 0 and rows[0].bytes >= rows[0].total // 2

        def done() -> bool:
            return any(e.kind == "node.staged" and e.fields.get("node") == "n2" for e in recovery.events(pool, job))

        wait_for("n2 half way through the files", lambda: half() or done(), self.timeout(1), every=0.02)
        killed_at = None if done() else time.time()
        if killed_at is not None:
            pool.stop_node("n1", signal.SIGKILL)
        got = wait_staged(pool, job, ["n2"], self.timeout(1))["n2"]
        into = link.into()
        base = self.one_node_into
        resent = into - base if into is not None and base is not None else None
        dropped = [e for e in log_events(pool.daemons["n2"].log) if e.get("event") == "source.dropped"]
        in_flight = WINDOW * CHUNK_BYTES
        one = self.one_node.seconds if self.one_node else 0.0
        if killed_at is None:
            pool.stop_node("n1", signal.SIGKILL)  # gone all the same: figure 2 starts from n0 alone
        self.figures.append(Figure(
            "4", "the source n1 killed half way through n2's fetch (n0 alive): bytes re-sent",
            f"completed in {got.seconds:.2f} s; re-sent {gib(resent) if resent is not None else 'n/a'}",
            f"in flight from n1 at most {WINDOW} x {gib(CHUNK_BYTES)} = {gib(in_flight)}; one node's fetch {one:.2f} s",
            f"{resent / in_flight:.2f} of a window" if resent is not None else "-", "no more than the chunks in flight",
            None if killed_at is None or resent is None else resent <= in_flight,
            notes=[
                f"n1 killed {killed_at - got.began:.2f} s after n2 began" if killed_at is not None else "n2 was done before half way was seen: nothing killed",
                *[f"n2 dropped {e.get('source')}: {e.get('reason')}" for e in dropped],
                f"bytes into n2's link {gib(into)}, into n1's in figure 1 {gib(base)}" if into is not None and base is not None else "no per-host link counters on loopback",
            ],
            data={"staged_s": got.seconds, "killed": killed_at is not None, "resent_bytes": resent, "in_flight_bytes": in_flight, "dropped": dropped},
        ))

    def fanout(self) -> None:
        """Figure 2: four fresh nodes stage the files at once (one submit, once all four are up)."""
        links = {h: Link(self.net, h) for h in ("n0", *FANOUT)}
        got = self.stage_to(FANOUT, "stage-four")
        span = max(g.ended for g in got.values()) - min(g.began for g in got.values())
        one = self.one_node.seconds if self.one_node else float("nan")
        served = {h: link.out_of() for h, link in links.items()}
        self.figures.append(Figure(
            "2", f"{gib(self.size)} to {len(FANOUT)} nodes at once ({', '.join(FANOUT)})",
            f"first node.staging -> last node.staged {span:.2f} s", f"one node {one:.2f} s", f"{span / one:.2f}x", f"<= {FANOUT_GOAL}x",
            span / one <= FANOUT_GOAL,
            notes=[
                "each: " + ", ".join(f"{n} {g.seconds:.2f} s" for n, g in got.items()),
                "bytes each host sent: " + (", ".join(f"{h} {gib(b)}" for h, b in served.items() if b is not None) or "n/a on loopback"),
            ],
            data={"span_s": span, "one_node_s": one, "each_s": {n: g.seconds for n, g in got.items()}, "served_bytes": served},
        ))

    def stage_to(self, names: Sequence[str], job_name: str) -> dict[str, Staged]:
        """Fresh nodes `names` started, then a parked job submitted from the laptop: each stages
        the files (together); the job is cancelled once all have."""
        for name in names:
            self.pool.start_node(name)
        self.pool.wait_nodes(names)
        job, _, _ = self.pool.submit_files(staging_job(self.root, job_name))
        got = wait_staged(self.pool, job, names, self.timeout(len(names)))
        self.pool.cancel(job)
        return got

    def beside_training(self) -> None:
        """Figure 5: n0, n3, n4 train a 3-rank GPT; fresh nodes (n7, n8, ...: `--rounds`) stage the
        files from them one after the other, each between windows of `--window-steps` steps
        without staging (a new dpd's start-up falls in neither)."""
        pool, k = self.pool, self.args.window_steps
        spec = recovery.bench_job("staging-train", 100_000)
        spec = dataclasses.replace(spec, workers=dataclasses.replace(spec.workers, min=len(TRAINERS), max=len(TRAINERS)))
        train = pool.call(m.Submit(job=spec.to_dict(), source="bench/staging.py"), m.Submitted).job_id
        clock = StepClock(pool, train)
        quiet: list[tuple[int, int]] = []  # step ranges (after, up to) without staging
        staged: list[Staged] = []
        parked_jobs: list[str] = []
        cpu: dict[str, list[float]] = {"without": [], "sources": [], "stager": []}  # shares of a core, of the dpds' own processes

        def steps_without() -> None:
            s0, meter = clock.step(), CpuMeter([pool.daemons[h].pid for h in TRAINERS])
            wait_for(f"{k} steps without staging", lambda: clock.step() >= s0 + k, 60 + 10.0 * k, every=0.05)
            quiet.append((s0, clock.step()))
            cpu["without"].append(meter.share())

        try:
            recovery.running(pool, train, len(TRAINERS))
            links = {h: Link(self.net, h) for h in TRAINERS}
            for name in stagers(self.args.rounds):
                pool.start_node(name)
                pool.wait_nodes([name])
                settle(pool.daemons[name].pid)
                steps_without()
                sources, stager = CpuMeter([pool.daemons[h].pid for h in TRAINERS]), CpuMeter([pool.daemons[name].pid])
                parked_jobs.append(self.submit_parked(f"stage-beside-{name}"))
                staged.append(wait_staged(pool, parked_jobs[-1], [name], self.timeout(1, rate_arg(self.args.stage_rate)))[name])
                cpu["sources"].append(sources.share())
                cpu["stager"].append(stager.share())
                pool.cancel(parked_jobs[-1])  # else the next node would stage it as soon as it registers
                pool.stop_node(name)  # it holds the files now: the next one fetches from the trainers alone
            steps_without()
            served = {h: link.out_of() for h, link in links.items()}
        finally:
            clock.stop()
            for job in [train, *parked_jobs]:
                with contextlib.suppress(Exception):
                    pool.cancel(job)
        seconds, at = step_seconds(pool, train), clock.times()
        windows = [[seconds[s] for s in range(lo + 1, hi + 1) if s in seconds] for lo, hi in quiet]
        parts = [[seconds[s] for s, t in at.items() if s in seconds and g.began <= t <= g.ended] for g in staged]
        without, during = [x for w in windows for x in w], [x for p in parts for x in p]
        base = statistics.median(without) if without else float("nan")
        busy = statistics.median(during) if len(during) >= 3 else None
        # each part against the windows on either side of it: the machine's drift cancels
        paired = [statistics.median(p) / statistics.mean([statistics.median(windows[i]), statistics.median(windows[i + 1])])
                  for i, p in enumerate(parts) if len(p) >= 3 and windows[i] and windows[i + 1]]
        self.figures.append(Figure(
            "5", f"step time of a 3-rank GPT ({', '.join(TRAINERS)}) while another node stages {gib(self.size)} from them",
            f"median {1000 * busy:.0f} ms over {len(during)} steps during staging" if busy is not None else f"n/a: only {len(during)} steps during staging",
            f"median {1000 * base:.0f} ms over {len(without)} steps without", f"{busy / base:.2f}x" if busy is not None else "-", f"<= {STEP_GOAL}x",
            busy / base <= STEP_GOAL if busy is not None else None,
            notes=[
                "staged: " + ", ".join(f"{g.node} in {g.seconds:.2f} s ({g.bytes / g.seconds / 1e6:.1f} MB/s)" for g in staged if g.seconds > 0)
                + f"; --stage-rate {self.args.stage_rate or f'default, {TRAINING_RATE_BPS / 1e6:g}MB'}",
                "bytes each trainer sent meanwhile (its ring's share too): " + (", ".join(f"{h} {gib(b)}" for h, b in served.items() if b is not None) or "n/a on loopback"),
                "medians, window by window: " + ", ".join(f"{1000 * statistics.median(w):.0f}" for w in windows if w) + " ms without; "
                + ", ".join(f"{1000 * statistics.median(p):.0f}" for p in parts if p) + " ms during",
                "each staging against the windows either side of it: " + (", ".join(f"{r:.2f}x" for r in paired) or "n/a")
                + (f" (median {statistics.median(paired):.2f}x)" if paired else ""),
                "CPU of the dpds' own processes (a core = 100%): the staging node's "
                + ", ".join(f"{100 * x:.0f}%" for x in cpu["stager"]) + "; the three trainers' dpds together "
                + ", ".join(f"{100 * x:.0f}%" for x in cpu["sources"]) + " while a node staged, "
                + ", ".join(f"{100 * x:.0f}%" for x in cpu["without"]) + " in the windows without",
            ],
            data={"during_ms": [1000 * x for x in during], "without_ms": [1000 * x for x in without], "staged": [dataclasses.asdict(g) for g in staged],
                  "paired": paired, "cpu": cpu, "stage_rate": self.args.stage_rate, "served_bytes": served},
        ))

    def submit_parked(self, name: str) -> str:
        """The parked staging job with its content named, as dpctl submits it once the pool holds
        the files (nothing to send: the same message, without a dpctl process's start-up)."""
        doc = parked(name) | {"content": {"data": self.digest}}
        spec = parse_job(doc, source=f"{name}.toml", base_dir=str(self.root))
        return self.pool.call(m.Submit(job=spec.to_dict(), source=f"{name}.toml"), m.Submitted).job_id

    def timeout(self, nodes: int, rate: float | None = None) -> float:
        """How long a staging of the files onto `nodes` may take: 20x a star at 100 Mbit/s (or at `rate`), and a minute."""
        return 60.0 + 20.0 * nodes * self.size / (rate or 12.5e6)


def wait_held(pool: StagingPool, digest: str) -> None:
    """Until the coordinator knows a node holds content `digest` (a submit of it then sends nothing)."""
    wait_for(f"a holder of {digest[:12]} known to the coordinator",
             lambda: pool.call(StageOffer(digests=[digest]), StageOfferReply).held == [digest], 60, every=0.1)


def rate_arg(text: str | None) -> float | None:
    """--stage-rate as bytes a second (None: never paced, or not a size this bench reads)."""
    if text is None:
        return TRAINING_RATE_BPS
    with contextlib.suppress(ValueError):
        return parse_size(text)
    return None


def log_events(log: Path) -> list[dict[str, Any]]:
    """A dpd's JSON log lines."""
    out = []
    with contextlib.suppress(OSError), open(log, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    out.append(row)
    return out


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size_arg, default=GIB, help="the job's files in all (default 1GiB)")
    ap.add_argument("--stage-rate", help="n0's dpd --stage-rate: the pace of a fetch whose sources train (default: the dpd's)")
    ap.add_argument("--window-steps", type=int, default=30, help="figure 5: steps in each window without staging")
    ap.add_argument("--rounds", type=int, default=2, help="figure 5: fresh nodes that stage the files one after the other, each after a window without staging")
    ap.add_argument("--training-only", action="store_true", help="figure 5 alone (n0 takes the upload, n3 and n4 fetch the files, unmeasured): to try other --stage-rate values")
    ap.add_argument("--loopback", action="store_true", help="no namespaces: every host on 127.0.0.1, nothing shaped (needs no root)")
    ap.add_argument("--no-shape", action="store_true", help="namespaces, but links as fast as veth goes")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (files, logs)")
    args = ap.parse_args(argv)
    if not args.loopback and (sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None):
        print("bench/staging.py: network namespaces need Linux, root and iproute2 (or --loopback: nothing shaped)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the pool and the links are ended below
    root = Path(tempfile.mkdtemp(prefix="dpool-staging-"))
    net: Net = Loopback() if args.loopback else Namespaces([LAPTOP, *NODES, *stagers(args.rounds)], shape=not args.no_shape)
    bench = Bench(args, root, net)
    load, started, ok, stopped = os.getloadavg(), time.monotonic(), False, False
    try:
        net.up()
        bench.run()
        ok = True
    except (BenchError, netns.NetnsError, TimeoutError, LocalPoolError) as e:
        print(f"bench/staging.py: {e}\n  the logs are kept in {root}", file=sys.stderr)
    except KeyboardInterrupt:
        stopped = True
        print("bench/staging.py: interrupted: ending the pool and removing the links", file=sys.stderr)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave namespaces behind
        recovery.stop_pool(bench.pool, root)
        net.down()
        if (ok or stopped) and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if stopped:
        return 130
    print()
    print(f"Staging {gib(args.size)} through a pool of dpds in {'network namespaces' if not args.loopback else 'one namespace'}; links: {net.shaping}; "
          f"load average before {', '.join(f'{x:.2f}' for x in load)}, after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.monotonic() - started:.0f} s in all")
    for f in bench.figures:
        print("\n".join(f.lines()))
    if args.json:
        doc = {"args": vars(args), "tag": net.tag, "root": str(root), "ok": ok, "links": net.shaping, "load_before": load,
               "figures": {f.key: dataclasses.asdict(f) for f in bench.figures}}
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
