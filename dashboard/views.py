"""The dashboard's pages as HTML, from what the poller knows: pure functions, no I/O.

A page is a few sections, each an element with an id; a view renders every section's inner HTML
(`Rendered.fragments`), the server wraps them in the page around them for a first load, and a live
update replaces the sections that changed. Every link is relative (a page under /jobs/ says
`../`), so the dashboard works under any sub-path of a reverse proxy. Every value is escaped; every
list is bounded (the rows a page shows, the characters of a line).

View names (what a page streams, and what the poller renders): `pool`, `jobs` (the newest page of
the list), `jobs?before=ID&n=N` (an older page: the jobs submitted before job ID, N of them before
it), `job:REF` (one job, by id, unique prefix or name).
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from html import escape
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, urlencode

from dpool.client.jobtimes import JobTimes
from dpool.client.tables import age, duration, num, shown, size, value_text
from dpool.dashboard import chart
from dpool.dashboard.follow import LOG_RANKS_MAX
from dpool.protocol.payloads import EventRow, JobStatus, NodeRow

if TYPE_CHECKING:
    from dpool.dashboard.follow import JobFollow
    from dpool.dashboard.poller import Conn, ListPage

REF_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
EVENTS_SHOWN = 100
NODES_SHOWN = 500
TITLE_CHARS = 4096  # of a cell's text cut short, its tooltip holds this many
ACTIVE = ("queued", "starting", "running", "recovering")


@dataclass(frozen=True, slots=True)
class Rendered:
    """A view, rendered: its title, its sections (element id -> inner HTML, in page order) and a
    checksum of each (a stream sends a browser only the sections it does not have)."""

    title: str
    fragments: dict[str, str]
    status: int = 200  # 404: no such job
    root: str = ""  # the relative path from the page to the dashboard's root ("" or "../")
    nav: str = "pool"
    sums: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, title: str, fragments: dict[str, str], **kw: Any) -> Rendered:
        return cls(title, fragments, sums={k: zlib.crc32(v.encode()) for k, v in fragments.items()}, **kw)


# -- view names ------------------------------------------------------------------------------------


def job_view_name(ref: str) -> str | None:
    return f"job:{ref}" if REF_RE.fullmatch(ref) else None


def job_ref(view: str) -> str:
    return view.removeprefix("job:")


def list_view_name(before: str | None, offset: int) -> str | None:
    if before is None:
        return "jobs"
    if not REF_RE.fullmatch(before):
        return None
    return "jobs?" + urlencode({"before": before, "n": max(0, min(offset, 10**9))})


def list_before(view: str) -> str | None:
    return parse_qs(view.partition("?")[2]).get("before", [None])[0]


def list_offset(view: str) -> int:
    n = parse_qs(view.partition("?")[2]).get("n", ["0"])[0]
    return int(n) if n.isdigit() else 0


# -- small pieces -------------------------------------------------------------------------------------


def e(v: Any) -> str:
    return "-" if v is None or v == "" else html_text(str(v))


def html_text(v: str) -> str:
    """Text from the pool as HTML: control characters written as `dpctl samples` writes them
    (`\\x00`: a generated sample may hold a NUL, an HTML parse error, or an ESC), then escaped."""
    return escape(shown(v))


def moment(t: float | None, now: float, *, ms: bool = False) -> str:
    """A moment as the pages show it: the time of day and the zone of the dashboard's clock, with
    the date first unless it is today's (`2026-12-04 13:45:57 UTC`), in a <time> element whose
    `datetime` is the instant (ISO 8601, with its offset): a viewer in another zone reads it right."""
    if t is None:
        return "-"
    try:
        at, today = datetime.fromtimestamp(t).astimezone(), datetime.fromtimestamp(now).astimezone().date()
    except (OverflowError, OSError, ValueError):
        return e(t)  # out of the clock's range: the number as it came
    words = at.strftime("%H:%M:%S") + (f".{at.microsecond // 1000:03d}" if ms else "")
    if at.date() != today:
        words = at.strftime("%Y-%m-%d ") + words
    zone = at.strftime("%Z") or at.strftime("UTC%z")
    return f'<time datetime="{at.isoformat(timespec="milliseconds" if ms else "seconds")}">{escape(f"{words} {zone}")}</time>'


def table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    """Cells are HTML already (escape what goes in). In a box of its own that scrolls sideways
    when the table is wider than the screen (a phone): the page itself never does."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def clipped(text: str | None, chars: int) -> str:
    """Text for a cell of a table: whole when it has at most `chars` characters, else cut at the
    last space before them with an ellipsis, the whole of it in the tooltip (`title`; at most
    TITLE_CHARS, the most a job's error holds: an event's details can hold more, `dpctl events`
    shows them)."""
    if not text:
        return "-"
    if len(text) <= chars:
        return html_text(text)
    head = text[:chars]
    if not text[chars].isspace() and len(words := head.rsplit(None, 1)) == 2:
        head = words[0]  # the word the cut falls in is left out (a word longer than the cell is cut)
    whole = text if len(text) <= TITLE_CHARS else text[:TITLE_CHARS] + " …"
    return f'<span title="{html_text(whole)}">{html_text(head.rstrip())}…</span>'


