"""The coordinator: a ROUTER socket and an asyncio loop around the pure `Pool`.

The loop reads every waiting frame, decodes it (a bad one gets an `error` reply naming the field,
and a rate-limited log line), hands it to the pool or answers a query from the store, carries out
the pool's actions, and on a timer ticks the pool (heartbeat expiry, deadlines) and heartbeats each
registered node once per its period (daemon/cadence.py). Then it lets the pool admit waiting jobs
(once per batch, not per message, and at most every 50 ms), commits, and only then sends what the
batch produced: a `group.start` never leaves before the generation it
starts is on disk, so a restarted coordinator cannot start that generation number again.

With CURVE keys every connection has a role, named by the ZAP handler (protocol/security.py): a
node key may send `node.*` and register only under its own name, a client key dpctl's requests, a
viewer key only the read-only ones; anything else is answered `forbidden` and logged. A key taken
out of the allow-list is refused on its connection's next message, and the node that connection
registered is gone. A node's report about a rank the plan gave another node is refused by the pool
(`Refused`) and logged.

Nothing a peer sends stops the loop. Each request and each tick is one unit of work: its database
writes are a savepoint and its messages wait in the outbox, so a unit that raises is undone whole
(its writes rolled back, its messages dropped; a request gets `internal`), logged with a traceback
at most once a minute per kind, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
import secrets
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from dpool.daemon import export_relay as xr
from dpool.daemon import jobstate as js
from dpool.daemon import statuspage
from dpool.daemon.cadence import HEARTBEAT_RATE
from dpool.daemon.export_relay import ExportRelay
from dpool.daemon.fitness import TRAINING_RATE_BPS
from dpool.daemon.pool import (
    Busy,
    JobChanged,
    NodeChanged,
    NodeForgotten,
    Pool,
    Record,
    Refused,
    Send,
)
from dpool.daemon.records import JobRef
from dpool.daemon.sharing import queue_reply, set_priority
from dpool.daemon.store import Store
from dpool.protocol import messages as m
from dpool.protocol.fit import fit
from dpool.protocol.jobspec import JobFileError, parse_job
from dpool.protocol.link_messages import NodeLink
from dpool.protocol.logs import Throttle, get_logger
from dpool.protocol.messages import ErrorCode, Message, MsgType, ProtocolError
from dpool.protocol.owner_messages import NodeYield
from dpool.protocol.payloads import EvalRow, EventRow, JobStatus, SampleRow, TestLossRow, TrainRow
from dpool.protocol.peerbudget import PeerBudget
from dpool.protocol.security import (
    HANDSHAKE_EVENTS,
    REFUSAL_LOG_S,
    ROLE_RULE,
    ROLE_SENDS,
    CurveServer,
    ServerKeys,
    user_parts,
)
from dpool.protocol.sharing import Queue, SetPriority
from dpool.protocol.sockets import HWM, pending_from
from dpool.protocol.stage_messages import (
    Cache,
    CachePrune,
    CachePruneReply,
    CacheReply,
    NodeStaged,
    StageAccept,
    StageOffer,
    StagePrune,
)

BATCH = 500  # frames handled between commits and ticks, at most
BATCH_S = 0.02  # and for at most this long: a flood of registrations cannot hold back the ticks
BAD_FRAME_LOGS_PER_S = 5
SLOW_UNIT_S = 0.25  # a unit of work this long holds every peer back: logged (rate-limited), with what it was
TRACEBACK_EVERY_S = 60.0  # one traceback per kind of failure this often; the others are counted
HEARTBEAT = m.CoordHeartbeat().to_frames()
SCHEDULE_S = 0.05  # admission at most this often (a pass over 2,000 nodes costs ms, a batch of reports less), after what was read
ALIVE_MARK_S = 1.0  # how often the store is told the coordinator lives (Store.mark_alive): a crash is dated to within this
READ_LAG_S = 10.0  # a node's silence is judged at most this far behind the clock (Pool.tick's read_to)
PAUSE_S = 1.0  # the coordinator woke this much later than it asked to: it was not running (stopped, starved)
PAUSE_GRACE_S = 5.0  # then, for this long, silence is judged only up to when it stopped running
AMBIGUOUS_SHOWN = 5  # ids named when a prefix matches several jobs
STORED_ROWS = (TrainRow, EvalRow, TestLossRow, SampleRow, EventRow)  # read back by the store through from_wire: valid as read


def steady_clock() -> Callable[[], float]:
    """Wall time as of now, advanced by the monotonic clock from here on.

    Liveness and every deadline are differences of this clock, so a step of the system clock (NTP
    correcting it, a user setting the date, a laptop waking) can neither mark every node lost at
    once nor stop the ticks. It drifts from wall time by every such step, and by the time the
    machine sleeps (the monotonic clock does not count it), so what people read as times (events,
    a job's submitted, started and finished times, its output lines) is stamped in wall time
    instead: the pool's `wall(now)`, from the offset the coordinator gives it each time it reads
    its clock (Coordinator._now)."""
    wall, mono = time.time(), time.monotonic()
    return lambda: wall + (time.monotonic() - mono)


class Coordinator:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        addr: str,
        state_dir: str | Path,
        *,
        heartbeat_s: float = 0.25,
        liveness: int = 6,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time,
        keys: ServerKeys | None = None,
        stage_rate_bps: float = TRAINING_RATE_BPS,
        heartbeat_rate: float = HEARTBEAT_RATE,
    ) -> None:
        self.ctx, self.addr, self.clock, self.wall = ctx, addr, clock or steady_clock(), wall
        self.keys = keys  # CURVE with an allow-list when given
        self.sender_key, self.sender_name = "", ""  # the key and name that sent the message being served
        self.curve: CurveServer | None = None
        self.heartbeat_s = heartbeat_s
        self.pool = Pool(heartbeat_s=heartbeat_s, liveness=liveness, stage_rate_bps=stage_rate_bps, heartbeat_rate=heartbeat_rate)
        self.period_said = heartbeat_s  # the pool's heartbeat period last logged (daemon/cadence.py)
        self.read_to = self.clock()  # when the socket's input was last read to its end (Pool.tick)
        self.paused: tuple[float, float] | None = None  # (when it stopped running, until when silence is judged only up to then)
        self.alive_marked = -math.inf  # when Store.mark_alive was last written
        self.scheduled_at, self.to_schedule = 0.0, True  # admission's last run; whether it is due
        self.exports = ExportRelay()  # `dpctl export`: requests to nodes and chunks back, relayed
        self.store = Store(Path(state_dir) / "coordinator.sqlite3")
        self.log = get_logger(component="coordinator")
        self.peer_of: dict[str, bytes] = {}  # node name -> routing id
        self.node_of: dict[bytes, str] = {}
        self.sock: zmq.asyncio.Socket | None = None
        self.raw: zmq.Socket | None = None  # the same socket, for non-blocking recv/send
        self.peers: PeerBudget | None = None  # what each connection may have queued, in bytes (protocol/peerbudget.py)
        self._outbox: list[list[bytes]] = []  # sent once the batch is committed
        self.endpoint: str | None = None
        self.ready = asyncio.Event()
        self.stats = {"frames": 0, "rejected": 0, "progress": 0, "failed": 0}
        self._rejected_log = Throttle(lines=BAD_FRAME_LOGS_PER_S, every=1.0)
        self._failed_log = Throttle(lines=1, every=TRACEBACK_EVERY_S)
        self._refused_log = Throttle(lines=1, every=REFUSAL_LOG_S)  # forbidden messages, refused reports: per key and kind
        self._slow_log = Throttle(lines=1, every=TRACEBACK_EVERY_S)
        self._fitted_log = Throttle(lines=1, every=TRACEBACK_EVERY_S)  # messages fitted to their bounds: per type

    # -- the loop ------------------------------------------------------------------------------

    def bind(self) -> str:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)  # a peer sending more is disconnected
        # Per peer: a client that never reads its replies costs at most HWM of them, then ZeroMQ
        # drops what does not fit (a ROUTER never blocks); a flooding peer is throttled by TCP.
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.SNDHWM, HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone or full peer says so: the budget counts what was queued
        if self.keys is not None:
            self.curve = CurveServer(self.ctx, self.keys, self.log)  # before bind: no plain handshake
            self.curve.apply(sock, monitor=False)  # the socket's one monitor is the budget's, which hands it the handshakes
        # And in bytes, each way: a peer that never reads, or never finishes a message, is dropped
        # past PEER_BYTES. Before bind: its monitor sees every connection.
        handshakes = {"events": HANDSHAKE_EVENTS, "on_event": self.curve.handshake_event} if self.curve is not None else {}
        self.peers = PeerBudget(self.ctx, sock, self.log, curve=self.keys is not None, name_of=self.node_of.get, **handshakes)
        try:
            sock.bind(self.addr)
        except zmq.ZMQError:  # the address is taken (or not this machine's): undo what was started, quietly
            self.peers.close()
            self.peers = None
            if self.curve is not None:
                for t in self.curve.tasks:
                    t.cancel()
                self.curve.zap.close(linger=0)
                self.curve = None
            sock.close(linger=0)
            raise
        self.sock, self.raw = sock, zmq.Socket.shadow(sock.underlying)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        now = self._now()
        self.pool.remembered = self.store.held_nodes()
        self.pool.known_nodes = len(self.store.node_names())
        alive_at = self.store.alive_at()  # the previous coordinator's last sign of life, wall time
        down_since = None if alive_at is None else now - max(0.0, self.pool.wall(now) - alive_at)
        for job, saved in self.store.load_jobs():
            if saved.state not in js.TERMINAL:
                job.logged = self.store.logged_steps(job.id)  # where a new generation may resume (Job.resume_max)
            self.pool.restore(job, saved, now, down_since)
        self.log.info("coordinator.listening", address=self.endpoint, jobs=len(self.pool.jobs), curve=self.keys is not None)
        self.ready.set()
        return self.endpoint

    async def run(self, stopping: asyncio.Event) -> None:
        if self.sock is None:
            self.bind()
        sock, raw = self.sock, self.raw
        assert sock is not None and raw is not None
        next_tick = ran_at = self.clock()
        try:
            while not stopping.is_set():
                wake = min(next_tick, self.scheduled_at + SCHEDULE_S) if self.to_schedule else next_tick
                timeout_ms = max(0, int((wake - self.clock()) * 1000))
                readable = await sock.poll(timeout_ms)
                self._woke(ran_at, timeout_ms / 1000)
                if readable:
                    self.to_schedule = True  # what was read may admit or resize jobs
                    until = time.monotonic() + BATCH_S
                    if self.curve is not None:
                        self.curve.refresh()  # the allow-list as it is now judges this batch (a stat per folder)
                    peers = self.peers
                    assert peers is not None
                    for frames, user, fd, wire in pending_from(raw, BATCH, frames=m.MAX_FRAMES + 1, users=self.curve is not None, curve=self.curve is not None):
                        if peers.read(frames[0], fd, wire):  # else from a peer dropped past its budget
                            self._handle_frames(frames, user)
                        if time.monotonic() > until:
                            break  # the rest waits for the next round, after the tick and the commit
                    if not raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self.read_to = self.clock()
                else:
                    self.read_to = self.clock()  # nothing came: every message sent before now was read
                now = self._now()
                if now >= next_tick:
                    self._unit("tick", functools.partial(self._tick, now))
                    next_tick, self.to_schedule = now + self.heartbeat_s, True
                if self.to_schedule and now >= self.scheduled_at + SCHEDULE_S:
                    self.scheduled_at, self.to_schedule = now, False
                    self._unit("schedule", lambda: self._run(self.pool.schedule(self._now())))
                self._commit_and_send()
                ran_at = self.clock()  # the loop's work is done: from here it waits (a pause is measured from here)
        finally:
            self.store.close()
            if self.peers is not None:
                self.peers.close()
            sock.close(linger=0)
            if self.curve is not None:
                await self.curve.stop()
            self.log.info("coordinator.stopped")

    def _now(self) -> float:
        """The clock (deadlines, liveness), the pool told how far wall time is from it (records)."""
        now = self.clock()
        self.pool.wall_offset = self.wall() - now
        return now

    def _woke(self, asked: float, timeout_s: float) -> None:
        """After a poll: a wake-up far later than the poll's timeout (counted from the end of the
        loop's last work, `asked`: the work itself takes little) means this process was not
        running (SIGSTOP, a machine starved or swapping). Its nodes went on, and what they sent
        meanwhile, through this dpd's own agent too, arrives over the next moments: until it has,
        their silence is judged only up to when the coordinator stopped, or a pause of the
        serving dpd became a stalled group and a restart (an 8 s SIGSTOP did)."""
        now = self.clock()
        late = now - asked - timeout_s
        if late > PAUSE_S:
            self.log.warning("coordinator.paused", seconds=round(late, 3))
            self.paused = (asked, now + PAUSE_GRACE_S)

    def _tick(self, now: float) -> None:
        # Silence is judged up to when the input was last read to its end, at most READ_LAG_S back
        # (a coordinator that far behind, under a flood, judges by the clock), and after a pause of
        # its own only up to when it stopped, for a while.
        read_to = max(self.read_to, now - READ_LAG_S)
        if self.paused is not None:
            if now < self.paused[1]:
                read_to = min(read_to, self.paused[0])
            else:
                self.paused = None
        self._run(self.pool.tick(now, read_to=read_to))
        if self.pool.live and now - self.alive_marked >= ALIVE_MARK_S:  # an idle pool writes nothing
            self.store.mark_alive(self.pool.wall(now))
            self.alive_marked = now
        self._relay(self.exports.tick(now, self._alive))
        cadence = self.pool.cadence
        if cadence.period_s != self.period_said:
            self.log.info("heartbeat.period", seconds=cadence.period_s, was=self.period_said, nodes=len(cadence.beats), rate=cadence.rate)
            self.period_said = cadence.period_s
        for name, tell in cadence.due(now):  # each registered node once per its period (a new period with it)
            peer = self.peer_of.get(name)
            if peer is None:
                continue
            if tell is None:
                self._send_frames(peer, HEARTBEAT)  # packed once: most of what the coordinator sends
            else:
                self._send_to(peer, m.CoordHeartbeat(heartbeat_s=tell, liveness=cadence.liveness))

    def _commit_and_send(self) -> None:
        """The batch's writes to disk, then its messages out (in the order they were made)."""
        try:
            self.store.commit()
        except Exception as e:  # a full disk: the pool runs on in memory; say so, rate-limited
            self._failed("commit", e)
        outbox, self._outbox = self._outbox, []
        assert self.raw is not None and self.peers is not None
        for frames in outbox:
            # What cannot be delivered (a full, vanished or dropped peer) is not sent; heartbeats notice the rest.
            self.peers.send(self.raw, frames)

    def _unit(self, what: str, work: Callable[[], None]) -> Exception | None:
        """Do one unit of work whole or not at all: what it raised (after undoing it), or None.
        A ProtocolError is an answer (not_found, ...); anything else a bug, logged."""
        sent, started = len(self._outbox), time.perf_counter()
        try:
            self.store.begin_unit()
            work()
            self.store.end_unit()
            self._timed(what, time.perf_counter() - started)
        except Exception as e:
            del self._outbox[sent:]
            with contextlib.suppress(sqlite3.Error):  # a database that cannot even roll back: said below
                self.store.undo_unit()
            if not isinstance(e, ProtocolError):
                self._failed(what, e)
            return e
        return None

    def _timed(self, what: str, seconds: float) -> None:
        if seconds > SLOW_UNIT_S and (held := self._slow_log.allow(what, time.monotonic())) is not None:
            self.log.warning("unit.slow", what=what, seconds=round(seconds, 3), repeated=held)

    def _failed(self, what: str, e: Exception) -> None:
        """A bug (or a failing disk) met while serving: one traceback per kind a minute."""
        self.stats["failed"] += 1
        held = self._failed_log.allow(f"{what}:{type(e).__name__}", self.clock())
        if held is not None:
            self.log.error(f"{what}.failed", error=f"{type(e).__name__}: {str(e)[:300]}", repeated=held, exc_info=e)

    # -- frames --------------------------------------------------------------------------------

    def _handle_frames(self, frames: list[bytes], user: str | None = None) -> None:
        """One message; `user`: its connection's User-Id with CURVE ("node:mac1:KEY"), else None (no roles)."""
        self.stats["frames"] += 1
        if len(frames) < 2:
            return  # not even a routing id and a frame: nothing to answer to
        peer, body = frames[0], frames[1:]
        role, key_name, sender_key = user_parts(user) if user is not None else ("", "", "")
        if user is not None:
            if self.curve is not None and not self.curve.admits(user):
                self._revoked(peer, body, role, key_name)
                return
            user = f"{role}:{key_name}"  # as messages and logs name it: the key stays out of them
        try:
            # A type the key's role may not send is refused from its header, before its body is read.
            msg, msg_id = m.decode(body, m.COORDINATOR_ACCEPTS if user is None else ROLE_SENDS.get(role, frozenset()))
        except ProtocolError as e:
            forbidden = user is not None and e.code is ErrorCode.UNEXPECTED
            msg_type = m.decode_header(body[0])[0] if forbidden else None
            if msg_type in m.COORDINATOR_ACCEPTS:
                self._forbid(peer, user or "", str(msg_type), e.msg_id, f"{msg_type} is not for a {role} key ({user}): {ROLE_RULE}")
            else:
                self._reject(peer, e)
            return
        if role == "node" and isinstance(msg, m.NodeRegister) and msg.name != key_name:
            self._forbid(peer, user or "", str(msg.TYPE), msg_id, f"the key of node {key_name!r} may register as {key_name!r} only, not as {msg.name!r}")
            return
        self.sender_key, self.sender_name = sender_key, key_name  # who sent the message being served ("": no keys)
        raised = self._unit(str(msg.TYPE), lambda: self._serve(peer, msg, msg_id, bound=user is not None))
        if isinstance(raised, ProtocolError):
            self._reject(peer, ProtocolError(raised.code, raised.message, msg_id))
        elif raised is not None:  # a bug costs one request, not the pool
            self._send_to(peer, m.Error(code=str(ErrorCode.INTERNAL), message=f"{msg.TYPE}: {type(raised).__name__}: {raised}"), msg_id)

    def _serve(self, peer: bytes, msg: Message, msg_id: int, *, bound: bool = False) -> None:
        # The reply goes out before what the request caused: a registering node knows it is
        # registered before any group message reaches it.
        reply, actions = self._dispatch(peer, msg, msg_id, bound=bound)
        if reply is not None:
            self._send_to(peer, reply, msg_id)
        self._run(actions)

    def _revoked(self, peer: bytes, body: list[bytes], role: str, name: str) -> None:
        """A message of a connection whose key left the allow-list (deleted, or given another role
        or name) after its handshake: refused, one line per key every REFUSAL_LOG_S, and the node
        this connection registered is gone as if its dpd had stopped (its workers are lost).

        A node is answered once, when it is dropped (and each `node.register`): an answered
        heartbeat would keep its link alive, while unanswered its dpd connects again, and the
        handshake refuses it from then on. An `error` is never answered."""
        self.stats["rejected"] += 1
        user = f"{role}:{name}"
        try:
            msg_type: MsgType | None
            msg_type, msg_id = m.decode_header(body[0])
        except ProtocolError:
            msg_type, msg_id = None, 0
        dropped = role == "node" and self.node_of.get(peer) == name
        if dropped:
            self._unit("revoked", lambda: self._drop_node(peer, name))
        held = self._refused_log.allow(f"revoked {user}", self.clock())
        if held is not None:
            self.log.warning("auth.revoked", user=user, type=str(msg_type), peer=peer.hex(), dropped=dropped, repeated=held)
        if msg_type is not MsgType.ERROR and (role != "node" or dropped or msg_type is MsgType.NODE_REGISTER):
            self._send_to(peer, m.Error(code=str(ErrorCode.FORBIDDEN), message=f"key of {user} was removed from the pool's allow-list"), msg_id)

    def _drop_node(self, peer: bytes, name: str) -> None:
        self.node_of.pop(peer, None)
        self.peer_of.pop(name, None)
        node = self.pool.nodes.get(name)
        if node is not None and not node.lost:
            self._run(self.pool._node_gone(node, self._now(), "its key was removed from the pool's allow-list"))

    def _reject(self, peer: bytes, err: ProtocolError) -> None:
        self.stats["rejected"] += 1
        held = self._rejected_log.allow("frame", self.clock())
        if held:
            self.log.warning("frame.rejected.suppressed", count=held)
        if held is not None:
            self.log.warning("frame.rejected", code=str(err.code), error=err.message[:500], peer=peer.hex())
        self._send_frames(peer, m.error_frames(err))

    def _forbid(self, peer: bytes, user: str, msg_type: str, msg_id: int, why: str) -> None:
        """A message this connection's key may not send: `forbidden` (an `error` is never answered)
        and one line per key and type every REFUSAL_LOG_S."""
        self.stats["rejected"] += 1
        held = self._refused_log.allow(f"forbidden {user} {msg_type}", self.clock())
        if held is not None:
            self.log.warning("auth.forbidden", user=user, type=msg_type, error=why, peer=peer.hex(), repeated=held)
        if msg_type != MsgType.ERROR:
            self._send_to(peer, m.Error(code=str(ErrorCode.FORBIDDEN), message=why), msg_id)

    def _refused(self, r: Refused) -> None:
        held = self._refused_log.allow(f"report {r.node} {r.kind}", self.clock())
        if held is not None:
            self.log.warning("report.refused", node=r.node, type=r.kind, reason=r.reason, repeated=held)

    def _send_to(self, peer: bytes, msg: Message, msg_id: int = 0) -> None:
        # Within its bounds, whatever it was derived from (protocol/fit.py): a receiver refuses a
        # message with one value out of bound, whole, so one job's bad ETA would hide every job.
        fitted, fixes = fit(msg, self._stored)
        if fixes:
            self._fitted(peer, msg, fixes)
            if fitted is None:
                if not msg_id or isinstance(msg, m.Error):
                    return
                fitted = m.Error(code=str(ErrorCode.INTERNAL), message=f"{msg.TYPE} could not be made to fit its bounds: {fixes[-1]}"[: m.ERROR_MESSAGE_MAX])
        msg = fitted
        try:
            frames = msg.to_frames(msg_id)
        except ProtocolError as e:
            frames = m.Error(code=str(e.code), message=e.message).to_frames(msg_id)
        self._send_frames(peer, frames)

    def _stored(self, row: Any) -> bool:
        """A row the store read back through `from_wire` (checked there), which `fit` takes as it
        is: the rows of metrics, samples and events pages, and the status rows of jobs no longer
        in memory. Those of jobs in memory are made from their state, and checked."""
        return isinstance(row, STORED_ROWS) or (isinstance(row, JobStatus) and row.id not in self.pool.jobs)

    def _fitted(self, peer: bytes, msg: Message, fixes: list[str]) -> None:
        """A message fitted to its bounds: a value derived out of them (a bug to fix where it is
        derived), one line per message type a minute."""
        held = self._fitted_log.allow(str(msg.TYPE), self.clock())
        if held is not None:
            self.log.warning("message.fitted", type=str(msg.TYPE), fixes=fixes[:8], count=len(fixes), peer=peer.hex(), repeated=held)

    def _send_frames(self, peer: bytes, frames: list[bytes]) -> None:
        self._outbox.append([peer, *frames])

    def _run(self, actions: list[Any]) -> None:
        now, saved = self._now(), set()
        for a in actions:
            if isinstance(a, JobChanged | NodeChanged):
                if a in saved:
                    continue  # saved once per unit of work, however often it changed
                saved.add(a)
            if isinstance(a, Send):
                peer = self.peer_of.get(a.node)
                if peer is not None:
                    self._send_to(peer, a.msg)
            elif isinstance(a, Refused):
                self._refused(a)
            elif isinstance(a, Record):
                self.store.add_event(a.job, self.pool.wall(a.t), a.kind, a.fields)
                self.log.info(a.kind, job=a.job, **a.fields)
            elif isinstance(a, JobChanged):
                job = self.pool.jobs.get(a.job)
                if job is not None:
                    self.store.save_job(job)
            elif isinstance(a, NodeChanged):
                node = self.pool.nodes.get(a.node)
                if node is not None:
                    self.store.save_node(self.pool.node_row(node, now), node.incarnation, node.joined_at, node.last_seen, node.hold)
            elif isinstance(a, NodeForgotten):
                self.store.forget_node(a.node)
                peer = self.peer_of.pop(a.node, None)
                if peer is not None:
                    self.node_of.pop(peer, None)

    def _relay(self, actions: list[xr.Action]) -> None:
        """Carry out the export relay's actions (answers to clients, requests to nodes)."""
        for a in actions:
            if isinstance(a, xr.Reply):
                self._send_to(a.peer, a.msg, a.msg_id)
            else:
                peer = self.peer_of.get(a.node)
                if peer is not None:  # a node gone meanwhile: the relay's tick answers for it
                    self._send_to(peer, a.msg, a.msg_id)
                if isinstance(a.msg, m.ExportPrepare):
                    self.log.info("export.asked", node=a.node, export=a.msg.export_id, job=a.msg.job, step=a.msg.step)

    def _alive(self, name: str) -> bool:
        node = self.pool.nodes.get(name)
        return node is not None and not node.lost and name in self.peer_of

    # -- dispatch ------------------------------------------------------------------------------

    def _dispatch(self, peer: bytes, msg: Message, msg_id: int = 0, *, bound: bool = False) -> tuple[Message | None, list[Any]]:
        """The reply to a message (None: answered later, or not at all) and the pool's actions.
        `bound`: the peer's key is bound to the name it registers under (checked before)."""
        now = self._now()
        match msg:
            case m.Submit():
                return self._submit(msg, now)
            case m.Status(job=None, active=True):
                live = sorted(self.pool.live.values(), key=lambda j: (j.submitted_at, j.id), reverse=True)
                return m.StatusReply(jobs=[dataclasses.replace(j.status(now, self.pool.wall(now)), **self.pool.comm_fields(j)) for j in live]), []
            case m.Status(job=None, limit=int()):
                return self._status_page(msg, now), []
            case m.Status(job=None):
                # the first page of the list (a client pages the rest: Status with `limit`)
                return self._status_page(m.Status(limit=m.PAGE_LIMIT), now), []
            case m.Status(job=ref):
                ref_ = self._job(ref)
                job = self.pool.jobs.get(ref_.id)
                if job is None:
                    return m.StatusReply(jobs=self.store.statuses(1, only=ref_.id)), []
                status = dataclasses.replace(job.status(now, self.pool.wall(now)), staging=self.pool.staging_rows(job.id, now), **self.pool.comm_fields(job))
                return m.StatusReply(jobs=[status]), []
            case StageOffer(digests=wanted, exclude=exclude):
                offer = self.pool.fitness.offer(wanted, [n.name for n in self.pool.nodes.values() if not n.lost], exclude)
                if not (offer.target and self.sender_key):
                    return offer, []
                # With keys the target takes this client's upload of these digests, and nothing else.
                client = self.sender_name or "client"
                accept = StageAccept(key=self.sender_key, client=client, digests=[d for d in wanted if d not in offer.held])
                return offer, [Send(offer.target, accept)]
            case Cache(node=name):
                if name is not None and name not in self.pool.nodes:
                    raise ProtocolError(ErrorCode.NOT_FOUND, f"no node {name!r} in the pool")
                return CacheReply(rows=self.pool.fitness.cache_rows(name)), []
            case CachePrune(node=name):
                if name is not None and name not in self.pool.nodes:
                    raise ProtocolError(ErrorCode.NOT_FOUND, f"no node {name!r} in the pool")
                asked = sorted(n.name for n in self.pool.nodes.values() if not n.lost and name in (None, n.name))
                return CachePruneReply(nodes=asked), [Send(n, StagePrune()) for n in asked]
            case m.Nodes():
                return m.NodesReply(nodes=self.pool.node_rows(now)), []
            case Queue():
                return queue_reply(self.pool), []
            case SetPriority(job=ref, priority=priority):
                return set_priority(self.pool, self._job(ref), priority, now)
            case m.Metrics(job=ref, after=after, limit=limit):
                job_id = self._job(ref).id
                rows, cursor, more = self.store.metrics(job_id, after, _page(limit))
                return m.MetricsReply(job_id=job_id, rows=rows, cursor=cursor, more=more), []
            case m.Samples(job=ref, after=after, limit=limit):
                job_id = self._job(ref).id
                samples, cursor, more = self.store.samples(job_id, after, _page(limit))
                return m.SamplesReply(job_id=job_id, rows=samples, cursor=cursor, more=more), []
            case m.Events(job=ref, after=after, limit=limit):
                found, limit = self._job(ref), _page(limit)
                events, cursor, more = self.store.events(found, after, limit)
                return m.EventsReply(job_id=found.id, events=events, cursor=cursor, more=more), []
            case m.Logs(job=ref, after=after, rank=rank, limit=limit):
                found, limit = self._job(ref), _page(limit)
                lines, cursor, more = self.store.logs(found.id, after, rank, limit)
                return m.LogsReply(job_id=found.id, lines=lines, cursor=cursor, more=more, state=str(found.state)), []
            case m.Cancel(job=ref):
                found = self._job(ref)
                job = self.pool.live.get(found.id)
                if job is None:  # finished already: nothing to cancel
                    return m.CancelReply(job_id=found.id, state=str(found.state)), []
                actions = self.pool.cancel(now, job)
                return m.CancelReply(job_id=job.id, state=str(job.state)), actions
            case m.Rm(job=ref):
                return self._rm(ref, now)
            case m.Drain(node=name) | m.Undrain(node=name):
                if name not in self.pool.nodes:
                    known = ", ".join(sorted(self.pool.nodes)) or "none"
                    raise ProtocolError(ErrorCode.NOT_FOUND, f"no node {name!r} in the pool (nodes: {known})")
                drain = isinstance(msg, m.Drain)
                actions = self.pool.drain(now, name) if drain else self.pool.undrain(now, name)
                node = self.pool.nodes[name]
                return (m.DrainReply if drain else m.UndrainReply)(node=name, state=str(node.state), reason=node.reason), actions
            case m.Export(job=ref, step=step):
                job_id = self._job(ref).id
                options = {k: True for k in ("fuse", "dequantize", "test") if getattr(msg, k)}
                self._relay(self.exports.start(now, peer, msg_id, job_id, step, self.pool.export_holders(job_id, step), options))
                return None, []  # answered once a node has made it (or could not)
            case m.ExportRead():
                self._relay(self.exports.read(now, peer, msg_id, msg))
                return None, []
            case m.ExportClose(export_id=export_id):
                self._relay(self.exports.close(now, peer, msg_id, export_id))
                return None, []
            case m.NodeRegister():
                return self._register(peer, msg, now, bound=bound)
        name = self.node_of.get(peer)
        if name is None or name not in self.pool.nodes:
            if isinstance(msg, m.Error):
                return None, []  # never answered, from anyone: an error about an error would echo forever
            if msg.TYPE.value.startswith("node."):
                raise ProtocolError(ErrorCode.NOT_REGISTERED, f"{msg.TYPE} from a peer that has not registered; send node.register")
            raise ProtocolError(ErrorCode.UNEXPECTED, f"the coordinator does not accept {msg.TYPE}")
        return None, self._from_node(peer, name, msg, msg_id, now)

    def _from_node(self, peer: bytes, name: str, msg: Message, msg_id: int, now: float) -> list[Any]:
        """A registered node's message: the pool's actions (nodes are never answered)."""
        self.pool.seen(now, name)
        match msg:
            case m.NodeBye():
                self.node_of.pop(peer, None)
                self.peer_of.pop(name, None)
                return self.pool.bye(now, name)
            case m.NodeProgress():
                self.stats["progress"] += 1
            case m.NodeMetric() | m.NodeSample() | m.NodeLogs() if (refused := self._foreign_rows(name, msg)) is not None:
                return [refused]
            case m.NodeMetric(job=job, generation=g, row=row):
                if isinstance(row, TrainRow) and row.generation is None:
                    msg = dataclasses.replace(msg, row=dataclasses.replace(row, generation=g))
                    row = msg.row
                if job in self.pool.jobs:
                    self.store.add_metric(job, g, row)
            case m.NodeSample(job=job, generation=g, row=row):
                if job in self.pool.jobs:
                    self.store.add_sample(job, g, row)
                return []
            case m.NodeLogs(job=job, generation=g, rank=r, lines=lines):
                if job in self.pool.jobs:
                    self.store.add_logs(job, self.pool.wall(now), r, g, lines)
                return []
            case m.NodeExportReady() | m.NodeExportData():
                self._relay(self.exports.from_node(now, name, msg_id, msg))
                return []
            case m.NodeRemoved(job=job):
                self.store.removed_on(job, name)  # a job it was not asked to remove: deletes nothing
                self.log.info("job.removed_on_node", job=job, node=name)
                return []
            case m.Error(code=code, message=text):
                if msg_id:  # a node's answer to a relayed export request it could not serve
                    self._relay(self.exports.from_node(now, name, msg_id, msg))
                else:
                    self.log.warning("node.error", node=name, code=code, error=text[:300])
                return []  # never answered: an error about an error would echo forever
            case (m.NodeHeartbeat() | m.NodePrepared() | m.NodeWorkerStarted() | m.NodeWorkerHello() | m.NodeWaiting() | m.NodeCheckpoint()
                  | m.NodeWorkerExited() | m.NodeWarmed() | NodeStaged() | NodeLink() | NodeYield()):
                pass
            case _:
                raise ProtocolError(ErrorCode.UNEXPECTED, f"the coordinator does not accept {msg.TYPE}")
        return self.pool.from_node(now, name, msg)  # type: ignore[arg-type]

    def _foreign_rows(self, name: str, msg: m.NodeMetric | m.NodeSample | m.NodeLogs) -> Refused | None:
        """Rows of a job are stored only from the node of that rank (rank 0's for metrics and
        samples) in that generation."""
        rank = msg.rank if isinstance(msg, m.NodeLogs) else None
        return self.pool.report_refused(name, msg.TYPE.value, msg.job, msg.generation, rank, stored=True)

    def _job(self, ref: str) -> JobRef:
        found = self.store.find_job(ref)
        if found is None:
            several = self.store.ids_with_prefix(ref, AMBIGUOUS_SHOWN + 1) if ref else []
            if len(several) > 1:
                shown = ", ".join(several[:AMBIGUOUS_SHOWN]) + (", ..." if len(several) > AMBIGUOUS_SHOWN else "")
                raise ProtocolError(ErrorCode.NOT_FOUND, f"{ref!r} is the start of several jobs' ids ({shown}); give more of the id, or a job name")
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no job {ref!r} (an id, a unique id prefix, or a job name)")
        job = self.pool.jobs.get(found.id)
        return job.ref() if job is not None else found

    def _status_page(self, msg: m.Status, now: float) -> m.StatusReply:
        """A page of the job list, newest first (daemon/statuspage.py)."""
        before = None
        if msg.before is not None:
            after = self._job(msg.before)
            before = (after.submitted_at, after.id)
        limit, cursor = _page(msg.limit or 0), before or statuspage.FIRST
        # the status of the jobs in memory that can be on this page, and no more (it is not free)
        held = sorted((j for j in self.pool.jobs.values() if (j.submitted_at, j.id) < cursor), key=lambda j: (j.submitted_at, j.id), reverse=True)
        memory = [dataclasses.replace(j.status(now, self.pool.wall(now)), **self.pool.comm_fields(j)) for j in held[: limit + 1]]

        def stored(cursor: statuspage.Key, n: int, skip: set[str]) -> list[JobStatus]:
            return self.store.statuses(n, skip=skip, before=cursor)

        jobs, more = statuspage.page(memory, stored, before, limit, skip=set(self.pool.jobs))
        return m.StatusReply(jobs=jobs, more=more, total=self.store.job_count())

    def _submit(self, msg: m.Submit, now: float) -> tuple[Message, list[Any]]:
        try:
            spec = parse_job(msg.job, source=msg.source)
        except JobFileError as e:
            return m.Error(code=str(ErrorCode.BAD_JOB), message=str(e)), []
        except (TypeError, ValueError, KeyError) as e:
            return m.Error(code=str(ErrorCode.BAD_JOB), message=f"{msg.source}: {e}"), []
        job_id = f"{spec.name}-{secrets.token_hex(3)}"
        while self.store.has_job(job_id):
            job_id = f"{spec.name}-{secrets.token_hex(3)}"
        return m.Submitted(job_id=job_id), self.pool.submit(now, job_id, spec)

    def _rm(self, ref: str, now: float) -> tuple[Message, list[Any]]:
        """`dpctl rm`: a finished job's rows go from the database and the pool forgets it; every
        node connected now is told to delete its folder of the job, every other node the store
        knows when it registers again (`removals`, until the node answers `node.removed`)."""
        found = self._job(ref)
        if found.id in self.pool.live or found.state not in js.TERMINAL:
            raise ProtocolError(
                ErrorCode.NOT_FINISHED,
                f"job {found.id} is {found.state}: only a finished job (succeeded, failed, cancelled) can be removed; "
                f"cancel it first (dpctl cancel {found.id})",
            )
        known = set(self.store.node_names()) | set(self.pool.nodes)
        asked = sorted(n for n in known if self._alive(n))
        later = sorted(known - set(asked))
        rows = self.store.remove_job(found.id, now, sorted(known))
        self.pool.remove(found.id)
        self.log.info("job.removed", job=found.id, state=str(found.state), rows=rows.to_wire(), nodes=asked, later=later)
        reply = m.RmReply(job_id=found.id, state=str(found.state), rows=rows, nodes=asked, later=later)
        return reply, [Send(n, m.JobRemove(job=found.id)) for n in asked]

    def _register(self, peer: bytes, msg: m.NodeRegister, now: float, *, bound: bool = False) -> tuple[Message, list[Any]]:
        removed = self.store.removals(msg.name)  # jobs removed while it was away: their checkpoints are not offered
        if removed and msg.holdings:
            gone = set(removed)
            msg = dataclasses.replace(msg, holdings=[h for h in msg.holdings if h.job not in gone])
        known = self.pool.nodes.get(msg.name)
        restarted = known is not None and known.incarnation != msg.incarnation
        replacing = restarted and bound and known is not None and not known.lost
        refusal, room = self.pool.admit_name(now, msg.name)
        if refusal is not None:
            self.log.warning("node.refused", node=msg.name, reason=refusal)
            return m.Error(code=str(ErrorCode.POOL_FULL), message=refusal), []
        self._run(room)
        refusal, actions = self.pool.register(now, msg, bound=bound)
        if refusal is not None:
            self.log.warning("node.refused", node=msg.name, reason=refusal)
            return m.Error(code=str(ErrorCode.NODE_BUSY if isinstance(refusal, Busy) else ErrorCode.DUPLICATE_NAME), message=str(refusal)), []
        if replacing and known is not None:
            self.log.info("node.replaced", node=msg.name, old_pid=known.info.pid, pid=msg.info.pid)
        old = self.peer_of.get(msg.name)
        if old is not None and old != peer:
            self.node_of.pop(old, None)
        self.peer_of[msg.name], self.node_of[peer] = peer, msg.name
        if restarted:
            self._relay(self.exports.node_restarted(now, msg.name))
        actions += [Send(msg.name, m.JobRemove(job=job)) for job in removed]  # after the welcome, as every action
        return m.NodeRegistered(heartbeat_s=self.pool.cadence.period_s, liveness=self.pool.liveness), actions


def _page(limit: int) -> int:
    return max(1, min(limit, m.PAGE_LIMIT))
