"""A job's life as a pure state machine: events in, actions out, no I/O and no clock of its own.

    queued -> starting -> running -> succeeded | failed | cancelled
       ^         |           |  ^
       |         v           v  |
       '------ recovering ------'   (a failure or a membership change: stop, re-plan, start g+1)

`recovering` goes through phases (`Phase`). First the old generation is stopped, now (`stopping`)
or at its next step boundary (`checkpointing`): `live` holds its ranks whose process may still run,
and the stop ends when every one has exited (or its node is gone), or when the settle time after a
failure has passed (a rank on a dead node never reports its exit; the next generation starts
without its slot). Then the job waits for admission like a queued job (`stopped`; the pool re-plans
with the slots that are free) and the next generation is prepared and started (`restarting`); it
is `running` again once every rank has said hello, and `group.resumed` is emitted at its first
completed step.

A failure (a rank exiting with an error, a node's heartbeats stopping, no step progress in time)
uses one restart of the job's budget; a membership change (a node joining, a drain, a dpd stopping
cleanly) never does. The budget spent, the job fails.

The machine knows nothing of nodes, slots or sockets: the pool (`daemon/pool.py`) turns its actions
into messages. Every transition carries a comment saying why it happens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
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


class Phase(enum.StrEnum):
    """What a RECOVERING job is doing (None in every other state)."""

    STOPPING = "stopping"  # the old group is being stopped now (SIGTERM, then SIGKILL)
    CHECKPOINTING = "checkpointing"  # the old group was asked to checkpoint at a step boundary and exit
    STOPPED = "stopped"  # nothing of it is expected to run: waiting for admission
    RESTARTING = "restarting"  # the next generation was admitted: being prepared, or launched and forming


class StopMode(enum.StrEnum):
    """How a group is stopped (the `mode` of group.stop on the wire)."""

    NOW = "now"  # SIGTERM, then SIGKILL after the grace time
    CHECKPOINT = "checkpoint"  # checkpoint at the next step boundary and exit 75


class Cause(enum.StrEnum):
    """Why a group was interrupted: a failure uses a restart of the budget, a membership change not."""

    FAILURE = "failure"
    MEMBERSHIP = "membership"


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
    """group.start went out for `generation`; the group must be up by `deadline`. `nodes`: each
    rank's node, for the events that name a rank."""

    generation: int
    deadline: float
    nodes: tuple[str, ...] = ()


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
class NodeBack:
    """A node declared lost came back under the same dpd process: it was alive all along (a slow or
    cut link, a machine that paused), not broken."""

    node: str


@dataclass(frozen=True, slots=True)
class Stalled:
    """No step progress within the deadline; `ranks` (with their nodes) reported least recently.
    `blame`: the node counted as failed, when the reports tell it (see Pool._check_progress)."""

    ranks: tuple[tuple[int, str], ...]
    detail: str
    blame: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Reached:
    """A rank of `generation` had reached `step`, said late: by its dpd registering again with a
    coordinator that restarted meanwhile (the progress reports went to the one that died)."""

    generation: int
    step: int


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
class Saved:
    """What the coordinator's database keeps of a job's machine (`daemon/store.py`)."""

    state: JobState
    generation: int
    restarts: int
    step: int
    error: str | None
    started_at: float | None
    finished_at: float | None
    interrupted_at: float | None = None  # wall time of the failure or change being recovered from
    cause: str | None = None  # and its Cause


@dataclass(frozen=True, slots=True)
class Restored:
    """A restarted coordinator read the job back from its database."""

    saved: Saved
    launched: int | None  # the world size of the saved plan when that plan is of `generation`: it was started
    start_deadline: float  # a group that was starting must be up by then
    settle_by: float  # a group that was being stopped is given up on by then (its ranks unreported)
    down_since: float | None = None  # the last moment the previous coordinator was known alive (None: unknown)


