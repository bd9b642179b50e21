"""The messages of the ring's measured link: what a group's start-up probe found, and what a step
of the job sends.

    trainer -> its dpd    worker.link   the probe's figures (rank 0 of a group of more than one
                                        rank) and the trainable parameters (every rank 0)
    dpd -> coordinator    node.link     the same, with job, generation and rank added

The coordinator keeps the figures per pair of nodes (`dpctl nodes --json` "links") and predicts
each running job's share of a step spent in all_sum from them (`status JOB --json` "comm_share";
daemon/links.py). Registered in messages.REGISTRY on import; a process that does not import this
module refuses these types as unexpected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dpool.protocol.messages import Message, MsgType, message
from dpool.protocol.payloads import (
    BitsPerSecond,
    Count,
    Generation,
    JobId,
    LinkLatency,
    Rank,
    Seconds,
)
from dpool.protocol.schema import Record, record


@record
@dataclass(frozen=True, slots=True)
class RingProbe(Record):
    """A group's start-up probe (trainer/linkprobe.py): its ring's pace, as the ring model reads it
    (protocol/commmodel.py: `bandwidth_bps` with the model's 90% link efficiency, `latency_s` per
    hop). `bytes`: the largest all_sum it timed; `seconds`: what the whole probe cost."""

    bandwidth_bps: BitsPerSecond
    latency_s: LinkLatency
    bytes: Count
    seconds: Seconds


@message
@dataclass(frozen=True, slots=True)
class WorkerLink(Message):
    """trainer -> its dpd, after worker.hello: the probe (None: a group of one, or no probe) and the
    trainable parameters of the job's model (what a step all_sums)."""

    TYPE: ClassVar[MsgType] = MsgType.WORKER_LINK
    ring: RingProbe | None
    params: Count


@message
@dataclass(frozen=True, slots=True)
class NodeLink(Message):
    """dpd -> coordinator: a relayed worker.link, about rank `rank` of the job's generation."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_LINK
    job: JobId
    generation: Generation
    rank: Rank
    ring: RingProbe | None
    params: Count
