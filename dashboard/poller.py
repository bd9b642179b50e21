"""The dashboard's one reader of the pool: a thread that asks the coordinator what dpctl asks it, at
a bounded rate, and renders each page that someone looks at, once per change, for every browser
that shows it.

However many pages are open, the coordinator sees one client: every `poll_s` seconds while someone
looks (a page open and streaming, a page loaded, a /metrics scrape in the last INTEREST_S seconds),
`nodes`, the first page of `status`, and for each job a page shows, its `status` and the rows that
came since the last poll (metrics, events, logs and samples, by their cursors; at most
PAGES_PER_POLL pages of each a poll, so a long history is caught up over a few polls rather than
in one burst). A job that ended and was read whole costs its page one `status` a poll: nothing
else of it will change, but it can be removed (`dpctl rm`), or its name come to name a newer job.
An older page of the job list is read when it is asked for, and again at most every OLD_PAGE_S
seconds while it is shown. With nobody looking the thread sleeps and the coordinator sees nothing.

For /metrics: the whole job list every METRICS_LIST_S seconds (however long the history, a
PAGE_LIMIT page a request), and every poll the first page, as for the pages, and the status and
events of the jobs that have series of their own (at most 110; one that ended and was read whole is
not asked again, its row of the list says all). Its counts and series are the list's as last read,
with what was read since laid over it: never an older answer over a newer one, never a job the
list no longer holds.

A coordinator that does not answer (it restarts) is asked again at the next poll, on a new socket
(ZeroMQ's reconnection would not drop what was queued for the old peer); the pages keep what they
last showed and say since when the coordinator is silent.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dpool.client.jobtimes import JobTimes, status_object
from dpool.client.rpc import Client, RemoteError, Unreachable
from dpool.dashboard import views
from dpool.dashboard.follow import TERMINAL, JobFollow
from dpool.protocol import messages as m
from dpool.protocol.payloads import JobStatus, NodeRow
from dpool.protocol.security import ClientKeys

INTEREST_S = 10.0  # a page loaded (or a scrape) keeps the poller busy this long; a stream as long as it is open
PAGES_PER_POLL = 4  # pages of one kind of row read for one job in one poll
JOBS_PAGE = 50  # jobs a page of the list shows
FOLLOWED_MAX = 160  # job pages followed at once, the newest asked (one asked for again reads only what came since); /metrics' jobs apart
METRICS_LIST_S = 15.0  # while /metrics is scraped, the whole job list is read again this often (a page of
METRICS_JOBS_MAX = 20_000  # PAGE_LIMIT jobs a request, up to this many): the counts of jobs by state
OLD_PAGE_S = 10.0  # an older page of the job list, while shown, is read again this often
LIST_PAGES_MAX = 64  # older pages of the job list kept
VIEWS_MAX = 48  # views read in one round (the streamed ones first, then the newest asked): a bound on a round's requests
EARLY_BURST, EARLY_PER_S = 10, 10.0  # rounds for pages nobody looked at before, between two polls: a bucket


@dataclass(frozen=True, slots=True)
class Conn:
    """Whether the coordinator answered the newest poll, and what the pages say about it."""

    ok: bool = False
    error: str | None = None
    since: float | None = None  # unix time of the first poll it missed (or answered, when ok)
    polled: float | None = None  # unix time of the newest answer


@dataclass(slots=True)
class ListPage:
    """A page of the job list: the jobs submitted before `before` (None: the newest)."""

    before: str | None
    jobs: list[JobStatus] = field(default_factory=list)
    more: bool = False
    total: int | None = None
    read_at: float = 0.0  # monotonic
    version: int = 0
    missing: str | None = None


class Interest:
    """Which views (pages) someone looks at, told from the server's thread, read by the poller."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._asked: dict[str, float] = {}
        self._streams: collections.Counter[str] = collections.Counter()
        self.wake = threading.Event()

    def ask(self, view: str) -> None:
        with self._lock:
            self._asked[view] = self.clock()
            self._asked = dict(sorted(self._asked.items(), key=lambda kv: kv[1])[-256:])  # bounded: the newest asked
        self.wake.set()

    def stream(self, view: str, delta: int) -> None:
        with self._lock:
            self._streams[view] += delta
            if self._streams[view] <= 0:
                del self._streams[view]
        if delta > 0:
            self.wake.set()

    def views(self) -> list[str]:
        """The views wanted now: streamed, or asked for in the last INTEREST_S seconds (newest
        first); at most VIEWS_MAX."""
        now = self.clock()
        with self._lock:
            asked = [v for v, t in sorted(self._asked.items(), key=lambda kv: -kv[1]) if now - t < INTEREST_S]
            return list(dict.fromkeys([*self._streams, *asked]))[:VIEWS_MAX]

    def streams(self) -> int:
        with self._lock:
            return sum(self._streams.values())


