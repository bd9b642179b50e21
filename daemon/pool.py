"""The coordinator's policy: nodes, slots, the job queue, admission and planning. Pure.

`Pool` holds no socket, no file and no clock: every method takes `now` and returns actions
(`Send` a message to a node, `Record` an event, `JobChanged`/`NodeChanged` to persist). The
coordinator's asyncio loop (`daemon/coordinator.py`) feeds it decoded messages and timer ticks and
carries its actions out. Each job's own life is a `JobMachine` (`daemon/jobstate.py`); the pool adds
what needs the whole pool: which slots are free, where ranks go, what each node must be told.

Starting a group is two-phase because only a node knows which of its TCP ports are free:
`group.prepare` asks each chosen node for one port per slot (`node.prepared`), then the pool writes
the ring hostfile and sends `group.start`. Slots are set aside from admission until the node
reports their worker's exit (or stops listing it in its heartbeat, or is lost).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from dpool.daemon import jobstate as js
from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.plan import FreeSlot, GroupPlan, Slot, choose_slots, equal_shares, ring_hostfile
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.messages import GroupPrepare, GroupStart, GroupStop, Message

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
    node: str


Action = Send | Record | JobChanged | NodeChanged


# -- records -----------------------------------------------------------------------------------


class NodeState(enum.StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    LOST = "lost"


@dataclass(slots=True)
class Node:
    name: str
    incarnation: str
    info: dict[str, Any]
    joined_at: float
    last_seen: float
    lost: bool = False
    draining: bool = False
    reason: str | None = None
    used: dict[int, tuple[str, int]] = field(default_factory=dict)  # slot -> (job, generation)
    holdings: dict[tuple[str, int], int] = field(default_factory=dict)  # (job, slot) -> newest step

    @property
    def slots(self) -> int:
        return int(self.info.get("slots", 1))

    @property
    def state(self) -> NodeState:
        if self.lost:
            return NodeState.LOST
        if self.draining:
            return NodeState.DRAINING
        return NodeState.BUSY if self.used else NodeState.IDLE

    def free(self) -> list[int]:
        if self.lost or self.draining:
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


@dataclass(slots=True)
class Pending:
    """A group being prepared: slots set aside, ports arriving per node."""

    generation: int
    slots: list[Slot]
    deadline: float
    endpoints: dict[Slot, str] = field(default_factory=dict)
    answered: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Job:
    id: str
    name: str
    spec: dict[str, Any]
    submitted_at: float
    machine: JobMachine = field(default_factory=JobMachine)
    plan: GroupPlan | None = None
    pending: Pending | None = None
    ranks: dict[int, RankRun] = field(default_factory=dict)
    step: int = 0
    loss: float | None = None
    val_loss: float | None = None
    checkpoint_step: int | None = None
    saved: dict[int, dict[int, float]] = field(default_factory=dict)  # step -> rank -> seconds
    reconcile_by: float | None = None  # after a coordinator restart: ranks must reappear by then

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def steps(self) -> int:
        return int(self.spec["train"]["steps"])

    def status(self) -> dict[str, Any]:
        """The `dpctl status JOB --json` object (INTERFACE.md)."""
        plan = self.plan
        workers = []
        if plan is not None and self.state not in js.TERMINAL:
            for r, slot in enumerate(plan.ranks):
                run = self.ranks.get(r)
                workers.append(
                    {"rank": r, "node": slot.node, "share": plan.shares[r], "tokens_per_s": round(run.tokens_per_s, 1) if run else 0.0}
                )
        return {
            "id": self.id,
            "name": self.name,
            "state": str(self.state),
            "step": self.step,
            "steps": self.steps,
            "generation": self.machine.generation,
            "world_size": plan.world_size if plan else 0,
            "workers": workers,
            "checkpoint_step": self.checkpoint_step,
            "loss": self.loss,
            "val_loss": self.val_loss,
            "error": self.machine.error,
        }


# -- the pool ----------------------------------------------------------------------------------


class Pool:
    def __init__(self, *, heartbeat_s: float = 0.5, liveness: int = 6, prepare_timeout_s: float | None = None) -> None:
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.expiry_s = heartbeat_s * liveness
        self.prepare_timeout_s = prepare_timeout_s if prepare_timeout_s is not None else max(5.0, 2 * self.expiry_s)
        self.nodes: dict[str, Node] = {}
        self.jobs: dict[str, Job] = {}  # in submission order

    # -- lookups -------------------------------------------------------------------------------

    def resolve(self, ref: str) -> Job | None:
        """A job by id, by name (its newest), or by a unique id prefix."""
        if ref in self.jobs:
            return self.jobs[ref]
        named = [j for j in self.jobs.values() if j.name == ref]
        if named:
            return max(named, key=lambda j: j.submitted_at)
        prefixed = [j for j in self.jobs.values() if j.id.startswith(ref)]
        return prefixed[0] if len(prefixed) == 1 else None

    def node_rows(self, now: float) -> list[dict[str, Any]]:
        """The `dpctl nodes --json` array (INTERFACE.md), by name."""
        rows = []
        for n in sorted(self.nodes.values(), key=lambda n: n.name):
            jobs = sorted({job for job, _ in n.used.values()})
            ranks = self._ranks_on(n.name)
            rows.append(
                {
                    "name": n.name,
                    "address": n.info.get("advertise", ""),
                    "state": str(n.state),
                    "platform": n.info.get("platform", ""),
                    "chip": n.info.get("chip", ""),
                    "memory_bytes": int(n.info.get("memory_bytes", 0)),
                    "mlx_version": n.info.get("mlx_version", ""),
                    "backend": n.info.get("backend", ""),
                    "slots": n.slots,
                    "busy_slots": len(n.used),
                    "job": ",".join(jobs) if jobs else None,
                    "ranks": ranks,
                    "heartbeat_age_s": round(max(0.0, now - n.last_seen), 3),
                    "reason": n.reason,
                }
            )
        return rows

    def _ranks_on(self, node: str) -> list[int]:
        out = []
        for job in self.jobs.values():
            if job.plan is not None and job.state in js.ACTIVE:
                out += [r for r, _ in job.plan.ranks_on(node)]
        return sorted(out)

    # -- nodes ---------------------------------------------------------------------------------

    def register(
        self,
        now: float,
        name: str,
        incarnation: str,
        info: dict[str, Any],
        running: list[dict[str, Any]],
        exited: list[dict[str, Any]],
        holdings: list[dict[str, Any]],
    ) -> tuple[str | None, list[Action]]:
        """A daemon (re)joins. Returns (refusal message or None, actions)."""
        old = self.nodes.get(name)
        if old is not None and old.incarnation != incarnation and not old.lost and now - old.last_seen < self.expiry_s:
            pid = old.info.get("pid", "?")
            return (
                f"node name {name!r} is already in the pool (dpd pid {pid} at {old.info.get('advertise', '?')}, "
                f"last heard {now - old.last_seen:.1f}s ago); give this daemon another --name",
                [],
            )
        actions: list[Action] = []
        rejoin = old is not None and old.incarnation == incarnation
        if rejoin:
            assert old is not None
            node = old
            node.lost, node.reason, node.last_seen, node.info = False, None, now, dict(info)
        else:
            if old is not None:
                # A new daemon process under a known name: whatever the old one ran is gone.
                actions += self._node_gone(old, now, "replaced by a new dpd process")
            node = Node(name=name, incarnation=incarnation, info=dict(info), joined_at=now, last_seen=now)
            self.nodes[name] = node
        for h in holdings:
            node.holdings[(str(h["job"]), int(h["slot"]))] = int(h["step"])
        for e in exited:
            actions += self.worker_exited(now, name, str(e["job"]), int(e["generation"]), int(e["rank"]), int(e["slot"]), int(e["code"]), bool(e.get("stopped", False)))
        for w in running:
            actions += self._adopt(now, node, w)
        kind = "node.rejoined" if rejoin else "node.joined"
        actions += [Record(None, kind, now, {"node": name, "slots": node.slots}), NodeChanged(name)]
        actions += self._schedule(now)
        return None, actions

    def _adopt(self, now: float, node: Node, w: dict[str, Any]) -> list[Action]:
        """A worker a (re)registering node runs: keep it if it belongs to a live group, else stop it."""
        job = self.jobs.get(str(w["job"]))
        gen, rank, slot = int(w["generation"]), int(w["rank"]), int(w["slot"])
        plan = job.plan if job else None
        if job is not None and plan is not None and job.state in js.ACTIVE and gen == plan.generation and rank < plan.world_size and plan.ranks[rank] == Slot(node.name, slot):
            node.used[slot] = (job.id, gen)
            run = job.ranks.setdefault(rank, RankRun(node.name, slot))
            run.pid = int(w.get("pid", 0)) or run.pid
            return []
        # An orphan: its job ended, moved on to another generation, or is unknown here.
        node.used[slot] = (str(w["job"]), gen)  # busy until it is gone
        return [Send(node.name, GroupStop(job=str(w["job"]), generation=gen))]

    def seen(self, now: float, name: str) -> Node | None:
        """Any message from a registered node is a heartbeat (Paranoid Pirate)."""
        node = self.nodes.get(name)
        if node is not None and not node.lost:
            node.last_seen = now
        return node

    def heartbeat(self, now: float, name: str, workers: list[dict[str, Any]]) -> list[Action]:
        """Free slots whose job is no longer using them and whose worker the node no longer has."""
        node = self.seen(now, name)
        if node is None or node.lost:
            return []
        alive = {(str(w["job"]), int(w["generation"]), int(w["slot"])) for w in workers}
        actions: list[Action] = []
        for slot, (job_id, gen) in list(node.used.items()):
            if (job_id, gen, slot) in alive:
                continue
            job = self.jobs.get(job_id)
            current = job is not None and job.state in js.ACTIVE and (
                (job.plan is not None and job.plan.generation == gen) or (job.pending is not None and job.pending.generation == gen)
            )
            if not current:
                del node.used[slot]
                actions.append(NodeChanged(name))
        if actions:
            actions += self._schedule(now)
        return actions

    def bye(self, now: float, name: str) -> list[Action]:
        node = self.nodes.get(name)
        if node is None or node.lost:
            return []
        return self._node_gone(node, now, "dpd stopped") + self._schedule(now)

    def _node_gone(self, node: Node, now: float, reason: str) -> list[Action]:
        node.lost, node.reason = True, reason
        actions: list[Action] = [Record(None, "node.lost", now, {"node": node.name, "reason": reason}), NodeChanged(node.name)]
        for job in self.jobs.values():
            if job.state not in js.ACTIVE:
                continue
            if job.pending is not None and any(s.node == node.name for s in job.pending.slots):
                actions += self._abort_start(job, now, f"node {node.name} lost while preparing: {reason}")
            elif job.plan is not None:
                ranks = tuple(r for r, _ in job.plan.ranks_on(node.name) if job.ranks.get(r, RankRun("", 0)).exit_code is None)
                actions += self._feed(job, js.NodeLost(node.name, ranks), now)
        node.used.clear()
        return actions

    # -- jobs ----------------------------------------------------------------------------------

    def submit(self, now: float, job_id: str, spec: JobSpec) -> list[Action]:
        job = Job(id=job_id, name=spec.name, spec=spec.to_dict(), submitted_at=now)
        self.jobs[job_id] = job
        w = spec.workers
        return [Record(job_id, "job.submitted", now, {"workers_min": w.min, "workers_max": w.max}), JobChanged(job_id), *self._schedule(now)]

    def cancel(self, now: float, job: Job) -> list[Action]:
        return self._feed(job, js.CancelRequested(), now) + self._schedule(now)

    def prepared(self, now: float, node_name: str, job_id: str, generation: int, host: str, ports: list[int], error: str | None) -> list[Action]:
        job = self.jobs.get(job_id)
        pend = job.pending if job else None
        if job is None or pend is None or pend.generation != generation or node_name in pend.answered:
            return []  # a late answer to a start that was already aborted or completed
        mine = [s for s in pend.slots if s.node == node_name]
        if error or len(ports) != len(mine):
            return self._abort_start(job, now, f"node {node_name} could not prepare: {error or 'wrong number of ports'}")
        pend.answered.add(node_name)
        for slot, port in zip(mine, ports, strict=True):
            pend.endpoints[slot] = f"{host}:{port}"
        if len(pend.answered) < len({s.node for s in pend.slots}):
            return []
        return self._launch(job, now)

    def _launch(self, job: Job, now: float) -> list[Action]:
        pend = job.pending
        assert pend is not None
        spec = job.spec
        shares = equal_shares(int(spec["train"]["global_batch"]), len(pend.slots))
        hostfile = ring_hostfile(pend.slots, pend.endpoints)
        plan = GroupPlan(
            job=job.id,
            generation=pend.generation,
            ranks=tuple(pend.slots),
            shares=tuple(shares),
            hostfile=tuple(tuple(h) for h in hostfile),
        )
        job.plan, job.pending = plan, None
        job.ranks = {r: RankRun(s.node, s.index) for r, s in enumerate(plan.ranks)}
        deadline = now + float(spec["recovery"]["start_timeout_s"])
        actions = self._feed(job, js.GroupLaunched(plan.generation, deadline), now)
        for node in plan.nodes():
            ranks = [{"slot": s.index, "rank": r} for r, s in plan.ranks_on(node)]
            actions.append(Send(node, GroupStart(job=job.id, generation=plan.generation, spec=spec, ranks=ranks, shares=list(shares), hostfile=hostfile)))
        actions.append(
            Record(job.id, "group.starting", now, {"generation": plan.generation, "world_size": plan.world_size, "nodes": plan.nodes(), "shares": list(shares)})
        )
        return actions

    def _abort_start(self, job: Job, now: float, reason: str) -> list[Action]:
        pend = job.pending
        if pend is None:
            return []
        for s in pend.slots:
            node = self.nodes.get(s.node)
            if node is not None and node.used.get(s.index) == (job.id, pend.generation):
                del node.used[s.index]
        job.pending = None
        return self._feed(job, js.StartAborted(reason), now)

    def worker_started(self, now: float, node: str, job_id: str, generation: int, rank: int, pid: int) -> list[Action]:
        run = self._run(job_id, generation, rank)
        if run is not None:
            run.pid = pid
        return []

    def worker_hello(self, now: float, node: str, job_id: str, generation: int, rank: int, pid: int, resume_step: int) -> list[Action]:
        job = self.jobs.get(job_id)
        run = self._run(job_id, generation, rank)
        if job is None or run is None:
            return []
        run.pid = pid
        actions: list[Action] = []
        if rank == 0:
            job.step = max(job.step, resume_step)
            if resume_step:
                actions.append(Record(job.id, "group.resumed_from", now, {"from_step": resume_step, "generation": generation}))
        return actions + self._feed(job, js.RankUp(generation, rank), now)

    def progress(self, now: float, job_id: str, generation: int, rank: int, step: int, tokens: int, seconds: float) -> list[Action]:
        job = self.jobs.get(job_id)
        run = self._run(job_id, generation, rank)
        if job is None or run is None:
            return []
        run.step = step
        if seconds > 0:
            rate = tokens / seconds
            run.tokens_per_s = rate if run.tokens_per_s == 0 else 0.8 * run.tokens_per_s + 0.2 * rate
        if rank == 0:
            job.step = max(job.step, step)
        # A step done means the rank is up, even if its hello was lost.
        return self._feed(job, js.RankUp(generation, rank), now) if job.state is JobState.STARTING else []

    def metric(self, now: float, job_id: str, generation: int, row: dict[str, Any]) -> list[Action]:
        job = self.jobs.get(job_id)
        if job is None or (job.plan is not None and generation < job.plan.generation):
            return []
        if row.get("kind") == "train" and isinstance(row.get("loss"), int | float):
            job.loss = float(row["loss"])
        elif row.get("kind") == "eval" and isinstance(row.get("val_loss"), int | float):
            job.val_loss = float(row["val_loss"])
        return []

    def checkpoint(self, now: float, node_name: str, job_id: str, generation: int, rank: int, slot: int, step: int, seconds: float) -> list[Action]:
        node = self.nodes.get(node_name)
        if node is not None:
            node.holdings[(job_id, slot)] = max(step, node.holdings.get((job_id, slot), 0))
        job = self.jobs.get(job_id)
        if job is None or job.plan is None or job.plan.generation != generation:
            return []
        got = job.saved.setdefault(step, {})
        got[rank] = seconds
        if len(got) < job.plan.world_size:
            return []
        # Every rank holds step `step`: the group can resume from it on any of its nodes.
        del job.saved[step]
        job.checkpoint_step = max(step, job.checkpoint_step or 0)
        return [Record(job.id, "checkpoint.saved", now, {"step": step, "seconds": round(max(got.values()), 4)}), JobChanged(job.id)]

    def worker_exited(self, now: float, node_name: str, job_id: str, generation: int, rank: int, slot: int, code: int, stopped: bool) -> list[Action]:
        actions: list[Action] = []
        node = self.nodes.get(node_name)
        if node is not None and node.used.get(slot) == (job_id, generation):
            del node.used[slot]
            actions.append(NodeChanged(node_name))
        job = self.jobs.get(job_id)
        run = self._run(job_id, generation, rank)
        if job is not None and run is not None and run.exit_code is None:
            run.exit_code = code
            actions += self._feed(job, js.RankExited(generation, rank, node_name, code, stopped), now)
        return actions + self._schedule(now)

    def _run(self, job_id: str, generation: int, rank: int) -> RankRun | None:
        job = self.jobs.get(job_id)
        if job is None or job.plan is None or job.plan.generation != generation:
            return None
        return job.ranks.get(rank)

    # -- time ----------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for node in self.nodes.values():
            if not node.lost and now - node.last_seen > self.expiry_s:
                actions += self._node_gone(node, now, f"no heartbeat for {now - node.last_seen:.1f}s")
        for job in self.jobs.values():
            if job.pending is not None and now >= job.pending.deadline:
                missing = sorted({s.node for s in job.pending.slots} - job.pending.answered)
                actions += self._abort_start(job, now, f"no answer to group.prepare from {', '.join(missing)}")
            if job.reconcile_by is not None and now >= job.reconcile_by:
                actions += self._reconcile(job, now)
            if job.state is JobState.STARTING:
                actions += self._feed(job, js.Tick(), now)
        return actions + self._schedule(now)

    # -- admission -----------------------------------------------------------------------------

    def _schedule(self, now: float) -> list[Action]:
        """Admit queued jobs in submission order while their workers.min fits in the free slots.

        A job that could never fit in the pool as it is (workers.min above every healthy slot)
        does not hold back the jobs behind it; one that merely waits for busy slots does, so big
        jobs are not starved by a stream of small ones.
        """
        actions: list[Action] = []
        capacity = sum(n.slots for n in self.nodes.values() if not n.lost and not n.draining)
        for job in list(self.jobs.values()):
            if job.state is not JobState.QUEUED:
                continue
            lo, hi = int(job.spec["workers"]["min"]), int(job.spec["workers"]["max"])
            if lo > capacity:
                continue
            free = [
                FreeSlot(n.name, i, n.holdings.get((job.id, i)))
                for n in self.nodes.values()
                for i in n.free()
            ]
            chosen = choose_slots(free, lo, min(hi, int(job.spec["train"]["global_batch"])))
            if chosen is None:
                break
            actions += self._admit(job, chosen, now)
        return actions

    def _admit(self, job: Job, chosen: list[Slot], now: float) -> list[Action]:
        generation = job.machine.generation + 1
        job.pending = Pending(generation=generation, slots=chosen, deadline=now + self.prepare_timeout_s)
        for s in chosen:
            self.nodes[s.node].used[s.index] = (job.id, generation)
        actions = self._feed(job, js.Admitted(len(chosen)), now)
        for node in sorted({s.node for s in chosen}):
            slots = [s.index for s in chosen if s.node == node]
            actions += [Send(node, GroupPrepare(job=job.id, generation=generation, slots=slots)), NodeChanged(node)]
        return actions

    # -- the job machine -----------------------------------------------------------------------

    def _feed(self, job: Job, event: js.Event, now: float) -> list[Action]:
        before = job.state
        out: list[Action] = []
        for action in job.machine.handle(event, now):
            if isinstance(action, js.StopGroup):
                out += self._stop(job, action)
            else:
                out.append(Record(job.id, action.kind, now, action.fields))
        if job.machine.terminal and job.pending is not None:
            out += self._release_pending(job)
        if job.state is not before or out:
            out.append(JobChanged(job.id))
        return out

    def _release_pending(self, job: Job) -> list[Action]:
        pend, job.pending = job.pending, None
        assert pend is not None
        for s in pend.slots:
            node = self.nodes.get(s.node)
            if node is not None and node.used.get(s.index) == (job.id, pend.generation):
                del node.used[s.index]
        return [NodeChanged(n) for n in sorted({s.node for s in pend.slots})]

    def _stop(self, job: Job, stop: js.StopGroup) -> list[Action]:
        if job.plan is None or job.plan.generation != stop.generation:
            return []
        return [
            Send(n, GroupStop(job=job.id, generation=stop.generation, mode=stop.mode))
            for n in job.plan.nodes()
            if n in self.nodes and not self.nodes[n].lost
        ]

    # -- restart -------------------------------------------------------------------------------

    def restore(self, job: Job, now: float) -> None:
        """A job read back from the store after a coordinator restart.

        A start that was being prepared is simply queued again (nothing ran). A launched group
        keeps running if its daemons re-register with its workers before `reconcile_by`.
        """
        self.jobs[job.id] = job
        if job.state is JobState.STARTING and job.plan is None:
            job.machine.state = JobState.QUEUED
        elif job.state in js.ACTIVE and job.plan is not None:
            job.ranks = {r: RankRun(s.node, s.index) for r, s in enumerate(job.plan.ranks)}
            job.reconcile_by = now + 2 * self.expiry_s + 2.0
            if job.state is JobState.STARTING:
                job.machine.deadline = now + float(job.spec["recovery"]["start_timeout_s"])
                job.machine.world_size = job.plan.world_size

    def _reconcile(self, job: Job, now: float) -> list[Action]:
        job.reconcile_by = None
        if job.plan is None or job.state not in js.ACTIVE:
            return []
        missing = []
        for r, slot in enumerate(job.plan.ranks):
            run = job.ranks.get(r)
            node = self.nodes.get(slot.node)
            adopted = node is not None and node.used.get(slot.index) == (job.id, job.plan.generation)
            if run is not None and run.exit_code is None and not adopted:
                missing.append(r)
        if not missing:
            return []
        node = job.plan.ranks[missing[0]].node
        return self._feed(job, js.NodeLost(node, tuple(missing)), now)
