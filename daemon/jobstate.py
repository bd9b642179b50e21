"""A job's life as a pure state machine: events in, actions out, no I/O and no clock of its own.

    queued -> starting -> running -> succeeded | failed | cancelled
       ^         |
       '---------'  (a start that could not be prepared goes back to the queue)

`recovering` is in the enum and the terminal set leaves room for it; the transitions into it
(a failed rank, a lost node or a stalled step restarting the group from the newest checkpoint) come
with recovery. Until then those events fail the job.

The machine knows nothing of nodes, slots or sockets: the pool (`daemon/pool.py`) turns its actions
into messages. Every transition carries a comment saying why it happens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class JobState(enum.StrEnum):
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RECOVERING})


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admitted:
    """Slots were set aside; the group is being prepared (ports) and will be started."""

    world_size: int


@dataclass(frozen=True, slots=True)
class StartAborted:
    """The group could not be prepared (a node refused or did not answer in time)."""

    reason: str


@dataclass(frozen=True, slots=True)
class GroupLaunched:
    """group.start went out for `generation`; the group must be up by `deadline`."""

    generation: int
    deadline: float


@dataclass(frozen=True, slots=True)
class RankUp:
    """A rank said hello: its group is formed and its checkpoint loaded."""

    generation: int
    rank: int


@dataclass(frozen=True, slots=True)
class RankExited:
    generation: int
    rank: int
    node: str
    code: int
    stopped: bool  # its daemon stopped it (group.stop, or dpd shutting down)


@dataclass(frozen=True, slots=True)
class NodeLost:
    """A node running ranks of the current generation stopped heartbeating."""

    node: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CancelRequested:
    pass


@dataclass(frozen=True, slots=True)
class Tick:
    pass


Event = Admitted | StartAborted | GroupLaunched | RankUp | RankExited | NodeLost | CancelRequested | Tick


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StopGroup:
    """Stop every worker of this generation (mode "now": SIGTERM then SIGKILL)."""

    generation: int
    mode: str = "now"


@dataclass(frozen=True, slots=True)
class Emit:
    """Append to the job's event log (`dpctl events`)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


Action = StopGroup | Emit


# -- the machine -------------------------------------------------------------------------------


@dataclass(slots=True)
class JobMachine:
    state: JobState = JobState.QUEUED
    generation: int = 0  # group starts so far; the running group's number
    world_size: int = 0
    error: str | None = None
    started_at: float | None = None  # first group.start
    finished_at: float | None = None
    deadline: float | None = None  # the group must be up by then (state STARTING)
    up: set[int] = field(default_factory=set)  # ranks of `generation` that said hello
    done: set[int] = field(default_factory=set)  # ranks of `generation` that exited 0

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def handle(self, event: Event, now: float) -> list[Action]:
        match event:
            case Admitted(world_size=n) if self.state is JobState.QUEUED:
                # QUEUED -> STARTING: enough free slots for workers.min; ports are being reserved.
                self.state, self.world_size = JobState.STARTING, n
                self.up, self.done, self.deadline = set(), set(), None
                return []
            case StartAborted(reason=reason) if self.state is JobState.STARTING and self.deadline is None:
                # STARTING -> QUEUED: nothing was started, so nothing is lost; try again when
                # slots are free (the node that failed to answer is usually lost by then).
                self.state = JobState.QUEUED
                return [Emit("group.aborted", {"reason": reason})]
            case GroupLaunched(generation=g, deadline=deadline) if self.state is JobState.STARTING:
                # STARTING (preparing) -> STARTING (launched): the generation counts from here.
                self.generation, self.deadline = g, deadline
                if self.started_at is None:
                    self.started_at = now
                return []
            case RankUp(generation=g, rank=rank) if g == self.generation and self.state is JobState.STARTING:
                self.up.add(rank)
                if len(self.up) == self.world_size:
                    # STARTING -> RUNNING: every rank joined the group and loaded its checkpoint.
                    self.state, self.deadline = JobState.RUNNING, None
                    return [Emit("group.started", {"generation": g, "world_size": self.world_size})]
                return []
            case RankExited(generation=g) if g != self.generation or self.state not in ACTIVE:
                return []  # an old generation's straggler, or a job already decided: no news
            case RankExited(rank=rank, node=node, code=0):
                self.done.add(rank)
                if len(self.done) == self.world_size:
                    # RUNNING -> SUCCEEDED: every rank finished the job's steps.
                    return self._finish(JobState.SUCCEEDED, None, now, [Emit("group.stopped", {"generation": self.generation, "reason": "done"})])
                return []
            case RankExited(rank=rank, node=node, code=code, stopped=stopped):
                # STARTING|RUNNING -> FAILED: a rank died (recovery will turn this into
                # RECOVERING). Code 2 is the trainer refusing the job file.
                why = "bad job file" if code == 2 else ("stopped by its daemon" if stopped else f"exit code {code}")
                error = f"rank {rank} on node {node} failed: {why}"
                return self._finish(
                    JobState.FAILED,
                    error,
                    now,
                    [
                        Emit("worker.failed", {"rank": rank, "node": node, "reason": "exit", "code": code}),
                        StopGroup(self.generation),
                        Emit("group.stopped", {"generation": self.generation, "reason": "worker.failed"}),
                    ],
                )
            case NodeLost(node=node, ranks=ranks) if self.state in ACTIVE and ranks:
                # STARTING|RUNNING -> FAILED: a node with ranks of this generation stopped
                # heartbeating; its ranks' peers will fail too (recovery will restart instead).
                error = f"node {node} (ranks {', '.join(map(str, ranks))}) stopped heartbeating"
                emits: list[Action] = [Emit("worker.failed", {"rank": r, "node": node, "reason": "heartbeat"}) for r in ranks]
                return self._finish(JobState.FAILED, error, now, [*emits, StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "worker.failed"})])
            case CancelRequested() if self.state is JobState.QUEUED:
                # QUEUED -> CANCELLED: nothing runs; the job leaves the queue.
                return self._finish(JobState.CANCELLED, None, now, [])
            case CancelRequested() if self.state in ACTIVE:
                # STARTING|RUNNING -> CANCELLED: the user asked; stop the group, keep checkpoints.
                actions: list[Action] = []
                if self.deadline is not None or self.state is not JobState.STARTING:
                    actions = [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "cancelled"})]
                return self._finish(JobState.CANCELLED, None, now, actions)
            case Tick() if self.state is JobState.STARTING and self.deadline is not None and now >= self.deadline:
                # STARTING -> FAILED: the group did not form in time (a peer that never appears
                # leaves the others waiting in MLX's init forever).
                missing = sorted(set(range(self.world_size)) - self.up)
                error = f"group {self.generation} did not start in time: ranks {missing} never reported"
                return self._finish(
                    JobState.FAILED,
                    error,
                    now,
                    [
                        *[Emit("worker.failed", {"rank": r, "reason": "stalled"}) for r in missing],
                        StopGroup(self.generation),
                        Emit("group.stopped", {"generation": self.generation, "reason": "start timeout"}),
                    ],
                )
        return []  # an event that does not apply in this state changes nothing

    def _finish(self, state: JobState, error: str | None, now: float, actions: list[Action]) -> list[Action]:
        self.state, self.error, self.finished_at, self.deadline = state, error, now, None
        return [*actions, Emit(f"job.{state}", {"error": error} if error else {})]
