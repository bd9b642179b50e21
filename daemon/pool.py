"""The coordinator's policy: nodes, slots, the job queue, admission, planning and recovery. Pure.

`Pool` holds no socket, no file and no clock: every method takes `now` and returns actions
(`Send` a message to a node, `Record` an event, `JobChanged`/`NodeChanged` to persist: a node is
saved when it joins, is lost or is held, not when its slots fill or empty, which is transient). The
coordinator's asyncio loop (`daemon/coordinator.py`) feeds it decoded messages (`from_node`) and
timer ticks and carries its actions out. Admission runs once per batch of messages (`schedule`), not
once per message: a thousand registrations plan once; what it reads from the nodes and jobs for the
scheduler is `daemon/admission.py`.

Work is proportional to what changed: the loops over jobs visit the live ones only (a finished job
stays in memory for `RECENT_FINISHED` more, then only in the database), and a plan indexes its ranks
by node. Each job's own life is a `JobMachine` (`daemon/jobstate.py`); the pool adds
what needs the whole pool: which slots are free, where ranks go, what each node must be told, the
progress deadline of each running group (`daemon/watch.py`), drains, and nodes set aside.

Starting a group is two-phase because only a node knows which of its TCP ports are free:
`group.prepare` asks each chosen node for one port per slot (`node.prepared`), then the pool writes
the ring hostfile and sends `group.start`. Slots are set aside from admission until the node
reports their worker's exit (or stops listing it in its heartbeat, or is lost).

Recovery re-uses admission: a job whose old group has stopped is admitted again, in its place in
the queue (daemon/scheduler.py: priority, then submission); rank 0 goes to the slot holding the
newest checkpoint, so the new generation resumes from it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, TypeAlias

from dpool.daemon import admission
from dpool.daemon import jobstate as js
from dpool.daemon import scheduler as sched
from dpool.daemon.cadence import HEARTBEAT_RATE, Cadence
from dpool.daemon.fitness import TRAINING_RATE_BPS, Fitness, Found, needs_files
from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.links import Links
from dpool.daemon.plan import GroupPlan, Slot, choose_slots, ring_hostfile, speed_shares
from dpool.daemon.records import (
    Action,
    Hold,
    Job,
    JobChanged,
    Node,
    NodeChanged,
    NodeForgotten,
    NodeState,
    Pending,
    RankRun,
    Record,
    Refused,
    Send,
)
from dpool.daemon.watch import StepWatch
from dpool.protocol import messages as m
from dpool.protocol.commmodel import timed_comm
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.link_messages import NodeLink
from dpool.protocol.messages import GroupPrepare, GroupStart, GroupStop
from dpool.protocol.owner_messages import NodeYield
from dpool.protocol.payloads import (
    ExitedWorker,
    NodeRow,
    RankSlot,
    RunningWorker,
    StageRow,
    TestLossRow,
    TrainRow,
)
from dpool.protocol.shares import replica_shares
from dpool.protocol.stage_messages import NodeStaged

__all__ = ["Action", "Busy", "Hold", "Job", "JobChanged", "Node", "NodeChanged", "NodeForgotten", "NodeState", "Pool", "Record", "Refused", "Send"]

SET_ASIDE_AFTER = 3  # workers failing on a node in a row before it takes no more work
MAX_NODES = 4096  # nodes the pool holds, lost ones included; beyond it a lost one is forgotten, else a new name is refused
REPLACE_SILENT_PARTS = 3  # a new dpd with a node's key replaces the live one only once it has been silent a third of its expiry (two periods at the default liveness)
RECENT_FINISHED = 64  # finished jobs kept in memory (for late reports); older ones are in the store only
PLACED_KEPT = 8  # generations per job whose placement is remembered, to check reports that arrive late
TOKENS_PER_S_MAX = 1e12  # a rank's measured rate is capped here: no machine is faster, and a report's quotient can be inf

NodeMessage: TypeAlias = (
    m.NodeHeartbeat | m.NodePrepared | m.NodeWorkerStarted | m.NodeWorkerHello | m.NodeProgress | m.NodeWaiting | m.NodeMetric
    | m.NodeCheckpoint | m.NodeWorkerExited | m.NodeWarmed | NodeStaged | NodeLink | NodeYield
)

RANK_REPORTS = (m.NodeWorkerStarted, m.NodeWorkerHello, m.NodeProgress, m.NodeWaiting, m.NodeCheckpoint, m.NodeWorkerExited, NodeLink)  # each names its rank


class Busy(str):
    """A registration refused while the node's live dpd heartbeats (Pool.register): the new dpd
    asks again (`node_busy`), and takes the node once that one falls silent."""


class Pool:
    def __init__(
        self, *, heartbeat_s: float = 0.5, liveness: int = 6, prepare_timeout_s: float | None = None, stage_rate_bps: float = TRAINING_RATE_BPS,
        policy: sched.Policy = sched.POLICY, heartbeat_rate: float = HEARTBEAT_RATE,
    ) -> None:
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        # Each node's heartbeat period, which grows with the pool; when it is lost, and how soon a
        # node of a group stopped at once must answer (daemon/cadence.py).
        self.cadence = Cadence(heartbeat_s, liveness, heartbeat_rate)
        self.known_nodes = 0  # nodes the store knows from before a restart (their periods bound reconcile_by)
        self.prepare_timeout_s = prepare_timeout_s if prepare_timeout_s is not None else max(5.0, 2 * heartbeat_s * liveness)
        self.nodes: dict[str, Node] = {}
        self.jobs: dict[str, Job] = {}  # in memory: the live jobs and the RECENT_FINISHED newest finished, in submission order
        self.live: dict[str, Job] = {}  # the jobs not finished, in submission order
        self._finished: collections.deque[str] = collections.deque()
        self.forgotten = 0  # jobs that left memory (the store alone has them)
        self.remembered: dict[str, tuple[Hold, str]] = {}  # node -> its hold and why (from the store)
        self.displaced: dict[str, tuple[str, str]] = {}  # node -> (the dpd process a new one replaced: its incarnation, who replaced it)
        self.fitness = Fitness(stage_rate_bps)  # which nodes can serve which job, and who holds its files (staging)
        self.links = Links()  # the links groups measured, and each running job's share of a step in all_sum
        self.policy = policy  # sharing the pool (daemon/scheduler.py)
        self.decision: sched.Decision | None = None  # the scheduler's newest, for `dpctl queue`
        # Wall time less `now`, as of the unit of work being handled (the coordinator sets it from
        # its clocks). Records, which people read as wall time, are stamped `wall(now)`: a job's
        # submitted, started and finished times here, events (Record.t) where they are written.
        # Deadlines and liveness stay on `now`, which a step of the system clock does not move.
        self.wall_offset = 0.0

    def wall(self, now: float) -> float:
        """The wall time of `now` (the pool's clock)."""
        return now + self.wall_offset

    # -- lookups -------------------------------------------------------------------------------

    def resolve(self, ref: str) -> Job | None:
        """A job in memory by id, by name (its newest), or by a unique id prefix."""
        if ref in self.jobs:
            return self.jobs[ref]
        named = [j for j in self.jobs.values() if j.name == ref]
        if named:
            return max(named, key=lambda j: j.submitted_at)
        prefixed = [j for j in self.jobs.values() if j.id.startswith(ref)]
        return prefixed[0] if len(prefixed) == 1 else None

    def node_rows(self, now: float) -> list[NodeRow]:
        """The `dpctl nodes --json` array (INTERFACE.md), by name."""
        ranks = self._ranks_by_node()
        return [self.node_row(n, now, ranks) for n in sorted(self.nodes.values(), key=lambda n: n.name)]

    def node_row(self, n: Node, now: float, ranks: dict[str, list[int]] | None = None) -> NodeRow:
        jobs = sorted({job for job, _ in n.used.values()})
        i = n.info
        on = (ranks if ranks is not None else self._ranks_by_node(n.name)).get(n.name, [])
        return NodeRow(
            name=n.name,
            address=i.advertise,
            state=str(n.state),
            platform=i.platform,
            chip=i.chip,
            memory_bytes=i.memory_bytes,
            mlx_version=i.mlx_version,
            backend=i.backend,
            slots=n.slots,
            busy_slots=len(n.used),
            job=",".join(jobs) if jobs else None,
            ranks=sorted(on),
            heartbeat_age_s=round(max(0.0, now - n.last_seen), 3),
            reason=n.reason or ("; ".join(self.fitness.node_reasons(n.name)) or None if not n.lost else None),
            interface=i.interface or None,
            links=self.links.rows(n.name, now),
        )

    def _ranks_by_node(self, only: str | None = None) -> dict[str, list[int]]:
        """node -> the ranks of live groups placed there (of one node, or all)."""
        out: dict[str, list[int]] = {}
        for job in self.live.values():
            if job.plan is None or not job.machine.live:
                continue
            if only is not None:
                out.setdefault(only, []).extend(r for r, _ in job.plan.ranks_on(only))
                continue
            for node in job.plan.nodes():
                out.setdefault(node, []).extend(r for r, _ in job.plan.ranks_on(node))
        return out

    def export_holders(self, job_id: str, step: int | None) -> list[tuple[str, int]]:
        """[(node, newest step it holds of the job)] for the live nodes holding any checkpoint of
        it, best first for an export of `step` (None: the newest): the node holding exactly that
        step (or the newest) first, then the closest newer ones (a run dir keeps `checkpoint.keep`
        steps, so they likely still have it); among equals an idle node before a busy one."""
        held = []
        for n in self.nodes.values():
            steps = [s for (j, _), s in n.holdings.items() if j == job_id]
            if steps and not n.lost:
                held.append((n.name, max(steps), bool(n.used)))
        if step is None:
            held.sort(key=lambda h: (-h[1], h[2], h[0]))
        else:
            held.sort(key=lambda h: (h[1] < step, h[1] - step, h[2], h[0]))
        return [(name, newest) for name, newest, _ in held]

    # -- nodes ---------------------------------------------------------------------------------

    def admit_name(self, now: float, name: str) -> tuple[str | None, list[Action]]:
        """Room for node `name` before it registers: (refusal or None, actions). A pool holds at
        most MAX_NODES nodes, lost ones included (they stay listed, with why): a new name past that
        makes the pool forget the node lost longest that holds nothing (no work, no checkpoint, no
        hold the user set), and is refused when none does. Without it, a peer registering names
        in a loop grew the pool without end: `dpctl nodes` could no longer be answered, and every
        node was told to heartbeat ever more slowly."""
        if name in self.nodes or len(self.nodes) < MAX_NODES:
            return None, []
        idle = [n for n in self.nodes.values() if n.lost and not n.used and not n.resumable and n.hold is None]
        if not idle:
            return f"the pool holds {MAX_NODES} nodes, its most, and none of them is lost and holds nothing; `dpctl nodes` lists them", []
        gone = min(idle, key=lambda n: n.last_seen)
        del self.nodes[gone.name]
        self.displaced.pop(gone.name, None)
        return None, [Record(None, "node.forgotten", now, {"node": gone.name, "lost_s": round(now - gone.last_seen, 1)}), NodeForgotten(gone.name)]

    def register(self, now: float, msg: m.NodeRegister, *, bound: bool = False) -> tuple[str | None, list[Action]]:
        """A daemon (re)joins. Returns (refusal message or None, actions).

        A new daemon process under the name of a live one is refused as a duplicate, unless
        `bound`: it holds that name's own key (CURVE, protocol/security.py), so it is that node's
        restarted dpd, and it replaces the old process at once (a refusal would be a restart loop
        under systemd or launchd)."""
        name, old = msg.name, self.nodes.get(msg.name)
        if name in self.displaced and self.displaced[name][0] == msg.incarnation:
            # The dpd a newer one with the same name-bound key replaced, still alive: two machines
            # hold this node's key. Let them take turns and every turn breaks the node's groups (a
            # job used up its restarts in two seconds); the older one is refused and exits instead.
            return (
                f"node name {name!r}: another dpd with this node's key replaced this one ({self.displaced[name][1]}); "
                f"two machines hold node {name}'s key: give each machine its own (`dpctl keys add-node NAME`, and its bundle)",
                [],
            )
        alive = old is not None and old.incarnation != msg.incarnation and not old.lost and now - old.last_seen < self.cadence.expiry_s(name)
        if alive and bound and old is not None and old.info.advertise != msg.info.advertise:
            # Its own key, but from another machine while the node's dpd lives: the key was copied
            # to two machines. The live one keeps the node (a restart on its machine keeps its
            # address and replaces it at once); this one is refused each time it asks.
            return (
                f"node name {name!r} is held by a live dpd with the same key at {old.info.advertise or '?'} (pid {old.info.pid or '?'}); "
                f"two machines hold node {name}'s key: give each machine its own (`dpctl keys add-node NAME`, and its bundle)",
                [],
            )
        if alive and bound and old is not None and now - old.last_seen < self.cadence.expiry_s(name) / REPLACE_SILENT_PARTS:
            # Its own key and this machine, but the node's dpd heartbeats still: a second dpd on
            # the machine, not a restart (a dpd restarted after a crash or a hang has been silent
            # for periods by the time its successor registers). Replacing it made the two take
            # turns under a service manager, each turn breaking the node's groups.
            return (
                Busy(
                    f"node name {name!r} is held by a live dpd with the same key on this machine (pid {old.info.pid or '?'}, "
                    f"last heard {now - old.last_seen:.1f}s ago); this dpd takes the node once that one falls silent "
                    "(one dpd per node: stop the other, or give this one its own key)"
                ),
                [],
            )
        if alive and not bound:
            assert old is not None
            return (
                f"node name {name!r} is already in the pool (dpd pid {old.info.pid or '?'} at {old.info.advertise or '?'}, "
                f"last heard {now - old.last_seen:.1f}s ago); give this daemon another --name",
                [],
            )
        actions: list[Action] = []
        rejoin = old is not None and old.incarnation == msg.incarnation
        if rejoin:
            assert old is not None
            node, returned = old, old.lost
            node.lost, node.last_seen, node.asked_at, node.info = False, now, None, msg.info
            if node.hold is None:
                node.reason = None
            if returned:
                actions += self._returned(now, node)
            actions += self._prepare_again(name)
        else:
            if old is not None and not old.lost:
                # A new daemon process under a known name: whatever the old one ran is gone.
                actions += self._node_gone(old, now, "replaced by a new dpd process")
                self.displaced[name] = (old.incarnation, f"dpd pid {msg.info.pid or '?'} at {msg.info.advertise or '?'}")
            actions += self.fitness.node_gone(name, now)  # a new dpd process: what it serves is asked afresh
            node = Node(name=name, incarnation=msg.incarnation, info=msg.info, joined_at=now, last_seen=now)
            # A hold outlives a dpd restart; a yield is the new dpd's to say (node.yield once registered).
            if old is not None and old.hold not in (None, Hold.YIELDING):
                node.hold, node.reason, node.drained_reported = old.hold, old.reason, True
            elif name in self.remembered and self.remembered[name][0] is not Hold.YIELDING:
                node.hold, node.reason = self.remembered[name]
                node.drained_reported = True
            self.nodes[name] = node
        for h in msg.holdings:
            node.add_holding(h.job, h.slot, h.step, h.memory)
        for e in msg.exited:
            refused = self.report_refused(name, "node.register exited", e.job, e.generation, e.rank)
            if refused is None and e.step is not None and (job := self.live.get(e.job)) is not None:
                actions += self._feed(job, js.Reached(e.generation, e.step), now)  # reported while the coordinator was away
            actions += [refused] if refused is not None else self._exited(now, node.name, e)
        if not rejoin:
            actions += self._ranks_gone_with_old_daemon(now, node, msg.running)
        for w in msg.running:
            actions += self._adopt(now, node, w)
        kind = "node.rejoined" if rejoin else "node.joined"
        self.cadence.registered(name, now)
        # What it keeps of jobs that ended while it was away (a lost node is sent no job.ended):
        # its state in memory (RAM, on Linux) and warm trainers are freed now, not after an idle while.
        ended = sorted({h.job for h in msg.holdings if h.memory and (j := self.jobs.get(h.job)) is not None and j.machine.terminal})
        welcome = [Send(name, m.JobEnded(job=job)) for job in ended]
        return None, [*actions, Record(None, kind, now, {"node": name, "slots": node.slots}), NodeChanged(name), *welcome]

    def _prepare_again(self, name: str) -> list[Action]:
        """The same dpd registered again (on a new connection: it gave up waiting on the old one): a
        group.prepare sent to the old connection may be lost with it, and the start would wait out
        its timeout. Each one it has not answered is sent again (a second prepare only replaces
        the first one's ports)."""
        out: list[Action] = []
        for job in self.live.values():
            pend = job.pending
            if pend is not None and name in pend.nodes and name not in pend.answered:
                out.append(Send(name, GroupPrepare(job=job.id, generation=pend.generation, slots=[s.index for s in pend.nodes[name]])))
        return out

    def _returned(self, now: float, node: Node) -> list[Action]:
        """A node declared lost is back under the same dpd process: it was alive. What its missing
        heartbeats were blamed for is taken back, and each job whose restart it caused gets the
        restart back (`NodeBack`)."""
        node.fail_streak, node.lost_blames = max(0, node.fail_streak - node.lost_blames), 0
        actions: list[Action] = []
        if node.hold is Hold.SET_ASIDE and node.fail_streak < SET_ASIDE_AFTER:
            # Set aside for failures that were not its own: it takes work again.
            node.hold, node.reason = None, None
            actions += [Record(None, "node.undrained", now, {"node": node.name, "was": "set aside for missed heartbeats"}), NodeChanged(node.name)]
        for job in list(self.live.values()):
            actions += self._feed(job, js.NodeBack(node.name), now)
        return actions

    def _ranks_gone_with_old_daemon(self, now: float, node: Node, running: list[RunningWorker]) -> list[Action]:
        """A new dpd process under this name: ranks the plan put here that it does not run died
        with the old process (its trainers die with it: PR_SET_PDEATHSIG). A restarted coordinator
        knows them only from its plans, so this is how it learns."""
        reported = {(w.job, w.generation, w.rank) for w in running}
        actions: list[Action] = []
        for job in list(self.live.values()):
            if job.plan is None:
                continue
            gone = tuple(
                r for r, _ in job.plan.ranks_on(node.name)
                if r in job.machine.live and (job.id, job.plan.generation, r) not in reported
            )
            if gone:
                actions += self._feed(job, js.NodeLost(node.name, gone), now)
        return actions

    def _adopt(self, now: float, node: Node, w: RunningWorker) -> list[Action]:
        """A worker a (re)registering node runs: keep it if it belongs to a live group, else stop it."""
        job = self.live.get(w.job)
        gen, rank, slot = w.generation, w.rank, w.slot
        plan = job.plan if job else None
        if (
            job is not None and plan is not None and job.state in (JobState.STARTING, JobState.RUNNING)
            and gen == plan.generation and rank < plan.world_size and plan.ranks[rank] == Slot(node.name, slot)
        ):
            node.used[slot] = (job.id, gen)
            run = job.ranks.setdefault(rank, RankRun(node.name, slot))
            run.pid = w.pid or run.pid
            return []
        # An orphan: its job ended, is being stopped, moved on to another generation, or is
        # unknown here.
        node.used[slot] = (w.job, gen)  # busy until it is gone
        return [Send(node.name, GroupStop(job=w.job, generation=gen))]

    def seen(self, now: float, name: str) -> Node | None:
        """Any message from a registered node is a heartbeat (Paranoid Pirate)."""
        node = self.nodes.get(name)
        if node is not None and not node.lost:
            node.last_seen, node.asked_at = now, None
        return node

    def report_refused(self, name: str, kind: str, job_id: str, generation: int, rank: int | None, *, stored: bool = False) -> Refused | None:
        """Whether node `name` may not report about `rank` of generation `generation` of a job: only
        the node the plan gave that rank may. Rank None: the job's rows (metrics, samples), which
        rank 0 sends. A report about a job or a generation the pool does not know changes nothing
        here, and is not refused, unless it is `stored` whatever its generation (rows): then the
        pool must know who ran that generation (the current one, or one of the PLACED_KEPT before)."""
        job = self.jobs.get(job_id)
        if job is None:
            return None  # not in memory: ignored wherever it goes
        r = 0 if rank is None else rank
        plan = job.plan
        if plan is not None and plan.generation == generation:
            world, owner = plan.world_size, plan.ranks[r].node if r < plan.world_size else None
        elif (placed := job.placed.get(generation)) is not None:
            world, owner = len(placed), placed[r] if r < len(placed) else None
        elif stored:
            return Refused(name, kind, f"job {job_id} generation {generation}: not a generation this coordinator placed, or one it no longer remembers")
        else:
            return None
        if owner == name:
            return None
        where = f"runs on node {owner}" if owner is not None else f"does not exist (world size {world})"
        return Refused(name, kind, f"rank {r} of job {job_id} generation {generation} {where}")

    def from_node(self, now: float, name: str, msg: NodeMessage) -> list[Action]:
        """A registered node's report (it counts as a heartbeat too). One about a rank the plan gave
        another node is `Refused`."""
        node = self.seen(now, name)
        if node is None:
            return []
        refused = None
        if isinstance(msg, RANK_REPORTS):
            refused = self.report_refused(name, msg.TYPE.value, msg.job, msg.generation, msg.rank)
        elif isinstance(msg, m.NodeMetric):
            refused = self.report_refused(name, msg.TYPE.value, msg.job, msg.generation, None, stored=True)
        if refused is not None:
            return [refused]
        match msg:
            case m.NodeHeartbeat():
                return self._heartbeat(now, node, msg)
            case m.NodePrepared():
                return self._prepared(now, node, msg)
            case m.NodeWorkerStarted() | m.NodeWorkerHello():
                return self._worker_up(now, msg)
            case m.NodeProgress():
                return self._progress(now, msg)
            case m.NodeWaiting(job=job_id, generation=gen, rank=rank, step=step):
                job = self.live.get(job_id)
                if job is not None and job.plan is not None and job.plan.generation == gen and (run := job.ranks.get(rank)) is not None:
                    run.waiting = max(step, run.waiting or 0)
                return []
            case m.NodeMetric():
                return self._metric(now, msg)
            case m.NodeCheckpoint():
                return self._checkpoint(now, node, msg)
            case m.NodeWorkerExited():
                return self._exited(now, name, msg)
            case m.NodeWarmed():
                return self._warmed(now, node, msg)
            case NodeLink():
                job = self.live.get(msg.job)
                return list(self.links.observe(now, job, msg)) if job is not None else []
            case NodeStaged():
                job = self.live.get(msg.job)
                out: list[Action] = []
                for a in self.fitness.staged(now, node.name, msg, job.spec if job else None, job.doc if job else None):
                    out += self._found(now, a) if isinstance(a, Found) else [a]
                return out
            case NodeYield():
                return self.owner_yield(now, node, msg.reason)
        return []

    def _found(self, now: float, f: Found) -> list[Action]:
        """QUEUED, never started: the job names the content a node found at its paths, so every
        node checks against it, and the nodes that lack the files fetch them. Once a group has
        run, the job's training hash (its checkpoints) stays as it was: nothing changes."""
        job = self.live.get(f.job)
        if job is None or job.state is not JobState.QUEUED or job.machine.generation or job.pending is not None:
            return []
        content = dataclasses.replace(job.spec.content, data=f.data or job.spec.content.data, model=f.model or job.spec.content.model)
        job.spec = dataclasses.replace(job.spec, content=content)
        job._doc = None
        self.fitness.track(job.id, job.spec, job.doc)
        self.fitness.ask_again(job.id)
        fields = {"node": f.node, **({"data": f.data} if f.data else {}), **({"model": f.model} if f.model else {})}
        return [Record(job.id, "job.content", now, fields), JobChanged(job.id)]

    def staging_rows(self, job_id: str, now: float) -> list[StageRow]:
        return self.fitness.rows(job_id, now)

    def comm_fields(self, job: Job) -> dict[str, Any]:
        """`status JOB --json`'s "comm_share" and "comm" (daemon/links.py)."""
        share, comm = self.links.share(job)
        return {"comm_share": None if share is None else round(share, 4), "comm": comm}

    def _warmed(self, now: float, node: Node, msg: m.NodeWarmed) -> list[Action]:
        """Warm trainers are ready on a node a growing job waits for (or, `error`, none will be:
        the growth need not wait for them). The growth itself comes with the next admission."""
        job = self.live.get(msg.job)
        if job is None or job.warming is None:
            return []
        done = {(node.name, s) for s in msg.slots} if msg.error is None else {k for k in job.warming.waiting if k[0] == node.name}
        job.warming.waiting -= done
        fields = {"node": node.name, "slots": sorted(s for _, s in done)} | ({"error": msg.error} if msg.error else {})
        return [Record(job.id, "group.warmed", now, fields)]

    def _heartbeat(self, now: float, node: Node, msg: m.NodeHeartbeat) -> list[Action]:
        """Free slots whose job is no longer using them and whose worker the node no longer has."""
        if node.lost:
            return []
        if msg.heartbeat_s is not None:
            self.cadence.acknowledged(node.name, msg.heartbeat_s)
        alive = {(w.job, w.generation, w.slot) for w in msg.workers}
        freed = False
        for slot, (job_id, gen) in list(node.used.items()):
            if (job_id, gen, slot) in alive:
                continue
            job = self.live.get(job_id)
            current = job is not None and (
                (job.plan is not None and job.plan.generation == gen and job.machine.live)
                or (job.pending is not None and job.pending.generation == gen)
            )
            if not current:
                del node.used[slot]
                freed = True
        return self._drained(now, node) if freed else []

    def bye(self, now: float, name: str) -> list[Action]:
        node = self.nodes.get(name)
        if node is None or node.lost:
            return []
        return self._node_gone(node, now, "dpd stopped")

    def _node_gone(self, node: Node, now: float, reason: str) -> list[Action]:
        node.lost = True
        self.cadence.forget(node.name)
        actions_: list[Action] = list(self.fitness.node_gone(node.name, now))
        if node.hold is None:
            node.reason = reason
        actions: list[Action] = [*actions_, Record(None, "node.lost", now, {"node": node.name, "reason": reason}), NodeChanged(node.name)]
        for job in list(self.live.values()):
            if job.pending is not None and node.name in job.pending.nodes:
                actions += self._abort_start(job, now, f"node {node.name} lost while preparing: {reason}")
            elif job.plan is not None:
                ranks = tuple(r for r, _ in job.plan.ranks_on(node.name) if r in job.machine.live)
                actions += self._feed(job, js.NodeLost(node.name, ranks), now)
        node.used.clear()
        return actions

    # -- drain ---------------------------------------------------------------------------------

    def drain(self, now: float, name: str) -> list[Action]:
        """`dpctl drain NODE`: its groups checkpoint and restart elsewhere; it takes no new work."""
        node = self.nodes[name]
        if node.hold is not None and node.hold is not Hold.YIELDING:
            return []
        yielding = node.hold is Hold.YIELDING  # its work is leaving already; the user's drain outlasts the yield
        node.hold, node.reason, node.drained_reported = Hold.DRAINED, "drained", False
        actions: list[Action] = [Record(None, "node.draining", now, {"node": name}), NodeChanged(name)]
        if not yielding:
            actions += self._move_off(now, name, f"node {name} is being drained")
        return actions + self._drained(now, node)

    def _move_off(self, now: float, name: str, why: str) -> list[Action]:
        actions: list[Action] = []
        for job in list(self.live.values()):
            if job.pending is not None and name in job.pending.nodes:
                # Being prepared there: start again elsewhere (nothing ran yet).
                actions += self._abort_start(job, now, why)
            elif job.plan is not None and job.machine.live and job.plan.ranks_on(name):
                if job.resize is None:  # its next group's size, smaller or not, says what the move cost
                    job.resize = sched.Note(sched.How.SHRINK, job.plan.world_size, (), now, cause=why)
                actions += self._reshape(job, now, why)
        return actions

    def undrain(self, now: float, name: str) -> list[Action]:
        """`dpctl undrain NODE`: take work again (also what lifts a node set aside)."""
        node = self.nodes[name]
        was = node.reason if node.hold is not None else None
        node.hold, node.fail_streak, node.lost_blames, node.reason, node.drained_reported = None, 0, 0, None, False
        if node.yielding is not None:
            node.hold, node.reason = Hold.YIELDING, node.yielding  # its owner still needs it: it yields on
        self.remembered.pop(name, None)
        return [Record(None, "node.undrained", now, {"node": name, "was": was}), NodeChanged(name)]

    def owner_yield(self, now: float, node: Node, why: str | None) -> list[Action]:
        """node.yield (`dpd run --yield-when`): its owner needs the machine for `why`, so its work
        moves off as a drain's does and it takes none; `why` None: it takes work again. A drain or
        a set-aside outlasts the yield."""
        was, node.yielding = node.yielding, why
        if why is not None and node.hold is None:
            node.hold, node.reason = Hold.YIELDING, why
            actions: list[Action] = [Record(None, "node.yielding", now, {"node": node.name, "reason": why}), NodeChanged(node.name)]
            return actions + self._move_off(now, node.name, f"node {node.name} yields to its owner ({why})")
        if node.hold is not Hold.YIELDING or why == node.reason:
            return []
        if why is not None:
            node.reason = why  # yielding still, now for this
            return [NodeChanged(node.name)]
        node.hold, node.reason = None, None
        return [Record(None, "node.returned", now, {"node": node.name, "reason": was}), NodeChanged(node.name)]

    def _drained(self, now: float, node: Node) -> list[Action]:
        if node.hold is Hold.DRAINED and not node.used and not node.drained_reported:
            node.drained_reported = True
            return [Record(None, "node.drained", now, {"node": node.name}), NodeChanged(node.name)]
        return []

    def _reshape(self, job: Job, now: float, reason: str) -> list[Action]:
        watch = job.watch
        stop_by = now + (watch.allowance() if watch else job.spec.recovery.start_timeout_s) + 10.0
        if watch is not None:
            watch.stopping = True
        return self._feed(job, js.Reshape(reason, stop_by), now)

    def _blame(self, now: float, name: str) -> list[Action]:
        node = self.nodes.get(name)
        if node is None:
            return []
        node.fail_streak += 1
        if node.fail_streak < SET_ASIDE_AFTER or node.hold is not None:
            return []
        # A node whose workers keep failing takes no more work until `dpctl undrain` (a broken
        # GPU, a full disk, a bad Python): restarting there would spend the job's budget.
        node.hold, node.drained_reported = Hold.SET_ASIDE, True
        node.reason = f"set aside: its workers failed {node.fail_streak} times in a row; `dpctl undrain {name}` when fixed"
        return [Record(None, "node.set_aside", now, {"node": name, "failures": node.fail_streak}), NodeChanged(name)]

    # -- jobs ----------------------------------------------------------------------------------

    def submit(self, now: float, job_id: str, spec: JobSpec) -> list[Action]:
        job = Job(id=job_id, name=spec.name, spec=spec, submitted_at=self.wall(now), machine=JobMachine(max_restarts=spec.recovery.max_restarts))
        self.jobs[job_id] = self.live[job_id] = job
        self.fitness.track(job_id, spec, job.doc)
        w = spec.workers
        return [Record(job_id, "job.submitted", now, {"workers_min": w.min, "workers_max": w.max}), JobChanged(job_id)]

    def set_priority(self, now: float, job: Job, priority: int) -> list[Action]:
        """`dpctl priority JOB N` (daemon/sharing.py): the scheduler's next round acts on it."""
        was = job.spec.priority
        if priority == was:
            return []  # nothing changed: no event, no new round
        job.spec, job._doc = dataclasses.replace(job.spec, priority=priority), None
        return [Record(job.id, "job.priority", now, {"priority": priority, "previous": was}), JobChanged(job.id)]

    def cancel(self, now: float, job: Job) -> list[Action]:
        return self._feed(job, js.CancelRequested(), now)

    def remove(self, job_id: str) -> None:
        """A finished job removed (`dpctl rm`): forgotten, and so are the checkpoints nodes held
        of it (they are being deleted). Its late reports then change nothing, as a forgotten job's."""
        assert job_id not in self.live, f"{job_id} has not finished"
        self.links.forget(job_id)
        if self.jobs.pop(job_id, None) is None:
            self.forgotten = max(0, self.forgotten - 1)  # it was in the store only
        elif job_id in self._finished:
            self._finished.remove(job_id)
        for node in self.nodes.values():
            for key in [k for k in node.holdings if k[0] == job_id]:
                del node.holdings[key]
            for key in [k for k in node.resumable if k[0] == job_id]:
                del node.resumable[key]

    def _prepared(self, now: float, node: Node, msg: m.NodePrepared) -> list[Action]:
        job = self.live.get(msg.job)
        pend = job.pending if job else None
        if job is None or pend is None or pend.generation != msg.generation or node.name in pend.answered:
            return []  # a late answer to a start that was already aborted or completed
        if node.name not in pend.nodes:
            return [Refused(node.name, msg.TYPE.value, f"job {job.id} generation {msg.generation} is being prepared on {', '.join(pend.nodes)}, not on node {node.name}")]
        mine = pend.nodes[node.name]
        if msg.error or len(msg.ports) != len(mine):
            return self._abort_start(job, now, f"node {node.name} could not prepare: {msg.error or 'wrong number of ports'}")
        pend.answered.add(node.name)
        for slot, port in zip(mine, msg.ports, strict=True):
            pend.endpoints[slot] = f"{msg.host}:{port}"
        if len(pend.answered) < len(pend.nodes):
            return []
        return self._launch(job, now)

    def _launch(self, job: Job, now: float) -> list[Action]:
        pend = job.pending
        assert pend is not None
        spec = job.spec
        # Proportional to what the last generation measured per node, when it measured them all.
        shares = speed_shares(spec.train.global_batch, [job.speeds.get(s.node) for s in pend.slots])
        if spec.sync.mode == "diloco":  # work moves in whole replicas: each rank's share is its replicas' sequences
            shares = replica_shares(shares, spec.sync.replicas, spec.train.global_batch)
        hostfile = ring_hostfile(pend.slots, pend.endpoints)
        plan = GroupPlan(
            job=job.id,
            generation=pend.generation,
            ranks=tuple(pend.slots),
            shares=tuple(shares),
            hostfile=tuple(tuple(h) for h in hostfile),
        )
        previous = job.plan
        previous_shares = job.shares or (previous.shares if previous else None)
        job.plan, job.pending, job.shares = plan, None, None
        job.placed[plan.generation] = tuple(s.node for s in plan.ranks)
        while len(job.placed) > PLACED_KEPT:
            del job.placed[min(job.placed)]
        job.ranks = {r: RankRun(s.node, s.index) for r, s in enumerate(plan.ranks)}
        job.watch = StepWatch.start(spec, now, job.watch)
        deadline = now + spec.recovery.start_timeout_s
        # Saved (and committed by the coordinator) before any group.start leaves: a restarted
        # coordinator knows this generation was launched and never launches its number again.
        actions = [*self._feed(job, js.GroupLaunched(plan.generation, deadline, tuple(s.node for s in plan.ranks)), now), JobChanged(job.id)]
        doc = job.doc  # one job file, split and hostfile for every node's group.start: packed once
        resume_max = job.resume_max()
        for node in plan.nodes():
            ranks = [RankSlot(slot=s.index, rank=r) for r, s in plan.ranks_on(node)]
            actions.append(Send(node, GroupStart(job=job.id, generation=plan.generation, spec=doc, ranks=ranks, shares=shares, hostfile=hostfile, resume_max=resume_max)))
        actions.append(
            # nodes: each once; ranks: the node of each rank, in rank order, as shares are
            Record(job.id, "group.starting", now, {"generation": plan.generation, "world_size": plan.world_size, "nodes": plan.nodes(),
                                                   "ranks": [s.node for s in plan.ranks], "shares": list(shares)})
        )
        if previous_shares is not None and previous_shares != plan.shares:
            actions.append(Record(job.id, "rebalanced", now, {"generation": plan.generation, "shares": list(shares), "previous": list(previous_shares), "cause": "membership"}))
        return actions

    def _abort_start(self, job: Job, now: float, reason: str) -> list[Action]:
        if job.pending is None:
            return []
        return self._release_pending(job) + self._feed(job, js.StartAborted(reason), now)

    def _worker_up(self, now: float, msg: m.NodeWorkerStarted | m.NodeWorkerHello) -> list[Action]:
        job = self.live.get(msg.job)
        run = self._run(job, msg.generation, msg.rank)
        if job is None or run is None:
            return []
        run.pid = msg.pid
        if isinstance(msg, m.NodeWorkerStarted):
            return []
        if msg.rank == 0:
            job.step = msg.resume_step  # where this generation starts
        return self._feed(job, js.RankUp(msg.generation, msg.rank, msg.resume_step if msg.rank == 0 else None), now)

    def _progress(self, now: float, msg: m.NodeProgress) -> list[Action]:
        """One rank finished one step (the hot path: one call per rank per step)."""
        job = self.live.get(msg.job)
        run = self._run(job, msg.generation, msg.rank)
        if job is None or run is None:
            return []
        step, seconds = msg.step, msg.seconds
        run.step = step
        if seconds > 0:
            rate = min(msg.tokens / seconds, TOKENS_PER_S_MAX)  # 2^53-1 tokens in 5e-324 s is inf
            run.tokens_per_s = rate if run.tokens_per_s == 0 else 0.8 * run.tokens_per_s + 0.2 * rate
        if msg.rank == 0:
            job.step = step
        if job.watch is not None:
            # diloco: ranks step apart between outer steps; the group moves as its slowest rank.
            live = job.machine.live
            seen = min(job.ranks[r].step for r in live if r in job.ranks) if job.spec.sync.mode == "diloco" and live else step
            if msg.gather:
                job.watch.gathers(step)  # rank 0's word, whichever rank is the slowest
            job.watch.observe(seen, now, seconds, resplit=msg.resplit)
        actions: list[Action] = []
        if msg.rank == 0:
            actions += self.links.step(now, job, msg.generation, step, seconds)  # rank 0's step: the group's
        if job.machine.forming:
            # A step done means the rank is up, even if its hello was lost.
            actions += self._feed(job, js.RankUp(msg.generation, msg.rank), now)
        if step > job.machine.step or job.machine.interrupted_at is not None:
            actions += self._feed(job, js.StepDone(msg.generation, step), now)
        return actions

    def _metric(self, now: float, msg: m.NodeMetric) -> list[Action]:
        job, generation, row = self.jobs.get(msg.job), msg.generation, msg.row
        if job is None or (job.plan is not None and generation < job.plan.generation):
            return []
        actions: list[Action] = []
        job.logged[row.kind] = max(row.step, job.logged.get(row.kind, 0))
        if isinstance(row, TrainRow):
            if row.loss is not None:
                job.loss = row.loss
            if job.plan is not None and generation == job.plan.generation:
                actions += self._measured(job, row, now)
                if row.all_sum_s is not None and row.outer_step is None and row.tokens_per_s > 0:  # a sync step's
                    comm = timed_comm(row.all_sum_s, row.tokens, row.shares, row.rank_tokens_per_s)
                    self.links.timed(job, generation, row.tokens / row.tokens_per_s, comm)
        elif isinstance(row, TestLossRow):
            if row.test_loss is not None:
                job.test_loss = row.test_loss
        elif row.val_loss is not None:
            job.val_loss = row.val_loss
        return actions

    def _measured(self, job: Job, row: TrainRow, now: float) -> list[Action]:
        """Rank 0's row carries each rank's speed and the split in force: keep the speeds for the
        next plan, and record a change of split the trainer made on its own."""
        plan = job.plan
        assert plan is not None
        speeds, shares = row.rank_tokens_per_s, row.shares
        if speeds is not None and len(speeds) == plan.world_size:
            for slot, v in zip(plan.ranks, speeds, strict=True):
                if v > 0:
                    # Smoothed: one step's timing on a busy machine is noise, not a speed.
                    old = job.speeds.get(slot.node)
                    job.speeds[slot.node] = float(v) if old is None else 0.9 * old + 0.1 * float(v)
        if shares is None or len(shares) != plan.world_size:
            return []
        current = job.shares or plan.shares
        if tuple(shares) == tuple(current):
            return []
        job.shares = tuple(shares)
        fields = {"generation": plan.generation, "step": row.step, "shares": shares, "previous": list(current), "cause": "speed"}
        return [Record(job.id, "rebalanced", now, fields), JobChanged(job.id)]

    def _checkpoint(self, now: float, node: Node, msg: m.NodeCheckpoint) -> list[Action]:
        node.add_holding(msg.job, msg.slot, msg.step, msg.memory)
        job = self.jobs.get(msg.job)  # also finished: a rank's last report may come after its exit
        if msg.memory or job is None or job.plan is None or job.plan.generation != msg.generation:
            return []
        got = job.saved.setdefault(msg.step, {})
        got[msg.rank] = msg.seconds
        if len(got) < job.plan.world_size:
            return []
        # Every rank holds step `step`: the group can resume from it on any of its nodes.
        del job.saved[msg.step]
        job.checkpoint_step = max(msg.step, job.checkpoint_step or 0)
        return [Record(job.id, "checkpoint.saved", now, {"step": msg.step, "seconds": round(max(got.values()), 4)}), JobChanged(job.id)]

    def _exited(self, now: float, node_name: str, e: m.NodeWorkerExited | ExitedWorker) -> list[Action]:
        actions: list[Action] = []
        node = self.nodes.get(node_name)
        if node is not None and node.used.get(e.slot) == (e.job, e.generation):
            del node.used[e.slot]
        job = self.live.get(e.job)
        run = self._run(job, e.generation, e.rank)
        if job is not None and run is not None and run.exit_code is None:
            run.exit_code = e.code
            if node is not None and e.code in (0, js.EXIT_STOPPED):
                node.fail_streak = node.lost_blames = 0  # a worker that ended well: the node is fine
            actions += self._feed(job, js.RankExited(e.generation, e.rank, node_name, e.code, e.stopped, e.error), now)
        if node is not None:
            actions += self._drained(now, node)
        return actions

    @staticmethod
    def _run(job: Job | None, generation: int, rank: int) -> RankRun | None:
        if job is None or job.plan is None or job.plan.generation != generation:
            return None
        return job.ranks.get(rank)

    # -- time ----------------------------------------------------------------------------------

    def tick(self, now: float, read_to: float | None = None) -> list[Action]:
        """Timers. `read_to`: the coordinator has read everything that reached it before then (default
        now): a node's silence is judged up to that moment, so that messages waiting in the
        coordinator's own input (2,000 answers to a stop) are not taken for silence."""
        actions: list[Action] = []
        heard = now if read_to is None else min(now, read_to)
        for node in self.nodes.values():
            if not node.lost and heard - node.last_seen > self.cadence.expiry_s(node.name):
                actions += self._node_gone(node, now, f"no heartbeat for {heard - node.last_seen:.1f}s")
            elif not node.lost and node.asked_at is not None and heard - node.asked_at >= self.cadence.answer_s(node.name):
                actions += self._node_gone(node, now, f"no answer for {heard - node.asked_at:.1f}s to the stop of its failed group")
        for job in list(self.live.values()):
            if job.pending is not None and now >= job.pending.deadline:
                missing = sorted(set(job.pending.nodes) - job.pending.answered)
                actions += self._abort_start(job, now, f"no answer to group.prepare from {', '.join(missing)}")
            if job.reconcile_by is not None and now >= job.reconcile_by:
                actions += self._reconcile(job, now)
            if (w := job.warming) is not None and w.waiting and now >= w.deadline:
                # A growth waits no longer for warm trainers than a cold start may take: the slots
                # not answered for are given up on, said, and started cold.
                for name in sorted({n for n, _ in w.waiting}):
                    fields = {"node": name, "slots": sorted(i for n, i in w.waiting if n == name), "error": f"no node.warmed within {job.spec.recovery.start_timeout_s:g} s"}
                    actions.append(Record(job.id, "group.warmed", now, fields))
                w.waiting.clear()
            if job.id in self.live:
                actions += self._feed(job, js.Tick(), now)
            if job.id in self.live:
                actions += self._check_progress(job, heard)
        return actions

    def _check_progress(self, job: Job, now: float) -> list[Action]:
        """RUNNING (or checkpointing on request): a step must complete before the watch's deadline
        (`now`: up to when the coordinator has heard what was sent, as for heartbeats)."""
        watch, plan, jm = job.watch, job.plan, job.machine
        if watch is None or plan is None or not jm.live or job.reconcile_by is not None:
            return []
        if not (job.state is JobState.RUNNING or jm.checkpointing):
            return []
        deadline = watch.deadline()
        if now < deadline:
            return []
        # Name the rank(s) that reported least recently: a frozen rank's last report may never
        # have left it, while its peers reported the step before they blocked. Its node is blamed
        # (counted towards setting it aside) only when that tells it apart: nodes whose ranks
        # reported a later step, or a group on one node. A rank that froze inside a step leaves
        # every rank at the same step (blaming the first of them set healthy nodes aside in
        # turn): then its peers' node.waiting tell it, the ranks that never said they wait on the
        # others for the next step, when those are all on one node.
        live = sorted(jm.live)
        low = min(job.ranks[r].step for r in live)
        ranks = tuple((r, plan.ranks[r].node) for r in live if job.ranks[r].step == low)
        nodes = {plan.ranks[r].node for r in live}
        late = {n for _, n in ranks}
        blame = (ranks[0][1],) if late < nodes or len(nodes) == 1 else ()
        if not blame and len(ranks) == len(live):
            stuck = tuple((r, n) for r, n in ranks if (job.ranks[r].waiting or 0) <= low)
            if stuck and len(stuck) < len(ranks) and len({n for _, n in stuck}) == 1:
                ranks, blame = stuck, (stuck[0][1],)
        waited = now - (watch.last_at if watch.last_step is not None else watch.started_at)
        detail = f"no step after step {watch.last_step or 0} for {waited:.1f}s (deadline {watch.allowance():.1f}s)"
        return self._feed(job, js.Stalled(ranks, detail, blame), now)

    # -- admission -----------------------------------------------------------------------------

    def schedule(self, now: float) -> list[Action]:
        """Admit waiting jobs and resize running ones as the scheduler decides (daemon/scheduler.py:
        priorities, fair shares, backfill, preemption by shrinking).

        Run once per batch of messages and per tick (not per message). Waiting means queued, or
        recovering with the old group stopped. A job no live node can serve fails; one whose files
        the nodes are still checking (its first group) waits for them outside the plan. Every resize
        is a planned restart (`_reshape`: checkpoint at the next step and exit, so 0 steps are
        recomputed), and a stopped job whose target is 0 goes back to the queue with its checkpoint.
        """
        actions: list[Action] = self._ask_fitness(now) + self._off_leaving(now)
        if not self.live:  # nothing to admit or resize: a thousand registrations cost no pass over the nodes
            self.decision = None
            return actions
        c = admission.census(self.nodes.values())
        usable = c.usable
        names = [n.name for n in usable] if any(j.state is not JobState.RUNNING for j in self.live.values()) else []
        views = []
        for job in list(self.live.values()):
            waiting = job.state is JobState.QUEUED or (job.pending is None and job.machine.ready_to_restart(now))
            if waiting and (hopeless := self.fitness.hopeless(job.id, names)) is not None:
                actions += self._feed(job, js.Unservable(hopeless), now)
                continue
            if waiting and job.machine.generation == 0 and self.fitness.checking(job.id, names, now):
                job.waiting = "the nodes still checking its files"
                continue  # its first group waits (briefly) for them
            # Only a job that names files, or that a node said it cannot serve, is bounded by the nodes that can.
            fit = self.fitness.eligible
            capacity = sum(n.slots for n in usable if fit(job.id, job.spec, n.name)) if needs_files(job.spec) or self.fitness.fits.get(job.id) else None
            views.append(admission.job_view(job, waiting, c.held[job.id], capacity))
        d = self.decision = sched.plan(now, c.total, c.free, views, self.policy)
        kept = admission.kept_for_resumes(self.live.values(), usable) if d.starts or d.resizes else {}
        for start in d.starts:
            job = self.live[start.job]
            free = admission.free_slots(job, self.nodes.values(), self.fitness.eligible, kept)
            if (held_by := admission.holders_busy(job, free, usable, now)) is not None:
                job.waiting = f"a free slot on a node holding its newest checkpoint ({held_by}), for at most {admission.HOLDER_WAIT_S:g} s"
                continue
            chosen = choose_slots(free, job.spec.workers.min, start.slots)
            if chosen is not None:
                given = admission.donor(job, chosen, self.nodes, self.fitness.eligible)
                if given is not None:
                    self.nodes[given.node].drained_reported = False  # node.drained again once this rank leaves
                actions += self._admit(job, [*chosen, given] if given else chosen, now)
        for job_id, why in d.waits.items():
            job = self.live[job_id]
            job.waiting = why
            if d.targets[job_id] == 0 and job.state is JobState.RECOVERING:
                # RECOVERING -> QUEUED: stopped, and the slots it could run on go to jobs ahead of it.
                note, job.resize = job.resize, None
                if note is not None:  # a stop the pool asked for (a preemption, or a node that left below its minimum)
                    actions.append(Record(job.id, "job.preempted", now, sched.preempted_event(note, now, job.step, job.checkpoint_step, why)))
                actions += self._feed(job, js.Requeue(why), now)
        claimed: set[tuple[str, int]] = set()  # slots growths warm this round: one job each
        growing = {r.job for r in d.resizes if r.how is sched.How.GROW}
        for job in self.live.values():
            if job.id not in growing:
                job.warming = None  # a later growth asks again
        for r in d.resizes:
            actions += self._resize(self.live[r.job], r, now, claimed, kept)
        return actions

    def _off_leaving(self, now: float) -> list[Action]:
        """A running group with a rank on a leaving node (one started there for its newest
        checkpoint: admission.donor; or found so by a coordinator that restarted), or with more
        ranks than `workers.max` (that node undrained meanwhile), once it has made a step (every
        rank holds that state): it checkpoints at the next step and restarts without it, as a
        drain moves it (nothing recomputed)."""
        actions: list[Action] = []
        for job in self.live.values():
            watch, plan = job.watch, job.plan
            if job.state is not JobState.RUNNING or watch is None or watch.last_step is None or watch.stopping or plan is None:
                continue
            off = self._on_leaving(job)
            if off or plan.world_size > job.spec.workers.max:
                why = f"node {off} is leaving; it gave the group its newest checkpoint" if off else f"{plan.world_size} workers, above workers.max"
                actions += self._reshape(job, now, why)
        return actions

    def _on_leaving(self, job: Job) -> str | None:
        """The leaving node one of the job's ranks runs on, if any."""
        plan = job.plan
        return next((s.node for s in plan.ranks if s.node in self.nodes and admission.leaving(self.nodes[s.node])), None) if plan else None

    def _resize(self, job: Job, r: sched.Resize, now: float, claimed: set[tuple[str, int]], kept: dict[tuple[str, int], str]) -> list[Action]:
        """Stop a running group at its next step to restart it on `r.to` slots (0: requeue it).
        A growth first warms trainers on the slots it adds (job.warm) while the group trains on,
        the slots `kept` for another job's resume last."""
        plan = job.plan
        assert plan is not None
        actions: list[Action] = []
        if r.how is sched.How.GROW:
            own = {(s.node, s.index) for s in plan.ranks} | claimed
            fit = self.fitness.eligible
            free = [(name, i) for name, n in self.nodes.items() if fit(job.id, job.spec, name) for i in n.free() if (name, i) not in own]
            new = sorted(free, key=lambda s: (kept.get(s, job.id) != job.id, s))
            new = new[: r.to - plan.world_size]
            if not new:
                return []  # only this job's own slots are free (its ranks are exiting)
            claimed |= set(new)
            warm = admission.warm(job, set(new), now)
            if warm is not None:
                return warm
            fields = {"generation": job.machine.generation, "world_size": plan.world_size, "free_slots": len(new), "to": r.to}
            actions.append(Record(job.id, "group.growing", now, fields))
            reason = f"growing from {plan.world_size} to {r.to} workers"
        elif r.how is sched.How.SHRINK:
            reason = f"shrinking from {plan.world_size} to {r.to} workers for {', '.join(r.by)}"
        else:
            reason = f"preempted by {', '.join(r.by)}: back to the queue with its checkpoint"
        job.resize, job.resized_at = sched.Note(r.how, plan.world_size, r.by, now), now
        return actions + self._reshape(job, now, reason)

    def _ask_fitness(self, now: float) -> list[Action]:
        """job.stage to the usable nodes that have not said whether they can serve each live job
        that names files (daemon/fitness.py; only what is due is sent)."""
        usable = [n.name for n in self.nodes.values() if not n.lost and n.hold is None]
        self.fitness.busy = {n.name for n in self.nodes.values() if n.used and not n.lost}
        actions: list[Action] = []
        for job in self.live.values():
            if not job.machine.terminal:
                actions += self.fitness.ask(now, job.id, job.spec, job.doc, usable)
        return actions

    def _admit(self, job: Job, chosen: list[Slot], now: float) -> list[Action]:
        generation = job.machine.generation + 1
        job.waiting, job.resized_at = None, now
        job.pending = Pending(generation=generation, slots=chosen, deadline=now + self.prepare_timeout_s)
        for s in chosen:
            self.nodes[s.node].used[s.index] = (job.id, generation)
        actions = self._feed(job, js.Admitted(len(chosen)), now)
        for node, slots in job.pending.nodes.items():
            actions.append(Send(node, GroupPrepare(job=job.id, generation=generation, slots=[s.index for s in slots])))
        return actions

    # -- the job machine -----------------------------------------------------------------------

    def _feed(self, job: Job, event: js.Event, now: float) -> list[Action]:
        before = job.state
        out: list[Action] = []
        for action in job.machine.handle(event, now, self.wall(now)):
            if isinstance(action, js.StopGroup):
                out += self._stop(job, action, now)
            elif isinstance(action, js.Unfit):
                out += self.fitness.unfit(now, job.id, action.node, action.reason)
            elif isinstance(action, js.Blame):
                out += self._blame(now, action.node)
                lost = self.nodes.get(action.node)
                if isinstance(event, js.NodeLost) and lost is not None:
                    lost.lost_blames += 1
            else:
                out.append(Record(job.id, action.kind, now, action.fields))
                if action.kind == "group.resumed" and job.resize is not None and self._on_leaving(job) is None:
                    # The first step after a resize: its cost is known (job.shrunk, job.grown).
                    note, job.resize = job.resize, None
                    made = sched.resumed_event(note, job.plan.world_size if job.plan else 0, action.fields)
                    out += [Record(job.id, made[0], now, made[1])] if made else []
        if job.machine.terminal:
            out += self._release_pending(job)
            if job.id in self.live:
                out += self._ended(job)
            self._retire(job)
        if job.state is not before or out:
            out.append(JobChanged(job.id))
        return out

    def _ended(self, job: Job) -> list[Action]:
        """job.ended to the nodes that ran it lately or warmed a trainer of it: what they keep
        for its restarts is no longer needed."""
        names = {n for placed in job.placed.values() for n in placed} | set(self.fitness.fits.get(job.id, {}))  # and those that staged it
        if job.warming is not None:
            names |= {n for n, _ in job.warming.asked}
        job.warming = None
        return [Send(n, m.JobEnded(job=job.id)) for n in sorted(names) if n in self.nodes and not self.nodes[n].lost]

    def _retire(self, job: Job) -> None:
        """A finished job leaves the live set; the oldest finished ones leave memory (the
        store keeps them all)."""
        if self.live.pop(job.id, None) is None:
            return
        self.fitness.forget(job.id)
        self._finished.append(job.id)
        self._forget()

    def _forget(self) -> None:
        while len(self._finished) > RECENT_FINISHED:
            gone = self._finished.popleft()
            self.jobs.pop(gone, None)
            self.links.forget(gone)
            self.forgotten += 1

    def _release_pending(self, job: Job) -> list[Action]:
        pend, job.pending = job.pending, None
        if pend is None:
            return []
        for s in pend.slots:
            node = self.nodes.get(s.node)
            if node is not None and node.used.get(s.index) == (job.id, pend.generation):
                del node.used[s.index]
        return []

    def _stop(self, job: Job, stop: js.StopGroup, now: float) -> list[Action]:
        if job.plan is None or job.plan.generation != stop.generation:
            return []
        if job.watch is not None and stop.mode is js.StopMode.CHECKPOINT:
            job.watch.stopping = True
        if stop.mode is js.StopMode.NOW:
            # A group stopped at once has failed (or was cancelled). Its nodes must be heard from
            # soon: a dpd that was killed took its trainer with it, and its peers' "connection
            # lost" may be all the pool hears of it. Waiting for its heartbeats' expiry would hold
            # the next generation back by that much (Pool.tick).
            for n in job.plan.nodes():
                node = self.nodes.get(n)
                if node is not None and not node.lost and node.asked_at is None:
                    node.asked_at = now
        return [
            Send(n, GroupStop(job=job.id, generation=stop.generation, mode=str(stop.mode)))
            for n in job.plan.nodes()
            if n in self.nodes and not self.nodes[n].lost
        ]

    # -- restart -------------------------------------------------------------------------------

    def restore(self, job: Job, saved: js.Saved, now: float, down_since: float | None = None) -> None:
        """A job read back from the store after a coordinator restart.

        A start that was being prepared is simply queued again (nothing ran). A launched group
        keeps running if its daemons re-register with its workers before `reconcile_by`; a group
        that was being stopped is stopped again (its daemons get group.stop when they report it).
        `down_since`: when the previous coordinator was last known alive, on the clock of `now`.
        """
        self.jobs[job.id] = job
        if saved.state in js.TERMINAL:
            self._finished.append(job.id)
        else:
            self.live[job.id] = job
            self.fitness.track(job.id, job.spec, job.doc)
        # The daemons heartbeat at the period the previous coordinator told them.
        reconcile_by = now + 2 * self.liveness * self.cadence.period_for(max(self.known_nodes, len(self.nodes))) + 2.0
        launched = job.plan is not None and job.plan.generation == saved.generation
        world = job.plan.world_size if launched and job.plan is not None else None
        job.machine.handle(js.Restored(saved, world, now + job.spec.recovery.start_timeout_s, reconcile_by, down_since), now, self.wall(now))  # acts on nothing
        if job.state in js.ACTIVE and launched and job.plan is not None:
            job.ranks = {r: RankRun(s.node, s.index) for r, s in enumerate(job.plan.ranks)}
            job.reconcile_by = reconcile_by
            job.watch = StepWatch.start(job.spec, now)
        self._forget()

    def _reconcile(self, job: Job, now: float) -> list[Action]:
        job.reconcile_by = None
        if job.plan is None or job.state not in js.ACTIVE:
            return []
        missing: dict[str, list[int]] = {}
        for r, slot in enumerate(job.plan.ranks):
            node = self.nodes.get(slot.node)
            adopted = node is not None and node.used.get(slot.index) == (job.id, job.plan.generation)
            if r in job.machine.live and not adopted:
                missing.setdefault(slot.node, []).append(r)
        actions: list[Action] = []
        for node_name, ranks in missing.items():
            # Nobody reported these ranks since the restart: their node is gone with them.
            actions += self._feed(job, js.NodeLost(node_name, tuple(ranks)), now)
        return actions

