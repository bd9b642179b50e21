"""A job's life as a pure state machine: events in, actions out, no I/O and no clock of its own.

    queued -> starting -> running -> succeeded | failed | cancelled
       ^         |           |  ^
       |         v           v  |
       '------ recovering ------'   (a failure or a membership change: stop, re-plan, start g+1)

`recovering` has two phases. First the old generation is stopped: `live` holds its ranks whose
process may still run, and the phase ends when every one has exited (or its node is gone), or when
the settle time after a failure has passed (a rank on a dead node never reports its exit; the next
generation starts without its slot). Then the job waits for admission like a queued job (the pool
re-plans with the slots that are free) and the next generation starts; it is `running` again once
every rank has said hello, and `group.resumed` is emitted at its first completed step.

A failure (a rank exiting with an error, a node's heartbeats stopping, no step progress in time)
uses one restart of the job's budget; a membership change (a node joining, a drain, a dpd stopping
cleanly) never does. The budget spent, the job fails.

The machine knows nothing of nodes, slots or sockets: the pool (`daemon/pool.py`) turns its actions
into messages. Every transition carries a comment saying why it happens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

EXIT_STOPPED = 75  # the trainer checkpointed at a step boundary and exited on request
SETTLE_S = 2.0  # after a failure, how long the pool waits for the old ranks' exits before re-planning


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
    """A rank said hello: its group is formed and its checkpoint loaded (rank 0: from `resume_step`)."""

    generation: int
    rank: int
    resume_step: int | None = None


@dataclass(frozen=True, slots=True)
class StepDone:
    """A rank of `generation` completed `step`."""

    generation: int
    step: int


@dataclass(frozen=True, slots=True)
class RankExited:
    generation: int
    rank: int
    node: str
    code: int
    stopped: bool  # its daemon stopped it (group.stop, or dpd shutting down)
    error: str | None = None  # the trainer's own `error: ...` line, when it printed one


@dataclass(frozen=True, slots=True)
class NodeLost:
    """A node running ranks of the current generation stopped heartbeating (or was replaced)."""

    node: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stalled:
    """No step progress within the deadline; `ranks` (with their nodes) reported least recently."""

    ranks: tuple[tuple[int, str], ...]
    detail: str


@dataclass(frozen=True, slots=True)
class Reshape:
    """The membership should change (a node joined, or is being drained): checkpoint and restart."""

    reason: str
    stop_by: float  # a group asked to checkpoint must have exited by then, else it is stopped now


@dataclass(frozen=True, slots=True)
class Requeue:
    """The old group is stopped but fewer than workers.min slots are free: wait in the queue."""

    reason: str


@dataclass(frozen=True, slots=True)
class CancelRequested:
    pass


@dataclass(frozen=True, slots=True)
class Tick:
    pass


Event = (
    Admitted | StartAborted | GroupLaunched | RankUp | StepDone | RankExited | NodeLost | Stalled | Reshape | Requeue
    | CancelRequested | Tick
)


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StopGroup:
    """Stop every worker of this generation (mode "now": SIGTERM then SIGKILL; "checkpoint": ask
    them to checkpoint at the next step boundary and exit 75)."""

    generation: int
    mode: str = "now"


@dataclass(frozen=True, slots=True)
class Emit:
    """Append to the job's event log (`dpctl events`)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Blame:
    """A worker on `node` failed: counts toward setting the node aside."""

    node: str


Action = StopGroup | Emit | Blame


# -- the machine -------------------------------------------------------------------------------


