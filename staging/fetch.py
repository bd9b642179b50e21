"""One fetch of a tree into the cache, on its Stager's loop (staging/channel.py): the manifest from a
source, then every chunk the cache lacks from up to MAX_SOURCES sources, each with a window of
requests in flight; a source that dies, falls silent, refuses or serves bad bytes is dropped."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dpool.staging.manifest import Entry
from dpool.staging.parts import (
    BATCH,
    LINK_EVENTS,
    MAX_LOSSES,
    MAX_SOURCES,
    RATE_WINDOW_S,
    RETRY_S,
    SOURCES_EVERY_S,
    TIMEOUT_S,
    FetchError,
    Key,
    Pacer,
    Source,
    chunk_key,
    effective,
    handshake_failure,
    manifest_key,
    settle,
)
from dpool.staging.wire import (
    MAX_DATA_BYTES,
    MAX_FRAMES,
    REPLIES,
    ChunkData,
    Code,
    Error,
    GetChunk,
    GetManifest,
    Incoming,
    ManifestData,
    Message,
    WireError,
    decode,
    pending,
)

if TYPE_CHECKING:
    from dpool.staging.channel import Stager


@dataclass(eq=False)
class _Item:
    """A manifest or a chunk to get, and what the sources said of it."""

    key: Key
    size: int  # bytes it pulls (0 for the manifest: not paced)
    entry: Entry | None = None
    index: int = 0
    lacks: set[str] = field(default_factory=set)  # endpoints that do not hold it
    retry: dict[str, float] = field(default_factory=dict)  # endpoint -> not asked again before

    def __str__(self) -> str:
        if self.entry is None:
            return "the manifest"
        return f"chunk {self.index} of {self.entry.path}"


@dataclass(eq=False)
class _Link:
    """One source of a fetch: a DEALER to it, and what is in flight there."""

    source: Source
    sock: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket
    created: float
    heard: float = 0.0  # when it last answered (or was first waited on)
    up: bool = False  # handshake done
    closed: bool = False
    retiring: bool = False  # `sources()` no longer offers it: asked for nothing new, closed once idle
    inflight: dict[int, _Item] = field(default_factory=dict)
    writing: int = 0  # its chunks being verified and written: they hold their window slots
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return self.source.endpoint


class Fetch:
    """One fetch on the Stager's loop: a little state machine (items queued, in flight, done; links
    up, dropped) fed by its links' replies and events, and a loop that sends what it can and waits."""

    def __init__(self, stager: Stager, digest: str, sources: Callable[[], Sequence[Source]], rate: float | None, future: concurrent.futures.Future[Path]) -> None:
        self.s, self.digest, self.sources_fn, self.future = stager, digest, sources, future
        self.log = stager.log.bind(digest=digest[:12])
        self.own_rate = rate
        self.pacer = Pacer(effective(rate, stager.rate_all))
        self.task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()
        self.links: dict[str, _Link] = {}
        self.tried: dict[str, str] = {}  # endpoint -> why it was left
        self.banned: set[str] = set()
        self.losses: collections.Counter[str] = collections.Counter()
        self.queue: collections.OrderedDict[int, _Item] = collections.OrderedDict()
        self.left = 0
        self.next_id = 1
        self.failure: BaseException | None = None
        self.stopped: str | None = None
        self.keys: list[Key] = []  # what this fetch told the server it expects
        self.unknown = False
        self.manifest_bytes: bytes | None = None
        self.chunk_bytes = 0
        self.done_bytes = self.total_bytes = 0
        self.rate_bps = 0.0  # over the last RATE_WINDOW_S, as of rate_at
        self.rate_at = 0.0
        self.samples: collections.deque[tuple[float, int]] = collections.deque()
        self.source_names: tuple[str, ...] = ()
        self.sources_at = -math.inf  # the last periodic look at `sources()`
        self.needed_at = -math.inf  # the last call for want of a source
        self.fruitless = 0  # `sources()` calls in a row that gave nothing new while one was needed
        self.need: str | None = None  # why the fetch cannot go on with the sources it has
        self.progress_at = time.monotonic()

    def begin(self) -> None:
        if self.stopped is not None or self.future.done():
            self.s.ended(self)
            return
        # Expectations are set before the first await: a chained fetcher asking right after this
        # node began is held, not told "not here".
        self.keys = [manifest_key(self.digest)]
        self.s.expect(self.keys)
        self.s.unknown[self.digest] += 1
        self.unknown = True
        self.task = asyncio.get_running_loop().create_task(self.run())

    def stop(self, why: str | None) -> None:
        """End this fetch: `why` becomes its FetchError; None: it was cancelled."""
        self.stopped = why
        if self.task is not None:
            self.task.cancel()
            return
        self.s.ended(self)
        if why is None:
            self.future.cancel()
        else:
            settle(self.future, exc=FetchError(why))

    async def run(self) -> None:
        started = time.monotonic()
        self.log.info("fetch.started")
        try:
            path = await self._stage()
        except asyncio.CancelledError:
            if self.stopped is None:
                self.future.cancel()
            else:
                settle(self.future, exc=FetchError(self.stopped))
            self.log.info("fetch.stopped", reason=self.stopped or "cancelled")
        except BaseException as e:
            self.s.count("fetches_failed")
            self.log.warning("fetch.failed", error=f"{type(e).__name__}: {str(e)[:500]}")
            settle(self.future, exc=e)
        else:
            self.s.count("fetches_done")
            self.log.info("fetch.done", bytes=self.total_bytes, seconds=round(time.monotonic() - started, 3))
            settle(self.future, path)
        finally:
            for link in list(self.links.values()):
                self._close(link)
            if self.unknown:
                self._known()
            self.s.unexpect(self.keys)
            self.s.ended(self)
            if not self.future.done() or self.future.cancelled() or self.future.exception() is not None:
                self.s.cache.release(self.digest)  # not fetching it any more: its blobs may be evicted

    async def _stage(self) -> Path:
        cache, io = self.s.cache, self.s.run_io
        tree = await io(cache.tree, self.digest)
        if tree is not None:
            return Path(tree)
        manifest = await io(cache.manifest, self.digest)
        if manifest is None:
            await self._pull([_Item(manifest_key(self.digest), 0)])
            manifest = await io(cache.put_manifest, self.manifest_bytes)
            if self.s.server is not None:
                self.s.server.landed(manifest_key(self.digest))
        self.total_bytes, self.chunk_bytes = manifest.total_bytes, manifest.chunk_bytes
        await io(cache.reserve, manifest)
        missing = await io(cache.missing, manifest)
        items = [_Item(chunk_key(e.sha256, i), e.chunk_size(i, manifest.chunk_bytes), e, i) for e, i in missing]
        self.done_bytes = max(0, self.total_bytes - sum(it.size for it in items))
        self.samples.append((time.monotonic(), self.done_bytes))  # the first chunk's rate counts from here
        keys = [it.key for it in items]
        self.keys += keys
        self.s.expect(keys)
        self._known()
        if items:
            await self._pull(items)
        return Path(await io(cache.complete, manifest))

    def _known(self) -> None:
        """The chunks this fetch will get are known (or it ended): holds for others are answered."""
        self.unknown = False
        self.s.unknown[self.digest] -= 1
        if self.s.unknown[self.digest] <= 0:
            del self.s.unknown[self.digest]
        if self.s.server is not None:
            self.s.server.recheck()

    # -- the loop ------------------------------------------------------------------------------------

    async def _pull(self, items: list[_Item]) -> None:
        for it in items:
            self.queue[id(it)] = it
        self.left = len(items)
        self.progress_at = time.monotonic()
        while self.left:
            if self.failure is not None:
                raise self.failure
            now = time.monotonic()
            self._expire(now)
            wake_at = self._fill(now)
            if now - self.progress_at > self.s.timeout_s:
                raise FetchError(self._why(self.need or f"no progress for {self.s.timeout_s:g} s"))
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(0.0, min(wake_at, now + 0.25) - now))
        if self.failure is not None:
            raise self.failure

    def _fill(self, now: float) -> float:
        """Send what the windows and the pace allow; when something could go next (inf: on a reply)."""
        soonest, self.need = math.inf, None
        if self.queue and now >= self.sources_at + SOURCES_EVERY_S:
            self._more_sources(now, None)  # the sources offered now: a lost one replaced, a chain's place taken
        for link in list(self.links.values()):
            self._close_if_retired(link)
        for link in [lk for lk in self.links.values() if lk.up and not lk.retiring]:  # not before its handshake: a dead source takes nothing
            while not link.closed and len(link.inflight) + link.writing < self.s.window and self.queue:
                item, retry_at = self._pick(link, now)
                if item is None:
                    soonest = min(soonest, retry_at)
                    break
                wait = self.pacer.take(item.size, now) if item.size else 0.0
                if wait > 0:
                    self.progress_at = now  # held back by the pace, not stalled
                    return min(soonest, now + wait)
                del self.queue[id(item)]
                self._send(link, item, now)
        if self.queue and soonest == math.inf and all(lk.up and not (lk.inflight or lk.writing) for lk in self.links.values()):
            stuck = next(iter(self.queue.values()))
            self.need = "no source left" if not self.links else f"no source holds {stuck}"
            self._more_sources(now, self.need)
            soonest = now + SOURCES_EVERY_S
        return min(soonest, self.sources_at + SOURCES_EVERY_S) if self.queue else soonest

    def _pick(self, link: _Link, now: float) -> tuple[_Item | None, float]:
        """The first queued item this link may be asked for; else when one may be."""
        retry_at = math.inf
        for item in self.queue.values():
            if link.endpoint in item.lacks:
                continue
            at = item.retry.get(link.endpoint, 0.0)
            if at > now:
                retry_at = min(retry_at, at)
                continue
            return item, 0.0
        return None, retry_at

    def _more_sources(self, now: float, need: str | None) -> None:
        """Ask `sources()` for others; `need`: why the fetch cannot go on without one (it fails when
        two calls in a row give nothing new). `need` None: the periodic look at where to read now,
        on a clock of its own, so it never delays the asking that can fail a fetch."""
        if need is None:
            if now < self.sources_at + SOURCES_EVERY_S:
                return
            self.sources_at = now
        else:
            if now < self.needed_at + SOURCES_EVERY_S:
                return
            self.needed_at = now
        try:
            offered = list(self.sources_fn())
        except Exception as e:
            self.log.warning("fetch.sources_failed", error=f"{type(e).__name__}: {str(e)[:300]}")
            offered = []
        added = 0
        offered = [src for src in offered if isinstance(src, Source)]
        if offered:
            # `sources()` says where to read now (the node fetching ahead of this one in a chain,
            # rather than the holder every fetcher would share): a source it no longer names is
            # asked for nothing more, and closed once what it has in flight is in.
            named = {src.endpoint for src in offered}
            for link in list(self.links.values()):
                link.retiring = link.endpoint not in named
                self._close_if_retired(link)
        for src in offered:
            if len([lk for lk in self.links.values() if not lk.retiring]) >= MAX_SOURCES:
                break
            ep = src.endpoint
            if ep in self.links or ep in self.banned or self.losses[ep] > MAX_LOSSES:
                continue
            if self._connect(src, now):
                added += 1
        if added:
            self.fruitless = 0
        if added or need is None:
            return
        self.fruitless += 1
        if self.fruitless >= 2:
            raise FetchError(self._why(need))

    def _why(self, what: str) -> str:
        tried = "; ".join(f"{ep}: {why}" for ep, why in self.tried.items())
        live = ", ".join(f"{lk.source} ({len(lk.inflight)} in flight)" for lk in self.links.values())
        return (
            f"fetch of {self.digest}: {what} ({self.left} items left"
            + (f"; sources in use: {live}" if live else "")
            + (f"; sources left: {tried}" if tried else "; no other source offered")
            + ")"
        )

    # -- links ---------------------------------------------------------------------------------------

    def _connect(self, src: Source, now: float) -> bool:
        ep = src.endpoint
        if src.server_key is not None and self.s.keys is None:
            self._leave(ep, "it is a CURVE server and this node has no keys", ban=True)
            return False
        assert self.s.ctx is not None
        sock = self.s.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES)
        sock.rcvhwm = sock.sndhwm = 2 * self.s.window + 2
        if src.server_key is not None and self.s.keys is not None:
            sock.curve_publickey, sock.curve_secretkey = self.s.keys.public, self.s.keys.secret
            sock.curve_serverkey = src.server_key
        try:
            monitor = sock.get_monitor_socket(LINK_EVENTS)
            sock.connect(ep)
        except (zmq.ZMQError, ValueError, TypeError) as e:
            sock.close(linger=0)
            self._leave(ep, f"cannot connect: {e}", ban=True)
            return False
        link = _Link(src, sock, monitor, created=now, heard=now)
        loop = asyncio.get_running_loop()
        link.tasks = [loop.create_task(self._read(link)), loop.create_task(self._watch(link))]
        self.links[ep] = link
        self.source_names = tuple(str(lk.source) for lk in self.links.values())
        return True

    def _close_if_retired(self, link: _Link) -> None:
        if link.retiring and not link.closed and not link.inflight and not link.writing:
            self.log.info("source.retired", source=str(link.source))
            self._close(link)

    def _leave(self, ep: str, why: str, *, ban: bool) -> None:
        self.tried[ep] = why
        if ban:
            self.banned.add(ep)
        else:
            self.losses[ep] += 1

    def _drop(self, link: _Link, why: str, *, ban: bool) -> None:
        """Stop using a source: what it had in flight goes back to the queue, to another."""
        if link.closed:
            return
        for item in link.inflight.values():
            self._requeue(item)
            self.pacer.give_back(item.size)
        link.inflight.clear()
        self._leave(link.endpoint, why, ban=ban)
        self.s.count("sources_dropped")
        self.log.warning("source.dropped", source=str(link.source), reason=why, banned=ban)
        self._close(link)
        self.wake.set()

    def _close(self, link: _Link) -> None:
        link.closed = True
        self.links.pop(link.endpoint, None)
        self.source_names = tuple(str(lk.source) for lk in self.links.values())
        current = asyncio.current_task()
        for t in link.tasks:
            if t is not current:
                t.cancel()

        def close() -> None:  # after the handler that dropped it has returned
            with contextlib.suppress(zmq.ZMQError):
                link.sock.disable_monitor()
            link.monitor.close(linger=0)
            link.sock.close(linger=0)

        asyncio.get_running_loop().call_soon(close)

    def _expire(self, now: float) -> None:
        timeout = self.s.timeout_s
        for link in list(self.links.values()):
            if not link.up and now - link.created > timeout:
                self._drop(link, f"no connection within {timeout:g} s", ban=False)
            elif link.inflight and now - link.heard > timeout:
                self._drop(link, f"no answer for {timeout:g} s", ban=False)

    async def _watch(self, link: _Link) -> None:
        """The link's socket events: its handshake done or refused, its connection lost."""
        while not link.closed:
            frames = await link.monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
                kind, value = event["event"], int(event["value"])
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.up, link.heard = True, time.monotonic()
                elif kind == zmq.EVENT_DISCONNECTED:
                    if link.up:
                        self._drop(link, "connection lost", ban=False)
                elif failed := handshake_failure(kind, value):
                    self._drop(link, failed, ban=True)
            except Exception as e:  # a bug: the fetch fails with it rather than hang
                self.failure = e
            self.wake.set()

    async def _read(self, link: _Link) -> None:
        raw: zmq.Socket[Any] = zmq.Socket.shadow(link.sock.underlying)
        while not link.closed:
            await link.sock.poll(500)
            for inc in pending(raw, BATCH, keep=MAX_FRAMES, metadata=False):
                try:
                    self._reply(link, inc)
                except Exception as e:  # a bug: the fetch fails with it rather than hang
                    self.failure = e
                self.wake.set()
                if link.closed:
                    return

    def _send(self, link: _Link, item: _Item, now: float) -> None:
        msg_id, self.next_id = self.next_id, self.next_id + 1
        msg: Message
        if item.entry is None:
            msg = GetManifest(digest=self.digest, hold_s=self.s.hold_s)
        else:
            msg = GetChunk(sha256=item.entry.sha256, index=item.index, chunk_bytes=self.chunk_bytes, hold_s=self.s.hold_s, digest=self.digest)
        if not link.inflight:
            link.heard = now  # its silence is counted from the first request it owes an answer to
        link.inflight[msg_id] = item
        try:
            link.sock.send_multipart(msg.frames(msg_id), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._drop(link, f"cannot send to it: {e}", ban=False)

    def _reply(self, link: _Link, inc: Incoming) -> None:
        try:
            msg, msg_id, data = decode(inc.frames, REPLIES, cut=inc.cut)
        except WireError as e:
            self._drop(link, f"sent a malformed reply: {e.code}: {e.message}", ban=True)
            return
        item = link.inflight.pop(msg_id, None)
        if item is None:
            return  # the answer to a request given up on
        now = link.heard = time.monotonic()
        if link.retiring:
            self.wake.set()  # _fill closes it once it is idle
        if isinstance(msg, Error):
            self._refused(link, item, msg, now)
        elif item.entry is None:
            if not isinstance(msg, ManifestData) or data is None:
                self._drop(link, f"answered a manifest request with {msg.OP}", ban=True)
                self._requeue(item)
                return
            got = hashlib.sha256(data).hexdigest()
            if got != self.digest:
                self._drop(link, f"served a manifest whose bytes hash to {got}, not the digest", ban=True)
                self._requeue(item)
                return
            self.manifest_bytes = bytes(data)
            self._done(item, now)
        else:
            if not isinstance(msg, ChunkData) or data is None or len(data) != item.size:
                got = f"{len(data)} bytes" if data is not None else msg.OP
                self._drop(link, f"answered {item} ({item.size} bytes) with {got}", ban=True)
                self._requeue(item)
                return
            link.writing += 1
            assert self.s.io is not None
            fut = asyncio.get_running_loop().run_in_executor(self.s.io, self.s.cache.write_chunk, item.entry, item.index, data, self.chunk_bytes)
            fut.add_done_callback(functools.partial(self._written, link, item))

    def _written(self, link: _Link, item: _Item, fut: asyncio.Future[bool]) -> None:
        link.writing -= 1
        self.wake.set()
        self._close_if_retired(link)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failure = exc
        elif fut.result():
            self._done(item, time.monotonic())
        else:
            self.s.count("corrupt")
            self._requeue(item)
            self._leave_for_garbage(link, f"served {item} whose bytes fail its sha256")

    def _leave_for_garbage(self, link: _Link, why: str) -> None:
        if link.closed:  # dropped meanwhile for another reason: it is never asked again all the same
            self.banned.add(link.endpoint)
            self.tried[link.endpoint] = why
        else:
            self._drop(link, why, ban=True)

    def _refused(self, link: _Link, item: _Item, err: Error, now: float) -> None:
        self.pacer.give_back(item.size)
        self._requeue(item)
        if err.code == Code.NOT_HERE and err.later:
            item.retry[link.endpoint] = now + RETRY_S
            self.progress_at = now  # it is on its way there: that source is not stuck
        elif err.code == Code.NOT_HERE:
            item.lacks.add(link.endpoint)
        elif err.code == Code.BUSY:
            item.retry[link.endpoint] = now + RETRY_S
        else:
            self._drop(link, f"{err.code}: {err.message}", ban=True)

    def _requeue(self, item: _Item) -> None:
        self.queue[id(item)] = item
        self.queue.move_to_end(id(item), last=False)  # first: a chain's next hop asks in order

    def _done(self, item: _Item, now: float) -> None:
        self.left -= 1
        self.progress_at = now
        if item.entry is not None:
            self.done_bytes += item.size
            self.s.count("chunks_fetched")
            self.s.count("bytes_fetched", item.size)
            if self.s.server is not None:
                self.s.server.landed(item.key)
            self.samples.append((now, self.done_bytes))
            while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
                self.samples.popleft()
            t0, b0 = self.samples[0]
            self.rate_bps = (self.done_bytes - b0) / (now - t0) if now > t0 else 0.0
            self.rate_at = now

    def quiet_s(self) -> float:
        """How long without a chunk landing before the fetch reads as stalled (rate 0): the rate
        window, or twice the last gap between landings where that is longer (4 MiB chunks paced
        at 1 MB/s land every 4 s; the rate read 0 between them), at most TIMEOUT_S."""
        if len(self.samples) < 2:
            return RATE_WINDOW_S
        gap = self.samples[-1][0] - self.samples[-2][0]
        return min(TIMEOUT_S, max(RATE_WINDOW_S, 2 * gap))
