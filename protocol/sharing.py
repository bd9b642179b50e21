"""The messages of sharing the pool: the queue as the scheduler sees it, and a job's priority.

    dpctl -> coordinator  queue              the live jobs in queue order: priority, what each holds
                          queue.reply        and should hold, what it waits for, what it would take
                                             from whom (daemon/scheduler.py)
    dpctl -> coordinator  priority           set a queued or running job's priority
                          priority.reply

Registered in messages.REGISTRY on import; a process that does not import this module refuses
these types as unexpected. `queue` is read-only (viewers may send it); `priority` is not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, TypeAlias

from dpool.protocol.messages import REPLY_BODY_BYTES, REPLY_OBJECTS, Message, MsgType, message
from dpool.protocol.payloads import MAX_WORLD, JobId, JobRef, Name, Text, UnixTime
from dpool.protocol.schema import MAX_INT, Int, Items, OneOf, Record, record

QUEUE_ROWS_MAX = 10_000  # live jobs one queue.reply lists (the pool keeps every live job in memory)
TAKES_MAX = 64  # jobs one row names as giving it slots
Priority: TypeAlias = Annotated[int, Int(-MAX_INT, MAX_INT)]  # jobspec.PRIORITY_MAX bounds what a job may say
Slots: TypeAlias = Annotated[int, Int(0, MAX_WORLD)]


@record
@dataclass(frozen=True, slots=True)
class TakeRow(Record):
    """`slots` the row's job would take from job `job`: by shrinking it, or by preempting it."""

    job: JobId
    slots: Slots
    how: Annotated[str, OneOf("shrink", "preempt")]


@record
@dataclass(frozen=True, slots=True)
class QueueRow(Record):
    """One live job in queue order (`dpctl queue --json`'s object)."""

    position: Annotated[int, Int(1, MAX_INT)]
    id: JobId
    name: Name
    priority: Priority
    state: Annotated[str, OneOf("queued", "starting", "running", "recovering")]
    workers: Slots  # the slots it holds now
    target: Slots  # what it should hold (0: it waits)
    min: Slots
    max: Slots
    submitted: UnixTime
    waiting: Text | None = None  # what it waits for (null: it does not wait)
    takes: Annotated[list[TakeRow], Items(TAKES_MAX)] = field(default_factory=list)


@message
@dataclass(frozen=True, slots=True)
class Queue(Message):
    TYPE: ClassVar[MsgType] = MsgType.QUEUE


@message
@dataclass(frozen=True, slots=True)
class QueueReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.QUEUE_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    rows: Annotated[list[QueueRow], Items(QUEUE_ROWS_MAX)]


@message
@dataclass(frozen=True, slots=True)
class SetPriority(Message):
    """Set a queued or running job's priority (a finished job's: `error bad_request`)."""

    TYPE: ClassVar[MsgType] = MsgType.PRIORITY
    job: JobRef
    priority: Priority


@message
@dataclass(frozen=True, slots=True)
class PriorityReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.PRIORITY_REPLY
    job_id: JobId
    priority: Priority
    previous: Priority
    state: Name
