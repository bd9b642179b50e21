"""The staging data channel (staging/channel.py, staging/wire.py): real Stagers on 127.0.0.1, each
with its own thread, loop and ZeroMQ context, real caches on disk, real files.

Trees are cut in 64 KiB chunks, so a megabyte makes a few dozen of them and a window of requests in
flight is a fraction of a tree. Peers that misbehave on purpose are raw ZeroMQ sockets speaking the
wire format by hand (`Peer`, `Impostor`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import free_port, wait_for

from dpool.protocol.security import ClientKeys
from dpool.staging.cache import Cache
from dpool.staging.channel import (
    WINDOW,
    ChannelError,
    FetchError,
    Pacer,
    Source,
    Stager,
    UploadError,
    upload,
)
from dpool.staging.manifest import Manifest, scan
from dpool.staging.wire import (
    MAX_DATA_BYTES,
    REPLIES,
    REQUESTS,
    ChunkData,
    Error,
    GetChunk,
    GetManifest,
    ManifestData,
    Message,
    Offer,
    OfferReply,
    Put,
    decode,
)

CHUNK = 64 * 1024
SIZES = {
    "corpus/a.txt": 5 * CHUNK + 123,
    "corpus/b.txt": 3 * CHUNK,
    "corpus/copy-of-b.txt": 3 * CHUNK,  # the same bytes as b.txt: fetched once
    "model/weights.bin": 8 * CHUNK + 1,
    "model/empty.json": 0,
}


def make_tree(root: Path, sizes: dict[str, int] = SIZES, seed: int = 1) -> Manifest:
    rng = random.Random(seed)
    for rel, size in sizes.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    copy = root / "corpus" / "copy-of-b.txt"
    if copy.exists():
        copy.write_bytes((root / "corpus" / "b.txt").read_bytes())
    return scan(root, chunk_bytes=CHUNK)


def unique_bytes(m: Manifest) -> int:
    """What a fetch of `m` moves: each content once."""
    return sum({e.sha256: e.size for e in m.entries}.values())


def assert_same_files(got: Path, src: Path, m: Manifest) -> None:
    for e in m.entries:
        assert (got / e.path).read_bytes() == (src / e.path).read_bytes(), e.path


def pair() -> ClientKeys:
    public, secret = zmq.curve_keypair()
    return ClientKeys(public=public, secret=secret, server_public=b"", source="test")


@dataclass
class Node:
    stager: Stager
    cache: Cache
    endpoint: str
    key: bytes | None = None

    @property
    def source(self) -> Source:
        return Source(self.endpoint, self.key, name=Path(self.cache.root).name)

    def fetch(self, m: Manifest, *sources: Node, **kw: Any) -> concurrent.futures.Future[Path]:
        return self.stager.fetch(m.digest, lambda: [s.source for s in sources], **kw)

    def stats(self) -> dict[str, int]:
        return self.stager.stats()


class Nodes:
    """Stagers for one test, each with a cache of its own under tmp_path; all stopped at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Stager] = []

    def node(self, name: str, *, holds: tuple[Path, Manifest] | None = None, bind: str | None = "tcp://127.0.0.1:0", **kw: Any) -> Node:
        cache = Cache(self.root / name, min_free=0)
        if holds is not None:
            folder, m = holds
            cache.put_manifest(m.to_bytes())
            cache.adopt(m.digest, folder)  # served from where it is
        stager = Stager(cache, bind=bind, **kw)
        self.started.append(stager)
        endpoint = stager.start()
        keys = kw.get("keys")
        return Node(stager, cache, endpoint, keys.public if keys is not None and bind is not None else None)

    def stop(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    got = Nodes(tmp_path / "nodes")
    try:
        yield got
    finally:
        got.stop()


@pytest.fixture
def src(tmp_path: Path) -> tuple[Path, Manifest]:
    return tmp_path / "src", make_tree(tmp_path / "src")


# -- raw peers ------------------------------------------------------------------------------------


class Peer:
    """A DEALER that speaks the wire format by hand, with CURVE when given keys."""

    def __init__(self, endpoint: str, keys: ClientKeys | None = None, server_key: bytes | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = keys.public, keys.secret, server_key
        self.sock.connect(endpoint)
        self.next_id = 100

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def request(self, msg: Message, data: bytes | None = None) -> list[bytes]:
        self.next_id += 1
        return msg.frames(self.next_id) + ([data] if data is not None else [])

    def answer(self, timeout: float = 10.0) -> tuple[Message, int, bytes | None]:
        assert self.sock.poll(timeout * 1000), "no answer"
        msg, msg_id, data = decode(self.sock.recv_multipart(), REPLIES)
        return msg, msg_id, None if data is None else bytes(data)

    def ask(self, *frames: bytes) -> tuple[Message, int, bytes | None]:
        self.send(*frames)
        return self.answer()

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class Impostor:
    """A data channel that answers every request the way `serve` says (a thread of its own)."""

    def __init__(self, serve: Callable[[Message], tuple[Message, bytes]]) -> None:
        self.serve = serve
        self.asked: collections.Counter[str] = collections.Counter()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if not self.sock.poll(50):
                continue
            rid, *frames = self.sock.recv_multipart()
            msg, msg_id, _ = decode(frames, REQUESTS)
            self.asked[str(msg.OP)] += 1
            reply, data = self.serve(msg)
            self.sock.send_multipart([rid, *reply.frames(msg_id), data])

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


# -- fetching -----------------------------------------------------------------------------------


def test_a_fetch_gets_every_file_of_a_tree_from_one_server_byte_for_byte(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    a = nodes.node("a", holds=src)
    b = nodes.node("b", bind=None)  # fetch only, as dpctl would
    got = b.fetch(m, a).result(60)
    assert_same_files(got, folder, m)
    assert got == b.cache.tree(m.digest)
    # Each content moved once (b.txt and its copy are one blob), and nothing else.
    assert a.stats()["bytes_served"] == b.stats()["bytes_fetched"] == unique_bytes(m)
    assert a.stats()["manifests_served"] == 1
    assert b.stager.progress(m.digest) is None  # done: no fetch to report on
    # Held now: a second fetch asks no one.
    requests = a.stats()["requests"]
    assert b.stager.fetch(m.digest, lambda: []).result(10) == got
    assert a.stats()["requests"] == requests


def test_a_node_still_fetching_serves_the_next_in_a_chain(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    a = nodes.node("a", holds=src)
    b = nodes.node("b")
    c = nodes.node("c")
    total = unique_bytes(m)
    fb = b.fetch(m, a, rate_bps=total / 1.5)  # b takes about 1.5 s: c starts while b is at its beginning
    fc = c.fetch(m, b)  # c knows only b
    got = fc.result(60)
    fb.result(60)
    assert_same_files(got, folder, m)
    assert b.stats()["held"] > 0  # c asked b for chunks b had yet to get, and b sent them once they came
    assert a.stats()["bytes_served"] == total  # the source sent each chunk once, to b
    assert b.stats()["bytes_served"] == total  # b passed every one on to c


def test_a_source_no_longer_offered_is_asked_for_nothing_more_and_the_new_one_serves_the_rest(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    """`sources()` is where to read now: when it names another source (a chain's node ahead,
    instead of the holder everyone shares), the fetch moves there, and the first one, once what it
    had in flight is in, is asked nothing more."""
    folder, m = src
    a = nodes.node("a", holds=src)
    b = nodes.node("b", holds=src)
    f = nodes.node("f", bind=None)
    total = unique_bytes(m)
    offered = [Source(a.endpoint, name="a")]
    future = f.stager.fetch(m.digest, lambda: list(offered), rate_bps=total / 2.0)
    wait_for("a quarter of the tree from a", lambda: (p := f.stager.progress(m.digest)) is not None and p.done_bytes >= total // 4, 30, 0.02)
    offered[:] = [Source(b.endpoint, name="b")]
    wait_for("f to ask b", lambda: b.stats()["requests"] > 0, 30, 0.02)
    from_a = a.stats()["bytes_served"]
    got = future.result(60)
    assert_same_files(got, folder, m)
    assert a.stats()["bytes_served"] - from_a <= WINDOW * CHUNK  # only what was in flight when b was named
    assert a.stats()["bytes_served"] + b.stats()["bytes_served"] - total <= WINDOW * CHUNK and b.stats()["bytes_served"] > total // 4
    assert f.stats()["sources_dropped"] == 0  # a was not lost: it was let go


def test_a_source_stopped_half_way_is_dropped_and_only_what_it_had_in_flight_is_sent_again(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    a = nodes.node("a", holds=src)
    b = nodes.node("b", holds=src)
    f = nodes.node("f", bind=None)
    total = unique_bytes(m)
    future = f.fetch(m, a, b, rate_bps=total / 2.0)
    wait_for("half of the tree", lambda: (p := f.stager.progress(m.digest)) is not None and p.done_bytes >= total // 2, 30, 0.02)
    assert a.stats()["bytes_served"] > 0
    a.stager.stop()
    got = future.result(60)
    assert_same_files(got, folder, m)
    served = a.stats()["bytes_served"] + b.stats()["bytes_served"]
    # Bytes sent twice: only the chunks a had sent (or was sending) when it stopped, a window at most.
    assert served - total <= WINDOW * CHUNK
    assert f.stats()["bytes_fetched"] == total
    assert f.stats()["sources_dropped"] >= 1


@pytest.mark.parametrize("lie", ["chunk", "manifest"])
def test_a_source_that_serves_garbage_is_dropped_and_never_asked_again(nodes: Nodes, src: tuple[Path, Manifest], lie: str) -> None:
    folder, m = src
    sizes = {e.sha256: e for e in m.entries}

    def serve(msg: Message) -> tuple[Message, bytes]:
        if isinstance(msg, GetManifest):
            return ManifestData(), m.to_bytes() + (b" " if lie == "manifest" else b"")
        assert isinstance(msg, GetChunk)
        return ChunkData(), bytes(sizes[msg.sha256].chunk_size(msg.index, CHUNK))  # the right length, the wrong bytes

    impostor = Impostor(serve)
    try:
        good = nodes.node("good", holds=src)
        f = nodes.node("f", bind=None)
        calls = []

        def sources() -> list[Source]:  # the impostor first; the good node when the fetch asks again
            calls.append(1)
            return [Source(impostor.endpoint, name="impostor")] + ([good.source] if len(calls) > 1 else [])

        got = f.stager.fetch(m.digest, sources).result(60)
        assert_same_files(got, folder, m)
        assert len(calls) > 1
        if lie == "chunk":
            assert f.stats()["corrupt"] >= 1
            assert 1 <= impostor.asked["chunk"] <= WINDOW  # those out when its first one failed; none after
        else:
            assert impostor.asked == {"manifest": 1}
        assert good.stats()["bytes_served"] == unique_bytes(m)
    finally:
        impostor.close()


def test_a_fetch_no_source_can_serve_fails_naming_each_source_and_why(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    _, m = src
    f = nodes.node("f", bind=None, timeout_s=1.0)
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(FetchError, match=rf"{nowhere}: no connection within 1 s"):
        f.stager.fetch(m.digest, lambda: [Source(nowhere)]).result(30)
    empty = nodes.node("empty")  # up, but holds nothing and fetches nothing
    with pytest.raises(FetchError, match="no source holds the manifest"):
        f.fetch(m, empty).result(30)
    with pytest.raises(FetchError, match="no source left"):
        f.stager.fetch(m.digest, lambda: []).result(30)


def test_a_cancelled_fetch_keeps_its_verified_chunks_and_the_next_one_resumes(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    a = nodes.node("a", holds=src)
    f = nodes.node("f", bind=None)
    total = unique_bytes(m)
    slow = f.fetch(m, a, rate_bps=total / 4)
    progress = wait_for("a third of the tree", lambda: (p := f.stager.progress(m.digest)) is not None and p.done_bytes >= total // 3 and p, 30, 0.02)
    assert progress.total_bytes == m.total_bytes and progress.sources == ["a"] and progress.rate_bps > 0
    f.stager.cancel(m.digest)
    with pytest.raises(concurrent.futures.CancelledError):
        slow.result(10)
    wait_for("the fetch to end", lambda: f.stager.progress(m.digest) is None, 10, 0.02)
    got = f.fetch(m, a).result(60)
    assert_same_files(got, folder, m)
    assert a.stats()["bytes_served"] - total <= WINDOW * CHUNK  # what was in flight at the cancel, at most


def test_stop_ends_the_thread_promptly_and_a_running_fetch_fails(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    _, m = src
    a = nodes.node("a", holds=src)
    f = nodes.node("f")
    future = f.fetch(m, a, rate_bps=1000)  # an hour and more at this pace
    wait_for("the fetch to start", lambda: f.stager.progress(m.digest), 10, 0.02)
    threads = sum(t.name == "staging" for t in threading.enumerate())
    f.stager.stop()  # returns once its thread has ended
    assert sum(t.name == "staging" for t in threading.enumerate()) == threads - 1
    with pytest.raises(FetchError, match="stopped"):
        future.result(0)
    with pytest.raises(FetchError, match="not running"):
        f.fetch(m, a).result(0)


def test_a_stager_that_cannot_bind_says_where_and_why(nodes: Nodes) -> None:
    a = nodes.node("a")
    with pytest.raises(ChannelError, match=rf"could not start on {a.endpoint}: Address already in use"):
        nodes.node("b", bind=a.endpoint)


# -- pacing ----------------------------------------------------------------------------------------


def test_a_paced_fetch_takes_at_least_its_size_over_its_rate(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    a = nodes.node("a", holds=src)
    f = nodes.node("f", bind=None)
    rate = unique_bytes(m) / 1.5
    started = time.monotonic()
    got = f.fetch(m, a, rate_bps=rate).result(60)
    assert time.monotonic() - started >= unique_bytes(m) / rate
    assert_same_files(got, folder, m)


def test_a_fetch_whose_chunks_land_slower_than_the_rate_window_never_reads_as_stalled(nodes: Nodes, src: tuple[Path, Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    """4 MiB chunks paced at 1 MB/s land every 4 s, more than the 3 s rate window: status read
    rate 0 and no ETA between them. Here the window is 0.2 s and chunks land every ~0.5 s."""
    import dpool.staging.fetch as fetch_module

    monkeypatch.setattr(fetch_module, "RATE_WINDOW_S", 0.2)
    _, m = src
    a = nodes.node("a", holds=src)
    f = nodes.node("f", bind=None)
    future = f.fetch(m, a, rate_bps=CHUNK / 0.5)
    wait_for("the first chunk", lambda: f.stats()["chunks_fetched"] >= 1, 30, 0.01)
    first = f.stager.progress(m.digest)
    assert first is not None
    assert first.rate_bps > 0, first  # counted from the fetch's start, not only from a second chunk
    rates = []
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and (p := f.stager.progress(m.digest)) is not None:
        rates.append(p.rate_bps)
        time.sleep(0.02)
    # Between landings (every ~0.5 s, four times the window) it read 0 about half the time; now
    # only a chunk more than twice as late as the last one would.
    assert len(rates) > 10 and sum(r == 0 for r in rates) <= len(rates) // 10, rates
    f.stager.cancel(m.digest)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(10)


def test_a_fetch_paced_to_a_crawl_finishes_once_its_pace_is_lifted(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    a = nodes.node("a", holds=src)
    f = nodes.node("f", bind=None)
    f.stager.set_rate(None, 1000)  # every fetch, those started later too: this one would take 20 minutes
    future = f.fetch(m, a)
    wait_for("the fetch to start", lambda: f.stager.progress(m.digest), 10, 0.02)
    assert not future.done()
    f.stager.set_rate(None, None)
    assert_same_files(future.result(60), folder, m)


def test_the_pacer_never_lets_more_through_than_the_rate_allows_whatever_the_changes() -> None:
    rng = random.Random(7)
    now, rate, allowed, taken = 0.0, 1000.0, 0.0, 0
    pacer = Pacer(rate, now)
    for _ in range(2000):
        step = rng.uniform(0, 0.2)
        now += step
        allowed += rate * step
        if rng.random() < 0.05:
            rate = rng.choice([10.0, 500.0, 5000.0, 0.0])
            pacer.set_rate(rate, now)
        n = rng.randint(1, 4000)
        if pacer.take(n, now) == 0:
            taken += n
            if rng.random() < 0.1:  # not delivered: given back
                pacer.give_back(n)
                taken -= n
        assert taken <= allowed + 1e-6
    assert taken > 0
    fresh = Pacer(1000.0, 0.0)
    assert fresh.take(500, 0.0) == pytest.approx(0.5)  # starts empty: the first bytes wait too
    assert fresh.take(500, 0.5) == 0
    assert Pacer(None, 0.0).take(10**9, 0.0) == 0


# -- uploads --------------------------------------------------------------------------------------


def test_an_upload_sends_what_the_node_lacks_and_the_same_upload_again_sends_nothing(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    n = nodes.node("n")
    seen: list[tuple[int, int]] = []
    sent = upload(n.source, folder, m, progress=lambda done, total: seen.append((done, total)))
    assert sent == unique_bytes(m)
    assert seen[0] == (0, sent) and seen[-1] == (sent, sent)
    got = n.cache.tree(m.digest)
    assert got is not None
    assert_same_files(got, folder, m)
    assert upload(n.source, folder, m) == 0
    assert n.stats()["bytes_put"] == sent


def test_an_upload_of_a_file_changed_since_its_scan_is_refused_before_it_is_sent(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    n = nodes.node("n")
    path = folder / "model" / "weights.bin"
    data = bytearray(path.read_bytes())
    data[3 * CHUNK] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(UploadError, match=r"weights.bin: changed since it was scanned \(chunk 3 differs\)"):
        upload(n.source, folder, m)
    assert n.stats()["bad_puts"] == 0


# -- hostile peers ------------------------------------------------------------------------------------


def test_a_hostile_peer_gets_errors_and_the_server_keeps_serving(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    _, m = src
    a = nodes.node("a", holds=src)
    entry = m.entries[0]
    good = GetChunk(sha256=entry.sha256, index=1, chunk_bytes=CHUNK)
    peer = Peer(a.endpoint)
    try:

        def refused(code: str, *frames: bytes, says: str = "") -> None:
            msg, _, _ = peer.ask(*frames)
            assert isinstance(msg, Error) and msg.code == code, msg
            assert says in msg.message, msg.message
            # ...and the next request is served
            msg, _, data = peer.ask(*peer.request(good))
            assert isinstance(msg, ChunkData) and data is not None
            assert hashlib.sha256(data).hexdigest() == entry.chunks[1]

        header = msgpack.packb(["dpool.data", 1, "chunk", 7])
        body = msgpack.packb({"sha256": entry.sha256, "index": 0, "chunk_bytes": CHUNK})
        refused("bad_request", b"\xc1", says="not msgpack")
        refused("bad_request", b"\x93\x01\x02\x03", body, says="header must be")
        refused("bad_version", msgpack.packb(["dpool.data", 2, "chunk", 7]), body, says="version 2 is not spoken here")
        refused("bad_version", msgpack.packb(["dpool", 1, "chunk", 7]), body, says="not a dpool.data header")
        refused("too_large", b"\x00" * 1024, body, says="header is 1024 bytes")
        refused("bad_request", msgpack.packb(["dpool.data", 1, "steal", 7]), body, says="unknown op 'steal'")
        refused("bad_request", msgpack.packb(["dpool.data", 1, "chunk.data", 7]), b"\x80", b"", says="chunk.data is not accepted here")
        refused("bad_request", header, body, b"extra", b"frames", says="more than 3 frames")
        refused("bad_request", header, says="2 frames")
        refused("too_large", header, b"\x00" * 5000, says="body is 5000 bytes")
        refused("bad_request", header, msgpack.packb({"sha256": entry.sha256, "index": "0", "chunk_bytes": CHUNK}), says="index: must be an integer")
        refused("bad_request", header, msgpack.packb({"sha256": entry.sha256, "index": 0, "chunk_bytes": 1}), says="chunk_bytes")
        refused("bad_request", header, msgpack.packb({"sha256": entry.sha256.upper(), "index": 0, "chunk_bytes": CHUNK}), says="sha256")
        refused("bad_request", header, msgpack.packb({"sha256": entry.sha256, "index": 0, "chunk_bytes": CHUNK, "path": "/etc"}), says="path")
        refused("not_here", *peer.request(GetChunk(sha256="0" * 64, index=0, chunk_bytes=CHUNK)), says="not held here")
        # an offer whose bytes do not hash to its digest, and one of bytes that are no manifest
        refused("bad_request", *peer.request(Offer(digest=m.digest), m.to_bytes() + b" "), says="hash to")
        junk = b'{"entries": "all of them"}'
        refused("bad_request", *peer.request(Offer(digest=hashlib.sha256(junk).hexdigest()), junk), says="manifest")
        # puts into no offered manifest, and of bytes that are not the chunk
        other = make_tree(a.cache.root.parent / "other", seed=2)
        refused("bad_request", *peer.request(Put(digest=other.digest, sha256=other.entries[0].sha256, index=0), b"x"), says="offer it first")
        msg, _, _ = peer.ask(*peer.request(Offer(digest=other.digest), other.to_bytes()))
        assert isinstance(msg, OfferReply) and msg.missing > 0
        e = other.entries[0]
        refused("bad_chunk", *peer.request(Put(digest=other.digest, sha256=e.sha256, index=0), bytes(CHUNK)), says="do not hash")
        refused("bad_request", *peer.request(Put(digest=other.digest, sha256=e.sha256, index=0), b"short"), says=f"{CHUNK} bytes, got 5")
        assert a.stats()["rejected"] == 14  # the malformed ones above (offers and puts were read, then refused)
        assert a.stats()["bad_puts"] == 1
    finally:
        peer.close()
    # A frame over the cap: libzmq drops that connection before keeping any of it; others are served.
    huge = Peer(a.endpoint)
    try:
        huge.send(header, bytes(MAX_DATA_BYTES + 1))
        assert not huge.sock.poll(1000)
    finally:
        huge.close()
    fresh = Peer(a.endpoint)
    try:
        msg, _, data = fresh.ask(*fresh.request(good))
        assert isinstance(msg, ChunkData) and data is not None and hashlib.sha256(data).hexdigest() == entry.chunks[1]
    finally:
        fresh.close()


# -- CURVE ----------------------------------------------------------------------------------------


def test_with_keys_a_key_not_allowed_is_refused_at_the_handshake(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    server, member, stranger = pair(), pair(), pair()
    allowed = {member.public.decode(): "node:member"}
    asked: list[str] = []

    def authorize(key: str) -> str | None:
        asked.append(key)
        return allowed.get(key)

    s = nodes.node("s", holds=src, keys=server, authorize=authorize)
    ok = nodes.node("ok", bind=None, keys=member)
    got = ok.fetch(m, s).result(60)
    assert_same_files(got, folder, m)
    assert asked.count(member.public.decode()) > 1  # at the handshake and on each request
    no = nodes.node("no", bind=None, keys=stranger)
    with pytest.raises(FetchError, match="refused this key at the handshake"):
        no.fetch(m, s).result(30)
    assert stranger.public.decode() in asked
    keyless = nodes.node("keyless", bind=None)
    with pytest.raises(FetchError, match="CURVE server and this node has no keys"):
        keyless.fetch(m, s).result(30)
    assert s.stats()["chunks_served"] == ok.stats()["chunks_fetched"]


def test_with_keys_a_key_taken_off_the_allow_list_is_refused_on_its_next_request(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    _, m = src
    server, member = pair(), pair()
    allowed = {member.public.decode(): "node:member"}
    s = nodes.node("s", holds=src, keys=server, authorize=allowed.get)
    entry = m.entries[0]
    peer = Peer(s.endpoint, member, server.public)
    try:
        msg, _, data = peer.ask(*peer.request(GetChunk(sha256=entry.sha256, index=0, chunk_bytes=CHUNK)))
        assert isinstance(msg, ChunkData) and data is not None
        del allowed[member.public.decode()]
        msg, _, _ = peer.ask(*peer.request(GetChunk(sha256=entry.sha256, index=1, chunk_bytes=CHUNK)))  # the same connection
        assert isinstance(msg, Error) and msg.code == "refused", msg
        assert s.stats()["refused"] == 1
    finally:
        peer.close()


def test_with_keys_a_client_puts_only_what_it_submitted_and_a_viewer_reads_nothing(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    folder, m = src
    server, alice, viewer = pair(), pair(), pair()
    roles = {alice.public.decode(): "client:alice", viewer.public.decode(): "viewer:dash"}
    submitted: set[tuple[str, str]] = set()
    n = nodes.node("n", keys=server, authorize=roles.get, may_put=lambda role, digest: (role, digest) in submitted)
    with pytest.raises(UploadError, match="client:alice may not put chunks") as refused:
        upload(n.source, folder, m, keys=alice)
    assert refused.value.code == "refused"
    assert n.cache.manifest(m.digest) is None  # not even its manifest was kept
    submitted.add(("client:alice", m.digest))
    assert upload(n.source, folder, m, keys=alice) == unique_bytes(m)
    assert upload(n.source, folder, m, keys=alice) == 0
    peer = Peer(n.endpoint, viewer, server.public)
    try:
        msg, _, _ = peer.ask(*peer.request(GetManifest(digest=m.digest)))
        assert isinstance(msg, Error) and msg.code == "refused" and "may not read" in msg.message
    finally:
        peer.close()


def test_a_peer_that_never_ends_a_message_is_dropped_and_the_server_serves_on(nodes: Nodes, src: tuple[Path, Manifest]) -> None:
    """Parts of one message sent without its last frame: libzmq holds them out of the reader's
    sight, and 2,000 parts of 1 MiB grew a dpd by 2.2 GB. Past the peer budget (one message of the
    largest size, and some) the connection is dropped; a fetch from the same server still works."""
    from zmtp import RawPeer

    from dpool.protocol.peerbudget import PEER_BYTES
    from dpool.staging.wire import MAX_DATA_BYTES

    a = nodes.node("a", holds=src)
    host, port = a.endpoint.removeprefix("tcp://").rsplit(":", 1)
    raw = RawPeer(host, int(port))
    try:
        sent = raw.send_parts(400, 1 << 20)  # 400 MiB, unless dropped on the way
        closed = raw.closed_by_peer()
    finally:
        raw.close()
    assert closed and sent < PEER_BYTES + MAX_DATA_BYTES + (128 << 20), f"{sent >> 20} MiB sent before the server closed"
    b = nodes.node("b")
    got = b.stager.fetch(src[1].digest, lambda: [Source(a.endpoint, None, "a")]).result(timeout=60)
    assert_same_files(got, src[0], src[1])
