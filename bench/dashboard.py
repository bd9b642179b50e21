"""What the dashboard costs the pool, each figure next to a baseline measured in the same run.

    python bench/dashboard.py [--phase-s 15] [--phases 6] [--jobs 3000] [--hour-s 180]

1. The coordinator is not slowed: a serving dpd (one slot) trains a small GPT job while a probe
   sends `status` (what `dpctl status` sends) every 10 ms and times each round trip. `dpctl
   dashboard` runs throughout (default poll, 1 s); phases alternate between no page open and five
   pages open and streaming (the pool, the job list, three of the job's page: five browsers, each
   read as a browser reads it). p99 with five open against p99 with none (goal: within 10%).
2. The job list with a long history: a coordinator with no job, then with `--jobs` past jobs
   (submitted and cancelled through the protocol, as users do), `GET /jobs` (the newest page, then
   every older page by its link) timed from a dashboard, against the same page with no history;
   and the coordinator's plain `status` of every job at once, as the old way to list them (goal:
   /jobs under 300 ms).
3. The dashboard's memory over an hour of streaming, compressed: the dashboard polls every 0.05 s
   (20x its default) for `--hour-s` seconds, 3,600 polls, with five pages streaming while a job
   logs every step; its RSS sampled every 5 s. Flat after warm-up: the growth over the second half
   (goal: none beyond noise, about 1 MiB).
Each part prints the machine's load average: on 2 cores other work shows in every figure.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from dpool.client.localpool import LocalPool, free_port, wait_for
from dpool.client.rpc import Client
from dpool.protocol import messages as m
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import parse_job

PAGES = ("pool", "jobs", "job", "job", "job")  # five browsers


def long_job(steps: int) -> dict[str, Any]:
    return {
        "name": "bench-dash",
        "workers": {"min": 1, "max": 1},
        "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
        "train": {"steps": steps, "global_batch": 6, "warmup_steps": 2, "log_every_steps": 1},
        "checkpoint": {"every_steps": 50},
        "eval": {"every_steps": 100, "batches": 1, "sample_every_steps": 500, "sample_tokens": 20},
    }


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class Dashboard:
    """`dpctl dashboard` in a process of its own, as a user starts it."""

    def __init__(self, root: Path, coordinator: str, poll: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = open(root / f"dashboard-{self.port}.log", "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dpool.client.cli", "--coordinator", coordinator, "dashboard", "--listen", f"127.0.0.1:{self.port}", "--poll", str(poll)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for("the dashboard", lambda: self._answers(), 30)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited: {self.proc.returncode}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def get(self, path: str) -> tuple[float, str]:
        t = time.perf_counter()
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            body = r.read().decode()
        return time.perf_counter() - t, body

    def rss_mib(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Browser(threading.Thread):
    """One open page: its live stream read as it comes (what EventSource does)."""

    def __init__(self, port: int, view: str) -> None:
        super().__init__(daemon=True)
        self.port, self.view = port, view
        self.updates = 0
        self.bytes = 0
        self.conn: http.client.HTTPConnection | None = None
        self.start()

    def run(self) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            self.conn.request("GET", f"/stream?view={self.view}")
            resp = self.conn.getresponse()
            while line := resp.readline():
                self.bytes += len(line)
                self.updates += line.startswith(b"event: update")
        except (OSError, ValueError, AttributeError):
            return

    def close(self) -> None:
        if self.conn is not None and self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)


def open_pages(port: int, job: str) -> list[Browser]:
    return [Browser(port, f"job:{job}" if p == "job" else p) for p in PAGES]


def probe(addr: str, seconds: float, every: float = 0.01) -> list[float]:
    """`status` round trips, one every `every` seconds for `seconds`."""
    out = []
    with Client(addr, 10) as c:
        end = time.monotonic() + seconds
        while (now := time.monotonic()) < end:
            t = time.perf_counter()
            c.call(m.Status(), m.StatusReply)
            out.append(time.perf_counter() - t)
            time.sleep(max(0.0, every - (time.monotonic() - now)))
    return out


# -- 1. the coordinator with five pages open ---------------------------------------------------------


def part_status(root: Path, phase_s: float, phases: int) -> None:
    pool = LocalPool(root / "p1", env={"DPOOL_WARM": "0"})
    try:
        pool.start(1)
        job = submit(pool, long_job(1_000_000))
        wait_for("the job running", lambda: (s := pool.status(job)) is not None and s.state == "running" and s.step > 5, 120)
        dash = Dashboard(root, pool.addr, 1.0)
        times: dict[str, list[float]] = {"none": [], "five": []}
        cpu: dict[str, list[float]] = {"none": [0.0, 0.0], "five": [0.0, 0.0]}  # dashboard, serving dpd: CPU seconds
        streamed = []
        try:
            probe(pool.addr, 3.0)  # warm-up
            for i in range(phases):
                kind = "five" if i % 2 else "none"
                pages = open_pages(dash.port, job) if kind == "five" else []
                if pages:
                    wait_for("five pages streaming", lambda pages=pages: all(p.updates for p in pages), 30)
                else:
                    time.sleep(1.0)  # the last phase's streams gone, the poller idle
                before = (cpu_s(dash.proc.pid), cpu_s(pool.daemons["n0"].pid))
                times[kind] += probe(pool.addr, phase_s)
                cpu[kind][0] += cpu_s(dash.proc.pid) - before[0]
                cpu[kind][1] += cpu_s(pool.daemons["n0"].pid) - before[1]
                streamed += [(p.updates, p.bytes) for p in pages]
                for p in pages:
                    p.close()
        finally:
            dash.stop()
    finally:
        pool.stop()
    none, five = times["none"], times["five"]
    updates = sum(u for u, _ in streamed) / max(1, len(streamed)) / phase_s
    rate = sum(b for _, b in streamed) / max(1, len(streamed)) / phase_s / 1024
    print(f"\n## 1. status round trip with five pages open and streaming ({phases} phases of {phase_s:.0f} s, interleaved; load {load()})")
    print("| figure | five pages open | none open | ratio |")
    print("| --- | --- | --- | --- |")
    for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
        print(f"| `status` round trip, {name} | {pct(five, q) * 1e3:.2f} ms | {pct(none, q) * 1e3:.2f} ms | {pct(five, q) / pct(none, q):.2f} |")
    print(f"| round trips measured | {len(five)} | {len(none)} | |")
    per = phase_s * (phases // 2)
    print(f"| the dashboard's CPU | {100 * cpu['five'][0] / per:.1f}% of a core | {100 * cpu['none'][0] / per:.1f}% | |")
    print(f"| the serving dpd's CPU (coordinator, agent) | {100 * cpu['five'][1] / per:.1f}% of a core | {100 * cpu['none'][1] / per:.1f}% | {cpu['five'][1] / max(cpu['none'][1], 1e-9):.2f} |")
    print(f"each page received {updates:.2f} updates/s ({rate:.1f} KiB/s) while open")


# -- 2. the job list with a long history ---------------------------------------------------------------


def part_jobs(root: Path, n: int) -> None:
    pool = LocalPool(root / "p2", env={"DPOOL_WARM": "0"})
    try:
        pool.start(1)
        dash = Dashboard(root, pool.addr, 1.0)
        try:
            dash.get("jobs")
            empty = [dash.get("jobs")[0] for _ in range(20)]
            doc = parse_job({**long_job(5), "workers": {"min": 2, "max": 2}}).to_dict()  # never starts on one slot
            t = time.perf_counter()
            with Client(pool.addr, 30) as c:
                for _ in range(n):
                    c.call(m.Cancel(job=c.call(m.Submit(job=doc, source="bench"), m.Submitted).job_id), m.CancelReply)
            made = time.perf_counter() - t
            with Client(pool.addr, 30) as c:
                t = time.perf_counter()
                listed = len(c.call(m.Status(), m.StatusReply).jobs)
                plain = time.perf_counter() - t
            t = time.perf_counter()

            def listed_all() -> str | None:
                page = dash.get("jobs")[1]
                return page if f"of {n}, newest first" in page else None

            body = wait_for("the page to list them all", listed_all, 30)
            seen = time.perf_counter() - t  # the page is a poll behind the pool at most
            warm = [dash.get("jobs")[0] for _ in range(20)]
            deep, pages = [], 1
            while (older := re.search(r'class="older" href="([^"]+)"', body)) is not None:
                time.sleep(0.5)  # someone reading page after page, quickly
                took, body = dash.get(older.group(1).replace("&amp;", "&"))
                deep.append(took)
                pages += 1
            total = re.search(r"of (\d+), newest first", body) or re.search(r"–(\d+)</b>", body)
            fresh = Dashboard(root, pool.addr, 1.0)
            try:
                cold, body = fresh.get("jobs")  # a dashboard's very first page: it waits for its first poll
                crawl, t = [], time.perf_counter()  # then page after page back to back, none seen before
                while (older := re.search(r'class="older" href="([^"]+)"', body)) is not None and len(crawl) < 40:
                    took, body = fresh.get(older.group(1).replace("&amp;", "&"))
                    crawl.append(took)
                crawled = time.perf_counter() - t
            finally:
                fresh.stop()
        finally:
            dash.stop()
    finally:
        pool.stop()
    print(f"\n## 2. the job list with {n:,} past jobs (made in {made:.1f} s; load {load()})")
    print("| figure | with history | baseline | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| `GET /jobs`, median of 20 | {statistics.median(warm) * 1e3:.1f} ms | no history {statistics.median(empty) * 1e3:.1f} ms | {statistics.median(warm) / statistics.median(empty):.2f} |")
    print(f"| `GET /jobs`, slowest of 20 | {max(warm) * 1e3:.1f} ms | no history {max(empty) * 1e3:.1f} ms | {max(warm) / max(empty):.2f} |")
    print(f"| an older page (`?before=`), median of {len(deep)} / slowest | {statistics.median(deep) * 1e3:.1f} / {max(deep) * 1e3:.1f} ms | newest page {statistics.median(warm) * 1e3:.1f} ms | {statistics.median(deep) / statistics.median(warm):.2f} |")
    print(f"| until the page listed them all, after the last was made | {seen * 1e3:.0f} ms | poll period 1000 ms | {seen:.2f} |")
    print(f"| a new dashboard's first `GET /jobs` (waits for its first poll) | {cold * 1e3:.1f} ms | | |")
    print(f"| the coordinator's `status` of every job at once ({listed:,} rows) | {plain * 1e3:.1f} ms | | |")
    print(f"| a crawler: {len(crawl)} new pages back to back (each a request to the coordinator) | {len(crawl) / crawled:.1f} pages/s, slowest {max(crawl) * 1e3:.0f} ms | | |")
    print(f"pages walked: {pages} ({total.group(1) if total else '?'} jobs listed in all), one every 0.5 s")


# -- 3. the dashboard's memory over a compressed hour -----------------------------------------------------


def part_memory(root: Path, hour_s: float) -> None:
    poll = 0.05
    pool = LocalPool(root / "p3", env={"DPOOL_WARM": "0"})
    samples: list[tuple[float, float]] = []
    try:
        pool.start(1)
        job = submit(pool, long_job(1_000_000))
        wait_for("the job running", lambda: (s := pool.status(job)) is not None and s.state == "running", 120)
        dash = Dashboard(root, pool.addr, poll)
        try:
            pages = open_pages(dash.port, job)
            start = time.monotonic()
            while (t := time.monotonic() - start) < hour_s:
                samples.append((t, dash.rss_mib()))
                time.sleep(5.0)
            samples.append((time.monotonic() - start, dash.rss_mib()))
            updates = sum(p.updates for p in pages)
            for p in pages:
                p.close()
            step = pool.status(job).step  # type: ignore[union-attr]
        finally:
            dash.stop()
    finally:
        pool.stop()
    half = [r for t, r in samples if t >= hour_s / 2]
    warm = [r for t, r in samples if t >= hour_s * 0.2]
    print(f"\n## 3. the dashboard's memory over {hour_s / poll:,.0f} polls ({hour_s:.0f} s at a {poll} s poll; load {load()})")
    print("| figure | MiB |")
    print("| --- | --- |")
    print(f"| RSS at the start | {samples[0][1]:.1f} |")
    print(f"| RSS after warm-up (20% of the run) | {warm[0]:.1f} |")
    print(f"| RSS at the half / at the end | {half[0]:.1f} / {samples[-1][1]:.1f} |")
    print(f"| growth over the second half | {samples[-1][1] - half[0]:+.1f} |")
    print(f"| highest after warm-up | {max(warm):.1f} |")
    print(f"the job reached step {step:,} (logging every step); the five pages received {updates:,} updates")
    print("samples (s: MiB): " + ", ".join(f"{t:.0f}: {r:.1f}" for t, r in samples))


def submit(pool: LocalPool, job: dict[str, Any]) -> str:
    path = pool.root / "job.toml"
    pool.root.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_job(parse_job(job, source=str(path))))
    with Client(pool.addr, 30) as c:
        return c.call(m.Submit(job=parse_job(job).to_dict(), source=str(path)), m.Submitted).job_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds of each phase of part 1")
    ap.add_argument("--phases", type=int, default=6, help="phases of part 1 (none, five, none, ...)")
    ap.add_argument("--jobs", type=int, default=3000, help="past jobs of part 2")
    ap.add_argument("--hour-s", type=float, default=180.0, help="seconds of part 3 (3,600 polls at 0.05 s)")
    ap.add_argument("--only", choices=("status", "jobs", "memory"), help="run one part")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dash-") as tmp:
        root = Path(tmp)
        if a.only in (None, "status"):
            part_status(root, a.phase_s, a.phases)
        if a.only in (None, "jobs"):
            part_jobs(root, a.jobs)
        if a.only in (None, "memory"):
            part_memory(root, a.hour_s)


if __name__ == "__main__":
    main()
