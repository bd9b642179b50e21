"""What admission reads from the pool before and after the scheduler decides. Pure.

`daemon/scheduler.py` decides from numbers (slots in all, slots free, each job's view); `Pool.schedule`
carries the decision out. Between the two sits what this module computes from the pool's records:
the usable nodes and what each job holds on them (`census`), a job as the scheduler sees it
(`job_view`), the free slots a job may use (`free_slots`), whether a job back from the queue waits
for a node holding its newest checkpoint (`holders_busy`), and the trainers a growth warms first
(`warm`). Every function takes the records and `now`, changes at most the job it is given, and
returns what the pool must send or record.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from dpool.daemon import scheduler as sched
from dpool.daemon.conditions import LABELS
from dpool.daemon.jobstate import JobState
from dpool.daemon.plan import FreeSlot, Slot
from dpool.daemon.records import Action, Hold, Job, Node, Record, Send, Warming
from dpool.protocol import messages as m
from dpool.protocol.jobspec import JobSpec

MEMORY_PRESSURE = LABELS["memory"]
DONOR_TRIES = 2  # groups started with a leaving node's rank for the same checkpoint step (admission.donor)
HOLDER_WAIT_S = 60.0  # a restarting job waits this long for a free slot that holds its newest step

Eligible = Callable[[str, JobSpec, str], bool]  # (job id, spec, node name): may the node serve the job


@dataclass(slots=True)
class Census:
    """The nodes that may take work (not lost, not held) and what is used of them."""

    usable: list[Node] = field(default_factory=list)
    held: collections.Counter[str] = field(default_factory=collections.Counter)  # job -> the usable slots it holds
    total: int = 0
    busy: int = 0

    @property
    def free(self) -> int:
        return self.total - self.busy


def census(nodes: Iterable[Node]) -> Census:
    """One pass over the nodes: this runs after every batch of messages."""
    c = Census()
    for n in nodes:
        if n.lost or n.hold is not None:
            continue
        c.usable.append(n)
        c.total += n.info.slots
        if n.used:
            c.busy += min(len(n.used), n.info.slots)
            c.held.update(job for job, _ in n.used.values())
    return c


def job_view(job: Job, waiting: bool, held: int, capacity: int | None) -> sched.JobView:
    """The job as the scheduler sees it. `capacity`: the slots of the nodes that can serve it
    (None: any node can)."""
    jm, plan = job.machine, job.plan
    running = not waiting and job.state is JobState.RUNNING
    # Resizable: a step of this generation done (a group that cannot get going is not made to
    # start over) and not finishing (a rank that is done frees its slot by itself).
    resizable = running and plan is not None and jm.from_step is not None and jm.interrupted_at is None and jm.from_step < job.step < job.spec.train.steps
    phase = sched.Phase.WAITING if waiting else sched.Phase.RUNNING if running else sched.Phase.MOVING
    return sched.JobView(
        id=job.id, priority=job.spec.priority, min=job.spec.workers.min, max=job.spec.max_workers(), submitted_at=job.submitted_at,
        phase=phase, held=0 if waiting else held, resizable=resizable, started_at=jm.started_at, resized_at=job.resized_at, capacity=capacity,
    )


def free_slots(job: Job, nodes: Iterable[Node], eligible: Eligible, kept: dict[tuple[str, int], str] | None = None) -> list[FreeSlot]:
    """The free slots of the nodes that may serve the job, each with the step it holds of it and
    whether it is `kept` for another job (kept_for_resumes)."""
    kept = kept or {}
    return [
        FreeSlot(n.name, i, n.resumable.get((job.id, i)), kept.get((n.name, i), job.id) != job.id)
        for n in nodes if eligible(job.id, job.spec, n.name) for i in n.free()
    ]


def kept_for_resumes(jobs: Iterable[Job], usable: list[Node]) -> dict[tuple[str, int], str]:
    """The slots holding the newest checkpoint of a job back in the queue (preempted, or below
    its minimum), by job: another job's start or growth takes them last, so that the job resumes
    there from its newest step rather than waiting HOLDER_WAIT_S and then starting further back."""
    queued = {j.id for j in jobs if j.state is JobState.QUEUED and j.machine.generation}
    if not queued:
        return {}
    holds: dict[str, list[tuple[str, int, int]]] = collections.defaultdict(list)
    for n in usable:
        for (j, i), step in n.resumable.items():
            if j in queued:
                holds[j].append((n.name, i, step))
    out: dict[tuple[str, int], str] = {}
    for j, slots in holds.items():
        newest = max(step for _, _, step in slots)
        out.update(((name, i), j) for name, i, step in slots if step == newest)
    return out


def leaving(n: Node) -> bool:
    """A node its work moves off: drained, or yielding to its owner (not set aside, not lost)."""
    return not n.lost and n.hold in (Hold.DRAINED, Hold.YIELDING)


def donor(job: Job, chosen: list[Slot], nodes: Mapping[str, Node], eligible: Eligible) -> Slot | None:
    """A free slot of a leaving node that holds a newer step of a restarting job than any of the
    `chosen` slots: it runs one more rank of the next group only. Checkpoints stay on the machines
    that wrote them, so without it a job whose every rank moved to machines without one (a
    one-machine job drained) started again from step 0. That rank's state reaches the others
    through the group's collective at start (trainer/restore.py), and at the group's first step
    the pool moves the job off the node as a drain does (Pool._off_leaving), with its newest step
    now held by the ranks that stay. None when no leaving node holds a newer step; or one more
    rank would not fit the job (a sequence per rank; diloco: a replica); or the node yields for
    memory pressure (a trainer's model would add to it); or that step was offered DONOR_TRIES
    times already (a donor whose group keeps failing is not asked again)."""
    if not job.machine.generation:
        return None
    world = len(chosen) + 1
    if world > job.spec.train.global_batch or (job.spec.sync.mode == "diloco" and world > job.spec.sync.replicas):
        return None
    have = max((nodes[s.node].resumable.get((job.id, s.index), 0) for s in chosen), default=0)
    best: tuple[int, Slot] | None = None
    for n in nodes.values():
        if not leaving(n) or MEMORY_PRESSURE in (n.yielding or "") or not eligible(job.id, job.spec, n.name):
            continue
        for i in range(n.slots):
            step = n.resumable.get((job.id, i), 0)
            if step > have and i not in n.used and (best is None or step > best[0]):
                best = (step, Slot(n.name, i))
    if best is None:
        return None
    tries = job.donated[1] + 1 if job.donated is not None and job.donated[0] == best[0] else 1
    if tries > DONOR_TRIES:
        return None
    job.donated = (best[0], tries)
    return best[1]


def holders_busy(job: Job, free: list[FreeSlot], usable: list[Node], now: float) -> str | None:
    """A job back from the queue (preempted, most often) resumes from its newest step only on a
    slot of a node that holds it: while those nodes are busy, it waits (their names), for at
    most HOLDER_WAIT_S, and then starts from the newest step a free slot holds."""
    if job.state is not JobState.QUEUED or not job.machine.generation:
        return None  # a first start, or a restart on the slots its group just left
    holds = [(n.name, s) for n in usable for (j, _), s in n.resumable.items() if j == job.id]  # one pass over the slots
    newest = max((s for _, s in holds), default=None)
    if newest is None or any(f.holds_step == newest for f in free):
        job.holders_wait = None
        return None
    if job.holders_wait is None:
        job.holders_wait = now + HOLDER_WAIT_S
    if now >= job.holders_wait:
        return None
    return ", ".join(sorted({name for name, s in holds if s == newest}))


def warm(job: Job, new: set[tuple[str, int]], now: float) -> list[Action] | None:
    """Before a growth: warm trainers of the job on the slots it adds (job.warm), while the
    group trains on. The actions to wait with, or None once they are ready (or the wait is
    over: `recovery.start_timeout_s`, what a cold start would be allowed)."""
    w = job.warming
    ask = new - w.asked if w is not None else new
    if w is None:
        w = job.warming = Warming(asked=set(), waiting=set(), deadline=now + job.spec.recovery.start_timeout_s)
    if not ask:
        if w.waiting & new and now < w.deadline:
            return []
        job.warming = None
        return None
    w.asked |= ask
    w.waiting |= ask
    by_node: dict[str, list[int]] = {}
    for name, i in sorted(ask):
        by_node.setdefault(name, []).append(i)
    actions: list[Action] = [Record(job.id, "group.warming", now, {"nodes": sorted(by_node), "slots": len(ask)})]
    return actions + [Send(name, m.JobWarm(job=job.id, spec=job.doc, slots=slots)) for name, slots in by_node.items()]
