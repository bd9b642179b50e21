"""`dpctl watch JOB`: a live view of one job until it ends.

On a terminal it draws a compact block in place with rich (state, a progress bar with the elapsed
time and ETA, losses, throughput, generation, the workers and the newest events), redrawn at the
terminal's width as it is resized, in colors unless `NO_COLOR` is set. When stdout is not a
terminal it prints one line per change (a status line when the step, state, generation or workers
change, a line per new event), so it can be logged or piped; with `--json`, one status object a
line (`status JOB --json`'s) per change.

A coordinator that stops answering once it has answered (it restarts; training goes on without it)
is waited for, with jittered retries, for up to `RIDE_OUT_S` seconds. Exit 0 when the job succeeded, 1 when it failed
or was cancelled, 3 when the coordinator stayed away.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from typing import Any, TextIO

import orjson
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dpool.client.jobtimes import JobTimes, status_object
from dpool.client.rpc import Client, RideOut, Unreachable
from dpool.client.tables import clock, duration, event_details, num, when
from dpool.protocol import messages as m
from dpool.protocol.payloads import EventRow, JobStatus

POLL_S = 0.5  # how often the view asks the control plane
REFRESH_PER_S = 4  # redraws a second on a terminal (a resize shows within this)
RECENT_EVENTS = 6
TERMINAL = {"succeeded", "failed", "cancelled"}
QUIET_EVENTS = {"checkpoint.saved"}  # frequent; the status line shows the newest checkpoint step
STATE_STYLE = {
    "queued": "cyan", "starting": "cyan", "running": "bold green", "recovering": "bold yellow",
    "succeeded": "bold green", "failed": "bold red", "cancelled": "bold yellow",
}
EVENT_STYLE = {"worker.failed": "red", "job.failed": "bold red", "group.resumed": "green", "job.succeeded": "bold green", "node.lost": "red"}


def event_text(e: EventRow) -> str:
    return f"{clock(e.t)}  {e.kind:<16} {event_details(e)}".rstrip()


def pool_tokens_per_s(s: JobStatus) -> float:
    return float(sum(w.tokens_per_s for w in s.workers))


def status_line(s: JobStatus) -> str:
    parts = [
        f"{s.state:<10}",
        f"step {s.step}/{s.steps}",
        f"loss {num(s.loss) or '-'}",
        f"val_loss {num(s.val_loss) or '-'}",
        f"tokens/s {pool_tokens_per_s(s):.0f}",
        f"gen {s.generation}",
        f"workers {s.world_size}",
    ]
    if s.checkpoint_step is not None:
        parts.append(f"ckpt {s.checkpoint_step}")
    for r in s.staging:
        parts.append(f"{r.node} {r.state}" + (f" {r.bytes / 1e6:.0f}/{r.total / 1e6:.0f} MB" if r.total else "") + (f" ({r.reason})" if r.reason else ""))
    if s.error:
        parts.append(f"error: {s.error}")
    return "  ".join(parts)


def view(s: JobStatus, events: list[EventRow], times: JobTimes | None = None, now: float | None = None, note: str | None = None) -> RenderableType:
    """The terminal block (rich renders it at the terminal's width)."""
    now = time.time() if now is None else now
    times = times or JobTimes()
    steps = max(s.steps, 1)
    head = Text.assemble(("job ", "dim"), (s.id, "bold"), "  ", s.name, "   ", (s.state.upper(), STATE_STYLE.get(s.state, "")))
    progress = Table.grid(expand=True, padding=(0, 2))
    progress.add_column(no_wrap=True)
    progress.add_column(ratio=1)
    progress.add_column(no_wrap=True)
    eta = times.eta_s(s, now)
    progress.add_row(
        f"step {s.step}/{s.steps}  {100 * min(s.step, steps) / steps:5.1f}%",
        ProgressBar(total=steps, completed=min(s.step, steps), complete_style="green" if s.state != "failed" else "red"),
        f"elapsed {duration(times.elapsed_s(now)) or '-'}   ETA {duration(eta) or '-'}",
    )
    numbers = Text(
        f"loss {num(s.loss) or '-'}   val_loss {num(s.val_loss) or '-'}   tokens/s {pool_tokens_per_s(s):.0f}   "
        f"generation {s.generation}   workers {s.world_size}   checkpoint step {s.checkpoint_step if s.checkpoint_step is not None else '-'}"
    )
    moments = Text(f"submitted {when(times.submitted, now) or '-'}   started {when(times.started, now) or '-'}   finished {when(times.finished, now) or '-'}", style="dim")
    parts: list[RenderableType] = [head, progress, numbers, moments]
    if s.error:
        parts.append(Text(f"error: {s.error}", style="red"))
    if note:
        parts.append(Text(note, style="yellow"))
    if s.workers:
        workers = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 3))
        for name in ("RANK", "NODE", "SHARE", "TOKENS/S"):
            workers.add_column(name, justify="left" if name == "NODE" else "right", no_wrap=True)
        for w in s.workers:
            workers.add_row(str(w.rank), w.node, str(w.share), f"{w.tokens_per_s:.0f}")
        parts.append(workers)
    else:
        parts += [Text(""), Text("no workers running", style="dim"), Text("")]
    if s.staging:
        staging = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 3))
        for name in ("NODE", "FILES", "HAVE", "RATE", "ETA", "WHY"):
            staging.add_column(name, justify="left" if name in ("NODE", "FILES", "WHY") else "right", no_wrap=name != "WHY", overflow="ellipsis")
        for r in s.staging:
            have = f"{r.bytes / 1e6:.0f}/{r.total / 1e6:.0f} MB" if r.total else "-"
            staging.add_row(r.node, r.state, have, f"{r.rate_bps / 1e6:.1f} MB/s" if r.rate_bps else "-", duration(r.eta_s) or "-", r.reason or "")
        parts.append(staging)
    recent = Table.grid(padding=(0, 2))
    recent.add_column(no_wrap=True, style="dim", min_width=12)
    recent.add_column(no_wrap=True, min_width=16)
    recent.add_column(overflow="ellipsis", no_wrap=True, ratio=1)
    shown = [e for e in events if e.kind not in QUIET_EVENTS][-RECENT_EVENTS:]
    for e in shown:
        recent.add_row(clock(e.t), Text(e.kind, style=EVENT_STYLE.get(e.kind, "")), event_details(e))
    parts += [Text("recent events", style="bold"), recent if shown else Text("  (none yet)", style="dim")]
    return Group(*parts)