@dataclass(frozen=True, slots=True)
class CancelRequested:
    pass


@dataclass(frozen=True, slots=True)
class Unservable:
    """No live node can serve the job (each is unfit for it, daemon/fitness.py)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Tick:
    pass


Event = (
    Admitted | StartAborted | GroupLaunched | RankUp | StepDone | Reached | RankExited | NodeLost | NodeBack | Stalled | Reshape | Requeue
    | Restored | CancelRequested | Unservable | Tick
)


# -- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StopGroup:
    """Stop every worker of this generation (mode "now": SIGTERM then SIGKILL; "checkpoint": ask
    them to checkpoint at the next step boundary and exit 75)."""

    generation: int
    mode: StopMode = StopMode.NOW


@dataclass(frozen=True, slots=True)
class Emit:
    """Append to the job's event log (`dpctl events`)."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Unfit:
    """A rank refused its input on `node` (the trainer's exit 2: a path missing there, files that
    differ, a model it cannot load): that node sits the job out (daemon/fitness.py)."""

    node: str
    reason: str


@dataclass(frozen=True, slots=True)
class Blame:
    """A worker on `node` failed: counts toward setting the node aside."""

    node: str


Action = StopGroup | Emit | Blame | Unfit


# -- the machine -------------------------------------------------------------------------------


