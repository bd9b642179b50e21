"""dpctl's push into one node's data channel: offer the manifest, send the chunks the node lacks
(pipelined), offer again so the node builds the tree. Not a node: a blocking function with a
zmq context of its own."""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dpool.protocol.security import ClientKeys
from dpool.staging.manifest import Entry, Manifest
from dpool.staging.parts import LINK_EVENTS, RETRY_S, WINDOW, Source, UploadError, handshake_failure
from dpool.staging.wire import (
    MAX_DATA_BYTES,
    MAX_FRAMES,
    MAX_MANIFEST_BYTES,
    REPLIES,
    Code,
    Error,
    Message,
    Offer,
    OfferReply,
    Put,
    PutDone,
    WireError,
    decode,
    pending,
)


def upload(
    source: Source,
    root: Path,
    manifest: Manifest,
    *,
    keys: ClientKeys | None = None,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 60.0,
    window: int = WINDOW,
) -> int:
    """Push the files of `manifest` under `root` into node `source`'s cache: offer the manifest, send
    the chunks the node lacks (`window` in flight), then offer again so the node builds the tree.
    Returns the bytes sent: 0 when the node holds it already. `progress(sent, to_send)` after each
    chunk. Raises UploadError (the node refused, is full, did not answer within `timeout_s`, or a
    file changed since it was scanned)."""
    ctx = zmq.Context()
    try:
        return _Upload(ctx, source, keys, timeout_s).run(Path(root), manifest, progress, max(1, window))
    finally:
        ctx.destroy(linger=0)


class _Upload:
    def __init__(self, ctx: zmq.Context[Any], source: Source, keys: ClientKeys | None, timeout_s: float) -> None:
        self.source, self.timeout_s = source, timeout_s
        if source.server_key is not None and keys is None:
            raise UploadError(f"{source}: its data channel uses CURVE: give keys (--keys)")
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_BYTES)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))  # a refused handshake drops the queue
        if source.server_key is not None and keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = keys.public, keys.secret
            self.sock.curve_serverkey = source.server_key
        self.monitor = self.sock.get_monitor_socket(LINK_EVENTS)
        try:
            self.sock.connect(source.endpoint)
        except zmq.ZMQError as e:
            raise UploadError(f"{source}: cannot connect: {e}") from None
        self.next_id = 1

    def run(self, root: Path, manifest: Manifest, progress: Callable[[int, int], None] | None, window: int) -> int:
        todo = self._offer(manifest)
        total = sum(e.chunk_size(i, manifest.chunk_bytes) for e, i in todo)
        sent = 0
        if progress is not None:
            progress(0, total)
        out: dict[int, tuple[Entry, int, int]] = {}  # request id -> (entry, index, bytes)
        later: collections.deque[tuple[Entry, int]] = collections.deque(todo)
        retry_at = 0.0
        while later or out:
            while later and len(out) < window and time.monotonic() >= retry_at:
                entry, index = later.popleft()
                data = self._chunk(root, manifest, entry, index)
                out[self._send(Put(digest=manifest.digest, sha256=entry.sha256, index=index), data)] = (entry, index, len(data))
            if not out:  # the node was busy: nothing is out, so nothing else will wake this
                time.sleep(max(0.0, retry_at - time.monotonic()))
                continue
            msg_id, msg, _ = self._recv()
            got = out.pop(msg_id, None)
            if got is None:
                continue
            entry, index, size = got
            if isinstance(msg, Error) and msg.code == Code.BUSY:
                later.appendleft((entry, index))
                retry_at = time.monotonic() + RETRY_S
            elif isinstance(msg, Error):
                raise UploadError(f"{self.source}: chunk {index} of {entry.path}: {msg.code}: {msg.message}", msg.code)
            elif isinstance(msg, PutDone):
                sent += size
                if progress is not None:
                    progress(sent, total)
            else:
                raise UploadError(f"{self.source}: answered a put with {msg.OP}", Code.BAD_REQUEST)
        if todo and self._offer(manifest):
            raise UploadError(f"{self.source}: still lacks chunks of {manifest.digest} after they were sent")
        return sent

    def _offer(self, manifest: Manifest) -> list[tuple[Entry, int]]:
        """Offer the manifest; the chunks the node lacks."""
        data = manifest.to_bytes()
        if len(data) > MAX_MANIFEST_BYTES:
            raise UploadError(f"the manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a node takes: stage fewer files at once")
        msg_id = self._send(Offer(digest=manifest.digest), data)
        while True:
            got_id, msg, bitmap = self._recv()
            if got_id == msg_id:
                break
        if isinstance(msg, Error):
            raise UploadError(f"{self.source}: {msg.code}: {msg.message}", msg.code)
        if not isinstance(msg, OfferReply) or bitmap is None:
            raise UploadError(f"{self.source}: answered an offer with {msg.OP}", Code.BAD_REQUEST)
        chunks = [(e, i) for e in manifest.entries for i in range(len(e.chunks))]
        if len(bitmap) != (len(chunks) + 7) // 8:
            raise UploadError(f"{self.source}: its bitmap of missing chunks is {len(bitmap)} bytes for {len(chunks)} chunks", Code.BAD_REQUEST)
        todo = [c for k, c in enumerate(chunks) if bitmap[k // 8] >> (k % 8) & 1]
        if len(todo) != msg.missing:
            raise UploadError(f"{self.source}: says {msg.missing} chunks are missing but marks {len(todo)}", Code.BAD_REQUEST)
        return todo

    def _chunk(self, root: Path, manifest: Manifest, entry: Entry, index: int) -> bytes:
        path = root.joinpath(*entry.path.split("/"))
        size = entry.chunk_size(index, manifest.chunk_bytes)
        try:
            with open(path, "rb") as f:
                f.seek(index * manifest.chunk_bytes)
                data = f.read(size)
        except OSError as e:
            raise UploadError(f"{path}: cannot read it: {e.strerror or e}") from None
        if len(data) != size or hashlib.sha256(data).hexdigest() != entry.chunks[index]:
            raise UploadError(f"{path}: changed since it was scanned (chunk {index} differs): scan it again")
        return data

    def _send(self, msg: Message, data: bytes) -> int:
        msg_id, self.next_id = self.next_id, self.next_id + 1
        try:
            self.sock.send_multipart([*msg.frames(msg_id), data], copy=False)
        except zmq.Again:
            raise UploadError(f"{self.source}: could not send within {self.timeout_s:g} s (its handshake refused, or it stopped reading)", Code.REFUSED) from None
        return msg_id

    def _recv(self) -> tuple[int, Message, memoryview | None]:
        """The next reply; UploadError when none comes within the timeout or the handshake fails."""
        deadline = time.monotonic() + self.timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise UploadError(f"{self.source}: no answer within {self.timeout_s:g} s (is its data channel at {self.source.endpoint}?)")
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self.monitor in ready:
                event = parse_monitor_message(self.monitor.recv_multipart())
                failed = handshake_failure(event["event"], int(event["value"]))
                if failed:
                    raise UploadError(f"{self.source}: {failed}", Code.REFUSED)
            if self.sock in ready:
                for inc in pending(self.sock, 1, keep=MAX_FRAMES, metadata=False):
                    try:
                        msg, msg_id, data = decode(inc.frames, REPLIES, cut=inc.cut)
                    except WireError as e:
                        raise UploadError(f"{self.source}: sent a malformed reply: {e.code}: {e.message}", Code.BAD_REQUEST) from None
                    return msg_id, msg, data