@dataclass(slots=True)
class JobMachine:
    state: JobState = JobState.QUEUED
    generation: int = 0  # group starts so far; the running group's number
    world_size: int = 0
    error: str | None = None
    started_at: float | None = None  # first group.start
    finished_at: float | None = None
    deadline: float | None = None  # the launched group must be up by then (None: not launched yet)
    up: set[int] = field(default_factory=set)  # ranks of `generation` that said hello
    done: set[int] = field(default_factory=set)  # ranks of `generation` that exited 0
    live: set[int] = field(default_factory=set)  # ranks of `generation` whose process may run
    max_restarts: int = 10
    restarts: int = 0  # crash restarts used (membership changes never count)
    stop_mode: str | None = None  # RECOVERING: how the old group is being stopped
    settle_by: float | None = None  # RECOVERING after a failure: re-plan by then even if ranks linger
    stop_by: float | None = None  # RECOVERING at a checkpoint: the group must have exited by then
    step: int = 0  # the highest step any generation completed
    high_water: int = 0  # `step` when the current generation launched
    from_step: int | None = None  # the current generation's resume step (rank 0's hello)
    interrupted_at: float | None = None  # when the failure or change that led here was seen
    cause: str | None = None  # what it was: "failure" or "membership"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def launched(self) -> bool:
        return self.deadline is not None or self.state is JobState.RUNNING

    def ready_to_restart(self, now: float) -> bool:
        """RECOVERING, the old group stopped (or given up on), the next one not yet admitted."""
        if self.state is not JobState.RECOVERING or self.stop_mode is None:
            return False
        return not self.live or (self.settle_by is not None and now >= self.settle_by)

    def handle(self, event: Event, now: float) -> list[Action]:
        st = self.state
        match event:
            case Admitted(world_size=n) if st is JobState.QUEUED or self.ready_to_restart(now):
                # QUEUED -> STARTING: enough free slots for workers.min; ports are being reserved.
                # RECOVERING (stopped) -> RECOVERING (restarting): the same, for generation g+1.
                if st is JobState.QUEUED and self.generation == 0:
                    self.state = JobState.STARTING
                elif st is JobState.QUEUED:
                    self.state = JobState.RECOVERING  # a requeued job resumes: still recovering
                self.world_size, self.stop_mode, self.settle_by, self.stop_by = n, None, None, None
                self.up, self.done, self.live, self.deadline = set(), set(), set(), None
                return []
            case StartAborted(reason=reason) if st in (JobState.STARTING, JobState.RECOVERING) and self.stop_mode is None and self.deadline is None:
                # STARTING -> QUEUED: nothing was started, so nothing is lost; try again when slots
                # are free (the node that failed to answer is usually lost by then). A restart being
                # prepared goes back to "stopped, waiting for admission".
                if st is JobState.STARTING:
                    self.state = JobState.QUEUED
                else:
                    self.stop_mode = "aborted"
                return [Emit("group.aborted", {"reason": reason})]
            case GroupLaunched(generation=g, deadline=deadline) if st in (JobState.STARTING, JobState.RECOVERING) and self.stop_mode is None:
                # (preparing) -> (launched): the generation counts from here.
                self.generation, self.deadline = g, deadline
                self.live, self.high_water, self.from_step = set(range(self.world_size)), self.step, None
                if self.started_at is None:
                    self.started_at = now
                return []
            case RankUp(generation=g, rank=rank, resume_step=resume) if g == self.generation and self.deadline is not None:
                self.up.add(rank)
                if rank == 0 and resume is not None:
                    self.from_step = resume
                if len(self.up) == self.world_size:
                    # STARTING|RECOVERING -> RUNNING: every rank joined the group and loaded its
                    # checkpoint. (The first step's deadline is the pool's progress watch.)
                    self.state, self.deadline = JobState.RUNNING, None
                    return [Emit("group.started", {"generation": g, "world_size": self.world_size})]
                return []
            case StepDone(generation=g, step=step):
                self.step = max(self.step, step)
                if g == self.generation and st is JobState.RUNNING and self.interrupted_at is not None:
                    # The first step of the new generation: the interruption is over.
                    start = self.from_step if self.from_step is not None else step - 1
                    fields = {
                        "from_step": start,
                        "generation": g,
                        "seconds_since_failure": round(now - self.interrupted_at, 3),
                        "steps_recomputed": max(0, self.high_water - start),
                        "cause": self.cause,
                    }
                    self.interrupted_at, self.cause = None, None
                    return [Emit("group.resumed", fields)]
                return []
            case RankExited(generation=g) if g != self.generation or st not in ACTIVE or not self.live:
                return []  # an old generation's straggler, or a job already decided: no news
            case RankExited(rank=rank, code=0):
                self.live.discard(rank)
                self.done.add(rank)
                if len(self.done) == self.world_size:
                    # RUNNING|RECOVERING -> SUCCEEDED: every rank finished the job's steps (a stop
                    # request that came too late to matter changes nothing).
                    return self._finish(JobState.SUCCEEDED, None, now, [Emit("group.stopped", {"generation": self.generation, "reason": "done"})])
                return []
            case RankExited(rank=rank, node=node, code=code) if code == EXIT_STOPPED:
                self.live.discard(rank)
                if st is not JobState.RECOVERING:
                    # RUNNING -> RECOVERING: the group checkpointed and stopped without being asked
                    # here (its trainer lost its daemon, or asked by a coordinator since restarted).
                    # Nothing is lost, so it is a membership change, not a failure.
                    return self._stop_group(now, "checkpoint", "membership", f"rank {rank} on {node} stopped at a checkpoint", settle=False)
                return []
            case RankExited(rank=rank, node=node, code=code, stopped=stopped, error=error):
                self.live.discard(rank)
                said = {"error": error} if error else {}
                if code == 2 and not stopped:
                    # STARTING|RUNNING|RECOVERING -> FAILED: the trainer refused its input (the job
                    # file, a path missing on that machine, an unusable checkpoint); no restart can
                    # help. Also while recovering: its peers' "connection lost" exits often arrive
                    # first and start a restart that would meet the same refusal.
                    why = f"node {node}: rank {rank}: {error}" if error else f"rank {rank} on node {node} failed: bad job file"
                    failed: list[Action] = [Emit("worker.failed", {"rank": rank, "node": node, "reason": "exit", "code": code, **said})]
                    if st is not JobState.RECOVERING or self.stop_mode == "checkpoint":
                        failed += [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "worker.failed"})]
                    return self._finish(JobState.FAILED, why, now, failed)
                detail = f"rank {rank} on node {node} failed: exit code {code}" + (f": {error}" if error else "")
                if st is JobState.RECOVERING and self.stop_mode == "checkpoint" and not stopped:
                    # RECOVERING (checkpointing) -> RECOVERING (failed): a rank died instead of
                    # checkpointing; the group is broken, stop the rest now.
                    return self._fail(now, [Emit("worker.failed", {"rank": rank, "node": node, "reason": "exit", "code": code, **said})], [node], detail)
                if st is JobState.RECOVERING:
                    return []  # the old group on its way out: peers of the failure, or our SIGTERM
                exited = Emit("worker.failed", {"rank": rank, "node": node, "reason": "exit", "code": code, **said, **({"stopped": True} if stopped else {})})
                if stopped:
                    # STARTING|RUNNING -> RECOVERING: its daemon stopped it (dpd shutting down): the
                    # node leaves; a membership change, so no restart is used and no node blamed.
                    return [exited, *self._stop_group(now, "now", "membership", f"rank {rank} on node {node} stopped by its daemon")]
                # STARTING|RUNNING -> RECOVERING: a rank died; its peers fail within ~0.1 s. Exit 1
                # is what a rank whose peer vanished exits with ("connection to a peer was lost"),
                # and it often arrives first, so it does not count against its node.
                blame = [node] if code != 1 else []
                return self._fail(now, [exited], blame, detail)
            case NodeLost(node=node, ranks=ranks) if st in ACTIVE and self.launched_or_stopping():
                gone = [r for r in ranks if r in self.live]
                self.live.difference_update(ranks)
                if not gone:
                    return []
                if st is JobState.RECOVERING and self.stop_mode != "checkpoint":
                    return []  # stopping anyway: the lost ranks are accounted for
                # STARTING|RUNNING|RECOVERING (checkpointing) -> RECOVERING: a node with ranks of
                # this generation stopped heartbeating; their peers will hang or fail.
                emits: list[Action] = [Emit("worker.failed", {"rank": r, "node": node, "reason": "heartbeat"}) for r in gone]
                return self._fail(now, emits, [node], f"node {node} (ranks {', '.join(map(str, gone))}) stopped heartbeating")
            case Stalled(ranks=ranks, detail=detail) if (st is JobState.RUNNING or (st is JobState.RECOVERING and self.stop_mode == "checkpoint")) and self.live:
                # RUNNING -> RECOVERING: no step completed within the progress deadline (a frozen
                # rank leaves the others spinning inside all_sum forever).
                emits = [Emit("worker.failed", {"rank": r, "node": n, "reason": "stalled", "detail": detail}) for r, n in ranks]
                return self._fail(now, emits, [n for _, n in ranks[:1]], f"group {self.generation} stalled: {detail}")
            case Reshape(reason=reason, stop_by=stop_by) if st is JobState.RUNNING:
                # RUNNING -> RECOVERING: a node joined or is drained; checkpoint at the next step
                # boundary and exit, so the next generation starts from exactly that step.
                stopping = self._stop_group(now, "checkpoint", "membership", reason, settle=False)
                self.stop_by = stop_by
                return stopping
            case Reshape(reason=reason) if st in (JobState.STARTING, JobState.RECOVERING) and self.deadline is not None:
                # STARTING|RECOVERING (launched, not up) -> RECOVERING: no step was taken yet, so
                # stopping now loses nothing; a membership change.
                return self._stop_group(now, "now", "membership", reason)
            case Requeue(reason=reason) if self.ready_to_restart(now):
                # RECOVERING -> QUEUED: fewer than workers.min slots are left; the checkpoints stay,
                # and the job resumes from them when slots return.
                self.state, self.stop_mode, self.live, self.settle_by = JobState.QUEUED, None, set(), None
                return [Emit("job.queued", {"reason": reason})]
            case CancelRequested() if st is JobState.QUEUED:
                # QUEUED -> CANCELLED: nothing runs; the job leaves the queue.
                return self._finish(JobState.CANCELLED, None, now, [])
            case CancelRequested() if st in ACTIVE:
                # STARTING|RUNNING|RECOVERING -> CANCELLED: the user asked; stop what runs, keep
                # checkpoints.
                actions: list[Action] = []
                if self.live:
                    actions = [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "cancelled"})]
                return self._finish(JobState.CANCELLED, None, now, actions)
            case Tick() if self.deadline is not None and now >= self.deadline and st in (JobState.STARTING, JobState.RECOVERING):
                # STARTING|RECOVERING (launched) -> RECOVERING: the group did not form in time (a
                # peer that never appears leaves the others waiting in MLX's init forever).
                missing = sorted(set(range(self.world_size)) - self.up)
                emits = [Emit("worker.failed", {"rank": r, "reason": "stalled", "detail": "start timeout"}) for r in missing]
                return self._fail(now, emits, [], f"group {self.generation} did not start in time: ranks {missing} never reported")
            case Tick() if st is JobState.RECOVERING and self.stop_mode == "checkpoint" and self.stop_by is not None and now >= self.stop_by and self.live:
                # RECOVERING (checkpointing) -> RECOVERING (stopping now): the group did not exit in
                # time after the stop request; whatever it saved is kept.
                self.stop_mode, self.settle_by, self.stop_by = "now", now + SETTLE_S, None
                return [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "checkpoint stop timed out"})]
        return []  # an event that does not apply in this state changes nothing

    def launched_or_stopping(self) -> bool:
        return self.launched or bool(self.live)

    def _stop_group(self, now: float, mode: str, cause: str, reason: str, *, settle: bool = True) -> list[Action]:
        self.state, self.stop_mode, self.deadline = JobState.RECOVERING, mode, None
        self.settle_by = now + SETTLE_S if settle else None
        self.interrupted_at, self.cause = now, cause
        return [StopGroup(self.generation, mode), Emit("group.stopped", {"generation": self.generation, "reason": reason, "mode": mode})]

    def _fail(self, now: float, emits: list[Action], nodes: list[str], error: str) -> list[Action]:
        blames: list[Action] = [Blame(n) for n in nodes]
        if self.restarts >= self.max_restarts:
            # -> FAILED: the restart budget is spent; stop whatever still runs.
            why = f"{error}; the restart budget (recovery.max_restarts = {self.max_restarts}) is used up"
            stop: list[Action] = [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "failed"})] if self.live else []
            return self._finish(JobState.FAILED, why, now, [*emits, *blames, *stop])
        self.restarts += 1
        actions = self._stop_group(now, "now", "failure", error)
        return [*emits, *blames, *actions]

    def _finish(self, state: JobState, error: str | None, now: float, actions: list[Action]) -> list[Action]:
        self.state, self.error, self.finished_at, self.deadline = state, error, now, None
        self.stop_mode, self.settle_by, self.stop_by = None, None, None
        return [*actions, Emit(f"job.{state}", {"error": error} if error else {})]
