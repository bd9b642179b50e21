"""What the coordinator's pool works with: the actions it returns and the records it keeps (nodes,
jobs, what runs for each rank). Plain data; the policy is in `daemon/pool.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from dpool.daemon import jobstate as js
from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.plan import GroupPlan, Slot
from dpool.daemon.scheduler import Note
from dpool.daemon.watch import StepWatch
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.messages import Message
from dpool.protocol.payloads import JobStatus, NodeInfo, WorkerStatus

# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    node: str
    msg: Message


@dataclass(frozen=True, slots=True)
class Record:
    """An event for `dpctl events` (job None: a pool event, shown with every job it overlaps)."""

    job: str | None
    kind: str
    t: float
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class JobChanged:
    job: str


@dataclass(frozen=True, slots=True)
class NodeChanged:
    """What the database keeps of the node changed: it joined, was lost, or is held (its slots
    in use are transient and never saved)."""

    node: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A node's report the pool did not take: about a rank (or a job's generation) the plan put on
    another node. The coordinator logs it (rate-limited); nothing else happens."""

    node: str
    kind: str  # the message type
    reason: str


@dataclass(frozen=True, slots=True)
class NodeForgotten:
    """A lost node was forgotten to make room for a new one (Pool.admit_name): its saved row goes."""

    node: str


Action = Send | Record | JobChanged | NodeChanged | NodeForgotten | Refused


# -- records -----------------------------------------------------------------------------------


class NodeState(enum.StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    LOST = "lost"
    YIELDING = "yielding"  # its owner needs it (`dpd run --yield-when`): `reason` says why


class Hold(enum.StrEnum):
    """Why a node takes no new work (until `dpctl undrain`)."""

    DRAINED = "drained"  # `dpctl drain`
    SET_ASIDE = "set_aside"  # its workers kept failing
    YIELDING = "yielding"  # its owner needs it (node.yield); lifted when its dpd says the condition cleared


@dataclass(slots=True)
class Node:
    name: str
    incarnation: str
    info: NodeInfo
    joined_at: float
    last_seen: float
    lost: bool = False
    asked_at: float | None = None  # when a failed group's stop asked it to answer, if not heard from since
    hold: Hold | None = None  # drained or set aside: takes no new work until `undrain`
    drained_reported: bool = False  # node.drained was recorded for the current drain
    fail_streak: int = 0  # workers failed here in a row (reset by one that ends well)
    lost_blames: int = 0  # of those, failures for its missing heartbeats (taken back if it returns alive)
    reason: str | None = None  # shown in `dpctl nodes`: why it is lost, drained, set aside or yielding
    yielding: str | None = None  # why its dpd last said it yields to its owner (node.yield), whatever its hold
    used: dict[int, tuple[str, int]] = field(default_factory=dict)  # slot -> (job, generation)
    holdings: dict[tuple[str, int], int] = field(default_factory=dict)  # (job, slot) -> newest step on disk
    # (job, slot) -> newest step it can resume from: on disk or kept in memory (outlives a trainer, not the machine)
    resumable: dict[tuple[str, int], int] = field(default_factory=dict)

    def add_holding(self, job: str, slot: int, step: int, memory: bool) -> None:
        """A checkpoint (or a kept state, `memory`) of `job` at `step` in `slot`."""
        key = (job, slot)
        if not memory:
            self.holdings[key] = max(step, self.holdings.get(key, 0))
        self.resumable[key] = max(step, self.resumable.get(key, 0))

    @property
    def slots(self) -> int:
        return self.info.slots

    @property
    def state(self) -> NodeState:
        if self.lost:
            return NodeState.LOST
        if self.hold is Hold.YIELDING:
            return NodeState.YIELDING  # its workers leave, or have left, for its owner
        if self.hold is not None:
            # drained or set aside: its workers checkpoint and leave, and it takes no work until
            # `dpctl undrain` (`reason` says which); "idle" would say it is free for work
            return NodeState.DRAINING
        return NodeState.BUSY if self.used else NodeState.IDLE

    def free(self) -> list[int]:
        if self.lost or self.hold is not None:
            return []
        return [i for i in range(self.slots) if i not in self.used]


@dataclass(slots=True)
class RankRun:
    """What runs for one rank of the current generation (the runtime beside the frozen plan)."""

    node: str
    slot: int
    pid: int | None = None
    step: int = 0
    tokens_per_s: float = 0.0
    exit_code: int | None = None
    waiting: int | None = None  # the newest step its dpd's heartbeat said it waits on its peers for


@dataclass(slots=True)
class Pending:
    """A group being prepared: slots set aside, ports arriving per node."""

    generation: int
    slots: list[Slot]
    deadline: float
    endpoints: dict[Slot, str] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)
    nodes: dict[str, list[Slot]] = field(init=False)  # node -> its slots, in rank order

    def __post_init__(self) -> None:
        self.nodes = {}
        for s in self.slots:
            self.nodes.setdefault(s.node, []).append(s)