def render(s: JobStatus, events: list[EventRow], width: int = 100, times: JobTimes | None = None, now: float | None = None) -> list[str]:
    """The terminal block as plain text, one string per line."""
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False).print(view(s, events, times, now))
    return [line.rstrip() for line in buf.getvalue().splitlines()]


class Watched:
    """What the view knows of its job: the newest status, its events, its times."""

    def __init__(self, job: str) -> None:
        self.job_id = job
        self.after = 0
        self.events: list[EventRow] = []
        self.times = JobTimes()

    def poll(self, c: Client) -> tuple[JobStatus, list[EventRow]]:
        s = c.call(m.Status(job=self.job_id), m.StatusReply).jobs[0]
        self.job_id = s.id
        new: list[EventRow] = []
        while True:
            reply = c.call(m.Events(job=self.job_id, after=self.after), m.EventsReply)
            self.after = reply.cursor
            new += reply.events
            if not reply.more:
                break
        self.times.add(new).seen(s)
        if s.state == "running":
            self.times.mark(time.time(), s.step)
        self.events = (self.events + new)[-200:]
        return s, new


def watch(c: Client, job: str, out: TextIO, *, tty: bool | None = None, json: bool = False, poll_s: float = POLL_S) -> int:
    tty = out.isatty() if tty is None else tty
    w = Watched(job)
    if json or not tty:
        return _watch_lines(c, w, out, poll_s, json=json)
    last: list[JobStatus] = []

    def missed(e: Unreachable, waited: float) -> None:
        note = f"no answer from the coordinator at {c.addr} for {waited:.0f}s: retrying (training goes on without it)"
        live.update(view(last[0], w.events, w.times, note=note) if last else Text(note, style="yellow"), refresh=True)

    patient = RideOut(c, on_retry=missed)
    # Rich redraws at the terminal's width several times a second, so a resize shows at once.
    console = Console(file=out, force_terminal=True)
    with Live(Text(f"asking {c.addr} about {job} ...", style="dim"), console=console, auto_refresh=True, refresh_per_second=REFRESH_PER_S, redirect_stdout=False, redirect_stderr=False) as live:
        while True:
            s, _ = patient(lambda: w.poll(c))
            last[:] = [s]
            live.update(view(s, w.events, w.times), refresh=True)
            if s.state in TERMINAL:
                return 0 if s.state == "succeeded" else 1
            time.sleep(poll_s)  # the view's refresh interval


def _watch_lines(c: Client, w: Watched, out: TextIO, poll_s: float, *, json: bool) -> int:
    last_key: tuple[Any, ...] | None = None
    patient = RideOut(c, "dpctl watch")
    while True:
        s, new = patient(lambda: w.poll(c))
        staging = tuple((r.node, r.state, r.bytes >> 24, r.reason) for r in s.staging)  # a line per 16 MB staged
        key = (s.state, s.step, s.generation, s.world_size, tuple((x.rank, x.node, x.share) for x in s.workers), s.error, staging)
        if json:
            if key != last_key:
                out.write(orjson.dumps(status_object(s, w.times, time.time())).decode() + "\n")
        else:
            for e in new:
                print(event_text(e), file=out)
            if key != last_key:
                print(f"{time.strftime('%H:%M:%S')}  job {s.id}  {status_line(s)}", file=out)
        last_key = key
        out.flush()
        if s.state in TERMINAL:
            return 0 if s.state == "succeeded" else 1
        time.sleep(poll_s)  # the view's refresh interval


def add_parser(sub: Any) -> None:
    s = sub.add_parser("watch", help="live view of a job until it ends (exit 0 if it succeeded, 1 if it failed or was cancelled)")
    s.add_argument("job", help="a job id, unique id prefix or name")
    s.add_argument("--json", action="store_true", help="one status object (as `status JOB --json`) a line, per change")
    s.set_defaults(fn=cmd_watch)


def cmd_watch(c: Client, a: argparse.Namespace) -> int:
    return watch(c, a.job, sys.stdout, json=a.json)