class Poller:
    """Reads the pool for the views `interest` names and hands each view to `publish(view,
    rendered)` after every round, None when it did not change (from this thread: the server
    moves it to its own loop)."""

    def __init__(self, coordinator: str, keys: ClientKeys | None, publish: Callable[[str, views.Rendered | None], None], *, poll_s: float, timeout_s: float, interest: Interest | None = None) -> None:
        self.coordinator, self.keys, self.publish = coordinator, keys, publish
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.interest = interest or Interest()
        self.conn = Conn()
        self.nodes: list[NodeRow] = []
        self.first = ListPage(None)
        self.pages: collections.OrderedDict[str, ListPage] = collections.OrderedDict()
        self.follows: collections.OrderedDict[str, JobFollow] = collections.OrderedDict()  # by the ref a page asked for
        self.series: dict[str, JobFollow] = {}  # by id: the jobs with series of their own in /metrics (prometheus.series_jobs)
        self.paged = True  # the coordinator takes status with a limit (an older one lists every job at once)
        self.polls = 0
        self.requests = 0  # sent to the coordinator, in all
        self._client: Client | None = None
        self._stop = threading.Event()
        self._tokens, self._filled = float(EARLY_BURST), time.monotonic()
        self._failed_said = -1e9
        self._rendered: dict[str, tuple[Any, views.Rendered]] = {}
        self._nodes_version = 0
        self.active: list[JobStatus] = []  # the jobs not finished, for the pool's page
        self._active_version = 0
        self._all_jobs: list[JobStatus] = []  # the whole job list, for /metrics
        self._all_wire: dict[str, dict[str, Any]] = {}  # the same, as `status --json` prints them
        self._all_read_at = -METRICS_LIST_S
        # None until the coordinator first answered a round for /metrics: no pool to count yet, not an empty one
        self.metrics_snapshot: tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[dict[str, Any]]]] | None = None
        self.thread = threading.Thread(target=self.run, name="dashboard-poller", daemon=True)

    # -- the loop ------------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.interest.wake.set()

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                wanted = self.interest.views()
                if not wanted:
                    self.interest.wake.wait()  # nobody looks: the coordinator sees nothing
                    self.interest.wake.clear()
                    continue
                started = time.monotonic()
                self.interest.wake.clear()
                self.round(wanted)
                done = set(wanted)
                # A page nobody looked at before is read at once, alone (what it needs and no
                # more), EARLY_BURST in a row and then EARLY_PER_S a second: someone clicking
                # through pages waits for nothing, a crawler cannot drive the coordinator's load.
                while not self._stop.is_set() and (left := self.poll_s - (time.monotonic() - started)) > 0:
                    if self.interest.wake.wait(left):
                        self.interest.wake.clear()
                        new = [v for v in self.interest.views() if v not in done]
                        if new:
                            self._early_wait()
                            self.round(new, full=False)
                            done.update(new)
        finally:
            if self._client is not None:
                self._client.close()

    def _early_wait(self) -> None:
        """Take a token of the early rounds' bucket, waiting for one if it is empty."""
        now = time.monotonic()
        self._tokens = min(EARLY_BURST, self._tokens + (now - self._filled) * EARLY_PER_S)
        self._filled = now
        if self._tokens < 1:
            self._stop.wait((1 - self._tokens) / EARLY_PER_S)
            self._tokens, self._filled = 1.0, time.monotonic()
        self._tokens -= 1

    def round(self, wanted: list[str], *, full: bool = True) -> None:
        """Poll and render; a failure of either (a reply this version cannot use, a bug) is said on
        stderr, at most once a minute, and the next round is tried: the dashboard never stops
        showing the pool over one bad answer."""
        try:
            self.poll(wanted)
            self.render(wanted, full=full)
        except Exception as e:
            if self._stop.is_set():
                return  # cut short by the stop (the process exiting closes the socket under the request): no failure to report
            now = time.monotonic()
            if now - self._failed_said > 60:
                print(f"dashboard: a round failed ({type(e).__name__}: {e}); trying again", file=sys.stderr, flush=True)
                self._failed_said = now
            self.conn = Conn(False, f"{type(e).__name__}: {e}"[:300], self.conn.since or time.time(), self.conn.polled)
            if self._client is not None:
                self._client.close()
                self._client = None

    def call(self, request: m.Message, expect: type[Any]) -> Any:
        if self._client is None:
            self._client = Client(self.coordinator, self.timeout_s, self.keys)
        self.requests += 1
        try:
            return self._client.call(request, expect)
        except Unreachable:
            self._client.close()  # a new socket next time: the old one's queue goes with it
            self._client = None
            raise

    def poll(self, wanted: list[str]) -> None:
        """One round of questions for the views in `wanted`; the coordinator's silence is noted,
        never raised."""
        self.polls += 1
        now = time.time()
        try:
            if "pool" in wanted or "metrics" in wanted:
                nodes = self.call(m.Nodes(), m.NodesReply).nodes
                if nodes != self.nodes:
                    self.nodes, self._nodes_version = nodes, self._nodes_version + 1
            if {"pool", "jobs", "metrics"} & set(wanted):
                self.read_list(self.first, force=True)
            if "pool" in wanted:
                # the first page holds them all unless there are older jobs; then ask for them
                active = self.call(m.Status(active=True), m.StatusReply).jobs if self.first.more else [j for j in self.first.jobs if j.state in views.ACTIVE]
                if active != self.active:
                    self.active, self._active_version = active, self._active_version + 1
            for view in wanted:
                if view.startswith("jobs?"):
                    self.read_list(self.list_page(view), force=False)
            if "metrics" in wanted and time.monotonic() - self._all_read_at > METRICS_LIST_S:
                self._all_jobs, self._all_read_at = self.read_all(), time.monotonic()
                self._all_wire = {j.id: status_object(j, JobTimes.of(j), now) for j in self._all_jobs}
            if "metrics" in wanted:
                self.series = self.series_follows()
            pages = {views.job_ref(v) for v in wanted if v.startswith("job:")}
            said: dict[str, JobStatus | None] = {}  # the status each job read this poll has now, by its ref (None: no such job now)
            for follow in self.followed(wanted):
                if self.read_job(follow, full=follow.ref in pages):
                    said[follow.ref] = follow.status
            if "metrics" in wanted:
                self.metrics_snapshot = self.for_metrics(now, said)
        except Unreachable as e:
            if self.conn.ok or self.conn.since is None:
                self.conn = Conn(False, str(e), now, self.conn.polled)
            return
        except RemoteError as e:
            self.conn = Conn(False, e.message, now if self.conn.ok or self.conn.since is None else self.conn.since, self.conn.polled)
            return
        self.conn = Conn(True, None, self.conn.since if self.conn.ok and self.conn.since else now, now)

    # -- the job list ----------------------------------------------------------------------------

    def list_page(self, view: str) -> ListPage:
        before = views.list_before(view)
        page = self.pages.get(view)
        if page is None:
            page = self.pages[view] = ListPage(before)
            while len(self.pages) > LIST_PAGES_MAX:
                self.pages.popitem(last=False)
        self.pages.move_to_end(view)
        return page

    def read_list(self, page: ListPage, *, force: bool) -> None:
        if not force and page.read_at and time.monotonic() - page.read_at < OLD_PAGE_S:
            return
        jobs, more, total, missing = self._status_page(page.before)
        page.read_at = time.monotonic()
        if (jobs, more, total, missing) != (page.jobs, page.more, page.total, page.missing):
            page.jobs, page.more, page.total, page.missing = jobs, more, total, missing
            page.version += 1

    def _status_page(self, before: str | None) -> tuple[list[JobStatus], bool, int | None, str | None]:
        if self.paged:
            try:
                reply = self.call(m.Status(limit=JOBS_PAGE, before=before), m.StatusReply)
                return reply.jobs, bool(reply.more), reply.total, None
            except RemoteError as e:
                if e.code == m.ErrorCode.NOT_FOUND:
                    return [], False, None, e.message
                if e.code not in (m.ErrorCode.BAD_BODY, m.ErrorCode.BAD_REQUEST):
                    raise
                self.paged = False  # a coordinator of a version before paged status
        every = self.call(m.Status(), m.StatusReply).jobs
        start = 0
        if before is not None:
            ids = [j.id for j in every]
            if before not in ids:
                return [], False, len(every), f"no job {before!r} in the list"
            start = ids.index(before) + 1
        return every[start : start + JOBS_PAGE], len(every) > start + JOBS_PAGE, len(every), None

    def read_all(self) -> list[JobStatus]:
        """Every job (up to METRICS_JOBS_MAX), newest first, a PAGE_LIMIT page a request."""
        if not self.paged:
            return self.call(m.Status(), m.StatusReply).jobs  # type: ignore[no-any-return]
        out: list[JobStatus] = []
        before = None
        while len(out) < METRICS_JOBS_MAX:
            reply = self.call(m.Status(limit=m.PAGE_LIMIT, before=before), m.StatusReply)
            out += reply.jobs
            if not reply.more or not reply.jobs:
                break
            before = reply.jobs[-1].id
        return out

    # -- one job ---------------------------------------------------------------------------------

    def followed(self, wanted: list[str]) -> list[JobFollow]:
        """The jobs to read this poll, each once: those whose page is wanted (the FOLLOWED_MAX
        wanted last are kept, the others forgotten), then for /metrics the jobs of its series."""
        out: dict[int, JobFollow] = {}
        for ref in list(dict.fromkeys(views.job_ref(v) for v in wanted if v.startswith("job:")))[:FOLLOWED_MAX]:
            follow = self.follows.get(ref) or self.series.get(ref) or JobFollow(ref)
            self.follows[ref] = follow
            self.follows.move_to_end(ref)
            out[id(follow)] = follow
        while len(self.follows) > FOLLOWED_MAX:
            self.follows.popitem(last=False)
        if "metrics" in wanted:
            out.update((id(f), f) for f in self.series.values())
        return list(out.values())

    def series_follows(self) -> dict[str, JobFollow]:
        """The jobs with series of their own in /metrics, as the whole list says (the first page's
        rows over it: they are newer), each with what was read of it before; a job that left the
        set, or the list, is forgotten."""
        from dpool.dashboard.prometheus import series_jobs

        listed = {j.id: j for j in self._all_jobs} | {j.id: j for j in self.first.jobs}
        ids = series_jobs([{"id": j.id, "state": j.state, "submitted": j.submitted, "finished": j.finished} for j in listed.values()])
        return {i: self.series.get(i) or self.follows.get(i) or JobFollow(i) for i in ids}

    def read_job(self, f: JobFollow, *, full: bool = True) -> bool:
        """Read what came of the job since the last poll: its status and events, and with `full`
        (a page shows it) its metrics, output and samples too. Whether its status was read: a job
        that ended and was read whole is asked nothing more for /metrics alone (its row of the
        list says all), and only its status for a page."""
        if f.settled and not full:
            return False
        try:
            status = self.call(m.Status(job=f.ref), m.StatusReply).jobs[0]
        except RemoteError as e:
            if e.code != m.ErrorCode.NOT_FOUND:
                raise
            f.not_found(e.message)  # removed (`dpctl rm`): the page says so, /metrics no longer counts it
            return True
        f.saw_status(status)  # a name that now names a newer job starts it over, unsettled
        if f.settled:
            return True
        job, ended = status.id, status.state in TERMINAL
        done = self._pages(lambda after: m.Events(job=job, after=after), m.EventsReply, f.cursors.events, lambda r: f.saw_events(r.events, r.cursor))
        if not full:
            return True
        done = all(
            (
                done,
                self._pages(lambda after: m.Metrics(job=job, after=after), m.MetricsReply, f.cursors.metrics, lambda r: f.saw_metrics(r.rows, r.cursor)),
                self._pages(lambda after: m.Logs(job=job, after=after), m.LogsReply, f.cursors.logs, lambda r: f.saw_logs(r.lines, r.cursor)),
                self._pages(lambda after: m.Samples(job=job, after=after), m.SamplesReply, f.cursors.samples, lambda r: f.saw_samples(r.rows, r.cursor)),
            )
        )
        f.settled = ended and done
        return True

    def _pages(self, ask: Callable[[int], m.Message], expect: type[Any], after: int, take: Callable[[Any], None]) -> bool:
        """Up to PAGES_PER_POLL pages from cursor `after`; whether the last one said no more."""
        for _ in range(PAGES_PER_POLL):
            reply = self.call(ask(after), expect)
            take(reply)
            after = reply.cursor
            if not reply.more:
                return True
        return False

    # -- what /metrics reads ---------------------------------------------------------------------

    def for_metrics(self, now: float, said: dict[str, JobStatus | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        """(nodes, jobs, events by job) as `dpctl nodes --json`, `status --json` and `events
        JOB --json` print them: what dashboard/prometheus.py renders. The jobs are the whole list
        as last read, with the rows read this poll over it: the first page's, then the status of
        each job read (`said`, by the ref it was read by; None: the coordinator knows no such job
        now, and it goes). A status read in an earlier poll is never laid over the list: a job
        that left a page or the series is the list's to say."""
        nodes = [n.to_wire() for n in self.nodes]
        fresh = {j.id: j for j in self.first.jobs} | {s.id: s for s in said.values() if s is not None}
        gone = {ref for ref, s in said.items() if s is None}
        jobs = {k: v for k, v in self._all_wire.items() if k not in gone} | {k: status_object(j, JobTimes.of(j), now) for k, j in fresh.items() if k not in gone}
        events: dict[str, list[dict[str, Any]]] = {}
        for f in self.series.values():
            if f.status is not None and f.status.id in jobs:
                # every restart (the newest RESTARTS_MAX), though the other events kept are the newest only
                kept = sorted([*f.resumed, *(e for e in f.events if e.kind != "group.resumed")], key=lambda e: e.t)
                events[f.status.id] = [e.to_wire() for e in kept]
        return nodes, list(jobs.values()), events

    # -- rendering -------------------------------------------------------------------------------

    def render(self, wanted: list[str], *, full: bool = True) -> None:
        """Render each wanted view whose inputs changed since it was last rendered, and publish it
        (None: unchanged); a full round forgets the views no longer wanted."""
        for view in wanted:
            if view == "metrics":
                self.publish(view, None)  # its snapshot is fresh (for_metrics)
                continue
            made = self._render(view)
            if made is None:
                self.publish(view, None)  # nothing to show yet (the coordinator has not answered)
                continue
            signature, build = made
            old = self._rendered.get(view)
            if old is not None and old[0] == signature:
                self.publish(view, None)  # looked at, unchanged
                continue
            rendered = build()
            self._rendered[view] = (signature, rendered)
            self.publish(view, rendered)
        for view in [v for v in self._rendered if full and v not in wanted]:
            del self._rendered[view]

    def _render(self, view: str) -> tuple[Any, Callable[[], views.Rendered]] | None:
        """The view's inputs (a page renders again when they change) and how to render it."""
        conn = self.conn
        said = (conn.ok, conn.error, conn.since, time.localtime()[:3])  # and the day: past midnight a time shows its date
        if view == "pool":
            return (said, self._nodes_version, self._active_version), lambda: views.pool_view(self.nodes, self.active, conn)
        if view == "jobs" or view.startswith("jobs?"):
            page = self.first if view == "jobs" else self.pages.get(view)
            if page is None:
                return None
            offset = views.list_offset(view)
            return (said, page.version), lambda: views.jobs_view(page, offset, conn)
        if view.startswith("job:"):
            follow = self.follows.get(views.job_ref(view))
            if follow is None:
                return None
            return (said, follow.version), lambda: views.job_view(follow, conn)
        return None