def state_badge(state: str) -> str:
    return f'<span class="state state-{escape(state)}">{escape(state)}</span>'


def job_link(root: str, job_id: str, text: str | None = None) -> str:
    return f'<a href="{root}jobs/{quote(job_id)}">{escape(text or job_id)}</a>'


def conn_text(conn: Conn) -> str:
    if conn.ok:
        return '<span class="live" title="the coordinator answers">live</span>'
    if conn.since is None:
        return '<span class="waiting">asking the coordinator…</span>'
    now = time.time()
    said = f", showing what it said at {moment(conn.polled, now)}" if conn.polled else ""
    return f'<span class="down" title="{html_text(conn.error or "")}">coordinator not answering since {moment(conn.since, now)}{said}; retrying</span>'


def eta_of(s: JobStatus, now: float) -> float | None:
    return JobTimes.of(s).eta_s(s, now)


def progress(s: JobStatus) -> str:
    steps = max(s.steps, 1)
    return f'<progress max="{steps}" value="{min(s.step, steps)}"></progress> <span class="step">{s.step}</span>/{s.steps}'


# -- the pool: /  -----------------------------------------------------------------------------------


def pool_view(nodes: list[NodeRow], jobs: list[JobStatus], conn: Conn) -> Rendered:
    root = ""
    slots = sum(n.slots for n in nodes if n.state != "lost")
    busy = sum(n.busy_slots for n in nodes if n.state != "lost")
    by_state: dict[str, int] = {}
    for n in nodes:
        by_state[n.state] = by_state.get(n.state, 0) + 1
    states = ", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) or "none"
    active = [j for j in jobs if j.state in ACTIVE]
    summary = (
        f'<p class="figures"><span><b id="node-count">{len(nodes)}</b> node{"s" if len(nodes) != 1 else ""} ({escape(states)})</span>'
        f"<span><b>{busy}</b>/{slots} slots busy</span><span><b>{len(active)}</b> active job{'s' if len(active) != 1 else ''}</span></p>"
    )
    rows = []
    for n in sorted(nodes, key=lambda n: n.name)[:NODES_SHOWN]:
        job = "-"
        if n.job:
            names = n.job.split(",")[:8]
            job = ", ".join(job_link(root, j) for j in names) + (f" rank {', '.join(str(r) for r in n.ranks[:16])}" if n.ranks else "")
        rows.append([
            f'<span class="node-name">{e(n.name)}</span>', state_badge(n.state), f"{n.busy_slots}/{n.slots}", e(size(n.memory_bytes)),
            e(n.address), e(n.interface), job, e(age(n.heartbeat_age_s)), e(" ".join(x for x in (n.platform, n.chip) if x)), e(n.mlx_version), e(n.reason),
        ])
    nodes_html = table(["node", "state", "slots", "memory", "ring address", "interface", "job", "heartbeat", "machine", "mlx", "reason"], rows, "nodes") if rows else "<p>no nodes yet</p>"
    if len(nodes) > NODES_SHOWN:
        nodes_html += f'<p class="quiet">the first {NODES_SHOWN} of {len(nodes)} nodes, by name (`dpctl nodes` lists them all)</p>'
    active_html = jobs_table(root, active, time.time()) if active else '<p class="quiet">no job queued or running</p>'
    return Rendered.of(
        "Pool",
        {"conn": conn_text(conn), "summary": summary, "nodes": "<h2>Nodes</h2>" + nodes_html, "active": f'<h2>Active jobs</h2>{active_html}<p><a href="{root}jobs">all jobs →</a></p>'},
        root=root,
        nav="pool",
    )


# -- the jobs: /jobs ----------------------------------------------------------------------------------


def jobs_table(root: str, jobs: list[JobStatus], now: float) -> str:
    rows = []
    for j in jobs:
        eta = eta_of(j, now)
        rows.append([
            job_link(root, j.id), e(j.name), state_badge(j.state), progress(j), e(num(j.loss)), e(num(j.val_loss)),
            e(duration(eta)), str(j.world_size or "-"), str(j.generation), moment(j.submitted, now), clipped(j.error, 200),
        ])
    return table(["job", "name", "state", "step", "loss", "val loss", "ETA", "workers", "gen", "submitted", "error"], rows, "jobs")