@dataclass(slots=True)
class JobMachine:
    """One job's state. Only its own methods write these fields: the pool reads them and feeds
    events through `handle`."""

    max_restarts: int = 10
    state: JobState = JobState.QUEUED
    phase: Phase | None = None  # RECOVERING: how far the recovery got
    generation: int = 0  # group starts so far; the running group's number
    world_size: int = 0
    error: str | None = None
    started_at: float | None = None  # first group.start
    finished_at: float | None = None
    deadline: float | None = None  # the launched group must be up by then (None: not launched, or up)
    up: set[int] = field(default_factory=set)  # ranks of `generation` that said hello
    nodes: tuple[str, ...] = ()  # each rank's node in `generation` (as launched)
    done: set[int] = field(default_factory=set)  # ranks of `generation` that exited 0
    live: set[int] = field(default_factory=set)  # ranks of `generation` whose process may run
    restarts: int = 0  # crash restarts used (membership changes never count)
    settle_by: float | None = None  # stopping after a failure: re-plan by then even if ranks linger
    stop_by: float | None = None  # checkpointing: the group must have exited by then
    step: int = 0  # the highest step any generation completed
    high_water: int = 0  # `step` when the current generation launched
    from_step: int | None = None  # the current generation's resume step (rank 0's hello)
    interrupted_at: float | None = None  # when the failure or change that led here was seen
    interrupted_wall: float | None = None  # the same in wall time (kept by the store across a coordinator restart)
    cause: Cause | None = None
    # A launched group restored after a coordinator crash: the last moment that coordinator was
    # alive. A failure found before the group's next step happened while nobody watched, most
    # likely with the coordinator (the serving dpd's own ranks die with it), so its cost counts
    # from there, not from the restart. Cleared by that step.
    down_since: float | None = None
    lost_to: set[str] = field(default_factory=set)  # nodes whose loss used a restart (refunded if they come back)
    # The wall time of the event being handled (`handle` sets it): started_at and finished_at are
    # records, read by people as wall time; deadlines stay on the clock of `now`, which no step of
    # the system clock moves (daemon/coordinator.py's steady_clock).
    wall: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def launched(self) -> bool:
        return self.deadline is not None or self.state is JobState.RUNNING

    @property
    def forming(self) -> bool:
        """Launched and not every rank up yet."""
        return self.deadline is not None

    @property
    def checkpointing(self) -> bool:
        return self.phase is Phase.CHECKPOINTING

    def launched_or_stopping(self) -> bool:
        return self.launched or bool(self.live)

    def ready_to_restart(self, now: float) -> bool:
        """RECOVERING, the old group stopped (or given up on), the next one not yet admitted."""
        if self.state is not JobState.RECOVERING or self.phase not in (Phase.STOPPING, Phase.CHECKPOINTING, Phase.STOPPED):
            return False
        return not self.live or (self.settle_by is not None and now >= self.settle_by)

    def handle(self, event: Event, now: float, wall: float | None = None) -> list[Action]:
        """Apply one event; the actions it calls for. An event that does not apply in this state
        changes nothing and returns []. `wall`: the wall time of `now` (None: `now` is wall time)."""
        self.wall = now if wall is None else wall
        return _HANDLERS[type(event)](self, event, now)

    # -- one method per event ------------------------------------------------------------------

    def _admitted(self, e: Admitted, now: float) -> list[Action]:
        if not (self.state is JobState.QUEUED or self.ready_to_restart(now)):
            return []
        # QUEUED -> STARTING: enough free slots for workers.min; ports are being reserved.
        # RECOVERING (stopped) -> RECOVERING (restarting): the same, for generation g+1; a requeued
        # job that resumes is recovering too.
        self.state = JobState.STARTING if self.state is JobState.QUEUED and self.generation == 0 else JobState.RECOVERING
        self.phase = Phase.RESTARTING if self.state is JobState.RECOVERING else None
        self.world_size, self.settle_by, self.stop_by = e.world_size, None, None
        self.up, self.done, self.live, self.deadline = set(), set(), set(), None
        return []

    def _start_aborted(self, e: StartAborted, now: float) -> list[Action]:
        if not (self.state is JobState.STARTING or self.phase is Phase.RESTARTING) or self.deadline is not None:
            return []
        # STARTING -> QUEUED: nothing was started, so nothing is lost; try again when slots are
        # free (the node that failed to answer is usually lost by then). A restart being prepared
        # goes back to "stopped, waiting for admission".
        if self.state is JobState.STARTING:
            self.state = JobState.QUEUED
        else:
            self.phase = Phase.STOPPED
        return [Emit("group.aborted", {"reason": e.reason})]

    def _group_launched(self, e: GroupLaunched, now: float) -> list[Action]:
        if not (self.state is JobState.STARTING or self.phase is Phase.RESTARTING):
            return []
        # (preparing) -> (launched): the generation counts from here.
        self.generation, self.deadline, self.nodes = e.generation, e.deadline, e.nodes
        self.live, self.high_water, self.from_step = set(range(self.world_size)), self.step, None
        if self.started_at is None:
            self.started_at = self.wall
        return []

    def _rank_up(self, e: RankUp, now: float) -> list[Action]:
        if e.generation != self.generation or self.deadline is None:
            return []
        self.up.add(e.rank)
        if e.rank == 0 and e.resume_step is not None:
            self.from_step = e.resume_step
        if len(self.up) < self.world_size:
            return []
        # STARTING|RECOVERING -> RUNNING: every rank joined the group and loaded its checkpoint.
        # (The first step's deadline is the pool's progress watch.)
        self.state, self.phase, self.deadline = JobState.RUNNING, None, None
        return [Emit("group.started", {"generation": e.generation, "world_size": self.world_size})]

    def _step_done(self, e: StepDone, now: float) -> list[Action]:
        self.step = max(self.step, e.step)
        if e.generation == self.generation:
            self.down_since = None  # the restored group trains: nothing was lost while the coordinator was away
        if e.generation != self.generation or self.state is not JobState.RUNNING or self.interrupted_at is None:
            return []
        # The first step of the new generation: the interruption is over.
        start = self.from_step if self.from_step is not None else e.step - 1
        fields = {
            "from_step": start,
            "generation": e.generation,
            "seconds_since_failure": round(now - self.interrupted_at, 3),
            "steps_recomputed": max(0, self.high_water - start),
            "cause": str(self.cause),
        }
        self.interrupted_at, self.interrupted_wall, self.cause = None, None, None
        return [Emit("group.resumed", fields)]

    def _rank_exited(self, e: RankExited, now: float) -> list[Action]:
        if e.generation != self.generation or self.state not in ACTIVE or not self.live:
            return []  # an old generation's straggler, or a job already decided: no news
        self.live.discard(e.rank)
        if e.code == 0:
            self.done.add(e.rank)
            if len(self.done) < self.world_size:
                return []
            # RUNNING|RECOVERING -> SUCCEEDED: every rank finished the job's steps (a stop request
            # that came too late to matter changes nothing).
            return self._finish(JobState.SUCCEEDED, None, now, [Emit("group.stopped", {"generation": self.generation, "reason": "done"})])
        if e.code == EXIT_STOPPED:
            if self.state is JobState.RECOVERING and self.phase is not Phase.RESTARTING:
                return []  # the checkpoint stop we asked for (or a stop that overtook it)
            # RUNNING -> RECOVERING: the group checkpointed and stopped without being asked here
            # (its trainer lost its daemon, or asked by a coordinator since restarted). Nothing is
            # lost, so it is a membership change, not a failure.
            return self._stop_group(now, StopMode.CHECKPOINT, Cause.MEMBERSHIP, f"rank {e.rank} on {e.node} stopped at a checkpoint", settle=False)
        said = {"error": e.error} if e.error else {}
        failed = Emit("worker.failed", {"rank": e.rank, "node": e.node, "reason": "exit", "code": e.code, **said, **({"stopped": True} if e.stopped else {})})
        if e.code == 2 and (not e.stopped or e.error):
            # The trainer refused its input there (a path missing on that machine, files that
            # differ, a model it cannot load): no restart on that node can help, and another node
            # may serve the job. So that node sits the job out and the group restarts without it,
            # as a membership change (no restart used); the pool fails the job at once when no
            # node is left that can serve it. Also while stopping: its peers' "connection lost"
            # exits often arrive first and start a restart, which is then not counted either.
            # A stop on its way changes nothing when the trainer said why it refused (exit 2 is
            # only ever a refusal): its ranks refuse together (trainer/loop.py _refuse_together),
            # and the stop the first one caused often reaches the others as they exit.
            why = f"rank {e.rank}: {e.error}" if e.error else f"rank {e.rank} refused the job file"
            unfit: list[Action] = [failed, Unfit(e.node, why)]
            if self.phase in (Phase.STOPPING, Phase.CHECKPOINTING):
                if self.cause is Cause.FAILURE and self.restarts > 0 and self.phase is Phase.STOPPING:
                    self.restarts -= 1  # the restart its peers' exits started was for this
                    self.cause = Cause.MEMBERSHIP
                return unfit
            # STARTING|RUNNING|RECOVERING (restarting) -> RECOVERING: re-plan without that node.
            return [*unfit, *self._stop_group(now, StopMode.NOW, Cause.MEMBERSHIP, f"node {e.node} cannot serve the job: {why}")]
        detail = f"rank {e.rank} on node {e.node} failed: exit code {e.code}" + (f": {e.error}" if e.error else "")
        if self.phase is Phase.CHECKPOINTING and not e.stopped:
            # RECOVERING (checkpointing) -> RECOVERING (stopping): a rank died instead of
            # checkpointing; the group is broken, stop the rest now.
            return self._fail(now, [failed], [e.node], detail)
        if self.phase in (Phase.STOPPING, Phase.CHECKPOINTING):
            if e.stopped or e.code == 1:
                return []  # the old group on its way out: our SIGTERM, or a peer of the failure
            # The failure itself, reported after its peers' "connection lost" exits started the
            # restart: no second restart, but its node is blamed (a full disk, a crash there).
            return [failed, Blame(e.node)]
        if e.stopped:
            # STARTING|RUNNING|RECOVERING (restarting) -> RECOVERING: its daemon stopped it (dpd
            # shutting down): the node leaves; a membership change, so no restart is used and no
            # node blamed.
            return [failed, *self._stop_group(now, StopMode.NOW, Cause.MEMBERSHIP, f"rank {e.rank} on node {e.node} stopped by its daemon")]
        # STARTING|RUNNING|RECOVERING (restarting) -> RECOVERING: a rank died; its peers fail
        # within ~0.1 s. Exit 1 is what a rank whose peer vanished exits with ("connection to a
        # peer was lost"), and it often arrives first, so it does not count against its node.
        return self._fail(now, [failed], [e.node] if e.code != 1 else [], detail)

    def _node_lost(self, e: NodeLost, now: float) -> list[Action]:
        if self.state not in ACTIVE or not self.launched_or_stopping():
            return []
        gone = [r for r in e.ranks if r in self.live]
        self.live.difference_update(e.ranks)
        if gone and self.phase is Phase.STOPPING and self.cause is Cause.FAILURE:
            # Stopping after a failure that may have been this node's: a dpd killed takes its
            # trainers along unreported, and their peers' "connection lost" (exit 1) reached the
            # pool first. Said, so the record names the node that went, not only its peers.
            return [Emit("worker.failed", {"rank": r, "node": e.node, "reason": "heartbeat"}) for r in gone]
        if not gone or self.phase in (Phase.STOPPING, Phase.STOPPED):
            return []  # nothing of this generation there, or stopping anyway: accounted for
        # STARTING|RUNNING|RECOVERING (checkpointing, restarting) -> RECOVERING: a node with ranks
        # of this generation stopped heartbeating; their peers will hang or fail.
        emits: list[Action] = [Emit("worker.failed", {"rank": r, "node": e.node, "reason": "heartbeat"}) for r in gone]
        used = self.restarts
        actions = self._fail(now, emits, [e.node], f"node {e.node} (ranks {', '.join(map(str, gone))}) stopped heartbeating")
        if self.restarts > used:
            self.lost_to.add(e.node)
        return actions

    def _node_back(self, e: NodeBack, now: float) -> list[Action]:
        if e.node not in self.lost_to or self.terminal:
            return []
        # A node that was alive after all: its loss was a membership change, not a failure; the
        # restart it used is given back (the group had to restart all the same: its ring broke).
        self.lost_to.discard(e.node)
        self.restarts -= 1
        if self.cause is Cause.FAILURE:
            self.cause = Cause.MEMBERSHIP
        return [Emit("node.returned", {"node": e.node, "restarts": self.restarts})]

    def _stalled(self, e: Stalled, now: float) -> list[Action]:
        if not (self.state is JobState.RUNNING or self.phase is Phase.CHECKPOINTING) or not self.live:
            return []
        # RUNNING|RECOVERING (checkpointing) -> RECOVERING: no step completed within the progress
        # deadline (a frozen rank leaves the others spinning inside all_sum forever).
        emits: list[Action] = [Emit("worker.failed", {"rank": r, "node": n, "reason": "stalled", "detail": e.detail}) for r, n in e.ranks]
        return self._fail(now, emits, list(e.blame), f"group {self.generation} stalled: {e.detail}")

    def _reached(self, e: Reached, now: float) -> list[Action]:
        # Steps done that the next generation does again: counted in its group.resumed, also when
        # it was launched before this was said.
        self.step = max(self.step, e.step)
        if e.generation < self.generation:
            self.high_water = max(self.high_water, e.step)
        return []

    def _reshape(self, e: Reshape, now: float) -> list[Action]:
        if self.state is JobState.RUNNING:
            # RUNNING -> RECOVERING (checkpointing): a node joined or is drained; checkpoint at the
            # next step boundary and exit, so the next generation starts from exactly that step.
            stopping = self._stop_group(now, StopMode.CHECKPOINT, Cause.MEMBERSHIP, e.reason, settle=False)
            self.stop_by = e.stop_by
            return stopping
        if self.forming:
            # STARTING|RECOVERING (launched, not up) -> RECOVERING (stopping): no step was taken
            # yet, so stopping now loses nothing; a membership change.
            return self._stop_group(now, StopMode.NOW, Cause.MEMBERSHIP, e.reason)
        return []

    def _requeue(self, e: Requeue, now: float) -> list[Action]:
        if not self.ready_to_restart(now):
            return []
        # RECOVERING -> QUEUED: fewer than workers.min slots are left; the checkpoints stay, and
        # the job resumes from them when slots return.
        self.state, self.phase, self.live, self.settle_by, self.stop_by = JobState.QUEUED, None, set(), None, None
        return [Emit("job.queued", {"reason": e.reason})]

    def _restored(self, e: Restored, now: float) -> list[Action]:
        """A restarted coordinator's view: a launched group keeps running if its daemons report it
        (the pool's reconcile time), a start being prepared is admitted again (nothing of it ran),
        and a group being stopped is stopped again."""
        if self.generation or self.state is not JobState.QUEUED:
            return []  # restored once, before any other event
        s = e.saved
        self.state, self.generation, self.restarts, self.step = s.state, s.generation, s.restarts, s.step
        self.error, self.started_at, self.finished_at = s.error, s.started_at, s.finished_at
        if s.state not in ACTIVE:
            return []
        if s.interrupted_at is not None and s.cause in {c.value for c in Cause}:
            # A recovery under way when the coordinator stopped: the next group's first step is
            # still its group.resumed, timed from the interruption (the coordinator's downtime
            # included: it was part of the wait).
            self.interrupted_at, self.interrupted_wall, self.cause = now - max(0.0, self.wall - s.interrupted_at), s.interrupted_at, Cause(s.cause)
        if e.launched is None:
            # A start (or restart) being prepared: nothing of it ran; admit it again.
            if s.state is JobState.STARTING:
                self.state = JobState.QUEUED
            else:
                self.state, self.phase = JobState.RECOVERING, Phase.STOPPED
            return []
        self.world_size, self.live = e.launched, set(range(e.launched))
        if self.interrupted_at is None and e.down_since is not None:
            self.down_since = min(now, e.down_since)
        if s.state is JobState.RUNNING:
            # Rank 0's hello, which said where this generation started, went to the coordinator
            # that died: the newest step it saved stands for it, so that the group counts as
            # resizable once it reports a step past it (a growth onto a freed slot waited forever).
            self.from_step = s.step
        if s.state is JobState.STARTING:
            self.deadline = e.start_deadline
        elif s.state is JobState.RECOVERING:
            # It was being stopped (or restarted): finish stopping it (ranks still running are
            # stopped when their daemons report them), and re-plan once they are gone or by then.
            self.phase, self.settle_by = Phase.STOPPING, e.settle_by
        return []

    def _cancel(self, e: CancelRequested, now: float) -> list[Action]:
        if self.state is JobState.QUEUED:
            # QUEUED -> CANCELLED: nothing runs; the job leaves the queue.
            return self._finish(JobState.CANCELLED, None, now, [])
        if self.state in ACTIVE:
            # STARTING|RUNNING|RECOVERING -> CANCELLED: the user asked; stop what runs, keep
            # checkpoints.
            return self._finish(JobState.CANCELLED, None, now, self._stop_rest("cancelled"))
        return []

    def _unservable(self, e: Unservable, now: float) -> list[Action]:
        if not (self.state is JobState.QUEUED or self.ready_to_restart(now)):
            return []
        # QUEUED|RECOVERING (stopped) -> FAILED: every node said it cannot serve the job, each
        # with its reason; waiting would not change that, and restarts would only repeat it.
        return self._finish(JobState.FAILED, e.reason, now, [])

    def _tick(self, e: Tick, now: float) -> list[Action]:
        if self.deadline is not None and now >= self.deadline and self.state in (JobState.STARTING, JobState.RECOVERING):
            # STARTING|RECOVERING (launched) -> RECOVERING: the group did not form in time (a peer
            # that never appears leaves the others waiting in MLX's init forever).
            missing = sorted(set(range(self.world_size)) - self.up)
            emits: list[Action] = [
                Emit("worker.failed", {"rank": r, **({"node": self.nodes[r]} if r < len(self.nodes) else {}), "reason": "stalled", "detail": "start timeout"})
                for r in missing
            ]
            return self._fail(now, emits, [], f"group {self.generation} did not start in time: ranks {missing} never reported")
        if self.phase is Phase.CHECKPOINTING and self.stop_by is not None and now >= self.stop_by and self.live:
            # RECOVERING (checkpointing) -> RECOVERING (stopping): the group did not exit in time
            # after the stop request; whatever it saved is kept.
            self.phase, self.settle_by, self.stop_by = Phase.STOPPING, now + SETTLE_S, None
            return [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": "checkpoint stop timed out"})]
        return []

    # -- shared transitions --------------------------------------------------------------------

    def _stop_rest(self, reason: str) -> list[Action]:
        """Stop what still runs of the generation."""
        if not self.live:
            return []
        return [StopGroup(self.generation), Emit("group.stopped", {"generation": self.generation, "reason": reason})]

    def _stop_group(self, now: float, mode: StopMode, cause: Cause, reason: str, *, settle: bool = True) -> list[Action]:
        self.state, self.deadline = JobState.RECOVERING, None
        self.phase = Phase.STOPPING if mode is StopMode.NOW else Phase.CHECKPOINTING
        self.settle_by = now + SETTLE_S if settle else None
        at = now if self.down_since is None or cause is not Cause.FAILURE else self.down_since
        self.interrupted_at, self.interrupted_wall, self.cause, self.down_since = at, self.wall - (now - at), cause, None
        return [StopGroup(self.generation, mode), Emit("group.stopped", {"generation": self.generation, "reason": reason, "mode": str(mode)})]

    def _fail(self, now: float, emits: list[Action], nodes: list[str], error: str) -> list[Action]:
        blames: list[Action] = [Blame(n) for n in nodes]
        if self.restarts >= self.max_restarts:
            # -> FAILED: the restart budget is spent; stop whatever still runs.
            why = f"{error}; the restart budget (recovery.max_restarts = {self.max_restarts}) is used up"
            return self._finish(JobState.FAILED, why, now, [*emits, *blames, *self._stop_rest("failed")])
        self.restarts += 1
        return [*emits, *blames, *self._stop_group(now, StopMode.NOW, Cause.FAILURE, error)]

    def _finish(self, state: JobState, error: str | None, now: float, actions: list[Action]) -> list[Action]:
        self.state, self.phase, self.error, self.finished_at, self.deadline = state, None, error, self.wall, None
        self.settle_by, self.stop_by = None, None
        return [*actions, Emit(f"job.{state}", {"error": error} if error else {})]


_HANDLERS: dict[type, Callable[[JobMachine, Any, float], list[Action]]] = {
    Admitted: JobMachine._admitted,
    StartAborted: JobMachine._start_aborted,
    GroupLaunched: JobMachine._group_launched,
    RankUp: JobMachine._rank_up,
    StepDone: JobMachine._step_done,
    RankExited: JobMachine._rank_exited,
    NodeLost: JobMachine._node_lost,
    NodeBack: JobMachine._node_back,
    Stalled: JobMachine._stalled,
    Reached: JobMachine._reached,
    Reshape: JobMachine._reshape,
    Requeue: JobMachine._requeue,
    Restored: JobMachine._restored,
    CancelRequested: JobMachine._cancel,
    Unservable: JobMachine._unservable,
    Tick: JobMachine._tick,
}
