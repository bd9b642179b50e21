"""The node agent: one per machine. Joins the coordinator, starts and stops trainer processes for
its slots, relays what they report, and keeps them running through a control-plane outage.

Sockets:
- a DEALER to the coordinator. Paranoid Pirate: any inbound message resets the liveness expiry;
  when it passes, the socket is closed, a new one made and the node registers again (bounded,
  jittered retries via tenacity, each round logged; the workers keep training meanwhile).
- a ROUTER its trainers connect to (`DPOOL_WORKER_ADDR`), an ipc socket in the state dir (tcp on
  loopback where the ipc path would be too long). A worker is known by the pid in its hello (a
  spare by the one in its ready); one read before that trainer's start has returned is kept until
  its record is made (daemon/worker.py, EarlyReports), so no report depends on which comes first.

Faults of this machine are the rank's, never the daemon's: a job folder that cannot be written at a
group start (a full disk) is reported as that rank's exit with the reason, and a `worker.log` that
cannot be written only loses lines. A job id from the wire becomes a path only once it matches the
job id pattern (`protocol/checkpoints.py`); any other is refused with a log line.

Warm trainers (spares) are daemon/spares.py's.

State in memory: every trainer gets `DPOOL_MEMORY_DIR`, a folder of this node's `MemoryStore`
(`daemon/memstore.py`) where it keeps the state of its last step; a restart resumes from there, and
the folders are offered as holdings (`memory`) when this node registers.

`job.remove` (`dpctl rm`) deletes the job's folder, `STATE/jobs/JOB`, once no worker of that job
runs here: renamed at once into `STATE/removed/` (then `node.removed` answers), deleted there in a
thread; what a stopped daemon left there is deleted at its next start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import random
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import zmq
import zmq.asyncio
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_delay,
    wait_random_exponential,
)

from dpool.daemon.childenv import StartedZygote, die_with_parent, trainer_command, trainer_env
from dpool.daemon.children import clean, error_message, is_alive, is_stopped
from dpool.daemon.exporter import Exporter, ExportError
from dpool.daemon.forkserver import ForkedProcess, ForkServer, ForkServerError, modules_for
from dpool.daemon.memstore import MemoryStore
from dpool.daemon.nodestage import NodeStaging
from dpool.daemon.owner import OwnerWatch
from dpool.daemon.power import SleepGuard
from dpool.daemon.replay import RowReplay
from dpool.daemon.spares import ENV_WARM, SPARE_AFTER_STEPS, WarmTrainers
from dpool.daemon.sysinfo import node_info
from dpool.daemon.worker import EarlyReports, Worker, write_file
from dpool.protocol import messages as m
from dpool.protocol.checkpoints import EXIT_DISK, memory_root, newest_step, valid_job_id
from dpool.protocol.content import NOT_THE_CONTENT
from dpool.protocol.jobspec import JobFileError
from dpool.protocol.link_messages import NodeLink, WorkerLink
from dpool.protocol.logs import RotatingFile, Throttle, get_logger
from dpool.protocol.messages import ErrorCode, Message, ProtocolError
from dpool.protocol.owner_messages import NodeYield
from dpool.protocol.payloads import AliveWorker, ExitedWorker, Holding, NodeInfo, RunningWorker
from dpool.protocol.schema import Invalid
from dpool.protocol.security import ClientKeys, curve_client
from dpool.protocol.sockets import HWM, pending
from dpool.protocol.stage_messages import JobStage, StageAccept, StagePeers, StagePrune

LOG_FLUSH_S = 0.2
# A trainer whose process stays stopped (SIGSTOP, SIGTSTP, a terminal's job control) this long is
# killed as failed: its group waits for it in all_sum and would only be freed by the progress
# deadline, seconds later. A hang inside a running process is still the deadline's to find.
WAITING_SAID_S = 0.5  # a rank that has waited on its peers this long is said to (node.waiting): a group that stalls names who froze
ENV_STOPPED = "DPOOL_STOPPED_S"  # seconds; "0": leave stopped trainers to the progress deadline
STOPPED_S = 0.25
LOG_BATCH_LINES = 500
LOG_LINE_MAX = 8192
IPC_PATH_MAX = 100  # sun_path is 104-108 bytes depending on the OS
EXITS_KEPT = 64
HELD_MAX = 20_000  # reports kept while the coordinator is away
HELD_LOG_BYTES = 8 << 20  # and workers' output lines, apart (chatty output never pushes a report out), the newest this much
# Kept while away, sent once registered again: the job's record (metrics, samples, checkpoints), and
# what the coordinator waits on: a rank's hello (its group counts as started only once every rank
# said it) and a warm trainer's readiness (a growth waits for it); and the group's link probe (said
# once per group).
KEPT_WHILE_AWAY = (m.NodeMetric, m.NodeSample, m.NodeCheckpoint, m.NodeWorkerStarted, m.NodeWorkerHello, m.NodeWarmed, NodeLink)
WORKER_LOG_BYTES = 4 << 20  # each worker.log is rotated past this size...
WORKER_LOG_BACKUPS = 2  # ...keeping worker.log.1 and worker.log.2: at most 12 MiB per run dir
SPARE_LINES = 200  # output lines of a spare kept until it is used
SWEEP_S = 5.0  # how often idle spares and forgotten state in memory are looked for


# How long a registration is waited for, at least. A coordinator that 2,000 dpds register with at
# once answers the last of them seconds later on a busy machine; asking again sooner, on a new
# socket, only adds a registration to its queue. A coordinator not yet up gets the registration
# when it is: ZeroMQ holds it until the connection is made.
REGISTER_WAIT_S = 5.0
STOP_POLL_S = 0.25  # the longest the control loop waits on its socket: a stop is seen this soon, whatever the heartbeat period


async def until_set(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less if `event` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


class Refused(Exception):
    """The coordinator refused this node (a duplicate name, or info out of bounds): fatal, the daemon exits 1."""


class NoAnswer(Exception):
    """No reply to node.register in time, or one to ask again after (`answered`: an error the
    coordinator sent, such as pool_full): retried with backoff."""

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


class Agent(WarmTrainers):
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        name: str,
        join: str,
        state_dir: str | Path,
        slots: int,
        advertise: str,
        heartbeat_s: float = 0.25,
        liveness: int = 6,
        stop_grace_s: float = 10.0,
        rejoin_round_s: float = 60.0,
        keys: ClientKeys | None = None,
        awake: SleepGuard | None = None,
        zygote: StartedZygote | None = None,
        cache_max: int | None = None,
        owner: OwnerWatch | None = None,
    ) -> None:
        self.keys = keys  # CURVE to the coordinator when given
        self.owner = owner  # `--yield-when`: what this machine's owner needs it for (daemon/owner.py)
        self.awake = awake or SleepGuard.for_this_machine()  # no idle sleep while a trainer runs (macOS)
        self.ctx, self.name, self.join = ctx, name, join
        self.state_dir = Path(state_dir)
        self.slots, self.advertise = slots, advertise
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.told = False  # this coordinator tells periods on coord.heartbeat: ours go on node.heartbeat (daemon/cadence.py)
        self.stop_grace_s, self.rejoin_round_s = stop_grace_s, rejoin_round_s
        self.incarnation = secrets.token_hex(8)
        self.log = get_logger(node=name)
        self.workers: dict[int, Worker] = {}  # slot -> worker
        self.exited: collections.deque[ExitedWorker] = collections.deque(maxlen=EXITS_KEPT)
        self.gone: collections.OrderedDict[bytes, Worker] = collections.OrderedDict()  # link peer -> a worker that exited (EXITS_KEPT)
        self.reserved: dict[tuple[str, int], list[socket.socket]] = {}  # (job, generation) -> port holders
        self.csock: zmq.asyncio.Socket | None = None
        self.craw: zmq.Socket | None = None
        self.wraw: zmq.Socket | None = None
        self.worker_addr = ""
        self.registered = False
        self.dropped = 0
        self.held: collections.deque[Message] = collections.deque(maxlen=HELD_MAX)  # reports kept while away
        self.held_logs: collections.deque[m.NodeLogs] = collections.deque()  # output lines kept while away (HELD_LOG_BYTES)
        self.held_log_bytes = 0
        self.replay = RowReplay()  # rows sent lately, again after a re-registration (daemon/replay.py)
        self._last_sent = 0.0
        self.exporter = Exporter(self.state_dir, name)
        self.export_tasks: set[asyncio.Task[Any]] = set()
        self.export_prepares: dict[str, asyncio.Task[Any]] = {}  # export id -> its preparation
        self._rejected_log = Throttle(lines=5, every=1.0)  # bad frames: dropped, said at most 5 times a second
        self._refused_log = Throttle(lines=5, every=1.0)  # job ids refused as paths
        self.removing: set[str] = set()  # removed jobs whose folder goes once their workers here have exited
        self.spares: dict[int, Worker] = {}  # slot -> a warm trainer waiting for worker.go
        self.spare_tasks: set[asyncio.Task[Any]] = set()
        self.spares_starting: set[int] = set()
        self.ended: set[str] = set()  # jobs over whose state in memory goes once their workers here have exited
        self.warm_wanted: dict[tuple[str, int], float] = {}  # (job, slot) the coordinator awaits (job.warm) -> answer deadline
        self.early = EarlyReports()  # what trainers said before they were recorded
        self.closing = False  # stopping every worker: no more spares
        self.warm = os.environ.get(ENV_WARM, "1") != "0"
        self.stopped_s = _seconds(os.environ.get(ENV_STOPPED), STOPPED_S)
        self.memory = MemoryStore(memory_root(self.state_dir))
        self.forks = ForkServer(zygote)  # trainers forked pre-imported (`zygote`: one started before the daemon's imports)
        self.kinds: dict[str, str] = {}  # job -> its model kind (what its trainers import)
        host = f"[{advertise}]" if ":" in advertise else advertise
        self.staging = NodeStaging(
            self.state_dir, bind=f"tcp://{host}:0", memory_bytes=int(node_info(slots=slots, advertise=advertise)["memory_bytes"]),
            keys=keys, cache_max=cache_max, log=self.log,
        )

    # -- life ----------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> int:
        (self.state_dir / "run").mkdir(parents=True, exist_ok=True)
        try:
            self.memory.prepare()
        except OSError as e:
            self.log.warning("memory_state.unavailable", path=str(self.memory.root), error=str(e))
        stale = self.exporter.clear_stale()
        if stale:
            self.log.info("export.stale_removed", count=stale)
        left = self._removed_dir()
        if left.is_dir():  # what a previous process was deleting when it stopped
            shutil.rmtree(left, ignore_errors=True)
        wsock = self._bind_worker_socket()
        self.forks.start()
        self.log.info("staging.listening", endpoint=self.staging.start(), cache=str(self.staging.cache.root))
        self.staging.announce_drops(self._send)
        side = [asyncio.create_task(self._worker_loop(wsock)), asyncio.create_task(self._flush_loop())]
        if self.owner is not None:
            side.append(asyncio.create_task(self.owner.run(lambda why: self._send(NodeYield(reason=why)))))
        try:
            code = await self._control_loop(stopping)
        finally:
            await self._stop_all("dpd stopping")
            self.memory.close()
            self.staging.stop()
            await self.forks.close()
            self.awake.close()
            for t in list(self.export_tasks):
                t.cancel()  # kills an export's trainer
            if self.export_tasks:
                await asyncio.gather(*self.export_tasks, return_exceptions=True)
            self.exporter.close()
            if self.registered:
                self._send(m.NodeBye())
                await asyncio.sleep(0)  # let the bye leave before the socket closes (it lingers)
            for t in side:
                t.cancel()
            for t in side:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            for holders in self.reserved.values():
                for s in holders:
                    s.close()
            if self.csock is not None:
                self.csock.close(linger=200)
            wsock.close(linger=0)
            self.log.info("node.stopped", dropped=self.dropped)
        return code

    def _bind_worker_socket(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, HWM)
        path = self.state_dir / "run" / "workers.sock"
        if len(str(path.absolute())) <= IPC_PATH_MAX:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a stale socket file of a dead dpd (a live one holds the state dir's lock)
            sock.bind(f"ipc://{path.absolute()}")
            os.chmod(path, 0o600)  # this user's trainers alone (the umask made it so already)
        else:
            sock.bind("tcp://127.0.0.1:*")
        self.worker_addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.wraw = zmq.Socket.shadow(sock.underlying)
        return sock

    # -- the coordinator link ------------------------------------------------------------------

    async def _control_loop(self, stopping: asyncio.Event) -> int:
        while not stopping.is_set():
            try:
                await self._register(stopping)
            except Refused as e:
                self.log.error("node.refused", reason=str(e))
                print(f"dpd: {e}", file=sys.stderr)
                return 1
            except RetryError:
                self.log.error("coordinator.unreachable", address=self.join, waited_s=self.rejoin_round_s, workers=len(self.workers))
                continue  # the workers keep training; start another round of attempts
            if stopping.is_set():
                break
            await self._connected(stopping)
        return 0

    async def _register(self, stopping: asyncio.Event) -> None:
        retrying = AsyncRetrying(
            stop=stop_after_delay(self.rejoin_round_s),
            wait=wait_random_exponential(multiplier=0.25, max=5.0),
            retry=retry_if_exception_type(NoAnswer),
            before_sleep=self._retrying,
            sleep=lambda seconds: until_set(stopping, seconds),  # a stop ends the wait between attempts
        )
        async for attempt in retrying:
            with attempt:
                if stopping.is_set():
                    return
                await self._register_once(stopping)

    def _retrying(self, rs: Any) -> None:
        """A coordinator.retry line: what the last attempt got, and what may be wrong when nothing
        came back (an error it sent, pool_full, says so itself)."""
        failed = rs.outcome.exception() if rs.outcome is not None else None
        said = {} if isinstance(failed, NoAnswer) and failed.answered else {"hint": self._no_answer_hint()}
        self.log.warning("coordinator.retry", address=self.join, attempt=rs.attempt_number, error=str(failed) if failed else None, **said)

    def _no_answer_hint(self) -> str:
        """What may keep the coordinator from answering (its side alone knows: its log says
        `auth.handshake_failed` for a key it does not take)."""
        if self.keys is None:
            return "is `dpd run --serve` running there, and reachable? does the pool use keys? then pass --keys DIR"
        return (f"is `dpd run --serve` running there? are {self.keys.source} and the coordinator.key beside it this pool's "
                "(its bundle from `dpctl keys add-node`), and is the node's key still in the coordinator's allowed/nodes/?")

    async def _register_once(self, stopping: asyncio.Event) -> None:
        self.registered, self.told = False, False
        if self.csock is not None:
            self.csock.close(linger=0)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        if self.keys is not None:
            curve_client(sock, self.keys)
        sock.connect(self.join)
        self.csock, self.craw = sock, zmq.Socket.shadow(sock.underlying)
        register = m.NodeRegister(
            name=self.name,
            incarnation=self.incarnation,
            info=NodeInfo(**node_info(slots=self.slots, advertise=self.advertise)),
            running=[RunningWorker(job=w.job, generation=w.generation, rank=w.rank, slot=w.slot, pid=w.pid) for w in self.workers.values()],
            exited=list(self.exited),
            holdings=self._holdings(),
        )
        try:
            self.craw.send_multipart(register.to_frames(1), flags=zmq.NOBLOCK)
        except zmq.Again:
            # libzmq drops a connection's queue when the coordinator refuses its CURVE handshake; on
            # a loaded machine that can happen between connect() and this send
            raise NoAnswer(f"{self.join} closed the connection before this dpd could register (its handshake refused: is this node's key in the pool's allow-list?)") from None
        deadline = time.monotonic() + max(REGISTER_WAIT_S, self.heartbeat_s * self.liveness)
        while (left := deadline - time.monotonic()) > 0:
            if stopping.is_set():
                return  # not registered: the control loop ends
            if not await sock.poll(int(min(left, STOP_POLL_S) * 1000) + 1):
                continue
            got = self._recv()
            msg = got[0] if got else None
            if isinstance(msg, m.NodeRegistered):
                self.heartbeat_s, self.liveness = msg.heartbeat_s, msg.liveness
                self.registered = True
                held, self.held = [*self.replay.again(), *self.held], collections.deque(maxlen=HELD_MAX)
                held += self.held_logs
                self.held_logs, self.held_log_bytes = collections.deque(), 0
                for h in held:
                    self._send(h)
                self.log.info("node.registered", coordinator=self.join, slots=self.slots, workers=len(self.workers), heartbeat_s=self.heartbeat_s)
                self._send(self.staging.hello())  # where its data channel listens, and what it holds
                if self.owner is not None:
                    self._send(NodeYield(reason=self.owner.yielding))  # a restarted coordinator learns it so
                return
            if isinstance(msg, m.Error) and msg.code in (ErrorCode.DUPLICATE_NAME, ErrorCode.BAD_BODY, ErrorCode.BAD_REQUEST):
                raise Refused(msg.message)  # asking again cannot help (`--workers 2000`: slots are at most 1024)
            if isinstance(msg, m.Error):
                raise NoAnswer(f"{msg.code}: {msg.message}", answered=True)
        raise NoAnswer(f"no answer from {self.join}")

    async def _connected(self, stopping: asyncio.Event) -> None:
        """Serve the coordinator until it is lost (or the daemon stops)."""
        sock = self.csock
        assert sock is not None
        expiry = time.monotonic() + self.heartbeat_s * self.liveness
        beats = asyncio.create_task(self._beat())
        try:
            while not stopping.is_set():
                wait = min(max(0.0, expiry - time.monotonic()), STOP_POLL_S)
                if await sock.poll(int(wait * 1000) + 1):
                    while (got := self._recv()) is not None:
                        msg, msg_id = got
                        expiry = time.monotonic() + self.heartbeat_s * self.liveness
                        self.replay.on_heard(time.monotonic())
                        if isinstance(msg, m.Error) and msg.code == ErrorCode.NOT_REGISTERED:
                            self.log.warning("coordinator.forgot_us")  # it restarted: register again
                            return
                        await self._on_coordinator(msg, msg_id)
                if time.monotonic() > expiry:
                    self.log.warning("coordinator.lost", address=self.join, silent_s=round(self.heartbeat_s * self.liveness, 2), workers=len(self.workers))
                    return
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats

    async def _beat(self) -> None:
        """Heartbeats while connected, in a task of their own: a message whose handling waits (a
        group's start on a zygote still importing, which can take seconds) must not silence the
        node; it was lost to the coordinator after 1.6 s of such a wait."""
        # The first at a random point of the first period: a thousand dpds that registered together
        # (after a coordinator restart) do not heartbeat together from then on.
        await asyncio.sleep(random.uniform(0, self.heartbeat_s))
        while True:
            try:
                self._send(self._heartbeat())
                self._say_waiting()
            except zmq.ZMQError as e:  # said at once, not when the connection ends (the task's end)
                self.log.warning("heartbeat.not_sent", error=str(e))
            await asyncio.sleep(self.heartbeat_s)

    def _say_waiting(self) -> None:
        """node.waiting for each rank that has waited on its peers WAITING_SAID_S or more for a
        step it has not finished: at most once per rank and step, and only for a long wait (a
        rank frozen elsewhere, a compile, a slow link, a split far from the ranks' speeds), so a
        balanced group of short steps sends none."""
        now = time.monotonic()
        for w in self.workers.values():
            if w.waiting is None or w.warm:
                continue
            step, since = w.waiting
            if step > (w.last_step or 0) and now - since >= WAITING_SAID_S and w.waiting_said != step:
                w.waiting_said = step
                self._send(m.NodeWaiting(job=w.job, generation=w.generation, rank=w.rank, step=step))

    def _heartbeat(self) -> m.NodeHeartbeat:
        """The workers alive here, and the period this node heartbeats at once the coordinator
        tells periods (an older one would refuse the field)."""
        alive = [AliveWorker(job=w.job, generation=w.generation, slot=w.slot) for w in self.workers.values()]
        return m.NodeHeartbeat(workers=alive, heartbeat_s=self.heartbeat_s if self.told else None)

    def _adopt_period(self, heartbeat_s: float, liveness: int) -> None:
        """The pool's heartbeat period changed (or the coordinator checks that this dpd follows
        it): adopted from the next heartbeat on, and acknowledged at once (daemon/cadence.py)."""
        if not self.told or (heartbeat_s, liveness) != (self.heartbeat_s, self.liveness):
            self.log.info("heartbeat.adopted", heartbeat_s=heartbeat_s, liveness=liveness, was=self.heartbeat_s)
        self.heartbeat_s, self.liveness, self.told = heartbeat_s, liveness, True
        self._send(self._heartbeat())

    def _recv(self) -> tuple[Message, int] | None:
        assert self.craw is not None
        for frames in pending(self.craw):
            try:
                return m.decode(frames, m.TO_NODE)
            except ProtocolError as e:
                self._rejected("coordinator", e)
        return None

    def _rejected(self, source: str, e: ProtocolError) -> None:
        """A frame that is not a message this daemon takes: dropped, with a rate-limited line."""
        held = self._rejected_log.allow(source, time.monotonic())
        if held is not None:
            self.log.warning("frame.rejected", source=source, code=str(e.code), error=e.message[:500], repeated=held)

    def _hold_logs(self, msg: m.NodeLogs) -> None:
        """Keep a batch of output lines for the coordinator's return; the oldest go past HELD_LOG_BYTES."""
        self.held_logs.append(msg)
        self.held_log_bytes += sum(len(line) for line in msg.lines)
        while self.held_log_bytes > HELD_LOG_BYTES and self.held_logs:
            gone = self.held_logs.popleft()
            self.held_log_bytes -= sum(len(line) for line in gone.lines)
            self.dropped += 1

    def _send(self, msg: Message, msg_id: int = 0) -> None:
        if self.craw is None or (not self.registered and not isinstance(msg, m.NodeRegister)):
            if isinstance(msg, KEPT_WHILE_AWAY):
                self.held.append(msg)  # sent once registered again: the job's record stays whole
            elif isinstance(msg, m.NodeLogs):
                self._hold_logs(msg)  # `dpctl logs` without a hole where the coordinator was away
            else:
                self.dropped += 1
            return
        try:
            self.craw.send_multipart(msg.to_frames(msg_id), flags=zmq.NOBLOCK)
            self._last_sent = time.monotonic()
            self.replay.on_sent(msg, self._last_sent)
        except zmq.Again:
            self.dropped += 1  # the coordinator is gone or slow; progress must not wait for it
        except ProtocolError as e:
            self.log.warning("message.too_large", type=str(msg.TYPE), error=e.message)

    async def _on_coordinator(self, msg: Message, msg_id: int = 0) -> None:
        if isinstance(msg, (m.GroupPrepare, m.GroupStart, m.GroupStop, m.ExportPrepare, m.JobRemove, m.JobWarm, m.JobEnded)) and not valid_job_id(msg.job):
            self._refuse_job_id(msg, msg_id)
            return
        match msg:
            case m.CoordHeartbeat(heartbeat_s=float() as period, liveness=int() as liveness):
                self._adopt_period(period, liveness)
            case m.CoordHeartbeat() | m.NodeRegistered():
                pass
            case m.GroupPrepare():
                self._send(self._prepare(msg))
            case m.GroupStart():
                await self._start(msg)
            case m.GroupStop(job=job, generation=gen, mode=mode):
                for holders in self.reserved.pop((job, gen), []):
                    holders.close()
                for w in list(self.workers.values()):
                    if w.job == job and (gen == 0 or w.generation == gen):
                        self._stop(w, mode, "group.stop")
                if mode == "now":
                    self._send(self._heartbeat())  # the answer a group stopped at once waits for (Pool.tick)
            case m.ExportPrepare() | m.ExportFetch():
                task = asyncio.create_task(self._export(msg, msg_id))  # off the loop: heartbeats go on
                self.export_tasks.add(task)
                task.add_done_callback(self.export_tasks.discard)
                if isinstance(msg, m.ExportPrepare) and msg.export_id not in self.export_prepares:
                    self.export_prepares[msg.export_id] = task
                    task.add_done_callback(functools.partial(_forget, self.export_prepares, msg.export_id))
            case m.JobRemove(job=job):
                self._remove_job(job)
            case m.JobWarm():
                self._warm_job(msg)
            case JobStage():
                self.staging.on_stage(msg, self._send)
                model = msg.spec.get("model")
                if isinstance(model, dict):  # what its trainers import beyond the zygote's: now, while its files stage
                    self.forks.preload(modules_for(model.get("kind")))
            case StageAccept():
                self.staging.accept(msg)
            case StagePeers(peers=peers):
                self.staging.peers = set(peers)
            case StagePrune():
                self.staging.on_prune(self._send)
            case m.JobEnded(job=job):
                if self.staging.ended(job):
                    self._send(self.staging.hello())  # its trees may be pruned now: say so
                self._retire_spares(job, "its job ended")
                self.ended.add(job)
                self._forget_kept(job)
            case m.ExportRelease(export_id=export_id):
                preparing = self.export_prepares.get(export_id)
                if preparing is not None:
                    preparing.cancel()  # the coordinator gave up on it: its trainer is killed
                    self.log.info("export.cancelled", export=export_id)
                elif self.exporter.release(export_id):
                    self.log.info("export.released", export=export_id)
            case m.Error():
                self.log.warning("coordinator.error", code=msg.code, error=msg.message)
            case _:
                self.log.warning("message.unexpected", type=str(msg.TYPE))

    def _refuse_job_id(self, msg: m.GroupPrepare | m.GroupStart | m.GroupStop | m.ExportPrepare | m.JobRemove | m.JobWarm | m.JobEnded, msg_id: int) -> None:
        """A job id that is not one (`..`, `/`, ...) never becomes a path: a log line, and the
        answer the message asks for (a refused prepare, the ranks' exits, an error)."""
        why = f"job id {msg.job[:80]!r} is not a job id"
        held = self._refused_log.allow("job_id", time.monotonic())
        if held is not None:
            self.log.warning("job_id.refused", type=str(msg.TYPE), job=msg.job[:80], repeated=held)
        match msg:
            case m.GroupPrepare():
                self._send(m.NodePrepared(job=msg.job, generation=msg.generation, host=self.advertise, ports=[], error=why))
            case m.GroupStart():
                for r in msg.ranks:
                    self._report_exit(msg.job, msg.generation, r.rank, r.slot, 2, False, why)
            case m.ExportPrepare():
                self._send(m.Error(code=str(ErrorCode.BAD_REQUEST), message=f"node {self.name}: {why}"), msg_id)
            case m.JobWarm():
                self._send(m.NodeWarmed(job=msg.job, slots=[], error=why))
            case _:
                pass  # group.stop, job.remove: it names no worker or folder of this node; nothing to answer

    async def _export(self, msg: m.ExportPrepare | m.ExportFetch, msg_id: int) -> None:
        """Answer export.prepare or export.fetch, with the request's id."""
        reply: Message
        try:
            if isinstance(msg, m.ExportPrepare):
                self.log.info("export.preparing", export=msg.export_id, job=msg.job, step=msg.step)
                t0 = time.monotonic()
                ready = await self.exporter.prepare(msg)
                self.log.info("export.prepared", export=msg.export_id, job=msg.job, step=ready.step, files=len(ready.files), seconds=round(time.monotonic() - t0, 3))
                reply = ready
            else:
                reply = await self.exporter.fetch(msg)
        except asyncio.CancelledError:
            return  # released while being prepared, or the daemon is stopping: nobody waits for it
        except ExportError as e:
            self.log.warning("export.refused", export=msg.export_id[:80], type=str(msg.TYPE), code=str(e.code), error=e.message)
            reply = m.Error(code=str(e.code), message=self.staging.named(msg.job, e.message))
        except Exception as e:  # a bug must cost one request, not the daemon
            self.log.exception("export.failed", export=msg.export_id[:80])
            reply = m.Error(code=str(ErrorCode.INTERNAL), message=f"node {self.name}: {type(e).__name__}: {e}")
        self._send(reply, msg_id)

    # -- groups --------------------------------------------------------------------------------

    def _prepare(self, msg: m.GroupPrepare) -> m.NodePrepared:
        """Reserve one TCP port per slot on the advertised address: bound (not listening) until
        the group starts, so no other process takes it; released just before the trainer binds it."""
        busy = [s for s in msg.slots if s in self.workers or not 0 <= s < self.slots]
        if busy:
            return m.NodePrepared(job=msg.job, generation=msg.generation, host=self.advertise, ports=[], error=f"slots {busy} are busy or do not exist")
        holders = []
        try:
            for _ in msg.slots:
                s = socket.socket(socket.AF_INET6 if ":" in self.advertise else socket.AF_INET, socket.SOCK_STREAM)
                # As MLX binds it: a co-located last rank probing whether this port listens yet
                # (trainer/listening.py) then sees a reserved port as not listening, not as taken.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((self.advertise, 0))
                holders.append(s)
        except OSError as e:
            for s in holders:
                s.close()
            return m.NodePrepared(job=msg.job, generation=msg.generation, host=self.advertise, ports=[], error=f"cannot bind {self.advertise}: {e}")
        for old in self.reserved.pop((msg.job, msg.generation), []):
            old.close()
        self.reserved[(msg.job, msg.generation)] = holders
        ports = [s.getsockname()[1] for s in holders]
        self.log.info("group.prepared", job=msg.job, generation=msg.generation, slots=msg.slots, ports=ports)
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return m.NodePrepared(job=msg.job, generation=msg.generation, host=host, ports=ports)

    async def _start(self, msg: m.GroupStart) -> None:
        job_dir = self.state_dir / "jobs" / msg.job
        world = len(msg.hostfile)
        job_file, hostfile = job_dir / "job.toml", job_dir / f"hostfile-g{msg.generation}.json"
        changed = await self.staging.recheck(msg.job, self._send)
        if changed is not None:
            # This node's files are not the job's any more: its ranks refuse their input (exit 2),
            # so the pool leaves this node out, not the group's others, until it is staged again.
            self.log.error("group.start_refused", job=msg.job, generation=msg.generation, error=changed)
            self._refuse_start(msg, 2, changed)
            return
        try:
            self._job_files(msg.job, msg.spec)
            if world > 1:
                write_file(hostfile, orjson.dumps(msg.hostfile))
        except (JobFileError, ValueError, TypeError) as e:
            self.log.error("group.bad_spec", job=msg.job, error=str(e))
            self._refuse_start(msg, 2, str(e))
            return
        except OSError as e:
            # This machine's fault (a full disk, a read-only folder): each of its ranks fails with
            # the reason and EXIT_DISK, so the pool blames this node, not the group's others.
            self.log.error("group.start_failed", job=msg.job, generation=msg.generation, error=str(e))
            self._refuse_start(msg, EXIT_DISK, f"cannot write the job's folder: {e}")
            return
        for holder in self.reserved.pop((msg.job, msg.generation), []):
            holder.close()  # the port is the trainer's to bind now
        for r in msg.ranks:
            await self._spawn(msg, job_file, hostfile if world > 1 else None, r.rank, r.slot)
        self.log.info("group.launched", job=msg.job, generation=msg.generation, ranks=[r.rank for r in msg.ranks], world_size=world)

    def _refuse_start(self, msg: m.GroupStart, code: int, reason: str) -> None:
        """This node starts none of the group's ranks: each is reported exited with `code` and
        the reason, and the ports held for them are let go."""
        for holder in self.reserved.pop((msg.job, msg.generation), []):
            holder.close()
        for r in msg.ranks:
            self._report_exit(msg.job, msg.generation, r.rank, r.slot, code, False, clean(reason))

    async def _spawn(self, msg: m.GroupStart, job_file: Path, hostfile: Path | None, rank: int, slot: int) -> None:
        old = self.workers.get(slot)
        if old is not None:
            self.log.error("slot.busy", slot=slot, job=msg.job, running=old.job)
            self._report_exit(msg.job, msg.generation, rank, slot, 1, False)
            return
        spare = self.spares.pop(slot, None)
        if spare is not None:
            if spare.job == msg.job and spare.proc.returncode is None and not spare.stopping:
                self._go(spare, msg, hostfile, rank)
                return
            self._stop(spare, "now", "its slot starts another job")
        run_dir = self._run_dir(msg.job, slot)
        shares = ",".join(str(s) for s in msg.shares)
        args = [str(job_file), "--run-dir", str(run_dir), "--shares", shares, "--generation", str(msg.generation)]
        if msg.resume_max is not None:
            args += ["--resume-max", str(msg.resume_max)]
        extra = {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)} if hostfile is not None else {}
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.log.error("worker.spawn_failed", job=msg.job, rank=rank, error=str(e))
            self._report_exit(msg.job, msg.generation, rank, slot, EXIT_DISK, False, clean(f"cannot make the run dir: {e}"))
            return
        try:
            proc = await self._launch(msg.job, slot, run_dir, args, extra)
        except OSError as e:
            self.log.error("worker.spawn_failed", job=msg.job, rank=rank, error=str(e))
            self._report_exit(msg.job, msg.generation, rank, slot, 127, False, clean(f"cannot start the trainer: {e}"))
            return
        w = Worker(job=msg.job, generation=msg.generation, rank=rank, slot=slot, run_dir=run_dir, proc=proc)
        self.workers[slot] = w
        self.awake.update(len(self.workers))  # the first trainer: the Mac stays awake from now
        w.tasks.append(asyncio.create_task(self._watch(w)))
        self._send(m.NodeWorkerStarted(job=w.job, generation=w.generation, rank=rank, slot=slot, pid=proc.pid))
        self.log.info("worker.started", job=w.job, generation=w.generation, rank=rank, slot=slot, pid=proc.pid, warm=False, forked=isinstance(proc, ForkedProcess))
        self._recorded(w)  # a hello read before this record counts now

    def _run_dir(self, job: str, slot: int) -> Path:
        """Where a trainer of `job` in `slot` runs, its spare too (`job` checked as a job id)."""
        return self.state_dir / "jobs" / job / f"slot-{slot}"

    async def _launch(self, job: str, slot: int, run_dir: Path, args: list[str], extra: dict[str, str]) -> asyncio.subprocess.Process | ForkedProcess:
        """A trainer: forked from this dpd's zygote where it can be, else a new interpreter."""
        env = trainer_env(DPOOL_WORKER_ADDR=self.worker_addr, DPOOL_JOB_ID=job, **extra)  # the job's id: its W&B run (trainer/report.py)
        if self.memory.root.is_dir():
            env["DPOOL_MEMORY_DIR"] = str(self.memory.folder(job, slot))
        then = modules_for(self.kinds.get(job))
        try:
            return await self.forks.spawn(args, env, str(run_dir), then)
        except ForkServerError as e:
            if self.forks.enabled and not self.closing:
                self.log.info("worker.not_forked", job=job, slot=slot, why=str(e))
        return await asyncio.create_subprocess_exec(
            *trainer_command(*args),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=str(run_dir),
            start_new_session=True,  # its own process group: stopping it stops its children too
            preexec_fn=die_with_parent(os.getpid()),
            limit=1 << 20,
        )

    def _forget_kept(self, job: str) -> None:
        """An ended job's state in memory goes once no worker of it runs here."""
        if job in self.ended and not any(w.job == job for w in self.workers.values()):
            self.ended.discard(job)
            self.memory.remove(job)
            self.log.info("memory_state.removed", job=job, why="its job ended")

    async def _watch(self, w: Worker) -> None:
        """Read the worker's output until EOF, then its exit status; report both. Whatever happens
        to the reading (or to worker.log), the process is waited for, its slot freed and its exit
        reported."""
        try:
            await self._read_output(w)
        except Exception:
            self.log.exception("worker.output_failed", job=w.job, rank=w.rank, pid=w.pid)
            self._stop(w, "now", "its output could not be read")  # it would block on a full pipe
        code = await w.proc.wait()
        for t in w.tasks[1:]:
            t.cancel()  # the SIGKILL timer, if any
        slot = w.slot
        if w.warm:  # a spare never used: nothing to report
            if self.spares.get(slot) is w:
                del self.spares[slot]
            # The coordinator waits for it (job.warm): it need not.
            self._warm_answered(w.job, w.slot, clean(f"the warm trainer in slot {w.slot} exited with {code}: {w.error or 'no error line'}"))
            log = self.log.info if w.stopping else self.log.warning
            log("spare.exited", job=w.job, slot=w.slot, pid=w.pid, code=code, stopped=w.stopping, error=w.error, output=w.lines[-5:] if not w.stopping else None)
            return
        self._flush(w)
        # What it said before it exited goes first: its last checkpoint reports (a planned stop's
        # checkpoint above all) were sent before its exit, and the coordinator picks the step the
        # next group resumes from by them. Anything its link delivers later is still its own.
        if self.wraw is not None:
            self._read_workers()
        if w.peer is not None:
            self.gone[w.peer] = w
            while len(self.gone) > EXITS_KEPT:
                self.gone.popitem(last=False)
        if self.workers.get(slot) is w:
            del self.workers[slot]
        self.awake.update(len(self.workers))  # the last trainer: it may sleep again
        if w.error is not None:
            w.error = self.staging.named(w.job, w.error)  # the user's paths, not this node's cache's
        self._report_exit(w.job, w.generation, w.rank, w.slot, code, w.stopping, w.error, w.last_step)
        self.log.info("worker.exited", job=w.job, generation=w.generation, rank=w.rank, code=code, stopped=w.stopping, error=w.error)
        if code == 2 and w.error is not None and NOT_THE_CONTENT in w.error:
            self.staging.verify(w.job, self._send)  # its copy does not hash to the job's digest: find the damage, fetch it again
        if code == 0:  # the job is done: what was kept for its restarts goes
            self._retire_spares(w.job, "its job finished")
            self.memory.remove(w.job, w.slot)
        self._forget_kept(w.job)
        if w.job in self.removing:
            self._remove_job(w.job)  # removed meanwhile: its folder goes once its last worker here is gone

    async def _read_output(self, w: Worker) -> None:
        """Relay the worker's output lines and keep them in its worker.log (rotated by size); a
        write that fails (a full disk) loses those lines from the file, said once per outage."""
        assert w.proc.stdout is not None
        failing = False
        held: list[bytes] = []  # a spare's output, written to worker.log once it is used
        with RotatingFile(w.run_dir / "worker.log", WORKER_LOG_BYTES, WORKER_LOG_BACKUPS) as local:
            while True:
                try:
                    raw = await w.proc.stdout.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    raw = await w.proc.stdout.read(1 << 16)  # an endless line: take it in pieces
                if not raw:
                    break
                if w.warm:  # the slot's worker.log is its running worker's
                    held = [*held[-SPARE_LINES + 1:], raw]
                    text = raw.decode("utf-8", "replace").rstrip("\n")
                    w.lines = [*w.lines[-SPARE_LINES + 1:], text[:LOG_LINE_MAX]]
                    w.error = error_message(text, str(w.run_dir.parent / "job.toml")) or w.error
                    continue
                if held:
                    raw, held = b"".join(held) + raw, []
                try:
                    local.write(raw)
                    if failing:
                        failing = False
                        self.log.info("worker.log_written_again", job=w.job, rank=w.rank, lost_writes=local.failed)
                except OSError as e:
                    if not failing:
                        failing = True
                        self.log.warning("worker.log_failed", job=w.job, rank=w.rank, path=str(local.path), error=str(e))
                text = raw.decode("utf-8", "replace").rstrip("\n")
                w.lines.extend(line[:LOG_LINE_MAX] for line in text.split("\n"))
                w.error = error_message(text.rsplit("\n", 1)[-1], str(w.run_dir.parent / "job.toml")) or w.error
                if len(w.lines) >= LOG_BATCH_LINES:
                    self._flush(w)

    def _report_exit(self, job: str, generation: int, rank: int, slot: int, code: int, stopped: bool, error: str | None = None, step: int | None = None) -> None:
        exit_ = ExitedWorker(job=job, generation=generation, rank=rank, slot=slot, code=code, stopped=stopped, error=error, step=step)
        self.exited.append(exit_)
        self._send(m.NodeWorkerExited(job=job, generation=generation, rank=rank, slot=slot, code=code, stopped=stopped, error=error))

    def _stop(self, w: Worker, mode: str, why: str) -> None:
        if mode == "checkpoint":
            if w.peer is not None:
                self._to_worker(w.peer, m.WorkerStop())
            else:
                w.stop_at_checkpoint = True
            return
        if w.proc.returncode is not None or w.stopping:
            return
        if not is_alive(w.pid):
            # Already dead, its exit not yet reaped (a forked trainer's comes through the zygote):
            # that exit is its own failure, not our stop, and is reported as such.
            return
        w.stopping = True
        self.log.info("worker.stopping", job=w.job, rank=w.rank, pid=w.pid, why=why, grace_s=self.stop_grace_s)
        self._signal(w, signal.SIGTERM)
        self._signal(w, signal.SIGCONT)  # a stopped (SIGSTOP) trainer acts on SIGTERM only once continued
        w.tasks.append(asyncio.create_task(self._kill_after_grace(w)))

    async def _kill_after_grace(self, w: Worker) -> None:
        await asyncio.sleep(self.stop_grace_s)  # the grace period itself, not a race
        if w.proc.returncode is None:
            self.log.warning("worker.killed", job=w.job, rank=w.rank, pid=w.pid, after_s=self.stop_grace_s)
            self._signal(w, signal.SIGKILL)

    def _check_stopped(self, now: float) -> None:
        """Kill a trainer whose process has stayed stopped for `stopped_s`. A worker's exit is then
        its failure (its group cannot step without it). One being stopped already is killed too:
        a SIGSTOP after our SIGCONT would hold it, and its slot, until the grace's SIGKILL; and a
        stopped spare, so that no generation is handed a process that cannot run."""
        if self.stopped_s <= 0:
            return
        for w in [*self.workers.values(), *self.spares.values()]:
            if w.proc.returncode is not None or not is_stopped(w.pid):
                w.stopped_since = None
            elif w.stopped_since is None:
                w.stopped_since = now
            elif now - w.stopped_since >= self.stopped_s:
                stopped_s = round(now - w.stopped_since, 2)
                w.stopped_since = None
                if w.warm and w.slot in self.spares and self.spares[w.slot] is w:
                    del self.spares[w.slot]  # not to be given a rank; its exit answers a job.warm waiting on it
                if w.stopping or w.warm:
                    w.stopping = True  # its exit is ours, not a failure
                else:
                    w.error = f"its process was stopped (SIGSTOP or job control) for {stopped_s:.1f} s; its group cannot step without it"
                self.log.warning("worker.stopped_process", job=w.job, rank=w.rank, pid=w.pid, stopped_s=stopped_s, spare=w.warm, stopping=w.stopping)
                self._signal(w, signal.SIGKILL)

    def _signal(self, w: Worker, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(w.pid, sig)  # the worker's own group (start_new_session): it and its children

    async def _stop_all(self, why: str) -> None:
        self.closing = True
        workers = list(self.workers.values()) + list(self.spares.values())
        for w in workers:
            self._stop(w, "now", why)
        if workers:
            await asyncio.gather(*(w.tasks[0] for w in workers), return_exceptions=True)

    # -- removed jobs --------------------------------------------------------------------------

    def _removed_dir(self) -> Path:
        return self.state_dir / "removed"

    def _remove_job(self, job: str) -> None:
        """Delete this node's folder of a removed job (its id checked before): never while a worker
        of it runs here (then once the last one has exited). The folder is renamed out of `jobs/`
        at once (so it is no longer a holding) and deleted in a thread; then `node.removed`."""
        self._retire_spares(job, "its job was removed")
        self.memory.remove(job)
        self.kinds.pop(job, None)
        running = sorted(w.rank for w in self.workers.values() if w.job == job)
        if running:
            if job not in self.removing:
                self.log.info("job.remove_waits", job=job, ranks=running)
            self.removing.add(job)
            return
        self.removing.discard(job)
        folder = self.state_dir / "jobs" / job
        if folder.is_dir():
            run_dirs, files, size = _contents(folder)
            aside = self._removed_dir() / f"{job}-{secrets.token_hex(4)}"
            try:
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.rename(folder, aside)
            except OSError as e:  # asked again when it next registers
                self.log.error("job.remove_failed", job=job, path=str(folder), error=str(e))
                return
            self.log.info("job.removed", job=job, path=str(folder), run_dirs=run_dirs, files=files, bytes=size)
            threading.Thread(target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True}, daemon=True).start()
        else:
            self.log.info("job.removed", job=job, path=str(folder), run_dirs=[], files=0, bytes=0)
        self._send(m.NodeRemoved(job=job))

    def _holdings(self) -> list[Holding]:
        out = []
        for job_dir in sorted((self.state_dir / "jobs").glob("*")):
            for run_dir in sorted(job_dir.glob("slot-*")):
                step = newest_step(run_dir)
                slot = run_dir.name.split("-", 1)[1]
                if step is None or not slot.isdigit():
                    continue
                try:  # a run dir of a slot this node no longer has, say, is not worth refusing the node for
                    out.append(Holding.from_wire({"job": job_dir.name, "slot": int(slot), "step": step}))
                except Invalid:
                    continue
        for job, slot, step in self.memory.holdings():
            with contextlib.suppress(Invalid):
                out.append(Holding.from_wire({"job": job, "slot": slot, "step": step, "memory": True}))
        return out[: m.HOLDINGS_MAX]

    # -- the workers' link ---------------------------------------------------------------------

    async def _worker_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.poll(1000)
            self._read_workers()

    def _read_workers(self) -> None:
        """Every message the trainers' link holds now, in order."""
        raw = self.wraw
        assert raw is not None
        for frames in pending(raw, frames=m.MAX_FRAMES + 1):
            if len(frames) < 2:
                continue
            try:
                msg, _ = m.decode(frames[1:], m.FROM_WORKER)
            except ProtocolError as e:
                self._rejected("worker", e)
                continue
            self._on_worker(frames[0], msg)

    def _on_worker(self, peer: bytes, msg: Message) -> None:
        if isinstance(msg, m.WorkerReady):
            w = next((w for w in [*self.spares.values(), *self.workers.values()] if w.pid == msg.pid), None)
            if w is None:
                self._early(msg.pid, peer, msg)
                return
            w.peer = peer
            if w.go is not None:
                self._to_worker(peer, w.go)
                w.go = None
            self.log.info("spare.ready", job=w.job, slot=w.slot, pid=w.pid, used=not w.warm)
            self._warm_answered(w.job, w.slot)
            return
        if isinstance(msg, m.WorkerHello):
            w = next((w for w in self.workers.values() if w.pid == msg.pid), None)
            if w is None:
                self._early(msg.pid, peer, msg)
                return
            w.peer = peer
            if w.stop_at_checkpoint:
                self._to_worker(peer, m.WorkerStop())
            self._send(m.NodeWorkerHello(job=w.job, generation=w.generation, rank=w.rank, pid=msg.pid, resume_step=msg.resume_step))
            return
        w = next((w for w in self.workers.values() if w.peer == peer), None) or self.gone.get(peer)
        if w is None:
            self.early.follow(peer, msg)  # kept if its trainer's hello is (not yet recorded); else one that has exited
            return
        match msg:
            case m.WorkerProgress(step=step, loss=loss, tokens=tokens, seconds=seconds, resplit=resplit, gather=gather):
                self._send(m.NodeProgress(
                    job=w.job, generation=w.generation, rank=w.rank, step=step, loss=loss, tokens=tokens, seconds=seconds,
                    resplit=resplit, gather=gather,
                ))
                w.steps += 1
                w.last_step = step
                if w.steps == SPARE_AFTER_STEPS and not w.stopping and not w.stop_at_checkpoint:
                    self._spare_soon(w.job, w.slot)  # the slot's next generation starts warm
            case m.WorkerWaiting(step=step):
                w.waiting = (step, time.monotonic())  # relayed only if it waits long (_say_waiting)
            case m.WorkerMetric(row=row):
                self._send(m.NodeMetric(job=w.job, generation=w.generation, row=row))
            case m.WorkerSample(row=row):
                self._send(m.NodeSample(job=w.job, generation=w.generation, row=row))
            case m.WorkerCheckpoint(step=step, seconds=seconds, memory=memory):
                self._send(m.NodeCheckpoint(job=w.job, generation=w.generation, rank=w.rank, slot=w.slot, step=step, seconds=seconds, memory=memory))
            case WorkerLink(ring=ring, params=params):
                self._send(NodeLink(job=w.job, generation=w.generation, rank=w.rank, ring=ring, params=params))
            case _:
                self.log.warning("message.unexpected", source="worker", type=str(msg.TYPE))

    def _early(self, pid: int, peer: bytes, msg: Message) -> None:
        """A worker.ready or worker.hello from a pid not recorded (yet): kept until its record is
        made, which may come later (its start has not returned), or EARLY_S has passed."""
        self.log.info("worker.early", pid=pid, type=str(msg.TYPE))
        dropped = self.early.hold(pid, peer, msg, time.monotonic())
        if dropped is not None:
            self.log.warning("worker.unknown", pid=dropped.pid, reports=len(dropped.messages), why="too many unrecorded trainers")

    def _recorded(self, w: Worker) -> None:
        """`w` was just recorded (or stopped as not needed): what it said before is handled now, in order."""
        early = self.early.take(w.pid)
        if early is None:
            return
        if not any(x is w for x in (*self.spares.values(), *self.workers.values())):
            return  # stopped at once: its reports go with it
        self.log.info("worker.early_handled", pid=w.pid, reports=len(early.messages), dropped=early.dropped, waited_s=round(time.monotonic() - early.at, 3))
        for msg in early.messages:
            self._on_worker(early.peer, msg)

    def _to_worker(self, peer: bytes, msg: Message) -> None:
        assert self.wraw is not None
        with contextlib.suppress(zmq.ZMQError):
            self.wraw.send_multipart([peer, *msg.to_frames()], flags=zmq.NOBLOCK)

    async def _flush_loop(self) -> None:
        next_sweep = 0.0
        while True:
            await asyncio.sleep(LOG_FLUSH_S)  # batching interval for output lines
            for w in list(self.workers.values()):
                self._flush(w)
            now = time.monotonic()
            self._check_stopped(now)
            self._check_warm(now)
            for early in self.early.expire(now):
                self.log.warning("worker.unknown", pid=early.pid, reports=len(early.messages), waited_s=round(now - early.at, 1))
            if now >= next_sweep:  # listing the memory folders: not every batching interval
                next_sweep = now + SWEEP_S
                self._check_spares(now)
                for job in self.memory.sweep(now, {w.job for w in self.workers.values()}):
                    self.log.info("memory_state.removed", job=job, why="no worker of it here for a while")
            for export_id in self.exporter.expire(time.monotonic()):
                self.log.info("export.expired", export=export_id)

    def _flush(self, w: Worker) -> None:
        while w.lines:
            batch, w.lines = w.lines[:LOG_BATCH_LINES], w.lines[LOG_BATCH_LINES:]
            self._send(m.NodeLogs(job=w.job, generation=w.generation, rank=w.rank, lines=batch))


def _forget(tasks: dict[str, asyncio.Task[Any]], key: str, _done: asyncio.Task[Any]) -> None:
    tasks.pop(key, None)


def _contents(folder: Path) -> tuple[list[str], int, int]:
    """A job folder's run dirs (`slot-K`), and its files and bytes in all, for the log."""
    files = size = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
    return sorted(p.name for p in folder.glob("slot-*")), files, size


def _seconds(text: str | None, default: float) -> float:
    """A duration from the environment; the default when unset or not a number (said nowhere:
    these knobs are for benches and tests)."""
    try:
        return float(text) if text is not None else default
    except ValueError:
        return default
