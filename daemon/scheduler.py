"""Sharing the pool: priorities, fair shares, backfill, and preemption by shrinking. Pure.

`plan(now, capacity, free, jobs)` looks at the pool's usable slots and its live jobs and says what
each job should hold (its target) and what to do now to get there: which waiting jobs start and on
how many slots, which running jobs stop at their next step to come back smaller (shrink), bigger
(grow) or not at all (preempt: requeued with the checkpoint of that step), and why each other job
waits. It holds no socket and reads no clock: `now` is given. The pool (`daemon/pool.py`) builds
the job views, calls it once per round of admission, and carries its decisions out with what it
already has: a planned restart (checkpoint at the next step, exit 75, restart from exactly that
step: 0 steps recomputed) for every resize, admission for every start. `bench/scheduling.py`
drives the same function through a simulated day.

The rule:

- Queue order: priority (higher first), then submission (earlier first).
- Targets: each job in queue order gets its workers.min if that still fits in the usable slots; a
  job that does not fit gets nothing and holds back no job behind it (backfill). Then, priority by
  priority from the highest, what is left is shared max-min fairly among the jobs of that priority
  that got their minimum, up to each one's workers.max. So a job of higher priority takes first what
  the jobs below it hold above their minimum (they shrink), and a job is stopped whole (preempted)
  only so that a job ahead of it gets its minimum. A backfilled job ahead of which a job becomes
  able to start is preempted as well: it never delays a job ahead of it by more than one stop.
- Who gives: a job that needs slots takes the free ones first, then the slots the jobs above their
  target hold, lowest priority first, then the most recently started.
- When: slots taken for a job of higher priority, or for a waiting job that cannot start without
  them (below its minimum), are taken at once. Slots moved between jobs of one priority otherwise
  (a fair share that changed) move at most once per `resize_interval_s` per job: each move costs the
  giving job a restart. Growth into slots nobody else wants is never held back: an idle slot is
  pure loss.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

RESIZE_INTERVAL_S = 60.0  # a job's fair share among equals changes at most this often (each change is a restart)
NAMED_MAX = 4  # jobs named in one "why it waits"


class Phase(enum.StrEnum):
    """Where a job stands, for the scheduler."""

    WAITING = "waiting"  # needs slots to (re)start: queued, or its old group has stopped
    RUNNING = "running"  # a group runs
    MOVING = "moving"  # starting, stopping or restarting: left alone until it settles


class How(enum.StrEnum):
    SHRINK = "shrink"
    GROW = "grow"
    PREEMPT = "preempt"


@dataclass(frozen=True, slots=True)
class JobView:
    """What the scheduler knows of one live job."""

    id: str
    priority: int
    min: int  # workers.min
    max: int  # the most workers it can use (workers.max, bounded by its global batch)
    submitted_at: float
    phase: Phase
    held: int = 0  # slots it holds now
    resizable: bool = False  # RUNNING, and its group has done a step and is not finishing: may stop at its next step
    started_at: float | None = None  # its first group's start (victims: the most recently started first)
    resized_at: float | None = None  # its last start or resize (damping)
    capacity: int | None = None  # usable slots that can serve it (None: every usable slot)


@dataclass(frozen=True, slots=True)
class Take:
    """`slots` that the job this is listed under takes from job `job`, by `how` it gives them."""

    job: str
    slots: int
    how: How


@dataclass(frozen=True, slots=True)
class Start:
    job: str
    slots: int


@dataclass(frozen=True, slots=True)
class Resize:
    """Stop `job` at its next step and restart it on `to` slots (0: requeue it); `by`: the jobs
    its slots go to (none for a growth)."""

    job: str
    to: int
    how: How
    by: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Policy:
    resize_interval_s: float = RESIZE_INTERVAL_S


@dataclass(slots=True)
class Decision:
    order: list[str]  # the live jobs in queue order
    targets: dict[str, int]  # job -> the slots it should hold
    starts: list[Start] = field(default_factory=list)  # waiting jobs to admit now, in queue order
    resizes: list[Resize] = field(default_factory=list)  # running jobs to stop at their next step
    waits: dict[str, str] = field(default_factory=dict)  # waiting job not starting -> why
    takes: dict[str, list[Take]] = field(default_factory=dict)  # job -> what it would take from whom


def queue_order(jobs: Iterable[JobView]) -> list[JobView]:
    return sorted(jobs, key=lambda j: (-j.priority, j.submitted_at, j.id))


def cap(j: JobView) -> int:
    return j.max if j.capacity is None else min(j.max, j.capacity)


def targets(capacity: int, order: Sequence[JobView]) -> dict[str, int]:
    """What each job should hold: minimums in queue order while they fit, then max-min shares of
    what is left, priority by priority."""
    out: dict[str, int] = {}
    left = capacity
    for j in order:
        fits = j.min <= min(left, cap(j))
        out[j.id] = j.min if fits else 0
        left -= out[j.id]
    i = 0
    while i < len(order) and left > 0:
        level = [j for j in order[i:] if j.priority == order[i].priority]
        i += len(level)
        members = [j for j in level if out[j.id] > 0 and cap(j) > out[j.id]]
        left -= _fill(members, out, left)
    return out


def _fill(members: list[JobView], out: dict[str, int], left: int) -> int:
    """Max-min fair: the highest water level `w` such that raising every member to `w` (each
    between its allocation and its cap) costs at most `left`; the slots still left go one each to
    the members at the level, earliest in queue order first. Returns the slots given."""
    if not members:
        return 0

    def cost(w: int) -> int:
        return sum(max(0, min(w, cap(j)) - out[j.id]) for j in members)

    lo, hi = 0, max(cap(j) for j in members)
    while lo < hi:  # the highest w with cost(w) <= left
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= left else (lo, mid - 1)
    given = cost(lo)
    for j in members:
        out[j.id] = max(out[j.id], min(lo, cap(j)))
    for j in members:
        if given < left and out[j.id] == lo and lo < cap(j):
            out[j.id] += 1
            given += 1
    return given


POLICY = Policy()


def plan(now: float, capacity: int, free: int, jobs: Iterable[JobView], policy: Policy = POLICY) -> Decision:
    """The scheduler's decision for this round (module docstring). `capacity`: the usable slots
    (on nodes neither lost nor held); `free`: those of them no job holds now."""
    order = queue_order(jobs)
    target = targets(capacity, order)
    d = Decision(order=[j.id for j in order], targets=target)
    by_id = {j.id: j for j in order}
    rank = {j.id: k for k, j in enumerate(order)}

    # Who gives: the surplus of every job above its target, lowest priority first, then the most
    # recently started. A job that is stopping gives it by itself; a running one once resized.
    victims = sorted(
        (j for j in order if j.phase is not Phase.WAITING and j.held > target[j.id]),
        key=lambda j: (j.priority, -(j.started_at if j.started_at is not None else j.submitted_at), -rank[j.id]),
    )
    surplus = {j.id: j.held - target[j.id] for j in victims}
    avail = free
    from_free: dict[str, int] = {}
    urgent: dict[str, bool] = {}  # (victim) some of its slots go to a job that must have them now
    gives: dict[str, list[str]] = {}  # victim -> the jobs its slots go to
    for j in order:
        need = target[j.id] - (0 if j.phase is Phase.WAITING else j.held)
        if need <= 0:
            continue
        got = min(need, avail)
        avail -= got
        from_free[j.id] = got
        need -= got
        waiting_below_min = j.phase is Phase.WAITING and got < j.min
        for v in victims:
            if need == 0:
                break
            n = min(need, surplus[v.id])
            if n == 0:
                continue
            surplus[v.id] -= n
            need -= n
            d.takes.setdefault(j.id, []).append(Take(v.id, n, How.PREEMPT if target[v.id] == 0 else How.SHRINK))
            gives.setdefault(v.id, []).append(j.id)
            if j.priority > v.priority or waiting_below_min:
                urgent[v.id] = True

    # Resizes of the givers: at once when urgent, else once their damping interval has passed.
    coming: set[str] = set()  # victims whose slots are on their way (stopping now, or resized below)
    for v in victims:
        taken = v.held - target[v.id] - surplus[v.id]
        if taken == 0:
            continue  # nobody needs its slots: it keeps them
        if v.phase is Phase.MOVING:
            coming.add(v.id)
            continue
        due = urgent.get(v.id, False) or v.resized_at is None or now - v.resized_at >= policy.resize_interval_s
        if not (v.resizable and due):
            continue
        to = v.held - taken
        if to < v.min or target[v.id] == 0:
            d.resizes.append(Resize(v.id, 0, How.PREEMPT, tuple(gives[v.id])))
        else:
            d.resizes.append(Resize(v.id, to, How.SHRINK, tuple(gives[v.id])))
        coming.add(v.id)

    # Starts and growths, in queue order, from the free slots each was given above.
    for j in order:
        given = from_free.get(j.id)
        if j.phase is Phase.WAITING:
            if target[j.id] == 0:
                d.waits[j.id] = _why_not(j, order, rank, target, capacity)
                continue
            takes = d.takes.get(j.id, [])
            waits_for = [t for t in takes if t.job in coming]
            pending = sum(t.slots for t in takes)
            uncovered = target[j.id] - (given or 0) - pending
            # Short of its target: it starts on what is free unless slots are on their way to it
            # (slots of exiting workers are not: such a worker may never be reported gone).
            if given == target[j.id] or (given is not None and given >= j.min and not waits_for):
                d.starts.append(Start(j.id, given))
                continue
            d.waits[j.id] = _why_waiting(j, takes, by_id, uncovered)
        elif j.phase is Phase.RUNNING and given and j.resizable:
            if any(t.job in coming for t in d.takes.get(j.id, [])):
                continue  # more is on its way: grow once, when it is here
            d.resizes.append(Resize(j.id, j.held + given, How.GROW))
    return d


def _why_not(j: JobView, order: Sequence[JobView], rank: dict[str, int], target: dict[str, int], capacity: int) -> str:
    """Why a job has no target: it never fits, or other jobs hold the slots. Every job due slots
    is named, those behind it too (backfilled into what it cannot use: they give way once it can
    start), so that the named slots and the free ones add up to the usable ones."""
    room = j.capacity if j.capacity is not None else capacity
    if j.min > room:
        return f"workers.min = {j.min} is more than the {room} usable slot(s) that can serve it"
    holders = [o for o in order if o.id != j.id and target[o.id] > 0]
    named = [_holder(o, j, rank, target[o.id]) for o in holders[:NAMED_MAX]]
    if len(holders) > NAMED_MAX:
        named.append(f"{len(holders) - NAMED_MAX} more ({sum(target[o.id] for o in holders[NAMED_MAX:])})")
    why = f"{j.min} free slot(s) (workers.min)"
    if not named:
        return why
    held_by = f"{', '.join(named[:-1])} and {named[-1]}" if len(named) > 1 else named[0]
    # The free ones: only where every usable slot can serve it (else the holders' slots may lie
    # on nodes it cannot use, and the sum would say nothing).
    idle = capacity - sum(target[o.id] for o in holders) if j.capacity is None else 0
    return f"{why}; {idle} free, the rest held by {held_by}" if idle > 0 else f"{why}; held by {held_by}"


def _holder(o: JobView, j: JobView, rank: dict[str, int], slots: int) -> str:
    """`o-1 (2)`, `o-1 (1, priority 5)`, `o-1 (1, behind it: backfill)`."""
    notes = [str(slots)]
    if o.priority != j.priority:
        notes.append(f"priority {o.priority}")
    if rank[o.id] > rank[j.id]:
        notes.append("behind it: backfill")
    return f"{o.id} ({', '.join(notes)})"


def _why_waiting(j: JobView, takes: list[Take], by_id: dict[str, JobView], uncovered: int) -> str:
    parts = []
    for t in takes:
        v = by_id[t.job]
        parts.append(f"{t.job} (preempted)" if t.how is How.PREEMPT else f"{t.job} (shrinking {v.held}->{v.held - t.slots})")
    if uncovered > 0:
        parts.append(f"{uncovered} slot(s) of exiting workers")
    return f"its {j.min if j.min == j.max else f'{j.min}-{j.max}'} slot(s): " + ", ".join(parts) if parts else "its slots"


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Note:
    """A resize the pool asked of a job, kept until the job restarts (its event then has the cost)."""

    how: How
    world_size: int  # before
    by: tuple[str, ...]
    at: float
    cause: str | None = None  # a shrink no job asked for: the node that left (a drain, its owner)


def resumed_event(note: Note, world_size: int, resumed: dict[str, object]) -> tuple[str, dict[str, object]] | None:
    """`job.shrunk` or `job.grown` for a job that restarted after a resize, from its `group.resumed`
    fields (the pause from the stop request to the first step, and the steps recomputed)."""
    if world_size == note.world_size:
        return None
    kind = "job.grown" if world_size > note.world_size else "job.shrunk"
    fields: dict[str, object] = {"from": note.world_size, "to": world_size}
    if kind == "job.shrunk":
        fields["by"] = list(note.by)
        if note.cause is not None:
            fields["cause"] = note.cause
    fields["steps_lost"] = resumed.get("steps_recomputed", 0)
    fields["restart_s"] = resumed.get("seconds_since_failure")
    return kind, fields


def preempted_event(note: Note, now: float, step: int, checkpoint_step: int | None, waits: str) -> dict[str, object]:
    """`job.preempted`'s fields, once a group the pool asked to stop has stopped and the job is
    back in the queue (whatever the resize asked for: its minimum no longer fits): who took the
    slots, or else why (`cause`, `by` empty, as in `job.shrunk`: the node that left it, or, for a
    job stopped to grow whose slots went to others meanwhile, what it now `waits` for), the
    checkpoint it resumes from and the steps past it (0: it stopped at a checkpoint), how long the
    stop took. Its restart's cost is the `group.resumed` of the group that takes it back."""
    saved = checkpoint_step or 0
    fields: dict[str, object] = {"by": list(note.by), "from": note.world_size}
    if note.cause is not None or not note.by:
        fields["cause"] = note.cause or waits
    return fields | {"step": saved, "steps_lost": max(0, step - saved), "stop_s": round(now - note.at, 3)}
