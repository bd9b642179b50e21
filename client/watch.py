"""`dpctl watch JOB`: a live view of one job until it ends.

On a terminal it redraws a compact block in place (state, progress, losses, throughput, generation,
the workers and the newest events); when stdout is not a terminal it prints one line per change
(a status line when the step, state, generation or workers change, a line per new event), so it
can be logged or piped. Exit 0 when the job succeeded, 1 when it failed or was cancelled.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from typing import Any, TextIO

from dpool.client.rpc import Client
from dpool.client.tables import clock, event_details, num, table
from dpool.protocol import messages as m
from dpool.protocol.payloads import EventRow, JobStatus

POLL_S = 0.5  # how often the view asks the control plane
RECENT_EVENTS = 6
TERMINAL = {"succeeded", "failed", "cancelled"}
QUIET_EVENTS = {"checkpoint.saved"}  # frequent; the status line shows the newest checkpoint step


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
    if s.error:
        parts.append(f"error: {s.error}")
    return "  ".join(parts)


def render(s: JobStatus, events: list[EventRow], width: int = 100) -> list[str]:
    """The terminal block, one string per line."""
    steps = max(s.steps, 1)
    bar_w = 30
    done = int(bar_w * min(s.step, steps) / steps)
    lines = [
        f"job {s.id}  {s.name}   {s.state.upper()}",
        f"step {s.step}/{s.steps}  [{'#' * done}{'.' * (bar_w - done)}] {100 * s.step / steps:5.1f}%   generation {s.generation}",
        f"loss {num(s.loss) or '-'}   val_loss {num(s.val_loss) or '-'}   tokens/s {pool_tokens_per_s(s):.0f}   checkpoint step {s.checkpoint_step if s.checkpoint_step is not None else '-'}",
    ]
    if s.error:
        lines.append(f"error: {s.error}")
    lines.append("")
    if s.workers:
        rows = [[w.rank, w.node, w.share, f"{w.tokens_per_s:.0f}"] for w in s.workers]
        lines += table(["RANK", "NODE", "SHARE", "TOKENS/S"], rows).splitlines()
    else:
        lines.append("no workers running")
    lines.append("")
    lines.append("recent events")
    shown = [e for e in events if e.kind not in QUIET_EVENTS][-RECENT_EVENTS:]
    lines += [f"  {event_text(e)}" for e in shown] or ["  (none yet)"]
    return [line[:width] for line in lines]  # a wrapped line would throw the in-place redraw off


def watch(c: Client, job: str, out: TextIO, *, tty: bool | None = None, poll_s: float = POLL_S) -> int:
    tty = out.isatty() if tty is None else tty
    after = 0
    events: list[EventRow] = []
    drawn = 0
    last_key: tuple[Any, ...] | None = None
    job_id = job
    while True:
        s = c.call(m.Status(job=job_id), m.StatusReply).jobs[0]
        job_id = s.id
        new: list[EventRow] = []
        while True:
            reply = c.call(m.Events(job=job_id, after=after), m.EventsReply)
            after = reply.cursor
            new += reply.events
            if not reply.more:
                break
        events = (events + new)[-200:]
        if tty:
            block = render(s, events, shutil.get_terminal_size((120, 40)).columns - 1)
            # Move up over the previous block and clear it, then draw the new one.
            out.write((f"\x1b[{drawn}F" if drawn else "") + "\x1b[J" + "\n".join(block) + "\n")
            out.flush()
            drawn = len(block)
        else:
            for e in new:
                print(event_text(e), file=out)
            key = (s.state, s.step, s.generation, s.world_size, tuple((w.rank, w.node, w.share) for w in s.workers), s.error)
            if key != last_key:
                print(f"{time.strftime('%H:%M:%S')}  job {s.id}  {status_line(s)}", file=out)
                last_key = key
            out.flush()
        if s.state in TERMINAL:
            return 0 if s.state == "succeeded" else 1
        time.sleep(poll_s)  # the view's refresh interval


def add_parser(sub: Any) -> None:
    s = sub.add_parser("watch", help="live view of a job until it ends (exit 0 if it succeeded)")
    s.add_argument("job", help="a job id, unique id prefix or name")
    s.set_defaults(fn=cmd_watch)


def cmd_watch(c: Client, a: argparse.Namespace) -> int:
    return watch(c, a.job, sys.stdout)
