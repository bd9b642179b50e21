"""The coordinator's policy: nodes, slots, the job queue, admission, planning and recovery. Pure.

`Pool` holds no socket, no file and no clock: every method takes `now` and returns actions
(`Send` a message to a node, `Record` an event, `JobChanged`/`NodeChanged` to persist). The
coordinator's asyncio loop (`daemon/coordinator.py`) feeds it decoded messages and timer ticks and
carries its actions out. Each job's own life is a `JobMachine` (`daemon/jobstate.py`); the pool adds
what needs the whole pool: which slots are free, where ranks go, what each node must be told, the
progress deadline of each running group (`daemon/watch.py`), drains, and nodes set aside.

Starting a group is two-phase because only a node knows which of its TCP ports are free:
`group.prepare` asks each chosen node for one port per slot (`node.prepared`), then the pool writes
the ring hostfile and sends `group.start`. Slots are set aside from admission until the node
reports their worker's exit (or stops listing it in its heartbeat, or is lost).

Recovery re-uses admission: a job whose old group has stopped is admitted again, with the slots
that are free, ahead of jobs submitted after it; rank 0 goes to the slot holding the newest
checkpoint, so the new generation resumes from it.
"""

from __future__ import annotations

from dpool.daemon import jobstate as js
from dpool.daemon.jobstate import JobState
from dpool.daemon.plan import FreeSlot, GroupPlan, Slot, choose_slots, ring_hostfile, speed_shares
from dpool.daemon.records import (
    Action,
    Job,
    JobChanged,
    Node,
    NodeChanged,
    NodeState,
    Pending,
    RankRun,
    Record,
    Send,
)
from dpool.daemon.watch import StepWatch
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.messages import GroupPrepare, GroupStart, GroupStop
from dpool.protocol.payloads import (
    AliveWorker,
    ExitedWorker,
    Holding,
    MetricRow,
    NodeInfo,
    NodeRow,
    RankSlot,
    RunningWorker,
    TrainRow,
)

__all__ = ["Action", "Job", "JobChanged", "Node", "NodeChanged", "NodeState", "Pool", "Record", "Send"]

SET_ASIDE_AFTER = 3  # workers failing on a node in a row before it takes no more work