@dataclass(frozen=True, slots=True)
class JobRef:
    """What a query about a job needs (the job may be finished and in the store only)."""

    id: str
    name: str
    state: JobState
    submitted_at: float
    finished_at: float | None


@dataclass(slots=True)
class Warming:
    """A growth that waits for warm trainers (job.warm) on the slots it adds, until `deadline`:
    the running group trains on meanwhile, and the restart that takes the new slots in costs no
    cold start."""

    asked: set[tuple[str, int]]  # (node, slot) sent job.warm
    waiting: set[tuple[str, int]]  # of those, not yet answered by node.warmed
    deadline: float


@dataclass(slots=True)
class Job:
    id: str
    name: str
    spec: JobSpec
    submitted_at: float
    machine: JobMachine = field(default_factory=JobMachine)
    plan: GroupPlan | None = None
    pending: Pending | None = None
    ranks: dict[int, RankRun] = field(default_factory=dict)
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None
    test_loss: float | None = None
    checkpoint_step: int | None = None
    saved: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> seconds
    reconcile_by: float | None = None  # after a coordinator restart: ranks must reappear by then
    watch: StepWatch | None = None  # the running generation's progress deadline
    shares: tuple[int, ...] | None = None  # the split in force, when the trainer rebalanced the plan's
    speeds: dict[str, float] = field(default_factory=dict)  # node -> tokens/s of one rank there (last measured)
    placed: dict[int, tuple[str, ...]] = field(default_factory=dict)  # generation -> the node of each rank (the newest few)
    logged: dict[str, int] = field(default_factory=dict)  # metric kind ("train", "eval") -> newest step recorded
    warming: Warming | None = None  # a growth waiting for warm trainers on its new slots
    waiting: str | None = None  # waiting for slots: why (daemon/scheduler.py), for `dpctl queue` and status
    resize: Note | None = None  # a resize the scheduler asked of it, until it restarts (its event then says the cost)
    resized_at: float | None = None  # its last start or resize (the scheduler's damping)
    holders_wait: float | None = None  # restarting: it waits until then for a free slot holding its newest step
    donated: tuple[int, int] | None = None  # the step a leaving node's rank was last given for (admission.donor), and how often
    _doc: dict[str, Any] | None = None

    def resume_max(self) -> int:
        """The latest step a new generation may resume from and leave no gap in the recorded
        metrics: the step before the next train row (every `train.log_every_steps`) and the next
        evaluation (every `eval.every_steps`) that were not recorded. Rows of the last steps can
        be lost with the coordinator, or with rank 0's node, while the state of those steps lives
        on in the survivors' memory; those steps are then trained again."""
        caps = []
        for kind, every in (("train", self.spec.train.log_every_steps), ("eval", self.spec.eval.every_steps)):
            caps.append((self.logged.get(kind, 0) // every + 1) * every - 1)
        return max(0, min(caps))

    @property
    def doc(self) -> dict[str, Any]:
        """The spec as plain data, for group.start and the store (made once)."""
        if self._doc is None:
            self._doc = self.spec.to_dict()
        return self._doc

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def steps(self) -> int:
        return self.spec.train.steps

    def ref(self) -> JobRef:
        m = self.machine
        return JobRef(id=self.id, name=self.name, state=m.state, submitted_at=self.submitted_at, finished_at=m.finished_at)

    def status(self, now: float, wall: float | None = None) -> JobStatus:
        """The `dpctl status JOB --json` object (INTERFACE.md), as of `now` (the coordinator's clock;
        `wall`: the wall time of `now`, what the job's times are in; None: `now` is wall time)."""
        wall = now if wall is None else wall
        plan = self.plan
        workers = []
        queued = self.state is JobState.QUEUED  # sent back to wait: its old group runs no more
        if plan is not None and self.state not in js.TERMINAL and not queued:
            for r, slot in enumerate(plan.ranks):
                run = self.ranks.get(r)
                workers.append(
                    WorkerStatus(
                        rank=r,
                        node=slot.node,
                        share=(self.shares or plan.shares)[r],
                        tokens_per_s=round(run.tokens_per_s, 1) if run else 0.0,
                        pid=run.pid if run else None,
                    )
                )
        return JobStatus(
            id=self.id,
            name=self.name,
            state=str(self.state),
            step=self.step,
            steps=self.steps,
            generation=self.machine.generation,
            world_size=plan.world_size if plan and not queued else 0,
            workers=workers,
            checkpoint_step=self.checkpoint_step,
            loss=self.loss,
            val_loss=self.val_loss,
            test_loss=self.test_loss,
            error=self.machine.error,
            submitted=self.submitted_at,
            started=(started := self.machine.started_at),
            finished=(finished := self.machine.finished_at),
            elapsed_s=None if started is None else round(max(0.0, (finished if finished is not None else wall) - started), 3),
            eta_s=round(eta, 1) if self.state is JobState.RUNNING and self.watch and (eta := self.watch.eta(now)) is not None else None,
            priority=self.spec.priority or None,
            waiting=self.waiting if self.state in (JobState.QUEUED, JobState.RECOVERING) else None,
        )
