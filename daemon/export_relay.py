"""The coordinator's half of `dpctl export`: which node makes the export, and the relay of its
chunks to the client. Pure: no socket and no clock; the coordinator feeds it requests, node answers
and ticks, and carries out what it returns (`Reply` to a client, `ToNode` to a node's dpd).

dpctl talks only to the coordinator, and nodes have no listening socket, so everything goes
through here:

    dpctl ── export {job, step} ──────▶ coordinator ── export.prepare (id r1) ──▶ dpd (runs the trainer)
          ◀─ export.reply {manifest} ──             ◀─ node.export_ready (id r1) ─
          ── export.read {name, offset} ▶           ── export.fetch (id r2) ─────▶
          ◀─ export.data {bytes} ───────            ◀─ node.export_data (id r2) ──
          ── export.close ─────────────▶            ── export.release ──────────▶ (deletes its files)

A request to a node carries a relay id of the coordinator's own; the node's answer carries it back,
and only an answer from the node that was asked counts. The coordinator answers the client later,
with the client's own request id: its loop never waits for a node, so a node preparing an export
for minutes costs nobody else anything.

An export belongs to the connection (routing id) that asked for it: another peer reading or closing
it gets `not_found`, as for an export that does not exist. Every read is checked against the
manifest (a name in it, an offset inside the file, a size up to EXPORT_CHUNK_MAX) before a node
sees it. Sessions and requests are bounded in number, and expire: a prepare the node does not
answer in time, a fetch likewise, a node that is lost, an export nobody read for `idle_s`.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from dpool.daemon.exporter import EXPORT_TIMEOUT_S, MAX_FILES
from dpool.protocol import messages as m
from dpool.protocol.messages import ErrorCode, Message, ProtocolError

PREPARE_TIMEOUT_S = m.EXPORT_PREPARE_TIMEOUT_S  # the node's own trainer timeout, plus hashing the files
assert PREPARE_TIMEOUT_S > EXPORT_TIMEOUT_S  # a node's own timeout answers first, with its reason
FETCH_TIMEOUT_S = m.EXPORT_FETCH_TIMEOUT_S  # one read of at most 1 MiB
IDLE_S = 300.0  # a ready export nobody reads for this long is released
MAX_EXPORTS = 16  # open at once in the pool
MAX_READS = 16  # in flight per export
NODE_CODES = {str(ErrorCode.NOT_FOUND), str(ErrorCode.BAD_REQUEST), str(ErrorCode.EXPORT_FAILED)}
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Reply:
    """Send `msg` to the client `peer`, as the answer to its request `msg_id`."""

    peer: bytes
    msg_id: int
    msg: Message


@dataclass(frozen=True, slots=True)
class ToNode:
    """Send `msg` to node `node`'s dpd; its answer will carry `msg_id` (0: no answer expected)."""

    node: str
    msg_id: int
    msg: Message


Action = Reply | ToNode


@dataclass(slots=True)
class Session:
    """One export, from the client's request to its close."""

    export_id: str
    job_id: str
    client: bytes
    step: int | None  # as asked (None: the newest)
    candidates: list[str]  # nodes still to ask, best first
    last_used: float
    asked: list[str] = field(default_factory=list)
    node: str | None = None  # the node asked last; once ready, the one holding the files
    options: dict[str, bool] = field(default_factory=dict)  # fuse, dequantize, test: what the node's trainer makes
    files: dict[str, tuple[int, str]] | None = None  # name -> (bytes, sha256), once ready
    reads: int = 0  # fetches in flight


@dataclass(slots=True)
class Waiting:
    """A request a node has not answered yet."""

    export_id: str
    node: str
    client_id: int  # the client's request id, for the answer
    deadline: float
    fetch: m.ExportFetch | None = None  # None: an export.prepare