class Pool:
    def __init__(self, *, heartbeat_s: float = 0.5, liveness: int = 6, prepare_timeout_s: float | None = None) -> None:
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.expiry_s = heartbeat_s * liveness
        self.prepare_timeout_s = prepare_timeout_s if prepare_timeout_s is not None else max(5.0, 2 * self.expiry_s)
        self.nodes: dict[str, Node] = {}
        self.jobs: dict[str, Job] = {}  # in submission order
        self.remembered: dict[str, str] = {}  # node -> reason it was drained/set aside (from the store)

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

    def node_rows(self, now: float) -> list[NodeRow]:
        """The `dpctl nodes --json` array (INTERFACE.md), by name."""
        return [self.node_row(n, now) for n in sorted(self.nodes.values(), key=lambda n: n.name)]

    def node_row(self, n: Node, now: float) -> NodeRow:
        jobs = sorted({job for job, _ in n.used.values()})
        i = n.info
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
            ranks=self._ranks_on(n.name),
            heartbeat_age_s=round(max(0.0, now - n.last_seen), 3),
            reason=n.reason,
        )

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

    def _ranks_on(self, node: str) -> list[int]:
        out = []
        for job in self.jobs.values():
            if job.plan is not None and job.state in js.ACTIVE and job.machine.live:
                out += [r for r, _ in job.plan.ranks_on(node)]
        return sorted(out)

    # -- nodes ---------------------------------------------------------------------------------

    def register(
        self,
        now: float,
        name: str,
        incarnation: str,
        info: NodeInfo,
        running: list[RunningWorker],
        exited: list[ExitedWorker],
        holdings: list[Holding],
    ) -> tuple[str | None, list[Action]]:
        """A daemon (re)joins. Returns (refusal message or None, actions)."""
        old = self.nodes.get(name)
        if old is not None and old.incarnation != incarnation and not old.lost and now - old.last_seen < self.expiry_s:
            return (
                f"node name {name!r} is already in the pool (dpd pid {old.info.pid or '?'} at {old.info.advertise or '?'}, "
                f"last heard {now - old.last_seen:.1f}s ago); give this daemon another --name",
                [],
            )
        actions: list[Action] = []
        rejoin = old is not None and old.incarnation == incarnation
        if rejoin:
            assert old is not None
            node = old
            node.lost, node.last_seen, node.info = False, now, info
            if not node.draining:
                node.reason = None
        else:
            if old is not None and not old.lost:
                # A new daemon process under a known name: whatever the old one ran is gone.
                actions += self._node_gone(old, now, "replaced by a new dpd process")
            node = Node(name=name, incarnation=incarnation, info=info, joined_at=now, last_seen=now)
            if old is not None and old.draining:
                node.draining, node.reason, node.drained_reported = True, old.reason, True  # a drain outlives a dpd restart
            elif name in self.remembered:
                node.draining, node.reason, node.drained_reported = True, self.remembered[name], True
            self.nodes[name] = node
        for h in holdings:
            node.holdings[(h.job, h.slot)] = h.step
        for e in exited:
            actions += self.worker_exited(now, name, e.job, e.generation, e.rank, e.slot, e.code, e.stopped, e.error)
        if not rejoin:
            actions += self._ranks_gone_with_old_daemon(now, node, running)
        for w in running:
            actions += self._adopt(now, node, w)
        kind = "node.rejoined" if rejoin else "node.joined"
        actions += [Record(None, kind, now, {"node": name, "slots": node.slots}), NodeChanged(name)]
        actions += self._schedule(now)
        return None, actions

    def _ranks_gone_with_old_daemon(self, now: float, node: Node, running: list[RunningWorker]) -> list[Action]:
        """A new dpd process under this name: ranks the plan put here that it does not run died
        with the old process (its trainers die with it: PR_SET_PDEATHSIG). A restarted coordinator
        knows them only from its plans, so this is how it learns."""
        reported = {(w.job, w.generation, w.rank) for w in running}
        actions: list[Action] = []
        for job in self.jobs.values():
            if job.plan is None or job.state not in js.ACTIVE:
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
        job = self.jobs.get(w.job)
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
            node.last_seen = now
        return node

    def heartbeat(self, now: float, name: str, workers: list[AliveWorker]) -> list[Action]:
        """Free slots whose job is no longer using them and whose worker the node no longer has."""
        node = self.seen(now, name)
        if node is None or node.lost:
            return []
        alive = {(w.job, w.generation, w.slot) for w in workers}
        actions: list[Action] = []
        for slot, (job_id, gen) in list(node.used.items()):
            if (job_id, gen, slot) in alive:
                continue
            job = self.jobs.get(job_id)
            current = job is not None and job.state in js.ACTIVE and (
                (job.plan is not None and job.plan.generation == gen and job.machine.live)
                or (job.pending is not None and job.pending.generation == gen)
            )
            if not current:
                del node.used[slot]
                actions.append(NodeChanged(name))
        if actions:
            actions += self._drained(now, node) + self._schedule(now)
        return actions

    def bye(self, now: float, name: str) -> list[Action]:
        node = self.nodes.get(name)
        if node is None or node.lost:
            return []
        return self._node_gone(node, now, "dpd stopped") + self._schedule(now)

    def _node_gone(self, node: Node, now: float, reason: str) -> list[Action]:
        node.lost = True
        if not node.draining:
            node.reason = reason
        actions: list[Action] = [Record(None, "node.lost", now, {"node": node.name, "reason": reason}), NodeChanged(node.name)]
        for job in self.jobs.values():
            if job.state not in js.ACTIVE:
                continue
            if job.pending is not None and any(s.node == node.name for s in job.pending.slots):
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
        if node.draining:
            return []
        node.draining, node.reason, node.drained_reported = True, "drained", False
        actions: list[Action] = [Record(None, "node.draining", now, {"node": name}), NodeChanged(name)]
        for job in self.jobs.values():
            if job.state not in js.ACTIVE:
                continue
            if job.pending is not None and any(s.node == name for s in job.pending.slots):
                # Being prepared there: start again elsewhere (nothing ran yet).
                actions += self._abort_start(job, now, f"node {name} is being drained")
            elif job.plan is not None and job.machine.live and any(True for _ in job.plan.ranks_on(name)):
                actions += self._reshape(job, now, f"node {name} is being drained")
        return actions + self._drained(now, node) + self._schedule(now)

    def undrain(self, now: float, name: str) -> list[Action]:
        """`dpctl undrain NODE`: take work again (also what lifts a node set aside)."""
        node = self.nodes[name]
        was = node.reason if node.draining else None
        node.draining, node.fail_streak, node.reason, node.drained_reported = False, 0, None, False
        self.remembered.pop(name, None)
        return [Record(None, "node.undrained", now, {"node": name, "was": was}), NodeChanged(name), *self._schedule(now)]

    def _drained(self, now: float, node: Node) -> list[Action]:
        if node.draining and not node.used and not node.drained_reported and node.reason == "drained":
            node.drained_reported = True
            return [Record(None, "node.drained", now, {"node": node.name}), NodeChanged(node.name)]
        return []

    def _reshape(self, job: Job, now: float, reason: str) -> list[Action]:
        watch = job.watch
        stop_by = now + (watch.allowance() if watch else float(job.spec["recovery"]["start_timeout_s"])) + 10.0
        if watch is not None:
            watch.stopping = True
        return self._feed(job, js.Reshape(reason, stop_by), now)

    def _blame(self, now: float, name: str) -> list[Action]:
        node = self.nodes.get(name)
        if node is None:
            return []
        node.fail_streak += 1
        if node.fail_streak < SET_ASIDE_AFTER or node.draining:
            return []
        # A node whose workers keep failing takes no more work until `dpctl undrain` (a broken
        # GPU, a full disk, a bad Python): restarting there would spend the job's budget.
        node.draining, node.drained_reported = True, True
        node.reason = f"set aside: its workers failed {node.fail_streak} times in a row; `dpctl undrain {name}` when fixed"
        return [Record(None, "node.set_aside", now, {"node": name, "failures": node.fail_streak}), NodeChanged(name)]

    # -- jobs ----------------------------------------------------------------------------------

    def submit(self, now: float, job_id: str, spec: JobSpec) -> list[Action]:
        job = Job(id=job_id, name=spec.name, spec=spec.to_dict(), submitted_at=now)
        job.machine.max_restarts = spec.recovery.max_restarts
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
        # Proportional to what the last generation measured per node, when it measured them all.
        shares = speed_shares(int(spec["train"]["global_batch"]), [job.speeds.get(s.node) for s in pend.slots])
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
        job.ranks = {r: RankRun(s.node, s.index) for r, s in enumerate(plan.ranks)}
        job.watch = StepWatch.for_job(spec, now, job.watch)
        deadline = now + float(spec["recovery"]["start_timeout_s"])
        # Saved (and committed by the coordinator) before any group.start leaves: a restarted
        # coordinator knows this generation was launched and never launches its number again.
        actions = [*self._feed(job, js.GroupLaunched(plan.generation, deadline), now), JobChanged(job.id)]
        for node in plan.nodes():
            ranks = [RankSlot(slot=s.index, rank=r) for r, s in plan.ranks_on(node)]
            actions.append(Send(node, GroupStart(job=job.id, generation=plan.generation, spec=spec, ranks=ranks, shares=list(shares), hostfile=hostfile)))
        actions.append(
            Record(job.id, "group.starting", now, {"generation": plan.generation, "world_size": plan.world_size, "nodes": plan.nodes(), "shares": list(shares)})
        )
        if previous_shares is not None and previous_shares != plan.shares:
            actions.append(Record(job.id, "rebalanced", now, {"generation": plan.generation, "shares": list(shares), "previous": list(previous_shares), "cause": "membership"}))
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
        if rank == 0:
            job.step = resume_step  # where this generation starts
        return self._feed(job, js.RankUp(generation, rank, resume_step if rank == 0 else None), now)

    def progress(self, now: float, job_id: str, generation: int, rank: int, step: int, tokens: int, seconds: float) -> list[Action]:
        """One rank finished one step (the hot path: one call per rank per step)."""
        job = self.jobs.get(job_id)
        run = self._run(job_id, generation, rank)
        if job is None or run is None:
            return []
        run.step = step
        if seconds > 0:
            rate = tokens / seconds
            run.tokens_per_s = rate if run.tokens_per_s == 0 else 0.8 * run.tokens_per_s + 0.2 * rate
        if rank == 0:
            job.step = step
        if job.watch is not None:
            job.watch.observe(step, now, seconds)
        actions: list[Action] = []
        if job.state is JobState.STARTING or (job.state is JobState.RECOVERING and job.machine.deadline is not None):
            # A step done means the rank is up, even if its hello was lost.
            actions += self._feed(job, js.RankUp(generation, rank), now)
        if step > job.machine.step or job.machine.interrupted_at is not None:
            actions += self._feed(job, js.StepDone(generation, step), now)
        return actions

    def metric(self, now: float, job_id: str, generation: int, row: MetricRow) -> list[Action]:
        job = self.jobs.get(job_id)
        if job is None or (job.plan is not None and generation < job.plan.generation):
            return []
        actions: list[Action] = []
        if isinstance(row, TrainRow):
            if row.loss is not None:
                job.loss = row.loss
            if job.plan is not None and generation == job.plan.generation:
                actions += self._measured(job, row, now)
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

    def worker_exited(
        self, now: float, node_name: str, job_id: str, generation: int, rank: int, slot: int, code: int, stopped: bool, error: str | None = None
    ) -> list[Action]:
        actions: list[Action] = []
        node = self.nodes.get(node_name)
        if node is not None and node.used.get(slot) == (job_id, generation):
            del node.used[slot]
            actions.append(NodeChanged(node_name))
        job = self.jobs.get(job_id)
        run = self._run(job_id, generation, rank)
        if job is not None and run is not None and run.exit_code is None:
            run.exit_code = code
            if node is not None and code in (0, js.EXIT_STOPPED):
                node.fail_streak = 0  # a worker that ended well: the node is fine
            actions += self._feed(job, js.RankExited(generation, rank, node_name, code, stopped, error), now)
        if node is not None:
            actions += self._drained(now, node)
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
            if job.state in js.ACTIVE:
                actions += self._feed(job, js.Tick(), now)
                actions += self._check_progress(job, now)
        return actions + self._schedule(now)

    def _check_progress(self, job: Job, now: float) -> list[Action]:
        """RUNNING (or checkpointing on request): a step must complete before the watch's deadline."""
        watch, plan, m = job.watch, job.plan, job.machine
        if watch is None or plan is None or not m.live or job.reconcile_by is not None:
            return []
        if not (job.state is JobState.RUNNING or (job.state is JobState.RECOVERING and m.stop_mode == "checkpoint")):
            return []
        deadline = watch.deadline()
        if now < deadline:
            return []
        # Name the rank(s) that reported least recently: a frozen rank's last report may never
        # have left it, while its peers reported the step before they blocked.
        live = sorted(m.live)
        low = min(job.ranks[r].step for r in live)
        ranks = tuple((r, plan.ranks[r].node) for r in live if job.ranks[r].step == low)
        waited = now - (watch.last_at if watch.last_step is not None else watch.started_at)
        detail = f"no step after step {watch.last_step or 0} for {waited:.1f}s (deadline {watch.allowance():.1f}s)"
        return self._feed(job, js.Stalled(ranks, detail), now)

    # -- admission -----------------------------------------------------------------------------

    def _schedule(self, now: float) -> list[Action]:
        """Admit waiting jobs in submission order while their workers.min fits in the free slots.

        Waiting means queued, or recovering with the old group stopped (those were submitted
        earlier, so they go first). A job that could never fit in the pool as it is (workers.min
        above every healthy slot) does not hold back the jobs behind it; one that merely waits for
        busy slots does, so big jobs are not starved by a stream of small ones. Then running jobs
        below workers.max grow into slots nobody waits for.
        """
        actions: list[Action] = []
        capacity = sum(n.slots for n in self.nodes.values() if not n.lost and not n.draining)
        blocked = False
        for job in list(self.jobs.values()):
            recovering = job.machine.ready_to_restart(now) and job.pending is None
            if job.state is not JobState.QUEUED and not recovering:
                continue
            lo, hi = int(job.spec["workers"]["min"]), int(job.spec["workers"]["max"])
            chosen = None if blocked else choose_slots(self._free_slots(job), lo, min(hi, int(job.spec["train"]["global_batch"])))
            if chosen is not None:
                actions += self._admit(job, chosen, now)
                continue
            if recovering:
                # RECOVERING -> QUEUED: fewer than workers.min usable slots are left.
                actions += self._feed(job, js.Requeue(f"{capacity} usable slot(s) for workers.min = {lo}" if lo > capacity else "waiting for free slots"), now)
            if lo <= capacity:
                blocked = True  # it waits for busy slots: nothing behind it jumps the queue
        if not blocked:
            actions += self._grow(now)
        return actions

    def _free_slots(self, job: Job) -> list[FreeSlot]:
        return [FreeSlot(n.name, i, n.holdings.get((job.id, i))) for n in self.nodes.values() for i in n.free()]

    def _grow(self, now: float) -> list[Action]:
        """A running job below workers.max, with healthy slots free: checkpoint and restart wider.

        At most once per generation, and only once the generation has completed a step (a group
        that cannot get going is not made to start over for more workers).
        """
        actions: list[Action] = []
        free = sum(len(n.free()) for n in self.nodes.values())
        if not free:
            return []
        for job in self.jobs.values():
            m, plan = job.machine, job.plan
            if job.state is not JobState.RUNNING or plan is None or job.grown_in == m.generation:
                continue
            if m.from_step is None or job.step <= m.from_step or m.interrupted_at is not None:
                continue  # no step of this generation yet
            if job.step >= int(job.spec["train"]["steps"]):
                continue  # finishing: a rank that is done frees its slot, which is no reason to grow
            own = {(s.node, s.index) for s in plan.ranks}
            if not any((name, i) not in own for name, n in self.nodes.items() for i in n.free()):
                continue  # only this job's own slots are free (its ranks are exiting)
            hi = min(int(job.spec["workers"]["max"]), int(job.spec["train"]["global_batch"]))
            if plan.world_size >= hi:
                continue
            job.grown_in = m.generation
            actions += [Record(job.id, "group.growing", now, {"generation": m.generation, "world_size": plan.world_size, "free_slots": free})]
            actions += self._reshape(job, now, f"{free} free slot(s): growing from {plan.world_size} workers")
            break  # the slots go to one job; the next schedule sees what is left
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
            elif isinstance(action, js.Blame):
                out += self._blame(now, action.node)
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
        if job.watch is not None and stop.mode == "checkpoint":
            job.watch.stopping = True
        return [
            Send(n, GroupStop(job=job.id, generation=stop.generation, mode=stop.mode))
            for n in job.plan.nodes()
            if n in self.nodes and not self.nodes[n].lost
        ]

    # -- restart -------------------------------------------------------------------------------

    def restore(self, job: Job, now: float) -> None:
        """A job read back from the store after a coordinator restart.

        A start that was being prepared is simply queued again (nothing ran). A launched group
        keeps running if its daemons re-register with its workers before `reconcile_by`; a group
        that was being stopped is stopped again (its daemons get group.stop when they report it).
        """
        self.jobs[job.id] = job
        m = job.machine
        m.max_restarts, m.step = int(job.spec["recovery"]["max_restarts"]), job.step
        launched = job.plan is not None and job.plan.generation == m.generation
        if job.state in js.ACTIVE and not launched:
            # A start (or restart) being prepared: nothing of it ran; admit it again.
            if job.state is JobState.STARTING:
                m.state = JobState.QUEUED
            else:
                m.stop_mode, m.live = "restored", set()
        elif job.state in js.ACTIVE and job.plan is not None:
            m.world_size = job.plan.world_size
            m.live = set(range(job.plan.world_size))
            job.ranks = {r: RankRun(s.node, s.index) for r, s in enumerate(job.plan.ranks)}
            job.reconcile_by = now + 2 * self.expiry_s + 2.0
            job.watch = StepWatch.for_job(job.spec, now)
            if job.state is JobState.STARTING:
                m.deadline = now + float(job.spec["recovery"]["start_timeout_s"])
            elif job.state is JobState.RECOVERING:
                # It was being stopped: finish that (ranks still running are stopped when their
                # daemons report them), and re-plan once they are gone or the reconcile time passed.
                m.stop_mode, m.settle_by = "now", job.reconcile_by

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