def jobs_view(page: ListPage, offset: int, conn: Conn) -> Rendered:
    root = ""
    now = time.time()
    if page.missing:
        body = f'<p class="error">{html_text(page.missing)}</p><p><a href="{root}jobs">newest jobs</a></p>'
        return Rendered.of("Jobs", {"conn": conn_text(conn), "jobs": body}, root=root, nav="jobs", status=404)
    total = f" of {page.total}" if page.total is not None else ""
    if page.total is not None:
        # `n` comes from the link that led here (or a hand-made URL): the last page's place is
        # known exactly, any other's is at most what leaves the rest room
        offset = page.total - len(page.jobs) if not page.more else max(0, min(offset, page.total - len(page.jobs) - 1))
    first, last = offset + 1, offset + len(page.jobs)
    pager = []
    if page.before is not None:
        pager.append(f'<a href="{root}jobs">← newest</a>')
    if page.more and page.jobs:
        older = urlencode({"before": page.jobs[-1].id, "n": last})
        pager.append(f'<a class="older" href="{root}jobs?{older}">older →</a>')
    shown = f"jobs <b>{first}–{last}</b>{total}, newest first" if page.jobs else f"no jobs here ({page.total} in all)" if page.total is not None else "no jobs here"
    head = f'<p class="figures"><span>{shown}</span>{"".join(f"<span>{p}</span>" for p in pager)}</p>'
    body = jobs_table(root, page.jobs, now) if page.jobs else ("<p>no older jobs</p>" if page.before is not None else "<p>no jobs</p>")
    return Rendered.of("Jobs", {"conn": conn_text(conn), "jobs": head + body}, root=root, nav="jobs")


# -- one job: /jobs/JOB ---------------------------------------------------------------------------------


def job_view(f: JobFollow, conn: Conn) -> Rendered:
    root = "../"
    if f.status is None:
        text = f.missing or "asking the coordinator…"
        return Rendered.of(f"Job {f.ref}", {"conn": conn_text(conn), "summary": f'<p class="error">{html_text(text)}</p>'}, root=root, nav="jobs", status=404 if f.missing else 200)
    s, now = f.status, time.time()
    t = JobTimes.of(s)
    restarts = f.restarts()
    failed = [r for r in f.resumed if r.fields.get("cause") == "failure"]
    lost_s = sum(float(r.fields.get("seconds_since_failure") or 0) for r in failed)
    redone = sum(int(r.fields.get("steps_recomputed") or 0) for r in failed)
    facts = [
        ("state", state_badge(s.state) + (f' <span class="error">{e(s.error)}</span>' if s.error else "")),
        ("step", f'<progress max="{max(s.steps, 1)}" value="{min(s.step, s.steps)}"></progress> <b id="step">{s.step}</b> of {s.steps}'),
        ("loss", f'<span id="loss">{e(num(s.loss))}</span>'),
        ("validation loss", e(num(s.val_loss))),
        ("generation", f"{s.generation} ({len(restarts)} restart{'s' if len(restarts) != 1 else ''}; {len(failed)} after a failure, {lost_s:.1f} s without training, {redone} step{'s' if redone != 1 else ''} recomputed)"),
        ("workers", str(s.world_size)),
        ("ETA", e(duration(t.eta_s(s, now)))),
        ("elapsed", e(duration(t.elapsed_s(now)))),
        ("submitted / started / finished", " / ".join(moment(v, now) for v in (s.submitted, s.started, s.finished))),
        ("checkpoint", e(s.checkpoint_step)),
    ]
    if s.test_loss is not None:
        facts.insert(4, ("test loss", e(num(s.test_loss))))
    summary = f'<h1>{escape(s.id)}</h1><dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{v}</dd>" for k, v in facts) + "</dl>"


    def figure() -> str:
        train = [(r.step, r.loss, r.tokens_per_s) for r in f.train.rows if r.loss is not None]
        evals = [(r.step, r.val_loss) for r in f.evals.rows if r.val_loss is not None]
        return "<h2>Loss and speed</h2>" + chart.svg(steps=s.steps, train=train, evals=evals, restarts=restarts)

    total = sum(w.share for w in s.workers) or 1
    workers = table(
        ["rank", "node", "share", "of the batch", "tokens/s"],
        [[str(w.rank), e(w.node), str(w.share), f"{100 * w.share / total:.0f}%", f"{w.tokens_per_s:.0f}"] for w in s.workers[:256]],
        "workers",
    ) if s.workers else '<p class="quiet">no workers now</p>'

    fragments = {
        "conn": conn_text(conn),
        "summary": summary,
        "chart": memo(f, "chart", (f.train.changes, f.evals.changes, len(f.resumed), s.steps), figure),
        "workers": "<h2>Workers and shares</h2>" + workers,
        "events": memo(f, "events", (f.event_count, s.id, time.localtime(now)[:3]), lambda: "<h2>Events</h2>" + events_html(f, now)),  # the day: a time shows its date from the next
        "logs": memo(f, "logs", (f.log_version,), lambda: "<h2>Newest output, by rank</h2>" + logs_html(f)),
        "samples": memo(f, "samples", (len(f.samples), f.samples[-1].step if f.samples else None), lambda: "<h2>Samples</h2>" + samples_html(f)),
    }
    return Rendered.of(f"Job {s.id}", fragments, root=root, nav="jobs")


