"""The links the pool has measured, and each running job's predicted share of a step spent in
all_sum. Pure: times come in as arguments.

Figures come from the groups themselves: right after a group forms, its trainers time a few
all_sums (trainer/linkprobe.py) and rank 0 reports what it found (`node.link`), with the trainable
parameters a step sums. A ring all_sum goes as fast as the ring's slowest link, so the probe
measures the ring, not each link: its figures go to every pair of neighbouring nodes of that ring,
marked `source: "ring"` (each of those links is at least that fast; the slowest of them is that
slow). The newest figure of a pair replaces the older one, whatever its ring: the links of a
machine change (a cable plugged in, Wi-Fi moving). Ranks that share a node are no link.

Kept in the coordinator's memory only, not in its store: a restarted coordinator knows no link
until the next group starts, and every group start measures again.

The prediction (protocol/commmodel.py): the ring model on the running group's own probe (its
slowest link), the job's bytes per all_sum (parameters x the `[sync] dtype`'s bytes), one all_sum
per step in sync mode or per `inner_steps` in diloco mode, against the compute of a step. In sync
mode rank 0's metrics rows time each step's all_sum (`all_sum_s`; less rank 0's wait there for
the slowest rank, what the step spent communicating): the compute is then the rest of recent steps,
and the share they spent communicating is shown beside the prediction (`measured_share`). Before
such rows, and in diloco mode, the compute is the median of rank 0's recent step times (less the
predicted all_sum where the step had one of its own: every step in sync mode, a diloco job's
`warmup_steps`). While a diloco job is in its warm-up its share is that of its warm-up (an
all_sum every step); its `job.comm_bound` check (one event per job, for a share above
COMM_BOUND) reads the steps after it, which the job is about.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from dpool.daemon.jobstate import JobState
from dpool.daemon.records import Job, Record
from dpool.protocol.commmodel import (
    Link,
    StepComm,
    bound_warning,
    comm_share,
    describe_link,
    measured_compute,
    step_comm,
)
from dpool.protocol.link_messages import NodeLink
from dpool.protocol.payloads import LINKS_MAX, MAX_SECONDS, CommRow, LinkRow
from dpool.protocol.rounds import Rounds
from dpool.protocol.schema import MAX_INT

STEPS_KEPT = 32  # rank 0's recent step times kept per job (the median of them is its step)
MIN_STEPS = 3  # no share is predicted from fewer steps (the first steps compile)
CHECK_AT = (8, 32)  # steps into a generation at which a job is checked for being comm-bound


@dataclass(frozen=True, slots=True)
class Measured:
    link: Link
    at: float  # when it was reported (the coordinator's clock)


@dataclass(slots=True)
class JobLink:
    """What the current generation of a job said about its ring, and how long its steps take."""

    generation: int
    ring: tuple[str, ...]  # the node of each rank
    link: Link | None  # its probe (None: a group of one, or no probe)
    params: int
    # (seconds, summed): each recent step of rank 0, and whether it had an all_sum of its own
    steps: collections.deque[tuple[float, bool]] = field(default_factory=lambda: collections.deque(maxlen=STEPS_KEPT))
    seen: int = 0  # steps reported in this generation
    # (seconds, communicating): rank 0's recent metrics rows of sync steps that timed their all_sum
    timed: collections.deque[tuple[float, float]] = field(default_factory=lambda: collections.deque(maxlen=STEPS_KEPT))
    rows: int = 0  # such rows reported in this generation (its first, which compiles, is not kept)


@dataclass(frozen=True, slots=True)
class Prediction:
    share: float | None  # null: no step measured yet
    comm: StepComm
    compute_s: float | None
    link: Link
    pace: tuple[str, str]  # the link named as the ring's pace
    ranks: int
    global_batch: int
    warm: bool = False  # of a diloco warm-up step: the job's choice for a while, not warned about
    measured: float | None = None  # the share of the recent steps spent communicating, as timed (None: not timed)
    params: int | None = None  # trainable parameters summed

    def row(self) -> CommRow:
        """Within the reply's bounds, whatever a node reported (a 1 bit/s ring, 2^53 parameters):
        a derived value never leaves them."""
        return CommRow(
            bytes=min(self.comm.nbytes, MAX_INT), every=self.comm.every, ranks=self.ranks, global_batch=self.global_batch,
            seconds=_seconds(self.comm.seconds), compute_s=None if self.compute_s is None else _seconds(self.compute_s),
            link=list(self.pace), bandwidth_bps=self.link.bandwidth_bps, latency_s=self.link.latency_s, warning=self.warning(),
            measured_share=None if self.measured is None else round(min(1.0, max(0.0, self.measured)), 4),
            params=None if self.params is None else min(self.params, MAX_INT),
        )

    def bound_share(self) -> float | None:
        """The share a warning reads: the predicted one, or the measured one where that is higher
        (a probe can read a link faster than the steps find it: 49% low on an unshaped link)."""
        if self.share is None:
            return self.measured
        return self.share if self.measured is None else max(self.share, self.measured)

    def warning(self) -> str | None:
        share = self.bound_share()
        if share is None or self.warm:
            return None
        timed = self.measured is not None and (self.share is None or self.measured > self.share)
        return bound_warning(share, "the ring's slowest link, " + describe_link(*self.pace, self.link), measured=timed)


class Links:
    def __init__(self) -> None:
        self.pairs: dict[tuple[str, str], Measured] = {}  # (a, b), a < b -> its newest figure
        self.jobs: dict[str, JobLink] = {}
        self.warned: set[str] = set()  # jobs that got their job.comm_bound event

    # -- what groups report --------------------------------------------------------------------

    def observe(self, now: float, job: Job, msg: NodeLink) -> list[Record]:
        """Rank 0 of the job's current generation reported its probe and parameters."""
        plan = job.plan
        if plan is None or plan.generation != msg.generation or msg.rank != 0:
            return []
        ring = tuple(s.node for s in plan.ranks)
        link = None if msg.ring is None else Link(msg.ring.bandwidth_bps, msg.ring.latency_s)
        self.jobs[job.id] = JobLink(msg.generation, ring, link, msg.params)
        if link is None:
            return []
        for pair in neighbours(ring):
            self.pairs[pair] = Measured(link, now)
        fields = {
            "generation": msg.generation, "nodes": sorted(set(ring)), "bandwidth_bps": round(link.bandwidth_bps),
            "latency_s": round(link.latency_s, 6), "probe_bytes": msg.ring.bytes if msg.ring else 0,
            "probe_s": round(msg.ring.seconds, 4) if msg.ring else 0.0,
        }
        return [Record(job.id, "group.link", now, fields)]

    def step(self, now: float, job: Job, generation: int, step: int, seconds: float) -> list[Record]:
        """Rank 0 finished global step `step` in `seconds`; at CHECK_AT steps into a generation, a
        job whose predicted share after any warm-up is above COMM_BOUND gets its one
        `job.comm_bound` event."""
        known = self.jobs.get(job.id)
        if known is None or known.generation != generation or seconds <= 0:
            return []
        known.steps.append((seconds, _summed(job, step)))
        known.seen += 1
        if known.seen not in CHECK_AT or job.id in self.warned:
            return []
        p = self.predict(job, steady=True)
        share = None if p is None else p.bound_share()
        if p is None or share is None or p.warning() is None:
            return []
        self.warned.add(job.id)
        fields = {
            "generation": generation, "share": round(share, 3), "link": f"{p.pace[0]} <-> {p.pace[1]}",
            "bandwidth_bps": round(p.link.bandwidth_bps), "latency_s": round(p.link.latency_s, 6),
            "comm_s": _seconds(p.comm.seconds), "compute_s": _seconds(p.compute_s or 0.0), "bytes": min(p.comm.nbytes, MAX_INT),
            "warning": p.warning(),
        }
        if p.measured is not None:  # `share` is the larger of the predicted (comm_s, compute_s) and the measured one
            fields["predicted_share"] = None if p.share is None else round(p.share, 3)
            fields["measured_share"] = round(p.measured, 3)
        return [Record(job.id, "job.comm_bound", now, fields)]

    def timed(self, job: Job, generation: int, seconds: float, comm_s: float) -> None:
        """Rank 0's metrics row of a sync step: the step took `seconds`, communicating `comm_s` of
        them (its all_sum as the trainer timed it, less rank 0's wait there for the slowest rank:
        commmodel.timed_comm). The generation's first such row is left out: its step compiles."""
        known = self.jobs.get(job.id)
        if known is None or known.generation != generation or not (0 <= comm_s <= seconds and 0 < seconds < MAX_SECONDS):
            return
        known.rows += 1
        if known.rows > 1:
            known.timed.append((seconds, comm_s))

    def forget(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        self.warned.discard(job_id)

    # -- what is asked -------------------------------------------------------------------------

    def predict(self, job: Job, steady: bool = False) -> Prediction | None:
        """The prediction for the job's newest reported group (the running one, while it runs), for
        the step it takes next (`steady`: for the steps after a diloco warm-up, wherever it is);
        None when the pool does not know enough (no report of the running generation, or a ring
        with no measured link)."""
        known = self.jobs.get(job.id)
        if known is None or len(known.ring) < 2:
            return None
        if job.state is JobState.RUNNING and (job.plan is None or job.plan.generation != known.generation):
            return None  # a new group that has not reported yet
        link, pace = known.link, self.pace(known.ring)
        if link is None:
            figures = [self.pairs[p].link for p in neighbours(known.ring) if p in self.pairs]
            if not figures:
                return None
            link = min(figures, key=lambda x: x.bandwidth_bps)
        sync = job.spec.sync
        each = step_comm(known.params, len(known.ring), link, dtype=sync.dtype)  # an all_sum every step
        after = step_comm(known.params, len(known.ring), link, dtype=sync.dtype, mode=sync.mode, inner_steps=sync.inner_steps)
        warm = not steady and after.every > 1 and _summed(job, job.step + 1)
        comm = each if warm else after
        compute = measured = None
        if known.timed:
            # A step's compute is what it spent outside its all_sum, as timed: the prediction then
            # rests on the probe for the all_sum alone, and the measured share stands beside it.
            compute = statistics.median(s - a for s, a in known.timed)
            measured = statistics.median(a / s for s, a in known.timed)
        elif len(known.steps) >= MIN_STEPS:
            compute = statistics.median(measured_compute(s, each if summed else after) for s, summed in known.steps)
        share = None if compute is None else min(1.0, max(0.0, comm_share(comm.seconds, compute)))
        return Prediction(share, comm, compute, link, pace, len(known.ring), job.spec.train.global_batch, warm, measured, known.params)

    def share(self, job: Job) -> tuple[float | None, CommRow | None]:
        """`status JOB --json`'s comm_share (for a running job; 0.0 for a group of one, which sums
        nothing) and comm (a job that is not running keeps its last group's)."""
        running = job.state is JobState.RUNNING and job.plan is not None
        if running and job.plan is not None and job.plan.world_size == 1:
            return 0.0, None
        p = self.predict(job)
        if p is None:
            return None, None
        return (p.share if running else None), p.row()

    def pace(self, ring: tuple[str, ...]) -> tuple[str, str]:
        """The link named as a ring's pace: of its neighbouring pairs of nodes, the one with the
        lowest figure the pool holds (another ring may have measured it alone); one node twice when
        every rank shares it."""
        pairs = neighbours(ring)
        if not pairs:
            return (ring[0], ring[0])
        known = [p for p in pairs if p in self.pairs]
        return min(known, key=lambda p: self.pairs[p].link.bandwidth_bps) if known else pairs[0]

    def rows(self, node: str, now: float) -> list[LinkRow]:
        """`dpctl nodes --json` "links" of `node`, by peer name."""
        out = []
        for (a, b), got in sorted(self.pairs.items()):
            if node in (a, b):
                out.append(LinkRow(
                    peer=b if a == node else a, bandwidth_bps=got.link.bandwidth_bps, latency_s=got.link.latency_s,
                    age_s=round(max(0.0, now - got.at), 3),
                ))
        return out[:LINKS_MAX]


def _summed(job: Job, step: int) -> bool:
    """Whether global step `step` of the job has an all_sum of its own: every step in sync mode; in
    diloco mode a warm-up step (an outer step of one step). A diloco step that ends an outer step of
    H also has one; the median of recent steps leaves those out."""
    sync = job.spec.sync
    return sync.mode != "diloco" or Rounds(sync.inner_steps, sync.warmup_steps).warm(step)


def _seconds(s: float) -> float:
    return round(min(s, MAX_SECONDS), 6)


def neighbours(ring: tuple[str, ...]) -> list[tuple[str, str]]:
    """The pairs of distinct nodes that are neighbours on the ring (rank r and r + 1, and the last
    and rank 0), each once, as (lower name, higher name)."""
    out: list[tuple[str, str]] = []
    for r, a in enumerate(ring):
        b = ring[(r + 1) % len(ring)]
        pair = (min(a, b), max(a, b))
        if a != b and pair not in out:
            out.append(pair)
    return out
