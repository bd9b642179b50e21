"""When a job was submitted, started and finished, how long it has run and how long it has left.

The coordinator's status rows carry the times and its ETA (the steps left at the running group's
median step time). A live view also reads the job's events, in the coordinator's clock
(`job.submitted`, the first `group.starting`, `job.succeeded|failed|cancelled`), and measures a
pace of its own from the steps it sees, for a coordinator that gives no ETA yet (no step timed).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dpool.protocol.payloads import EventRow, JobStatus

START_KINDS = ("group.starting", "group.started")
END_KINDS = ("job.succeeded", "job.failed", "job.cancelled")
PACE_WINDOW_S = 120.0  # the pace is measured over about the last two minutes of the running group
ETA_MAX_S = 1e11  # JobStatus.eta_s's bound (daemon/watch.py gives none beyond it either)


@dataclass(slots=True)
class JobTimes:
    """A job's times, fed with its events (in order) and, in a live view, with what it polled."""

    submitted: float | None = None
    started: float | None = None
    finished: float | None = None
    marks: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)  # (t, step) of the running group

    eta: float | None = None  # the coordinator's, from the newest status row

    @classmethod
    def of(cls, s: JobStatus) -> JobTimes:
        """The times a status row carries."""
        return cls().seen(s)

    def seen(self, s: JobStatus) -> JobTimes:
        """Take what the coordinator's status row says."""
        self.submitted = s.submitted if s.submitted is not None else self.submitted
        self.started = s.started if s.started is not None else self.started
        self.finished = s.finished if s.finished is not None else self.finished
        self.eta = s.eta_s
        return self

    def add(self, events: Iterable[EventRow]) -> JobTimes:
        for e in events:
            if e.kind == "job.submitted" and self.submitted is None:
                self.submitted = e.t
            if e.kind in START_KINDS and self.started is None:
                self.started = e.t
            if e.kind == "group.started":
                self.marks.clear()  # a new group: its own pace
            elif e.kind == "checkpoint.saved" and isinstance(step := e.fields.get("step"), int):
                self.mark(e.t, step)
            elif e.kind in END_KINDS:
                self.finished = e.t
        return self

    def mark(self, t: float, step: int) -> None:
        """The running group was at `step` at time `t`."""
        if self.marks and (step <= self.marks[-1][1] or t <= self.marks[-1][0]):
            return
        self.marks.append((t, step))
        while len(self.marks) > 2 and self.marks[1][0] < t - PACE_WINDOW_S:
            self.marks.popleft()

    def elapsed_s(self, now: float) -> float | None:
        """Seconds since the job started, up to its end; None while it never started."""
        if self.started is None:
            return None
        return max(0.0, (self.finished if self.finished is not None else now) - self.started)

    def eta_s(self, s: JobStatus, now: float) -> float | None:
        """Seconds until the last step at the running group's pace; None unless it runs and has
        made progress that can be timed."""
        if s.state != "running" or self.finished is not None:
            return None
        if self.eta is not None:
            return self.eta
        points = list(self.marks)
        if not points or s.step > points[-1][1]:
            points.append((now, s.step))
        if len(points) < 2:
            return None
        (t0, s0), (t1, s1) = points[0], points[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        per_step = (t1 - t0) / (s1 - s0)
        eta = max(0.0, (s.steps - s1) * per_step - (now - t1))
        return eta if eta <= ETA_MAX_S else None  # as the coordinator's: beyond a status row's bound is no estimate

    def to_wire(self, s: JobStatus, now: float) -> dict[str, Any]:
        """The keys `status --json` adds to a job's object (INTERFACE.md)."""
        elapsed, eta = self.elapsed_s(now), self.eta_s(s, now)
        return {
            "submitted": self.submitted,
            "started": self.started,
            "finished": self.finished,
            "elapsed_s": None if elapsed is None else round(elapsed, 3),
            "eta_s": None if eta is None else round(eta, 1),
        }


def status_object(s: JobStatus, times: JobTimes, now: float) -> dict[str, Any]:
    """`status JOB --json`'s object: the status row and its times. Every key is there whatever the
    job (the wire leaves out a few while null, for older peers; a script reads `priority` of any job)."""
    doc = {**s.to_wire(), **times.to_wire(s, now)}
    doc.setdefault("priority", 0)
    doc.setdefault("comm", None)
    doc.setdefault("waiting", None)
    return doc
