"""What the dashboard keeps of one job, fed with the coordinator's replies, and bounded however long
the job runs: the newest status, the metrics as a thinned series, the newest events, the newest log
lines of each rank and the newest samples. Pure: the poller (dashboard/poller.py) asks the
coordinator and hands each reply here.

Bounds. Training rows: at most SERIES_MAX, thinned by doubling a stride (every row kept while they
fit, then every 2nd, 4th, ...: a 1,000,000-step job keeps about SERIES_MAX evenly spread rows, and
its curve's shape). Evaluation rows: the same. Events: the newest EVENTS_MAX, with the counts and
the cost of every restart kept whole (the restart markers and the summary need them all). Logs:
LOG_LINES_MAX a rank for LOG_RANKS_MAX ranks, each line cut to LOG_LINE_CHARS. Samples: the newest
SAMPLES_MAX, each cut to SAMPLE_CHARS.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
from typing import Any

from dpool.client.plot import JobRecord, restarts
from dpool.protocol.payloads import (
    EvalRow,
    EventRow,
    JobStatus,
    LogLine,
    MetricRow,
    SampleRow,
    TestLossRow,
    TrainRow,
)

SERIES_MAX = 2000
EVENTS_MAX = 300
RESTARTS_MAX = 1000
LOG_RANKS_MAX = 16  # a page shows the output of the first 16 ranks (dpctl logs JOB --rank N: any rank)
LOG_LINES_MAX = 20
LOG_LINE_CHARS = 300
SAMPLES_MAX = 5
SAMPLE_CHARS = 4000
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class Thinned:
    """Rows in step order, at most `cap`: each row while they fit, then every 2nd, every 4th...
    A row for a step already held (a recomputed step, a page read twice) replaces it."""

    def __init__(self, cap: int = SERIES_MAX) -> None:
        self.cap, self.stride = cap, 1
        self.changes = 0  # counts changes: what is drawn from it is drawn again when it moved
        self.rows: list[Any] = []
        self.steps: list[int] = []

    def add(self, row: Any) -> bool:
        """Whether the series changed."""
        step = row.step
        if self.steps and step <= self.steps[-1]:
            i = bisect.bisect_left(self.steps, step)
            if i < len(self.steps) and self.steps[i] == step:
                self.rows[i] = row
                self.changes += 1
                return True
            return False  # thinned away already: the curve does not need it
        if step % self.stride:
            return False
        self.rows.append(row)
        self.steps.append(step)
        self.changes += 1
        if len(self.rows) > self.cap:
            self.stride *= 2
            keep = [i for i, s in enumerate(self.steps) if s % self.stride == 0 or i == len(self.steps) - 1]
            self.rows = [self.rows[i] for i in keep]
            self.steps = [self.steps[i] for i in keep]
        return True

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(slots=True)
class Cursors:
    metrics: int = 0
    events: int = 0
    logs: int = 0
    samples: int = 0


@dataclass(slots=True)
class JobFollow:
    """One job as the dashboard shows it. `ref` is what the page asked for (an id, a prefix, a
    name); `status.id` the job it names now."""

    ref: str
    status: JobStatus | None = None
    train: Thinned = field(default_factory=Thinned)
    evals: Thinned = field(default_factory=Thinned)
    tests: list[TestLossRow] = field(default_factory=list)
    events: collections.deque[EventRow] = field(default_factory=lambda: collections.deque(maxlen=EVENTS_MAX))
    resumed: collections.deque[EventRow] = field(default_factory=lambda: collections.deque(maxlen=RESTARTS_MAX))
    failures: int = 0
    event_count: int = 0
    logs: dict[int, collections.deque[LogLine]] = field(default_factory=dict)
    samples: collections.deque[SampleRow] = field(default_factory=lambda: collections.deque(maxlen=SAMPLES_MAX))
    cursors: Cursors = field(default_factory=Cursors)
    version: int = 0  # counts changes: a page renders again when it moved
    log_version: int = 0
    memo: dict[str, tuple[Any, str]] = field(default_factory=dict)  # a page's sections by what they were drawn from
    missing: str | None = None  # the coordinator knows no such job (its message)
    settled: bool = False  # ended, and every row of it read: nothing will change

    @property
    def job_id(self) -> str | None:
        return self.status.id if self.status is not None else None

    def saw_status(self, s: JobStatus) -> None:
        if self.status is not None and self.status.id != s.id:
            self.reset()  # a name now names a newer job
        if s != self.status:
            self.status, self.missing = s, None
            self.version += 1

    def not_found(self, message: str) -> None:
        if self.missing != message:
            self.reset()
            self.missing = message
            self.version += 1

    def reset(self) -> None:
        fresh = JobFollow(self.ref)
        for name in JobFollow.__slots__:
            if name not in ("ref", "version", "log_version"):
                setattr(self, name, getattr(fresh, name))
        self.version += 1

    def saw_metrics(self, rows: list[MetricRow], cursor: int) -> None:
        changed = False
        for r in rows:
            if isinstance(r, TrainRow):
                changed |= self.train.add(r)
            elif isinstance(r, EvalRow):
                changed |= self.evals.add(r)
            elif isinstance(r, TestLossRow):
                self.tests = [*[t for t in self.tests if t.step != r.step][-9:], r]
                changed = True
        self.cursors.metrics = cursor
        self.version += changed

    def saw_events(self, rows: list[EventRow], cursor: int) -> None:
        for e in rows:
            self.events.append(e)
            self.event_count += 1
            if e.kind == "group.resumed":
                self.resumed.append(e)
            elif e.kind == "worker.failed":
                self.failures += 1
        self.cursors.events = cursor
        self.version += bool(rows)

    def saw_logs(self, lines: list[LogLine], cursor: int) -> None:
        for line in lines:
            kept = self.logs.get(line.rank)
            if kept is None:
                if len(self.logs) >= LOG_RANKS_MAX:
                    continue
                kept = self.logs[line.rank] = collections.deque(maxlen=LOG_LINES_MAX)
            if len(line.text) > LOG_LINE_CHARS:
                line = LogLine(seq=line.seq, t=line.t, rank=line.rank, generation=line.generation, text=line.text[:LOG_LINE_CHARS] + " …")
            kept.append(line)
        self.cursors.logs = cursor
        self.version += bool(lines)
        self.log_version += bool(lines)

    def saw_samples(self, rows: list[SampleRow], cursor: int) -> None:
        for r in rows:
            text = r.text if len(r.text) <= SAMPLE_CHARS else r.text[:SAMPLE_CHARS] + " …"
            self.samples.append(SampleRow(step=r.step, text=text))
        self.cursors.samples = cursor
        self.version += bool(rows)

    def record(self) -> JobRecord:
        """As `dpctl plot` reads a job: for its restart rules (client/plot.py)."""
        assert self.status is not None
        return JobRecord(self.status, metrics=[*self.train.rows, *self.evals.rows], events=list(self.resumed))

    def restarts(self) -> list[dict[str, Any]]:
        """One entry per restart, as `dpctl plot` marks them: {generation, from_step,
        steps_recomputed, seconds}."""
        return restarts(self.record()) if self.status is not None else []

    @property
    def ended(self) -> bool:
        return self.status is not None and self.status.state in TERMINAL
