"""A node's data-channel server: the ROUTER that answers `manifest`, `chunk`, `offer` and `put`
(staging/README.md), its ZAP handler, and the requests it holds for chunks on their way (the chain
of fetchers). It runs on its Stager's loop (staging/channel.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils import z85

from dpool.protocol.logs import Throttle
from dpool.protocol.peerbudget import PEER_BYTES, PeerBudget
from dpool.protocol.security import ZAP_ENDPOINT, zap_answer
from dpool.staging.cache import CacheFull
from dpool.staging.manifest import Entry, Manifest, ManifestError
from dpool.staging.parts import (
    BATCH,
    KEY_PROPERTY,
    MAX_HOLDS,
    MAX_WORK,
    MAX_WORK_BYTES,
    NO_KEYS,
    READ_ROLES,
    SERVER_HWM,
    Key,
    chunk_key,
    manifest_key,
    shown,
)
from dpool.staging.wire import (
    MAX_DATA_BYTES,
    MAX_FRAMES,
    MAX_MANIFEST_BYTES,
    REQUESTS,
    ChunkData,
    Code,
    GetChunk,
    GetManifest,
    Incoming,
    ManifestData,
    Message,
    Offer,
    OfferReply,
    Put,
    PutDone,
    WireError,
    decode,
    error_frames,
    pending,
)

if TYPE_CHECKING:
    from dpool.staging.channel import Stager


@dataclass(eq=False)
class _Hold:
    rid: bytes
    msg_id: int
    msg: GetChunk | GetManifest
    deadline: float  # loop time
    timer: asyncio.TimerHandle | None = None


class Server:
    """The ROUTER that answers peers, its ZAP handler, and the requests held for chunks on their way."""

    def __init__(self, stager: Stager, ctx: zmq.asyncio.Context) -> None:
        self.s, self.ctx = stager, ctx
        self.cache, self.log = stager.cache, stager.log
        self.curve = stager.keys is not None
        self.sock = ctx.socket(zmq.ROUTER)
        self.raw: zmq.Socket[Any] = zmq.Socket.shadow(self.sock.underlying)
        self.zap: zmq.asyncio.Socket | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.holds: dict[Key, list[_Hold]] = {}
        self.held = 0
        self.work = 0
        self.work_bytes = 0
        self.landings = 0
        self.landed_at: dict[Key, int] = {}  # expected keys -> the landing that brought them
        self.manifests: collections.OrderedDict[str, tuple[Manifest, dict[str, Entry]]] = collections.OrderedDict()
        self.manifests_lock = threading.Lock()  # the I/O threads share those
        self.throttle = Throttle(lines=5, every=1.0)
        self.budget: PeerBudget | None = None  # what one connection may have queued inbound (protocol/peerbudget.py)

    def open(self, bind: str) -> str:
        sock = self.sock
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES)
        sock.sndhwm = sock.rcvhwm = SERVER_HWM
        if self.s.keys is not None:
            self.zap = self.ctx.socket(zmq.REP)
            self.zap.linger = 0
            self.zap.bind(ZAP_ENDPOINT)  # in this Stager's own context: the daemon's has its own
            sock.curve_server = True
            sock.curve_secretkey = self.s.keys.secret
            sock.curve_publickey = self.s.keys.public
            sock.zap_domain = b"dpool.data"
            self.tasks.append(asyncio.create_task(self._answer_zap(self.zap)))
        # A peer that starts a message and never ends it: libzmq holds its parts out of sight
        # (an attack grew a dpd by 2 GB). Dropped past the budget, which a peer sending one
        # message of the largest size at a time stays under. Made before bind: it sees every connection.
        self.budget = PeerBudget(self.ctx, sock, self.log, curve=self.curve, budget=PEER_BYTES + MAX_DATA_BYTES)
        try:
            sock.bind(bind)
        except zmq.ZMQError:
            self.budget.close()
            self.budget = None
            raise
        self.tasks.append(asyncio.create_task(self._serve()))
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for holds in self.holds.values():
            for h in holds:
                if h.timer is not None:
                    h.timer.cancel()
        if self.budget is not None:
            self.budget.close()
        self.sock.close(linger=0)
        if self.zap is not None:
            self.zap.close(linger=0)

    # -- authentication ---------------------------------------------------------------------------

    async def _answer_zap(self, zap: zmq.asyncio.Socket) -> None:
        """ZAP (RFC 27) for this Stager's context: a CURVE key `authorize` knows gets its role as the
        connection's User-Id and the key itself as a property, so each request can be asked about
        again. Never dies: a request it fails on is answered 500."""
        raw: zmq.Socket[Any] = zmq.Socket.shadow(zap.underlying)
        while True:
            await zap.poll(500)
            for inc in pending(raw, BATCH, keep=16, metadata=False):
                raw.send_multipart(zap_answer([f.bytes for f in inc.frames], self._zap_reply, self._warn))

    def _zap_reply(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *creds = frames
        if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            self._warn("auth.refused", "not curve", peer=address.decode(errors="replace"), reason="not CURVE")
            return [version, request_id, b"400", b"CURVE only", b"", b""]
        key = z85.encode(creds[0]).decode()
        role = self._authorize(key)
        if role is None:
            self._warn("auth.refused", "not allowed", peer=address.decode(errors="replace"), key=key, reason="public key not allowed")
            return [version, request_id, b"400", b"public key not allowed", b"", b""]
        name, value = KEY_PROPERTY.encode(), key.encode()
        metadata = bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value  # ZMTP property encoding
        return [version, request_id, b"200", b"OK", role.encode(), metadata]

    def _authorize(self, key: str) -> str | None:
        assert self.s.authorize is not None
        try:
            role = self.s.authorize(key)
        except Exception as e:  # the lead's allow-list failing refuses, it does not crash the channel
            self._warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
            return None
        return role if isinstance(role, str) and role else None

    def _role(self, inc: Incoming) -> str | None:
        """The requester's role now: asked again on every request (a revoked key is refused on an
        open connection), None = refused."""
        if not self.curve:
            return NO_KEYS
        return self._authorize(inc.key) if inc.key else None

    def _may_put(self, role: str, digest: str) -> bool:
        if not self.curve:
            return True
        if self.s.may_put is None:
            return False
        try:
            return bool(self.s.may_put(role, digest))
        except Exception as e:
            self._warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
            return False

    # -- requests ---------------------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            await self.sock.poll(500)  # a timeout: the descriptor is edge-triggered (protocol/sockets.py)
            for inc in pending(self.raw, BATCH, keep=1 + MAX_FRAMES, metadata=self.curve, curve=self.curve):
                if self.budget is not None and not self.budget.read(inc.frames[0].bytes, inc.fd, inc.size):
                    continue  # from a connection dropped past its budget: not served
                self.s.count("requests")
                try:
                    self._request(inc)
                except Exception as e:  # a bug must not end the server: logged, the next request is served
                    self._warn("request.failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
            await asyncio.sleep(0)

    def _request(self, inc: Incoming) -> None:
        rid = inc.frames[0].bytes
        try:
            msg, msg_id, data = decode(inc.frames[1:], REQUESTS, cut=inc.cut)
        except WireError as e:
            self.s.count("rejected")
            self._warn("frame.rejected", str(e.code), code=str(e.code), error=e.message, user=inc.user)
            self._send(rid, error_frames(e))
            return
        role = self._role(inc)
        if role is None:
            self._refuse(rid, msg_id, inc, "revoked", "this key is not allowed (any more)")
        elif isinstance(msg, GetChunk | GetManifest):
            if role.partition(":")[0] not in READ_ROLES:
                self._refuse(rid, msg_id, inc, "read", f"role {role!r} may not read")
            else:
                self._read(rid, msg_id, msg, None)
        elif isinstance(msg, Offer | Put):
            if not self._may_put(role, msg.digest):
                self._refuse(rid, msg_id, inc, "put", f"{role} may not put chunks of {shown(msg.digest)}")
            elif data is not None:
                self._write(rid, msg_id, msg, data)

    def _refuse(self, rid: bytes, msg_id: int, inc: Incoming, kind: str, why: str) -> None:
        self.s.count("refused")
        self._warn("request.refused", kind, user=inc.user, key=inc.key, reason=why)
        self._send(rid, error_frames(WireError(Code.REFUSED, why, msg_id)))

    def _busy(self, nbytes: int) -> bool:
        return self.work >= MAX_WORK or self.work_bytes + nbytes > MAX_WORK_BYTES

    def _read(self, rid: bytes, msg_id: int, msg: GetChunk | GetManifest, deadline: float | None) -> None:
        """Answer a read from the cache, on an I/O thread; a miss the node is fetching is held."""
        nbytes = msg.chunk_bytes if isinstance(msg, GetChunk) else MAX_MANIFEST_BYTES // 64
        if self._busy(nbytes):
            self.s.count("busy")
            self._send(rid, error_frames(WireError(Code.BUSY, f"{self.work} reads and writes in progress here", msg_id)))
            return
        self.work += 1
        self.work_bytes += nbytes
        loop = asyncio.get_running_loop()
        if isinstance(msg, GetChunk):
            key = chunk_key(msg.sha256, msg.index)
            fut = loop.run_in_executor(self.s.io, self.cache.read_chunk, msg.sha256, msg.index, msg.chunk_bytes)
        else:
            key = manifest_key(msg.digest)
            fut = loop.run_in_executor(self.s.io, self._manifest_bytes, msg.digest)
        fut.add_done_callback(functools.partial(self._read_done, rid, msg_id, msg, key, self.landings, deadline, nbytes))

    def _manifest_bytes(self, digest: str) -> bytes | None:
        m = self.cache.manifest(digest)
        return None if m is None else m.to_bytes()

    def _read_done(self, rid: bytes, msg_id: int, msg: GetChunk | GetManifest, key: Key, seq: int, deadline: float | None, nbytes: int, fut: asyncio.Future[bytes | None]) -> None:
        self.work -= 1
        self.work_bytes -= nbytes
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self._warn("read.failed", type(exc).__name__, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self._not_here(rid, msg_id, f"cannot read it here: {type(exc).__name__}: {str(exc)[:200]}", later=False)
            return
        data = fut.result()
        if data is not None:
            if isinstance(msg, GetChunk):
                self.s.count("chunks_served")
                self.s.count("bytes_served", len(data))
                self._send(rid, [*ChunkData().frames(msg_id), data])
            else:
                self.s.count("manifests_served")
                self._send(rid, [*ManifestData().frames(msg_id), data])
            return
        if self.landed_at.get(key, -1) >= seq:  # it landed while this read was looking: look again
            self._read(rid, msg_id, msg, deadline)
            return
        later = self._expects(key, msg)
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + min(msg.hold_s, self.s.hold_s)
        if not later or deadline <= loop.time():
            self._not_here(rid, msg_id, "not held here" if not later else "still on its way here", later=later)
        elif self.held >= MAX_HOLDS:
            self.s.count("busy")
            self._send(rid, error_frames(WireError(Code.BUSY, f"{self.held} requests held here", msg_id)))
        else:
            hold = _Hold(rid, msg_id, msg, deadline)
            hold.timer = loop.call_at(deadline, self._expire, key, hold)
            self.holds.setdefault(key, []).append(hold)
            self.held += 1
            self.s.count("held")

    def _expects(self, key: Key, msg: GetChunk | GetManifest) -> bool:
        """Whether a fetch of this node's is about to get `key` (or may: its chunks are not known yet)."""
        if key in self.s.expected:
            return True
        return isinstance(msg, GetChunk) and msg.digest is not None and msg.digest in self.s.unknown

    def _not_here(self, rid: bytes, msg_id: int, why: str, *, later: bool) -> None:
        self.s.count("not_here")
        self._send(rid, error_frames(WireError(Code.NOT_HERE, why, msg_id), later=later))

    def _take(self, key: Key, hold: _Hold) -> bool:
        holds = self.holds.get(key)
        if holds is None or hold not in holds:
            return False
        holds.remove(hold)
        if not holds:
            del self.holds[key]
        self.held -= 1
        if hold.timer is not None:
            hold.timer.cancel()
        return True

    def _expire(self, key: Key, hold: _Hold) -> None:
        if self._take(key, hold):
            self._not_here(hold.rid, hold.msg_id, f"still on its way here after {hold.msg.hold_s:g} s", later=True)

    def landed(self, key: Key) -> None:
        """`key` is in the cache now: serve what waits for it."""
        self.landings += 1
        if key in self.s.expected:
            self.landed_at[key] = self.landings
        for hold in list(self.holds.get(key, ())):
            if self._take(key, hold):
                self._read(hold.rid, hold.msg_id, hold.msg, hold.deadline)

    def recheck(self) -> None:
        """What this node's fetches expect changed: a hold for what none expects now is looked up
        once more, then answered."""
        for k in [k for k in self.landed_at if k not in self.s.expected]:
            del self.landed_at[k]
        for key, holds in list(self.holds.items()):
            for hold in list(holds):
                if not self._expects(key, hold.msg) and self._take(key, hold):
                    self._read(hold.rid, hold.msg_id, hold.msg, hold.deadline)

    def _write(self, rid: bytes, msg_id: int, msg: Offer | Put, data: memoryview) -> None:
        if self._busy(len(data)):
            self.s.count("busy")
            self._send(rid, error_frames(WireError(Code.BUSY, f"{self.work} reads and writes in progress here", msg_id)))
            return
        self.work += 1
        self.work_bytes += len(data)
        fn = self._offer if isinstance(msg, Offer) else self._put
        assert self.s.io is not None
        fut = asyncio.get_running_loop().run_in_executor(self.s.io, fn, msg, data)
        fut.add_done_callback(functools.partial(self._write_done, rid, msg_id, len(data)))

    def _write_done(self, rid: bytes, msg_id: int, nbytes: int, fut: asyncio.Future[tuple[Message, bytes | None]]) -> None:
        self.work -= 1
        self.work_bytes -= nbytes
        if fut.cancelled():
            return
        exc = fut.exception()
        if isinstance(exc, WireError):
            exc.msg_id = msg_id
            self._send(rid, error_frames(exc))
        elif exc is not None:
            self._warn("put.failed", type(exc).__name__, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            full = isinstance(exc, CacheFull) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
            code = Code.FULL if full else Code.INTERNAL
            self._send(rid, error_frames(WireError(code, f"{type(exc).__name__}: {str(exc)[:1000]}", msg_id)))
        else:
            reply, data = fut.result()
            self._send(rid, reply.frames(msg_id) + ([data] if data is not None else []))

    def _offer(self, msg: Offer, data: memoryview) -> tuple[Message, bytes | None]:
        """On an I/O thread: keep the offered manifest, make room, say what is missing."""
        self.s.count("offers")
        got = hashlib.sha256(data).hexdigest()
        if got != msg.digest:
            raise WireError(Code.BAD_REQUEST, f"the manifest's bytes hash to {got}, not {msg.digest}")
        try:
            manifest = self.cache.put_manifest(bytes(data))
        except ManifestError as e:
            raise WireError(Code.BAD_REQUEST, f"manifest {shown(msg.digest)}: {e}") from None
        try:
            self.cache.reserve(manifest)
        except CacheFull as e:
            raise WireError(Code.FULL, str(e)) from None
        missing = self.cache.missing(manifest)
        if not missing:
            self.cache.complete(manifest)
        first: dict[str, int] = {}  # an entry's path -> the place of its chunk 0 in the bitmap
        n = 0
        for entry in manifest.entries:
            first[entry.path] = n
            n += len(entry.chunks)
        bitmap = bytearray((n + 7) // 8)
        for entry, index in missing:
            k = first[entry.path] + index
            bitmap[k // 8] |= 1 << (k % 8)
        size = sum(entry.chunk_size(index, manifest.chunk_bytes) for entry, index in missing)
        return OfferReply(missing=len(missing), bytes=size), bytes(bitmap)

    def _put(self, msg: Put, data: memoryview) -> tuple[Message, bytes | None]:
        """On an I/O thread: write one offered chunk, verified."""
        self.s.count("puts")
        found = self._manifest(msg.digest)
        if found is None:
            raise WireError(Code.BAD_REQUEST, f"no manifest {shown(msg.digest)} here: offer it first")
        manifest, by_sha = found
        entry = by_sha.get(msg.sha256)
        if entry is None:
            raise WireError(Code.BAD_REQUEST, f"manifest {shown(msg.digest)} has no file of sha256 {msg.sha256}")
        if msg.index >= len(entry.chunks):
            raise WireError(Code.BAD_REQUEST, f"{entry.path} has {len(entry.chunks)} chunks, no chunk {msg.index}")
        size = entry.chunk_size(msg.index, manifest.chunk_bytes)
        if len(data) != size:
            raise WireError(Code.BAD_REQUEST, f"chunk {msg.index} of {entry.path} is {size} bytes, got {len(data)}")
        if not self.cache.write_chunk(entry, msg.index, data, manifest.chunk_bytes):
            self.s.count("bad_puts")
            raise WireError(Code.BAD_CHUNK, f"chunk {msg.index} of {entry.path}: its bytes do not hash to {entry.chunks[msg.index]}")
        self.s.count("bytes_put", size)
        return PutDone(), None

    def _manifest(self, digest: str) -> tuple[Manifest, dict[str, Entry]] | None:
        """A manifest and its entries by sha256, from a few kept parsed (puts come in runs)."""
        with self.manifests_lock:
            found = self.manifests.get(digest)
        if found is not None:
            return found
        manifest = self.cache.manifest(digest)
        if manifest is None:
            return None
        found = (manifest, {e.sha256: e for e in manifest.entries})
        with self.manifests_lock:
            self.manifests[digest] = found
            while len(self.manifests) > 4:
                self.manifests.popitem(last=False)
        return found

    def _send(self, rid: bytes, frames: list[Any]) -> None:
        """To one peer; a ROUTER drops what a peer past its high-water mark would not take."""
        with contextlib.suppress(zmq.ZMQError):
            self.raw.send_multipart([rid, *frames], copy=False)

    def _warn(self, event: str, what: str, **fields: Any) -> None:
        """A line at most 5 times a second per event and `what` (a small set: codes, kinds of
        refusal, exception types), with the count held back: a peer cannot flood the log."""
        held = self.throttle.allow(f"{event} {what}", time.monotonic())
        if held is not None:
            self.log.warning(event, repeated=held, **fields)
