"""Warm trainers: the spares a dpd keeps so that a restart skips the interpreter, the imports and
the build (a mixin of the node agent, daemon/agent.py).

Once a worker of a job has completed a few steps, its slot gets a spare: a second trainer of
the same job started with `--warm`, which imports MLX, builds the model and data, says
`worker.ready` and blocks. The next generation's `group.start` on that slot hands it `worker.go`
(rank, generation, shares, hostfile) instead of starting a process, so a restart skips the
interpreter, the imports and the build. A spare is invisible to the coordinator until then; it is
stopped when its job finishes or is removed here, when its slot starts another job, and after
`SPARE_IDLE_S` without a worker of its job on this node. A joining node is asked for spares by the
coordinator (`job.warm`) before its group grows, and says which are ready (`node.warmed`).

No hand-off here depends on the order messages arrive in:
- a spare's `worker.ready` read before its start returned (a forked one's pid comes back on another
  pipe) is kept by the agent and handled once the spare is recorded (daemon/worker.py, EarlyReports);
- `worker.go` for a spare not yet ready waits on it; a `worker.ready` comes before or after it;
- every slot a `job.warm` names is answered once (`node.warmed`): ready, or an error saying why not
  (the slot is busy, no spare could be started, it exited, or it is not ready by the job's
  `recovery.start_timeout_s`), never silence. Spares start in tasks of their own, so a slow fork
  never holds up the daemon's link (its heartbeats) while the coordinator waits for the answer.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from dpool.daemon.children import clean
from dpool.daemon.exporter import SUBMITTED_JOB
from dpool.daemon.forkserver import ForkedProcess
from dpool.daemon.worker import Worker, write_file
from dpool.protocol import messages as m
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import JobFileError, JobSpec, parse_job

SPARE_IDLE_S = 120.0  # a spare with no worker of its job on this node for this long is stopped
# A worker's spare starts once it has completed this many steps: not while its group starts, when
# the machine's cores are what the group waits for (compiling, the first steps, the other ranks).
SPARE_AFTER_STEPS = 3
ENV_WARM = "DPOOL_WARM"  # "0": no spares (a cold start every generation; benches compare both)


class WarmTrainers:
    """The agent's spares. What it needs of the agent is declared here; the agent provides it."""

    name: str
    slots: int
    state_dir: Path
    warm: bool  # spares on (ENV_WARM)
    closing: bool
    log: Any  # a structlog logger
    workers: dict[int, Worker]
    spares: dict[int, Worker]  # slot -> a warm trainer waiting for worker.go
    spares_starting: set[int]  # slots whose spare is being started (marked before its task runs)
    spare_tasks: set[asyncio.Task[Any]]
    warm_wanted: dict[tuple[str, int], float]  # (job, slot) the coordinator awaits an answer for (job.warm) -> answer deadline (monotonic)
    removing: set[str]
    kinds: dict[str, str]
    awake: Any
    staging: Any  # daemon/nodestage.py: where this node has each job's files

    def _send(self, msg: m.Message, msg_id: int = 0) -> None:
        raise NotImplementedError

    def _to_worker(self, peer: bytes, msg: m.Message) -> None:
        raise NotImplementedError

    def _stop(self, w: Worker, mode: str, why: str) -> None:
        raise NotImplementedError

    def _run_dir(self, job: str, slot: int) -> Path:
        raise NotImplementedError

    async def _launch(self, job: str, slot: int, run_dir: Path, args: list[str], extra: dict[str, str]) -> asyncio.subprocess.Process | ForkedProcess:
        raise NotImplementedError

    async def _watch(self, w: Worker) -> None:
        raise NotImplementedError

    def _recorded(self, w: Worker) -> None:
        raise NotImplementedError

    def _go(self, spare: Worker, msg: m.GroupStart, hostfile: Path | None, rank: int) -> None:
        """The slot's spare becomes the rank: told by worker.go (now, or once it is ready)."""
        spare.warm, spare.generation, spare.rank, spare.idle_since = False, msg.generation, rank, None
        go = m.WorkerGo(
            rank=rank, generation=msg.generation, shares=list(msg.shares),
            hostfile=str(hostfile) if hostfile is not None else None, resume_max=msg.resume_max,
        )
        if spare.peer is not None:
            self._to_worker(spare.peer, go)
        else:
            spare.go = go
        self.workers[spare.slot] = spare
        self.awake.update(len(self.workers))
        self._send(m.NodeWorkerStarted(job=spare.job, generation=msg.generation, rank=rank, slot=spare.slot, pid=spare.pid))
        self.log.info("worker.started", job=spare.job, generation=msg.generation, rank=rank, slot=spare.slot, pid=spare.pid, warm=True, ready=spare.peer is not None)

    def _spare_soon(self, job: str, slot: int) -> bool:
        """Start a warm trainer of `job` for `slot` in a task of its own, unless the slot has one
        or one is starting; the slot counts as starting from now. False: none will start."""
        if not self.warm or self.closing or slot in self.spares or slot in self.spares_starting or job in self.removing:
            return False
        self.spares_starting.add(slot)
        task = asyncio.create_task(self._start_spare(job, slot))
        self.spare_tasks.add(task)
        task.add_done_callback(self.spare_tasks.discard)
        return True

    async def _start_spare(self, job: str, slot: int) -> None:
        """A warm trainer of `job` for `slot` (marked starting by `_spare_soon`), ready for its
        next generation."""
        run_dir = self._run_dir(job, slot)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            # A spare builds at a low priority where this node trains (its cores are the workers');
            # on a node that runs none yet (one that joins), at the usual one.
            low = "1" if self.workers else "0"
            proc = await self._launch(job, slot, run_dir, [str(run_dir.parent / "job.toml"), "--run-dir", str(run_dir), "--warm"], {"DPOOL_WARM_LOW": low})
        except OSError as e:
            self.log.warning("spare.start_failed", job=job, slot=slot, error=str(e))
            self._warm_answered(job, slot, clean(f"cannot start a warm trainer in slot {slot}: {e}"))
            return
        finally:
            self.spares_starting.discard(slot)
        w = Worker(job=job, generation=0, rank=0, slot=slot, run_dir=run_dir, proc=proc, warm=True)
        w.tasks.append(asyncio.create_task(self._watch(w)))
        if self.closing or slot in self.spares:
            self._stop(w, "now", "not needed")
            self._recorded(w)  # what it said already goes with it
            return
        self.spares[slot] = w
        self.log.info("spare.started", job=job, slot=slot, pid=proc.pid, forked=isinstance(proc, ForkedProcess))
        self._recorded(w)  # a worker.ready read before this record counts now

    def _job_files(self, job: str, submitted: dict[str, Any]) -> JobSpec:
        """Write the job's files into this node's folder of it, for its trainers and spares:
        job.toml with the job's paths where this node holds its staged files, and the job as it was
        submitted (an export names the submitted paths). The job as this node runs it. Raises
        JobFileError, ValueError or TypeError for the job, OSError for the folder."""
        given = parse_job(submitted, source=f"job {job}")
        spec = self.staging.localize(job, given)
        text, as_given = dump_job(spec), dump_job(given)
        self.kinds[job] = spec.model.kind
        job_dir = self.state_dir / "jobs" / job
        job_dir.mkdir(parents=True, exist_ok=True)
        write_file(job_dir / "job.toml", text.encode())
        write_file(job_dir / SUBMITTED_JOB, as_given.encode())
        return spec

    def _warm_job(self, msg: m.JobWarm) -> None:
        """job.warm: a spare of the job in each of these free slots, ahead of a group that will
        include them. Each slot is answered by node.warmed: the ready ones now, the others as each
        says worker.ready, or with the reason none will be (`_check_warm`)."""
        refused = None
        deadline = 0.0
        if not self.warm:
            refused = f"warm trainers are off on node {self.name} ({ENV_WARM}=0)"
        else:
            try:
                spec = self._job_files(msg.job, msg.spec)  # as a group start writes them
                deadline = time.monotonic() + spec.recovery.start_timeout_s  # what the coordinator waits at most
            except (JobFileError, ValueError, TypeError, OSError) as e:
                refused = clean(f"cannot prepare job {msg.job} on node {self.name}: {e}")
        if refused is not None:
            self.log.warning("job.warm_refused", job=msg.job, error=refused)
            self._send(m.NodeWarmed(job=msg.job, slots=[], error=refused))
            return
        ready, busy = [], []
        for slot in msg.slots:
            if not 0 <= slot < self.slots or slot in self.workers:
                busy.append(slot)  # taken meanwhile (or never ours): the growth must not wait for it
                continue
            spare = self.spares.get(slot)
            if spare is not None and spare.job == msg.job and spare.peer is not None:
                ready.append(slot)
                continue
            if spare is not None and spare.job != msg.job:
                del self.spares[slot]
                self._stop(spare, "now", f"its slot warms job {msg.job}")
            self.warm_wanted[(msg.job, slot)] = deadline
            self._spare_soon(msg.job, slot)  # none when one is there or starting: its worker.ready answers
        if ready:
            self._send(m.NodeWarmed(job=msg.job, slots=ready))
        if busy:
            self._send(m.NodeWarmed(job=msg.job, slots=[], error=f"slots {busy} of node {self.name} are busy or do not exist"))
        self.log.info("job.warming", job=msg.job, slots=list(msg.slots), ready=ready, busy=busy)

    def _warm_answered(self, job: str, slot: int, error: str | None = None) -> None:
        """node.warmed for (job, slot), if the coordinator waits for it: ready, or why it will not be."""
        if self.warm_wanted.pop((job, slot), None) is None:
            return
        self._send(m.NodeWarmed(job=job, slots=[] if error else [slot], error=error))

    def _check_warm(self, now: float) -> None:
        """Every job.warm gets its answer: a spare that is ready says so (whatever the order its
        record and its worker.ready came in); a slot with no spare of the job, none starting, or
        one not ready by the deadline is answered with the reason."""
        for (job, slot), deadline in list(self.warm_wanted.items()):
            spare = self.spares.get(slot)
            ours = spare is not None and spare.job == job and not spare.stopping
            if ours and spare is not None and spare.peer is not None:
                self._warm_answered(job, slot)
            elif not ours and slot not in self.spares_starting:
                why = "this node is stopping" if self.closing else "its job is being removed here" if job in self.removing else "none runs or starts there"
                self._warm_answered(job, slot, f"no warm trainer of job {job} in slot {slot} of node {self.name}: {why}")
            elif now >= deadline:
                self.log.warning("spare.not_ready", job=job, slot=slot, pid=spare.pid if spare else None)
                self._warm_answered(job, slot, f"the warm trainer of job {job} in slot {slot} of node {self.name} was not ready in time")

    def _retire_spares(self, job: str, why: str) -> None:
        for slot, spare in list(self.spares.items()):
            if spare.job == job:
                del self.spares[slot]
                self._stop(spare, "now", why)

    def _check_spares(self, now: float) -> None:
        """Stop spares whose job has had no worker on this node for SPARE_IDLE_S."""
        running = {w.job for w in self.workers.values()}
        for slot, spare in list(self.spares.items()):
            if spare.job in running:
                spare.idle_since = None
            elif spare.idle_since is None:
                spare.idle_since = now
            elif now - spare.idle_since >= SPARE_IDLE_S:
                del self.spares[slot]
                self._stop(spare, "now", f"no worker of its job here for {SPARE_IDLE_S:.0f} s")