class ExportRelay:
    def __init__(self, *, prepare_timeout_s: float = PREPARE_TIMEOUT_S, fetch_timeout_s: float = FETCH_TIMEOUT_S, idle_s: float = IDLE_S) -> None:
        self.prepare_timeout_s, self.fetch_timeout_s, self.idle_s = prepare_timeout_s, fetch_timeout_s, idle_s
        self.sessions: dict[str, Session] = {}
        self.waiting: dict[int, Waiting] = {}  # relay id -> request
        self._ids = itertools.count(1)

    # -- from the client -------------------------------------------------------------------------

    def start(
        self, now: float, client: bytes, msg_id: int, job_id: str, step: int | None, holders: list[tuple[str, int]],
        options: dict[str, bool] | None = None,
    ) -> list[Action]:
        """`export`: ask the best of `holders` ([(node, newest step it holds)], best first) to make it.
        Raises ProtocolError for what can be answered at once."""
        if step is not None and step < 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"--step {step}: must be >= 0")
        candidates = [n for n, newest in holders if step is None or newest >= step]
        if not candidates:
            if not holders:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no live node holds a checkpoint of job {job_id}")
            newest = max(s for _, s in holders)
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no live node holds step {step} of job {job_id} (the newest checkpoint held is step {newest})")
        if len(self.sessions) >= MAX_EXPORTS:
            raise ProtocolError(ErrorCode.EXPORT_FAILED, f"{MAX_EXPORTS} exports are in progress in the pool; try again later")
        export_id = secrets.token_hex(16)
        s = Session(export_id=export_id, job_id=job_id, client=client, step=step, candidates=candidates, last_used=now, options=options or {})
        self.sessions[export_id] = s
        return self._ask(now, s, msg_id)

    def read(self, now: float, client: bytes, msg_id: int, msg: m.ExportRead) -> list[Action]:
        """`export.read`: relay a checked read to the node holding the files."""
        s = self._own(client, msg.export_id)
        if s.files is None or s.node is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"export {msg.export_id} is not ready yet")
        entry = s.files.get(msg.name)
        if entry is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"export {msg.export_id} has no file {msg.name[:200]!r}")
        size = entry[0]
        if not 0 <= msg.offset <= size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{msg.name}: offset {msg.offset} is outside the file (0..{size})")
        if not 0 < msg.size <= m.EXPORT_CHUNK_MAX:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"size {msg.size}: must be 1..{m.EXPORT_CHUNK_MAX}")
        if s.reads >= MAX_READS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{MAX_READS} reads of export {msg.export_id} are in flight already; wait for their answers")
        s.reads += 1
        s.last_used = now
        relay_id = next(self._ids)
        fetch = m.ExportFetch(export_id=msg.export_id, name=msg.name, offset=msg.offset, size=msg.size)
        self.waiting[relay_id] = Waiting(msg.export_id, s.node, msg_id, now + self.fetch_timeout_s, fetch)
        return [ToNode(s.node, relay_id, fetch)]

    def close(self, now: float, client: bytes, msg_id: int, export_id: str) -> list[Action]:
        """`export.close`: the node deletes the files; reads still in flight go unanswered."""
        s = self._own(client, export_id)
        return [*self._drop(s), Reply(client, msg_id, m.ExportClosed(export_id=export_id))]

    def _own(self, client: bytes, export_id: str) -> Session:
        s = self.sessions.get(export_id)
        if s is None or s.client != client:
            # Another peer's export is answered like one that does not exist: ids are not probed.
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no export {export_id[:80]!r} of this connection (finished, expired, or never made)")
        return s

    # -- from a node -----------------------------------------------------------------------------

    def from_node(self, now: float, node: str, msg_id: int, msg: Message) -> list[Action]:
        """A node's node.export_ready, node.export_data or `error`, carrying a relay id."""
        w = self.waiting.get(msg_id)
        if w is None or w.node != node:
            return []  # a late answer (the request timed out), or not this node's to give
        del self.waiting[msg_id]
        s = self.sessions.get(w.export_id)
        if s is None:
            # The client closed or the export expired meanwhile: the files it made go too.
            return [ToNode(node, 0, m.ExportRelease(export_id=w.export_id))] if isinstance(msg, m.NodeExportReady) else []
        s.last_used = now
        if w.fetch is None:
            return self._prepared(now, s, w, msg)
        s.reads -= 1
        return [Reply(s.client, w.client_id, self._data(s, w.fetch, msg))]

    def _prepared(self, now: float, s: Session, w: Waiting, msg: Message) -> list[Action]:
        if isinstance(msg, m.Error):
            if msg.code == ErrorCode.NOT_FOUND:
                if s.candidates:
                    return self._ask(now, s, w.client_id)  # it holds no such checkpoint: the next one may
                what = f"step {s.step}" if s.step is not None else "a checkpoint"
                said = f": {msg.message[:500]}" if msg.message else ""  # the last one asked: which steps it holds
                return self._fail(s, w.client_id, ErrorCode.NOT_FOUND, f"no live node holds {what} of job {s.job_id} (asked {', '.join(s.asked)}{said})")
            code = msg.code if msg.code in NODE_CODES else str(ErrorCode.EXPORT_FAILED)
            return self._fail(s, w.client_id, code, msg.message[:2000])
        problem = _manifest_problem(msg, s) if isinstance(msg, m.NodeExportReady) else f"answered export.prepare with {msg.TYPE}"
        if problem is not None or not isinstance(msg, m.NodeExportReady):
            return [ToNode(w.node, 0, m.ExportRelease(export_id=s.export_id)), *self._fail(s, w.client_id, ErrorCode.EXPORT_FAILED, f"node {w.node} {problem}")]
        s.files = {f.name: (f.bytes, f.sha256) for f in msg.files}
        return [Reply(s.client, w.client_id, m.ExportReply(export_id=s.export_id, job_id=s.job_id, node=w.node, step=msg.step, files=list(msg.files)))]

    def _data(self, s: Session, fetch: m.ExportFetch, msg: Message) -> Message:
        if isinstance(msg, m.Error):
            code = msg.code if msg.code in NODE_CODES else str(ErrorCode.EXPORT_FAILED)
            return m.Error(code=code, message=msg.message[:2000])
        size = (s.files or {}).get(fetch.name, (0, ""))[0]
        want = min(fetch.size, size - fetch.offset)
        if not isinstance(msg, m.NodeExportData) or (msg.export_id, msg.name, msg.offset) != (fetch.export_id, fetch.name, fetch.offset) or len(msg.data) != want:
            got = f"{len(msg.data)} bytes of {msg.name[:200]!r} at {msg.offset}" if isinstance(msg, m.NodeExportData) else str(msg.TYPE)
            return m.Error(code=str(ErrorCode.EXPORT_FAILED), message=f"node {s.node} answered a read of {want} bytes of {fetch.name!r} at {fetch.offset} with {got}")
        return m.ExportData(export_id=msg.export_id, name=msg.name, offset=msg.offset, data=msg.data)

    # -- time and nodes --------------------------------------------------------------------------

    def node_restarted(self, now: float, node: str) -> list[Action]:
        """A new dpd process under `node`'s name: what the old one prepared or was asked is gone."""
        return self.tick(now, lambda name: name != node)

    def tick(self, now: float, alive: Callable[[str], bool]) -> list[Action]:
        """Answer requests a node left unanswered (too long, or it is lost); release idle exports."""
        actions: list[Action] = []
        for relay_id, w in list(self.waiting.items()):
            lost = not alive(w.node)
            if not lost and now < w.deadline:
                continue
            del self.waiting[relay_id]
            s = self.sessions.get(w.export_id)
            if s is None:
                continue
            why = f"node {w.node} was lost" if lost else f"node {w.node} did not answer within {(self.prepare_timeout_s if w.fetch is None else self.fetch_timeout_s):g}s"
            if w.fetch is None:
                if lost and s.candidates:
                    actions += self._ask(now, s, w.client_id)  # another node holds it too
                    continue
                if not lost:
                    actions.append(ToNode(w.node, 0, m.ExportRelease(export_id=s.export_id)))  # stops its trainer
                actions += self._fail(s, w.client_id, ErrorCode.EXPORT_FAILED, f"export of job {s.job_id} failed: {why}")
            else:
                s.reads -= 1
                actions.append(Reply(s.client, w.client_id, m.Error(code=str(ErrorCode.EXPORT_FAILED), message=f"reading {w.fetch.name!r} failed: {why}")))
        for s in list(self.sessions.values()):
            if s.files is None:
                continue  # being prepared: its own deadline above
            if not alive(s.node or "") or (now - s.last_used > self.idle_s and s.reads == 0):
                actions += self._drop(s)
        return actions

    # -- internals -------------------------------------------------------------------------------

    def _ask(self, now: float, s: Session, client_id: int) -> list[Action]:
        node = s.candidates.pop(0)
        s.asked.append(node)
        s.node = node
        relay_id = next(self._ids)
        self.waiting[relay_id] = Waiting(s.export_id, node, client_id, now + self.prepare_timeout_s)
        return [ToNode(node, relay_id, m.ExportPrepare(export_id=s.export_id, job=s.job_id, step=s.step, **s.options))]

    def _drop(self, s: Session) -> list[Action]:
        self.sessions.pop(s.export_id, None)
        for relay_id in [r for r, w in self.waiting.items() if w.export_id == s.export_id]:
            del self.waiting[relay_id]
        return [ToNode(s.node, 0, m.ExportRelease(export_id=s.export_id))] if s.node is not None else []

    def _fail(self, s: Session, client_id: int, code: str, message: str) -> list[Action]:
        self.sessions.pop(s.export_id, None)
        return [Reply(s.client, client_id, m.Error(code=str(code), message=message))]


def _manifest_problem(msg: m.NodeExportReady, s: Session) -> str | None:
    """None when a node's manifest is well formed, else what is wrong with it."""
    if msg.export_id != s.export_id:
        return f"answered for export {msg.export_id[:80]!r}"
    if s.step is not None and msg.step != s.step:
        return f"exported step {msg.step} instead of step {s.step}"
    if not 0 < len(msg.files) <= MAX_FILES:
        return f"sent a manifest of {len(msg.files)} files"
    names: set[str] = set()
    for f in msg.files:  # sizes and types were checked by decode (ExportFile)
        problem = m.export_name_problem(f.name)
        if problem is not None:
            return f"sent an unsafe {problem}"
        if f.name in names:
            return f"sent {f.name!r} twice"
        names.add(f.name)
        if not SHA256_RE.match(f.sha256):
            return f"sent a malformed sha256 for {f.name!r}"
    return None
