"""What the coordinator answers about sharing the pool: `dpctl queue` (the live jobs as the
scheduler's newest decision ordered them, daemon/scheduler.py) and `dpctl priority JOB N`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dpool.daemon import jobstate as js
from dpool.daemon.pool import Pool
from dpool.daemon.records import Job, JobRef
from dpool.daemon.scheduler import Decision
from dpool.protocol.jobspec import check_priority
from dpool.protocol.messages import ErrorCode, ProtocolError
from dpool.protocol.sharing import PriorityReply, QueueReply, QueueRow, TakeRow


def held(job: Job) -> int:
    """The slots a live job holds: its group being prepared, or the one that runs or stops."""
    if job.pending is not None:
        return len(job.pending.slots)
    if job.plan is not None and job.machine.live and job.state is not js.JobState.QUEUED:
        return job.plan.world_size
    return 0


def queue_rows(live: Iterable[Job], decision: Decision | None) -> list[QueueRow]:
    """Every live job in queue order; the jobs the decision left out (their files are being
    checked) after the rest, in submission order."""
    jobs = {j.id: j for j in live}
    planned = [i for i in (decision.order if decision is not None else []) if i in jobs]
    seen = set(planned)
    order = planned + [i for i in jobs if i not in seen]
    rows = []
    for position, job_id in enumerate(order, 1):
        job = jobs[job_id]
        w = job.spec.workers
        takes = decision.takes.get(job_id, []) if decision is not None else []
        rows.append(QueueRow(
            position=position, id=job.id, name=job.name, priority=job.spec.priority, state=str(job.state), workers=held(job),
            target=decision.targets.get(job_id, 0) if decision is not None else 0, min=w.min, max=job.spec.max_workers(),
            submitted=job.submitted_at, waiting=job.waiting if job.state in (js.JobState.QUEUED, js.JobState.RECOVERING) else None,
            takes=[TakeRow(job=t.job, slots=t.slots, how=str(t.how)) for t in takes],
        ))
    return rows


def queue_reply(pool: Pool) -> QueueReply:
    return QueueReply(rows=queue_rows(pool.live.values(), pool.decision))


def set_priority(pool: Pool, found: JobRef, priority: int, now: float) -> tuple[PriorityReply, list[Any]]:
    """`dpctl priority JOB N`: a queued or running job's new priority (the next round of
    admission acts on it)."""
    job = pool.live.get(found.id)
    if job is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"job {found.id} is {found.state}: only a job that has not finished has a priority to change")
    if (err := check_priority(priority)) is not None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"priority {priority}: {err}")
    previous = job.spec.priority
    actions = pool.set_priority(now, job, priority)
    return PriorityReply(job_id=job.id, priority=priority, previous=previous, state=str(job.state)), actions