def memo(f: JobFollow, section: str, inputs: Any, draw: Callable[[], str]) -> str:
    """A section drawn again only when what it is drawn from changed (a running job's page is
    rendered every poll; its curve, events and output only when they moved)."""
    kept = f.memo.get(section)
    if kept is None or kept[0] != inputs:
        kept = f.memo[section] = (inputs, draw())
    return kept[1]


def cost(ev: EventRow) -> str:
    """What an event cost the job, in words (a restart's time without training and recomputed steps)."""
    f = ev.fields
    if ev.kind == "group.resumed":
        words = []
        if f.get("seconds_since_failure") is not None:
            words.append(f"{float(f['seconds_since_failure']):.1f} s without training")  # type: ignore[arg-type]
        redo = int(f.get("steps_recomputed") or 0)  # type: ignore[arg-type]
        words.append(f"{redo} step{'s' if redo != 1 else ''} recomputed")
        return ", ".join(words)
    if ev.kind == "checkpoint.saved" and f.get("seconds") is not None:
        return f"{float(f['seconds']):.2f} s"  # type: ignore[arg-type]
    return ""


def events_html(f: JobFollow, now: float) -> str:
    newest = list(f.events)[-EVENTS_SHOWN:][::-1]
    if not newest:
        return '<p class="quiet">no events yet</p>'
    rows = []
    for ev in newest:
        details = " ".join(f"{k}={value_text(v)}" for k, v in ev.fields.items())
        cls = "failure" if ev.kind in ("worker.failed", "group.aborted") else ("restart" if ev.kind == "group.resumed" else "")
        rows.append([f'<span class="{cls}">{moment(ev.t, now, ms=True)}</span>', f'<span class="{cls}">{html_text(ev.kind)}</span>', clipped(details, 400), escape(cost(ev))])
    more = f.event_count - len(newest)
    note = f'<p class="quiet">the newest {len(newest)} of {f.event_count} events (`dpctl events {escape(f.status.id if f.status else f.ref)}` lists them all)</p>' if more > 0 else ""
    return table(["time", "event", "details", "cost"], rows, "events") + note


def logs_html(f: JobFollow) -> str:
    if not f.logs:
        return '<p class="quiet">no output yet</p>'
    parts = []
    for rank in sorted(f.logs):
        lines = "\n".join(html_text(line.text) for line in f.logs[rank])
        parts.append(f'<div class="log"><h3>rank {rank}</h3><pre>{lines}</pre></div>')
    if f.status is not None and f.status.world_size > len(f.logs) >= LOG_RANKS_MAX:
        parts.append(f'<p class="quiet">the first {LOG_RANKS_MAX} ranks\' output (`dpctl logs {escape(f.status.id)} --rank N`: any rank)</p>')
    return "".join(parts)


def samples_html(f: JobFollow) -> str:
    if not f.samples:
        return '<p class="quiet">no samples yet</p>'
    return "".join(f'<div class="sample"><h3>step {r.step}</h3><pre>{html_text(r.text)}</pre></div>' for r in reversed(f.samples))


# -- the page around the sections ----------------------------------------------------------------------


def page(view: str, r: Rendered) -> str:
    """The whole page of a first load: the sections of `r` in their places, the stylesheet, the
    script that streams `view`'s updates; every URL relative."""
    root = r.root or "./"
    sections = "".join(f'<section id="{k}">{v}</section>' for k, v in r.fragments.items() if k != "conn")
    nav = "".join(
        f'<a href="{root}{href}"{" class=current" if r.nav == key else ""}>{label}</a>' for key, href, label in (("pool", "", "Pool"), ("jobs", "jobs", "Jobs"))
    )
    stream = escape(f"{root}stream?" + urlencode({"view": view}))
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'  # no icon: the browser asks no /favicon.ico (a 404 in every console)
        f"<title>{escape(r.title)} · dpool</title>"
        f'<link rel="stylesheet" href="{root}static/dash.css"><script src="{root}static/dash.js" defer></script>'
        f'</head><body data-stream="{stream}"><header><a class="brand" href="{root}">dpool</a><nav>{nav}</nav>'
        f'<span id="conn">{r.fragments.get("conn", "")}</span></header><main>{sections}</main></body></html>'
    )
