"""Staging's bottom layers on real files: manifests (what a tree is, by content; what a peer may not
send) and the node's content-addressed cache (chunks verified as they land, resumed after a crash,
evicted least recently used first, never while a job holds them)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from structlog.testing import capture_logs

from dpool.staging.cache import Cache, CacheFull, Incomplete
from dpool.staging.integrity import SEAL_NS
from dpool.staging.manifest import (
    CHUNK_BYTES,
    EMPTY_SHA256,
    Entry,
    HashCache,
    Limits,
    Manifest,
    ManifestError,
    differences,
    scan,
)

SMALL = 64 * 1024  # the smallest chunk a manifest may use: multi-chunk files stay small


def write(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def pattern(n: int, seed: int = 0) -> bytes:
    """`n` bytes that differ from chunk to chunk and from seed to seed."""
    block = hashlib.sha256(f"{seed}".encode()).digest() * 2048  # 64 KiB
    out = bytearray()
    k = 0
    while len(out) < n:
        out += hashlib.sha256(block + k.to_bytes(4, "big")).digest() + block[: SMALL - 32]
        k += 1
    return bytes(out[:n])


TREE = {"corpus/a.txt": b"alpha\n" * 1000, "corpus/b.txt": pattern(3 * SMALL + 5), "README": b"", ".hidden/c": b"c"}


# -- manifests -------------------------------------------------------------------------------------


def test_the_same_tree_in_two_folders_has_the_same_digest(tmp_path: Path) -> None:
    one = write(tmp_path / "home" / "alice" / "corpus", TREE)
    two = write(tmp_path / "Users" / "bob" / "data" / "corpus", TREE)
    os.chmod(two / "README", 0o600)
    os.utime(two / "corpus" / "a.txt", (1_000_000, 1_000_000))
    a, b = scan(one, chunk_bytes=SMALL), scan(two, chunk_bytes=SMALL)
    assert a.to_bytes() == b.to_bytes() and a.digest == b.digest
    assert [e.path for e in a.entries] == [".hidden/c", "README", "corpus/a.txt", "corpus/b.txt"]
    assert b"alice" not in a.to_bytes() and str(tmp_path).encode() not in a.to_bytes()
    write(two, {"corpus/a.txt": b"alpha\n" * 999 + b"alphA\n"})
    assert scan(two, chunk_bytes=SMALL).digest != a.digest


def test_a_manifest_round_trips_through_its_canonical_bytes(tmp_path: Path) -> None:
    m = scan(write(tmp_path, TREE), chunk_bytes=SMALL)
    again = Manifest.from_bytes(m.to_bytes())
    assert again == m and again.digest == m.digest == hashlib.sha256(m.to_bytes()).hexdigest()
    assert m.total_bytes == sum(len(v) for v in TREE.values())
    b = next(e for e in m.entries if e.path == "corpus/b.txt")
    data = TREE["corpus/b.txt"]
    assert b.sha256 == hashlib.sha256(data).hexdigest() and len(b.chunks) == 4
    assert [b.chunk_size(i, SMALL) for i in range(4)] == [SMALL, SMALL, SMALL, 5]
    assert b.chunks[3] == hashlib.sha256(data[3 * SMALL :]).hexdigest()
    with pytest.raises(IndexError):
        b.chunk_size(4, SMALL)


def test_files_of_zero_bytes_one_chunk_and_one_chunk_plus_one_byte(tmp_path: Path) -> None:
    data = pattern(CHUNK_BYTES + 1)
    write(tmp_path, {"empty": b"", "exact": data[:CHUNK_BYTES], "over": data})
    m = scan(tmp_path)
    empty, exact, over = m.entries
    assert (empty.size, empty.sha256, empty.chunks) == (0, EMPTY_SHA256, ())
    assert exact.chunks == (exact.sha256,) and exact.chunk_size(0, CHUNK_BYTES) == CHUNK_BYTES
    assert len(over.chunks) == 2 and over.chunk_size(1, CHUNK_BYTES) == 1
    assert over.chunks[1] == hashlib.sha256(data[-1:]).hexdigest()
    assert Manifest.from_bytes(m.to_bytes()) == m


def good_doc() -> dict[str, Any]:
    a, b = b"a" * 10, pattern(SMALL + 1)
    return {
        "version": 1,
        "chunk_bytes": SMALL,
        "entries": [
            {"path": "d/a", "size": 10, "sha256": hashlib.sha256(a).hexdigest(), "chunks": [hashlib.sha256(a).hexdigest()]},
            {"path": "d/b", "size": len(b), "sha256": hashlib.sha256(b).hexdigest(), "chunks": [hashlib.sha256(b[:SMALL]).hexdigest(), hashlib.sha256(b[SMALL:]).hexdigest()]},
        ],
    }


def canonical(doc: Any) -> bytes:
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)


def entry0(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["entries"][0].update(fields)

    return change


def path0(path: str) -> Callable[[dict[str, Any]], None]:
    return entry0(path=path)


def add_entry(path: str) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        doc["entries"].append({"path": path, "size": 0, "sha256": EMPTY_SHA256, "chunks": []})
        doc["entries"].sort(key=lambda e: e["path"])

    return change


X = "ab" * 32  # a well-formed hash that is no file's
REFUSALS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown_key", lambda d: d.update(extra=1), "unknown: ['extra']"),
    ("missing_key", lambda d: d.pop("entries"), "missing: ['entries']"),
    ("version", lambda d: d.update(version=2), "manifest: version is 2, expected 1 to 1"),
    ("chunk_bytes_small", lambda d: d.update(chunk_bytes=65535), "chunk_bytes is 65535, expected 65536 to 67108864"),
    ("chunk_bytes_large", lambda d: d.update(chunk_bytes=(64 << 20) + 1), "chunk_bytes is 67108865"),
    ("chunk_bytes_bool", lambda d: d.update(chunk_bytes=True), "chunk_bytes must be an integer, got bool"),
    ("entries_dict", lambda d: d.update(entries={}), "entries must be a list, got dict"),
    ("entry_not_object", lambda d: d["entries"].insert(0, "d/a"), "entry 0: expected a JSON object, got str"),
    ("path_not_string", path0(7), "entry 0: path must be a string, got int"),  # type: ignore[arg-type]
    ("entry_extra_key", entry0(mode=0o644), "d/a: expected the keys"),
    ("absolute", path0("/etc/passwd"), "/etc/passwd: the path is absolute"),
    ("dotdot", path0("d/../../etc"), "d/../../etc: the path has a '..' part"),
    ("dot", path0("d/./a"), "d/./a: the path has a '.' part"),
    ("empty_part", path0("d//a"), "d//a: the path has an empty part"),
    ("trailing_slash", path0("d/a/"), "d/a/: the path has an empty part"),
    ("empty_path", path0(""), ": the path is empty"),
    ("backslash", path0("d\\a"), "d\\a: the path holds a backslash"),
    ("nul", path0("d/a\x00"), "'d/a\\x00': the path holds a NUL or control character"),
    ("newline", path0("d/a\nb"), "'d/a\\nb': the path holds a NUL or control character"),
    ("too_long", path0("d/" + "x" * 1023), "the path has 1025 characters, more than the limit of 1024"),
    ("duplicate", lambda d: d["entries"].insert(1, dict(d["entries"][0])), "d/a: listed twice"),
    ("out_of_order", lambda d: d["entries"].reverse(), "d/a: out of order"),
    ("file_and_folder", add_entry("d/a/inner"), "d/a/inner: d/a is listed as a file and is a folder here"),
    ("short_sha", entry0(sha256="ab" * 31), "d/a: sha256 must be 64 lowercase hex digits"),
    ("upper_sha", entry0(sha256="AB" * 32), "d/a: sha256 must be 64 lowercase hex digits"),
    ("bad_chunk_hash", entry0(chunks=["zz" * 32]), "d/a: chunk 0 must be 64 lowercase hex digits"),
    ("chunk_count", entry0(size=SMALL + 1), "d/a: 1 chunks for 65537 bytes, expected 2 of 65536 bytes"),
    ("no_chunks", entry0(chunks=[]), "d/a: 0 chunks for 10 bytes, expected 1"),
    ("negative_size", entry0(size=-1), "d/a: size is -1, expected 0 to"),
    ("float_size", entry0(size=10.0), "d/a: size must be an integer, got float"),
    ("one_chunk_mismatch", entry0(chunks=[X]), "d/a: a file of one chunk has that chunk's sha256"),
    ("empty_with_hash", lambda d: d["entries"].insert(0, {"path": "c", "size": 0, "sha256": X, "chunks": []}), "c: an empty file's sha256 is"),
]


@pytest.mark.parametrize(("change", "message"), [(c, m) for _, c, m in REFUSALS], ids=[n for n, _, _ in REFUSALS])
def test_from_bytes_refuses_what_a_hostile_peer_could_send(change: Callable[[dict[str, Any]], None], message: str) -> None:
    doc = good_doc()
    assert Manifest.from_bytes(canonical(doc)).entries[1].path == "d/b"
    change(doc)
    with pytest.raises(ManifestError) as e:
        Manifest.from_bytes(canonical(doc))
    assert message in str(e.value)


def test_from_bytes_refuses_bytes_that_are_not_its_canonical_form() -> None:
    data = canonical(good_doc())
    with pytest.raises(ManifestError, match="manifest: not valid JSON"):
        Manifest.from_bytes(data[:-1])
    with pytest.raises(ManifestError, match="manifest: expected a JSON object, got list"):
        Manifest.from_bytes(b"[]")
    for other in (data.replace(b",", b", ", 1), orjson.dumps(good_doc()), data + b"\n"):  # whitespace, key order
        with pytest.raises(ManifestError, match="not in canonical form"):
            Manifest.from_bytes(other)


def test_from_bytes_holds_a_manifest_to_its_limits() -> None:
    data = canonical(good_doc())
    cases = [
        (Limits(max_files=1), "manifest: 2 files, more than the limit of 1"),
        (Limits(max_bytes=SMALL), "d/b: size is 65537, expected 0 to 65536"),
        (Limits(max_bytes=SMALL + 5), "manifest: more than the limit of 65541 bytes in all (past d/b)"),
        (Limits(max_path=2), "d/a: the path has 3 characters, more than the limit of 2"),
        (Limits(max_manifest_bytes=100), f"manifest: {len(data)} bytes, more than the limit of 100"),
    ]
    for limits, message in cases:
        with pytest.raises(ManifestError) as e:
            Manifest.from_bytes(data, limits)
        assert message in str(e.value)


def test_scan_refuses_a_symlink_that_leaves_the_folder(tmp_path: Path) -> None:
    root = write(tmp_path / "root", {"a": b"a"})
    (tmp_path / "secret").write_bytes(b"s")
    os.symlink(tmp_path / "secret", root / "link")
    with pytest.raises(ManifestError, match=r"^link: a symlink to .*secret, outside .*root"):
        scan(root)
    os.unlink(root / "link")
    os.symlink("../root/../secret", root / "relative")
    with pytest.raises(ManifestError, match=r"^relative: a symlink"):
        scan(root)
    os.unlink(root / "relative")
    os.symlink(tmp_path, root / "up")
    with pytest.raises(ManifestError, match=r"^up: a symlink"):
        scan(root)


def test_a_hugging_face_snapshot_is_scanned_through_its_links_to_the_repos_blobs_and_no_further(tmp_path: Path) -> None:
    """`huggingface-cli download` lays a model out as snapshots/REV/FILE -> ../../blobs/SHA; mlx-lm
    loads such a folder, and dpool refused every file of it as a link outside the folder."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, data in (("config.json", b'{"model_type": "llama"}'), ("model.safetensors", pattern(3 * SMALL))):
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    m = scan(snapshot, chunk_bytes=SMALL)
    assert [e.path for e in m.entries] == ["config.json", "model.safetensors"]
    assert differences(snapshot, m) == []
    copy = write(tmp_path / "copy", {"config.json": b'{"model_type": "llama"}', "model.safetensors": pattern(3 * SMALL)})
    assert scan(copy, chunk_bytes=SMALL).digest == m.digest  # the same content, however it is laid out
    (tmp_path / "secret").write_bytes(b"s")
    os.symlink(tmp_path / "secret", snapshot / "leak")  # beyond the repo's blobs: still refused
    with pytest.raises(ManifestError, match=r"^leak: a symlink to .*secret, outside"):
        scan(snapshot)


def test_scan_follows_symlinks_inside_the_folder_and_refuses_loops_and_special_files(tmp_path: Path) -> None:
    root = write(tmp_path / "root", {"data/a": b"a", ".git/objects/x": b"history", "sub/.git": b"gitdir: elsewhere"})
    os.symlink("data/a", root / "alias")
    os.symlink("data", root / "folder")
    m = scan(root)
    by_path = {e.path: e for e in m.entries}
    assert sorted(by_path) == ["alias", "data/a", "folder/a", "sub/.git"]  # a .git folder is not walked
    assert by_path["alias"].sha256 == by_path["folder/a"].sha256 == hashlib.sha256(b"a").hexdigest()
    assert [e.path for e in scan(root, [Path(".git/objects/x")]).entries] == [".git/objects/x"]
    os.symlink("..", root / "data" / "loop")
    with pytest.raises(ManifestError, match=r"^data/loop: a symlink loop"):
        scan(root)
    os.unlink(root / "data" / "loop")
    os.symlink("nowhere", root / "dangling")
    with pytest.raises(ManifestError, match=r"^dangling: leads nowhere"):
        scan(root)
    os.unlink(root / "dangling")
    os.mkfifo(root / "data" / "pipe")
    with pytest.raises(ManifestError, match=r"^data/pipe: a special file"):
        scan(root)


def test_scan_of_listed_files_and_folders(tmp_path: Path) -> None:
    root = write(tmp_path / "model", {"config.json": b"{}", "weights/w0": b"0", "weights/w1": b"1", "notes": b"n"})
    m = scan(root, [Path("config.json"), root / "weights", Path("weights/w0")])
    assert [e.path for e in m.entries] == ["config.json", "weights/w0", "weights/w1"]
    assert m.digest == scan(root.parent / "model" / ".." / "model", [root / "weights", root / "config.json"]).digest
    with pytest.raises(ManifestError, match="not under"):
        scan(root, [tmp_path / "elsewhere"])
    with pytest.raises(ManifestError, match=r"^missing: no such file under"):
        scan(root, [Path("missing")])
    with pytest.raises(ManifestError, match="not a folder"):
        scan(root / "notes")
    with pytest.raises(ManifestError, match=r"more than the limit of 2 files"):
        scan(root, limits=Limits(max_files=2))


def test_scan_refuses_a_name_a_peer_would_refuse(tmp_path: Path) -> None:
    write(tmp_path, {"a\\b": b"x"})
    with pytest.raises(ManifestError, match="holds a backslash"):
        scan(tmp_path)


def test_differences_names_each_file_that_keeps_a_folder_from_holding_the_tree(tmp_path: Path) -> None:
    m = scan(write(tmp_path / "src", TREE), chunk_bytes=SMALL)
    copy = write(tmp_path / "copy", TREE)
    write(copy, {"extra": b"not in the manifest"})
    assert differences(copy, m) == []
    write(copy, {"corpus/a.txt": b"short", "corpus/b.txt": b"x" * len(TREE["corpus/b.txt"])})
    os.unlink(copy / ".hidden" / "c")
    b = hashlib.sha256(b"x" * len(TREE["corpus/b.txt"])).hexdigest()
    assert differences(copy, m) == [
        ".hidden/c: missing",
        f"corpus/a.txt: 5 bytes, expected {len(TREE['corpus/a.txt'])}",
        f"corpus/b.txt: content differs (sha256 {b[:12]}..., expected {m.entries[3].sha256[:12]}...)",
    ]


def test_a_hash_cache_spares_rehashing_an_unchanged_file_and_notices_a_change(tmp_path: Path) -> None:
    root = write(tmp_path / "root", {"w": pattern(2 * SMALL)})
    hashes = HashCache(tmp_path / "hashes.db")
    old = 1_000_000_000
    os.utime(root / "w", (old, old))
    first = scan(root, hashes=hashes, chunk_bytes=SMALL)
    # Same size, same mtime, same inode: the cache answers, so it cannot see this change...
    with open(root / "w", "r+b") as f:
        f.write(b"X")
    os.utime(root / "w", (old, old))
    assert scan(root, hashes=hashes, chunk_bytes=SMALL) == first
    assert scan(root, chunk_bytes=SMALL) != first  # ...which a scan without it does.
    os.utime(root / "w", (old + 1, old + 1))
    assert scan(root, hashes=hashes, chunk_bytes=SMALL) == scan(root, chunk_bytes=SMALL) != first
    # A file written just now is hashed but not remembered: it may change again within its mtime's tick.
    write(root, {"w": pattern(2 * SMALL, seed=1)})
    fresh = scan(root, hashes=hashes, chunk_bytes=SMALL)
    with open(root / "w", "r+b") as f:
        f.write(b"Y")
    os.utime(root / "w", ns=(os.stat(root / "w").st_mtime_ns,) * 2)
    assert scan(root, hashes=hashes, chunk_bytes=SMALL) != fresh
    hashes.close()


def test_a_corrupt_hash_cache_file_is_started_again(tmp_path: Path) -> None:
    (tmp_path / "hashes.db").write_bytes(b"not a database" * 100)
    root = write(tmp_path / "root", {"a": b"a"})
    hashes = HashCache(tmp_path / "hashes.db")
    assert scan(root, hashes=hashes).entries == (Entry("a", 1, hashlib.sha256(b"a").hexdigest(), (hashlib.sha256(b"a").hexdigest(),)),)
    hashes.close()


# -- the cache -------------------------------------------------------------------------------------


def chunk_of(root: Path, entry: Entry, index: int, chunk_bytes: int) -> bytes:
    with open(root / entry.path, "rb") as f:
        f.seek(index * chunk_bytes)
        return f.read(entry.chunk_size(index, chunk_bytes))


def fetch(cache: Cache, m: Manifest, source: Path, chunks: list[tuple[Entry, int]] | None = None) -> int:
    """Write `chunks` (default: every missing one) from the files under `source`; how many."""
    todo = cache.missing(m) if chunks is None else chunks
    for entry, index in todo:
        assert cache.write_chunk(entry, index, chunk_of(source, entry, index, m.chunk_bytes), m.chunk_bytes)
    return len(todo)


def staged(tmp_path: Path, name: str, files: dict[str, bytes]) -> tuple[Path, Manifest]:
    source = write(tmp_path / "sources" / name, files)
    return source, scan(source, chunk_bytes=SMALL)


def test_a_fetched_tree_holds_the_source_files_byte_for_byte(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    heard: list[tuple[str, int]] = []
    cache.on_chunk(lambda sha, index: heard.append((sha, index)))
    assert cache.put_manifest(m.to_bytes()) == m and cache.manifest(m.digest) == m
    assert (tmp_path / "cache" / "manifests" / m.digest).read_bytes() == m.to_bytes()
    assert cache.tree(m.digest) is None
    cache.reserve(m)
    todo = cache.missing(m)
    assert sorted((e.path, i) for e, i in todo) == [(".hidden/c", 0), ("corpus/a.txt", 0)] + [("corpus/b.txt", i) for i in range(4)]
    fetch(cache, m, source, todo[:1])
    with pytest.raises(Incomplete, match=r"2 of 4 files are not in the cache yet \(corpus/a.txt, corpus/b.txt\)"):
        cache.complete(m)
    fetch(cache, m, source)
    assert sorted(heard) == sorted((e.sha256, i) for e, i in todo)
    tree = cache.complete(m)
    assert tree == tmp_path / "cache" / "trees" / m.digest == cache.tree(m.digest)
    assert differences(tree, m) == [] and scan(tree, chunk_bytes=SMALL) == m
    assert cache.missing(m) == []
    b = tree / "corpus" / "b.txt"
    assert not os.access(b, os.W_OK) or os.geteuid() == 0
    assert os.stat(b).st_mode & 0o222 == 0
    (e,) = cache.entries()
    assert (e.digest, e.bytes, e.files, e.complete, e.pinned_by, e.adopted) == (m.digest, m.total_bytes, 4, True, (), None)


def test_write_chunk_refuses_a_chunk_that_is_not_the_one_named(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    cache.put_manifest(m.to_bytes())
    b = m.entries[3]
    good = chunk_of(source, b, 1, SMALL)
    bad = [
        (1, good[:-1] + bytes([good[-1] ^ 1])),  # one bit flipped
        (1, good[:-1]),  # short
        (2, good),  # another chunk's bytes
        (4, good),  # no such chunk
        (-1, good),
    ]
    for index, data in bad:
        assert not cache.write_chunk(b, index, data, SMALL)
    assert not cache.write_chunk(b, 1, good, 2 * SMALL)  # the manifest's chunks are not of that size
    assert not cache.has_chunk(b.sha256, 1) and cache.read_chunk(b.sha256, 1, SMALL) is None
    assert not (tmp_path / "cache" / "partial" / b.sha256).exists()
    assert len(cache.missing(m)) == 6
    assert cache.write_chunk(b, 1, good, SMALL) and cache.has_chunk(b.sha256, 1)
    assert cache.read_chunk(b.sha256, 1, SMALL) == good and not cache.has_chunk(b.sha256, 2)


def test_a_fetch_interrupted_half_way_resumes_with_only_the_missing_chunks(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "model", {"w0": pattern(5 * SMALL + 7), "w1": pattern(3 * SMALL, seed=1), "config": b"{}"})
    first = Cache(tmp_path / "cache")
    first.put_manifest(m.to_bytes())
    todo = first.missing(m)
    assert len(todo) == 6 + 3 + 1
    fetch(first, m, source, todo[::2])
    written = sum(min(m.chunk_bytes, e.size - i * m.chunk_bytes) for e, i in todo[::2])
    (entry,) = first.entries()  # what it holds of the tree, not the tree's size (dpctl cache said 22.9MiB of a manifest alone)
    assert not entry.complete and entry.bytes == m.total_bytes and entry.held == written < m.total_bytes
    del first  # the daemon was killed: nothing but the files remains
    again = Cache(tmp_path / "cache")
    assert again.manifest(m.digest) == m
    assert again.entries()[0].held == written  # read back from the partial files' records
    rest = again.missing(m)
    assert rest == todo[1::2]
    assert all(again.has_chunk(e.sha256, i) for e, i in todo[::2] if e.size > SMALL)  # complete ones are blobs
    fetch(again, m, source, rest)
    assert differences(again.complete(m), m) == []
    assert list((tmp_path / "cache" / "partial").iterdir()) == []
    assert again.entries()[0].held == m.total_bytes


def test_a_torn_chunk_is_detected_when_a_fetch_resumes(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "corpus", {"big": pattern(4 * SMALL)})
    (big,) = m.entries
    cache = Cache(tmp_path / "cache")
    fetch(cache, m, source, [(big, 0), (big, 1), (big, 2)])
    partial = tmp_path / "cache" / "partial" / big.sha256
    # The crash let chunk 1's line in `.have` reach the disk but not all of its bytes; and cut a line.
    with open(partial, "r+b") as f:
        f.seek(SMALL + 100)
        f.write(b"\0" * 1000)
    with open(partial.with_name(f"{big.sha256}.have"), "ab") as f:
        f.write(b"3 " + big.chunks[3][:20].encode())
    cache = Cache(tmp_path / "cache")
    assert not cache.has_chunk(big.sha256, 1) and cache.read_chunk(big.sha256, 1, SMALL) is None
    assert cache.has_chunk(big.sha256, 2) and cache.read_chunk(big.sha256, 2, SMALL) == chunk_of(source, big, 2, SMALL)
    assert cache.missing(m) == [(big, 1), (big, 3)]
    assert Cache(tmp_path / "cache").missing(m) == [(big, 1), (big, 3)]  # what it found stays found
    fetch(cache, m, source, [(big, 3)])  # after the cut line: `.have` was written again whole
    assert Cache(tmp_path / "cache").missing(m) == [(big, 1)]
    fetch(cache, m, source)
    assert differences(cache.complete(m), m) == []


def test_a_file_whose_last_chunk_landed_just_before_a_kill_becomes_a_blob_at_resume(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "corpus", {"big": pattern(3 * SMALL + 1)})
    (big,) = m.entries
    asks: list[Callable[[Cache], bool]] = [lambda c: c.missing(m) == [], lambda c: c.has_chunk(big.sha256, 3), lambda c: c.read_chunk(big.sha256, 3, SMALL) == b"\xbb"]
    for k, ask in enumerate(asks):
        root = tmp_path / f"cache{k}"
        fetch(Cache(root), m, source, [(big, 0), (big, 1), (big, 2)])
        # As write_chunk leaves it when killed between the last chunk's `.have` line and the rename.
        partial = root / "partial" / big.sha256
        with open(partial, "r+b") as f:
            f.seek(3 * SMALL)
            f.write(chunk_of(source, big, 3, SMALL))
        with open(partial.with_name(f"{big.sha256}.have"), "ab") as f:
            f.write(f"3 {big.chunks[3]}\n".encode())
        os.chmod(partial, 0o444)
        cache = Cache(root)
        assert ask(cache)
        assert differences(cache.complete(m), m) == [] and list((root / "partial").iterdir()) == []


def test_a_file_held_twice_is_fetched_once(tmp_path: Path) -> None:
    shared = pattern(2 * SMALL, seed=7)
    source_a, a = staged(tmp_path, "a", {"x/one": shared, "x/two": shared, "own": b"a"})
    source_b, b = staged(tmp_path, "b", {"copy": shared, "own": b"b"})
    cache = Cache(tmp_path / "cache")
    assert sorted((e.path, i) for e, i in cache.missing(a)) == [("own", 0), ("x/one", 0), ("x/one", 1)]
    fetch(cache, a, source_a)
    assert [(e.path, i) for e, i in cache.missing(b)] == [("own", 0)]
    fetch(cache, b, source_b)
    tree_a, tree_b = cache.complete(a), cache.complete(b)
    assert differences(tree_a, a) == [] and differences(tree_b, b) == []
    assert os.stat(tree_a / "x" / "one").st_ino == os.stat(tree_b / "copy").st_ino
    assert os.stat(tmp_path / "cache" / "blobs" / a.entries[1].sha256).st_nlink == 4  # blob + 3 paths


def test_files_of_zero_bytes_one_chunk_and_one_chunk_plus_one_byte_through_the_cache(tmp_path: Path) -> None:
    data = pattern(CHUNK_BYTES + 1, seed=3)
    source = write(tmp_path / "src", {"empty": b"", "exact": data[:CHUNK_BYTES], "over": data, "also/empty": b""})
    m = scan(source)
    cache = Cache(tmp_path / "cache")
    assert sorted((e.path, i) for e, i in cache.missing(m)) == [("exact", 0), ("over", 0), ("over", 1)]
    fetch(cache, m, source)
    over = next(e for e in m.entries if e.path == "over")
    assert cache.read_chunk(over.sha256, 1, CHUNK_BYTES) == data[-1:]
    assert cache.read_chunk(over.sha256, 2, CHUNK_BYTES) is None
    tree = cache.complete(m)
    assert differences(tree, m) == [] and (tree / "empty").read_bytes() == b"" == (tree / "also" / "empty").read_bytes()
    assert not (tmp_path / "cache" / "blobs" / EMPTY_SHA256).exists()


def complete_tree(cache: Cache, tmp_path: Path, name: str, size: int, used: float) -> Manifest:
    source, m = staged(tmp_path, name, {name: pattern(size, seed=hash(name) & 0xFFFF)})
    cache.put_manifest(m.to_bytes())
    cache.reserve(m)
    fetch(cache, m, source)
    cache.complete(m)
    os.utime(tmp_path / "cache" / "used" / m.digest, (used, used))
    return m


def test_budget_eviction_is_least_recently_used_first_and_never_takes_a_pinned_tree(tmp_path: Path) -> None:
    size = 2 * SMALL
    cache = Cache(tmp_path / "cache", max_bytes=3 * size, min_free=0)
    a = complete_tree(cache, tmp_path, "a", size, used=1000)
    b = complete_tree(cache, tmp_path, "b", size, used=2000)
    c = complete_tree(cache, tmp_path, "c", size, used=3000)
    cache.pin(a.digest, "job-1")
    assert cache.tree(c.digest) is not None  # c is used now: b is the least recently used unpinned one
    d = complete_tree(cache, tmp_path, "d", size, used=4000)
    assert cache.tree(b.digest) is None and cache.manifest(b.digest) is None
    assert {e.digest for e in cache.entries()} == {a.digest, c.digest, d.digest}
    assert (tmp_path / "cache" / "trees" / a.digest).is_dir()  # older than every other, but pinned
    e = complete_tree(cache, tmp_path, "e", size, used=5000)
    assert {x.digest for x in cache.entries()} == {a.digest, c.digest, e.digest}  # d (4000) went before c (now)
    assert next(x for x in cache.entries() if x.digest == a.digest).pinned_by == ("job-1",)
    # A tree larger than the budget less what is pinned: refused, and nothing evicted for it.
    _, big = staged(tmp_path, "big", {"big": pattern(2 * size + 1)})
    with pytest.raises(CacheFull) as full:
        cache.reserve(big)
    message = str(full.value)
    assert f"{2 * size + 1} more bytes needed" in message and f"a budget of {3 * size} bytes" in message
    assert f"pinned: {a.digest[:12]} by job-1" in message and "bytes free on its disk" in message
    assert "Raise the cache's budget (dpd run --cache-max) or end the jobs that pin trees." in message
    cache.pin(big.digest, "job-2")  # the tree being made room for, pinned by its own job: never named as in the way
    with pytest.raises(CacheFull) as full:
        cache.reserve(big)
    assert big.digest[:12] not in str(full.value).split("more bytes needed")[1], str(full.value)
    cache.unpin("job-2")
    assert {x.digest for x in cache.entries() if x.complete} == {a.digest, c.digest, e.digest}
    cache.unpin("job-1")
    complete_tree(cache, tmp_path, "f", size, used=6000)
    assert cache.tree(a.digest) is None  # unpinned, it was the oldest


def test_reserve_keeps_room_on_the_disk(tmp_path: Path) -> None:
    _, m = staged(tmp_path, "corpus", TREE)
    margin = shutil.disk_usage(tmp_path).free + (1 << 40)  # more than the disk will have free
    cache = Cache(tmp_path / "cache", min_free=margin)
    with pytest.raises(CacheFull, match=rf"{m.total_bytes} more bytes needed, no budget; \d+ bytes free on its disk, keeping {margin} free\. Free disk space\."):
        cache.reserve(m)
    Cache(tmp_path / "cache", min_free=0).reserve(m)


def test_a_fetch_in_flight_keeps_its_blobs_and_counts_against_the_budget(tmp_path: Path) -> None:
    size = 2 * SMALL
    cache = Cache(tmp_path / "cache", max_bytes=2 * size, min_free=0)
    old = complete_tree(cache, tmp_path, "old", size, used=1000)
    source, m = staged(tmp_path, "new", {"one": pattern(size, seed=11)})
    cache.reserve(m)
    fetch(cache, m, source)  # its blob is there, linked by no tree yet
    _, other = staged(tmp_path, "other", {"two": pattern(size, seed=12)})
    cache.reserve(other)  # room for it: the old tree goes, not the blob of the fetch in flight
    assert cache.tree(old.digest) is None
    assert differences(cache.complete(m), m) == []
    (two,) = other.entries
    fetch(cache, other, source.parent / "other", [(two, 0)])
    cache.pin(m.digest, "job-3")
    assert cache.prune() == 0  # m is pinned, and `other` is in flight: its partial file stays
    assert cache.has_chunk(two.sha256, 0) and differences(cache.tree(m.digest), m) == []  # type: ignore[arg-type]
    cache.release(other.digest)  # the fetch gave up
    assert cache.prune() > 0 and not cache.has_chunk(two.sha256, 0)


def test_prune_frees_a_blob_only_when_no_tree_links_it(tmp_path: Path) -> None:
    shared, own_a, own_b = pattern(3 * SMALL, seed=1), pattern(SMALL, seed=2), pattern(SMALL + 9, seed=3)
    cache = Cache(tmp_path / "cache")
    manifests = []
    for name, files in (("a", {"shared": shared, "own": own_a}), ("b", {"data/shared": shared, "own": own_b})):
        source, m = staged(tmp_path, name, files)
        fetch(cache, m, source)
        cache.complete(m)
        manifests.append(m)
    a, b = manifests
    assert cache.prune(a.digest) == len(own_a)  # the shared blob is still linked by b's tree
    assert cache.tree(a.digest) is None and differences(cache.tree(b.digest), b) == []  # type: ignore[arg-type]
    cache.pin(b.digest, "job-2")
    with pytest.raises(ValueError, match=f"cannot prune {b.digest}: pinned by job-2"):
        cache.prune(b.digest)
    assert cache.prune() == 0
    cache.unpin("job-2")
    assert cache.prune() == len(shared) + len(own_b)
    assert list((tmp_path / "cache" / "blobs").iterdir()) == [] and cache.entries() == []


def test_an_adopted_folder_is_served_in_place_until_it_no_longer_matches(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    with pytest.raises(ValueError, match="put it first"):
        cache.adopt(m.digest, source)
    cache.put_manifest(m.to_bytes())
    cache.adopt(m.digest, source)
    assert Cache(tmp_path / "cache").tree(m.digest) == source.resolve()  # it outlives the process
    assert cache.missing(m) == [] and cache.complete(m) == source.resolve()
    b = m.entries[3]
    assert cache.has_chunk(b.sha256, 3) and not cache.has_chunk(b.sha256, 4)
    assert cache.read_chunk(b.sha256, 3, SMALL) == TREE["corpus/b.txt"][3 * SMALL :]
    (e,) = cache.entries()
    assert e.adopted == str(source.resolve()) and e.complete
    assert list((tmp_path / "cache" / "blobs").iterdir()) == []  # served from there, never copied
    with open(source / "corpus" / "b.txt", "r+b") as f:
        f.write(b"changed")
    assert cache.read_chunk(b.sha256, 0, SMALL) is None
    assert cache.tree(m.digest) is None and not (tmp_path / "cache" / "adopted" / m.digest).exists()
    assert len(cache.missing(m)) == 6


def test_names_from_a_peer_never_become_paths_outside_the_cache(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache")
    (tmp_path / "secret").write_bytes(b"s")
    for name in ("../secret", "../../" + "0" * 58, "A" * 64, ""):
        assert cache.manifest(name) is None and cache.tree(name) is None
        assert not cache.has_chunk(name, 0) and cache.read_chunk(name, 0, SMALL) is None
        with pytest.raises(ValueError):
            cache.pin(name, "job")
    entry = Entry("x", 1, "../secret", ("../secret",))
    assert not cache.write_chunk(entry, 0, b"s", SMALL)
    with pytest.raises(ManifestError):
        cache.put_manifest(b'{"chunk_bytes":65536,"entries":[],"version":1} ')


def test_leftovers_of_a_killed_process_are_cleared_and_a_corrupt_manifest_dropped(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    cache.put_manifest(m.to_bytes())
    fetch(cache, m, source)
    half = tmp_path / "cache" / "trees" / f".tmp-{m.digest}-1-2"
    write(half, {"corpus/a.txt": b"half built"})
    (tmp_path / "cache" / "manifests" / m.digest).write_bytes(m.to_bytes()[:-3])
    cache = Cache(tmp_path / "cache")
    assert not half.exists()
    assert cache.manifest(m.digest) is None and not (tmp_path / "cache" / "manifests" / m.digest).exists()
    assert differences(cache.complete(m), m) == []  # the blobs were kept; the manifest is written again
    assert cache.manifest(m.digest) == m


def test_chunks_written_and_read_from_many_threads_at_once(tmp_path: Path) -> None:
    files = {f"f{k}": pattern(4 * SMALL + k, seed=k) for k in range(4)}
    source, m = staged(tmp_path, "many", files)
    cache = Cache(tmp_path / "cache")
    todo = cache.missing(m)
    served: list[bytes] = []
    errors: list[BaseException] = []

    def writer(part: list[tuple[Entry, int]]) -> None:
        try:
            fetch(cache, m, source, part)
        except BaseException as e:
            errors.append(e)

    def reader() -> None:
        try:
            for entry, index in todo * 3:
                if cache.has_chunk(entry.sha256, index):
                    data = cache.read_chunk(entry.sha256, index, SMALL)
                    assert data is not None and hashlib.sha256(data).hexdigest() == entry.chunks[index]
                    served.append(data)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(todo[k::3],)) for k in range(3)]
    threads += [threading.Thread(target=writer, args=(todo,)), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert cache.missing(m) == [] and differences(cache.complete(m), m) == []


KILLED_WRITER = """
import sys
from pathlib import Path
from dpool.staging.cache import Cache
from dpool.staging.manifest import Manifest
cache_root, source, manifest = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]).read_bytes()
cache = Cache(cache_root)
m = cache.put_manifest(manifest)
for entry, index in cache.missing(m):
    with open(source / entry.path, "rb") as f:
        f.seek(index * m.chunk_bytes)
        assert cache.write_chunk(entry, index, f.read(entry.chunk_size(index, m.chunk_bytes)), m.chunk_bytes)
    print(entry.path, index, flush=True)
sys.stdin.read()  # done: wait to be killed
"""


def test_a_writer_killed_mid_fetch_loses_no_chunk_it_had_written(tmp_path: Path) -> None:
    source, m = staged(tmp_path, "big", {"w0": pattern(40 * SMALL, seed=5), "w1": pattern(24 * SMALL + 3, seed=6)})
    (tmp_path / "manifest").write_bytes(m.to_bytes())
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path / "cache"), str(source), str(tmp_path / "manifest")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    written = []
    try:
        assert child.stdout is not None
        while len(written) < 30:
            line = child.stdout.readline()
            assert line, "the writer ended before it wrote 30 chunks"
            path, index = line.split()
            written.append((path, int(index)))
    finally:
        os.kill(child.pid, signal.SIGKILL)  # mid-write, most likely: it does not wait between chunks
        child.wait(timeout=30)
    cache = Cache(tmp_path / "cache")
    left = [(e.path, i) for e, i in cache.missing(m)]
    assert not set(left) & set(written) and len(left) <= 65 - 30
    fetch(cache, m, source)
    assert differences(cache.complete(m), m) == []


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_a_file_whose_chunks_match_but_whose_whole_hash_lies_never_becomes_its_blob(tmp_path: Path, order: tuple[int, ...]) -> None:
    """A hostile manifest: each chunk hash true, the file's sha256 another file's. The chunks are
    taken, but the file is checked whole as they land (in any order), so blobs/<sha256> never
    holds bytes that do not hash to its name."""
    chunk = SMALL
    data = os.urandom(3 * chunk)
    pieces = [data[i * chunk : (i + 1) * chunk] for i in range(3)]
    lie = hashlib.sha256(b"another file").hexdigest()
    entry = Entry(path="a.bin", size=len(data), sha256=lie, chunks=tuple(hashlib.sha256(p).hexdigest() for p in pieces))
    cache = Cache(tmp_path / "cache")
    results = [cache.write_chunk(entry, i, pieces[i], chunk) for i in order]
    assert results[:2] == [True, True] and results[2] is False
    assert not (tmp_path / "cache" / "blobs" / lie).exists()
    honest = Entry(path="a.bin", size=len(data), sha256=hashlib.sha256(data).hexdigest(), chunks=entry.chunks)
    assert all(cache.write_chunk(honest, i, pieces[i], chunk) for i in order)
    assert (tmp_path / "cache" / "blobs" / honest.sha256).read_bytes() == data


# -- integrity of what is used: a stat per file, a hash when the stat moved ------------------------


def fetched(tmp_path: Path) -> tuple[Cache, Manifest, Path]:
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    cache.put_manifest(m.to_bytes())
    cache.reserve(m)
    fetch(cache, m, source)
    return cache, m, cache.complete(m)


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Bytes written in place (size kept), as a stray `dd conv=notrunc` or a bad disk would."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "removed"])
def test_a_damaged_cache_tree_is_dropped_and_fetched_again_never_used(tmp_path: Path, damage: str) -> None:
    """A node trained on a cached file truncated or overwritten after it was verified, and the
    job succeeded with other numbers. `tree` now checks each file's stat: a damaged tree is
    dropped with the damaged blob, and the chunks of that file are missing again."""
    cache, m, tree = fetched(tmp_path)
    b = tree / "corpus" / "b.txt"
    if damage == "truncated":
        os.truncate(b, 100)
    elif damage == "overwritten":
        overwrite(b, 5, b"garbage")
    else:
        b.unlink()
    with capture_logs() as logs:
        assert cache.tree(m.digest) is None
    (said,) = [e for e in logs if e["event"] == "cache.damaged"]
    assert said["problem"].startswith("corpus/b.txt:") and said["digest"] == m.digest
    assert not tree.exists()
    entry = next(e for e in m.entries if e.path == "corpus/b.txt")
    assert sorted((e.path, i) for e, i in cache.missing(m)) == [("corpus/b.txt", i) for i in range(len(entry.chunks))]
    fetch(cache, m, tmp_path / "sources" / "corpus")
    assert differences(cache.complete(m), m) == [] and cache.tree(m.digest) == tree


def test_a_tree_damaged_in_several_files_loses_them_all_at_once_and_is_repaired_in_one_fetch(tmp_path: Path) -> None:
    """Every damaged file is found in one check: the tree was dropped with its first damaged file
    only, rebuilt from the other damaged blobs, and found damaged again at each use, one file a
    time (a 200-step job restarted 15 times)."""
    cache, m, tree = fetched(tmp_path)
    overwrite(tree / "corpus" / "a.txt", 0, b"ALPHA")
    overwrite(tree / "corpus" / "b.txt", 7, b"garbage")
    with capture_logs() as logs:
        folder, problem = cache.check(m.digest)
    assert folder is None and problem is not None and "(and 1 more file(s))" in problem, problem
    (said,) = [e for e in logs if e["event"] == "cache.damaged"]
    assert said["files"] == 2
    assert {e.path for e, _ in cache.missing(m)} == {"corpus/a.txt", "corpus/b.txt"}
    fetch(cache, m, tmp_path / "sources" / "corpus")
    assert differences(cache.complete(m), m) == [] and cache.check(m.digest) == (tree, None)


def test_bytes_changed_with_their_times_put_back_pass_a_stat_but_not_a_full_check(tmp_path: Path) -> None:
    """What no stat shows (the bytes overwritten, the seal's mtime put back; a disk's own damage) is
    found by `check(full=True)`, which a node runs when a trainer refused its copy."""
    cache, m, tree = fetched(tmp_path)
    b = tree / "corpus" / "b.txt"
    overwrite(b, 5, b"garbage")
    os.utime(b, ns=(SEAL_NS, SEAL_NS))
    assert cache.check(m.digest) == (tree, None)  # the stat says verified
    folder, problem = cache.check(m.digest, full=True)
    assert folder is None and problem is not None and problem.startswith("corpus/b.txt: its bytes changed since they were verified"), problem
    assert {e.path for e, _ in cache.missing(m)} == {"corpus/b.txt"}


def test_a_touched_file_with_the_same_bytes_is_hashed_once_and_kept(tmp_path: Path) -> None:
    cache, m, tree = fetched(tmp_path)
    b = tree / "corpus" / "b.txt"
    assert os.stat(b).st_mtime_ns == SEAL_NS  # sealed when verified
    os.utime(b)  # `touch`
    assert cache.tree(m.digest) == tree and differences(tree, m) == []
    assert os.stat(b).st_mtime_ns == SEAL_NS  # sealed again: the next use hashes nothing


def test_an_adopted_folder_changed_in_place_with_its_size_kept_is_dropped(tmp_path: Path) -> None:
    """The node's own copy, served where it is: its files' mtimes are recorded when verified; one
    rewritten since (same size) is hashed again at the next use, and the adoption dropped."""
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    cache.put_manifest(m.to_bytes())
    cache.adopt(m.digest, source)
    os.utime(source / "corpus" / "a.txt")  # touched only: kept
    assert cache.tree(m.digest) == source.resolve()
    overwrite(source / "corpus" / "b.txt", 0, TREE["corpus/b.txt"][:3][::-1])
    with capture_logs() as logs:
        assert Cache(tmp_path / "cache").tree(m.digest) is None  # a restarted daemon checks it too
    (said,) = [e for e in logs if e["event"] == "cache.adoption_dropped"]
    assert "corpus/b.txt: its bytes changed since they were verified" in said["reason"]
    assert not (tmp_path / "cache" / "adopted" / m.digest).exists()


def test_a_cache_removed_under_a_running_daemon_is_made_again_empty(tmp_path: Path) -> None:
    """`rm -rf STATE/cache` while dpd ran: the next listing raised FileNotFoundError, which ended
    the serving dpd and the pool's coordinator with it."""
    cache, m, _ = fetched(tmp_path)
    shutil.rmtree(tmp_path / "cache")
    with capture_logs() as logs:
        assert cache.entries() == []
    assert [e["event"] for e in logs] == ["cache.recreated"]
    assert cache.tree(m.digest) is None and cache.manifest(m.digest) is None
    cache.put_manifest(m.to_bytes())
    cache.reserve(m)
    fetch(cache, m, tmp_path / "sources" / "corpus")
    assert differences(cache.complete(m), m) == [] and [e.digest for e in cache.entries()] == [m.digest]


def test_an_adopted_folder_moved_away_is_no_longer_listed_and_its_drop_is_told(tmp_path: Path) -> None:
    """A node served a folder in place; the folder moved. Its listing still named the content, so
    the pool kept sending fetchers to it, and a job waited on it. The listing now leaves it out, and
    whoever listens (the dpd, which then sends its holdings again) hears of the drop."""
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(tmp_path / "cache")
    heard: list[str] = []
    cache.on_adoption_dropped(heard.append)
    cache.put_manifest(m.to_bytes())
    cache.adopt(m.digest, source)
    assert [(e.digest, e.complete) for e in cache.entries()] == [(m.digest, True)]
    source.rename(tmp_path / "moved")
    assert [(e.digest, e.complete) for e in cache.entries()] == [(m.digest, False)]  # the manifest stays; nothing to serve
    assert heard == [m.digest] and not (tmp_path / "cache" / "adopted" / m.digest).exists()
    b = next(e for e in m.entries if e.size)
    assert not cache.has_chunk(b.sha256, 0)


def test_a_budget_lowered_since_the_trees_were_fetched_applies_at_start(tmp_path: Path) -> None:
    """`dpd run --cache-max` below what the cache holds evicted nothing until the next fetch."""
    size = 2 * SMALL
    cache = Cache(tmp_path / "cache", min_free=0)
    for name, used in (("old", 1000.0), ("mid", 2000.0), ("new", 3000.0)):
        complete_tree(cache, tmp_path, name, size, used)
    mid = next(e for e in cache.entries() if e.last_used == 2000.0)
    smaller = Cache(tmp_path / "cache", max_bytes=size // 2, min_free=0)
    smaller.pin(mid.digest, "job")  # in use: never evicted, whatever its age
    with capture_logs() as logs:
        assert smaller.trim() == 2 * size
    assert [e.digest for e in smaller.entries()] == [mid.digest]  # old went first, then new; mid is pinned
    assert [e["event"] for e in logs] == ["cache.evicted", "cache.evicted", "cache.over_budget"]
    assert Cache(tmp_path / "cache", max_bytes=10 * size).trim() == 0


def test_dpd_cache_lists_and_prunes_a_state_dirs_trees(tmp_path: Path) -> None:
    """The command a user runs on a stopped dpd's state dir: a table of what it holds (it failed
    with a NameError whenever the cache held a tree), then a prune that empties it."""
    state = tmp_path / "state"
    source, m = staged(tmp_path, "corpus", TREE)
    cache = Cache(state / "cache")
    fetch(cache, m, source)
    cache.complete(m)
    env = {**os.environ, "HOME": str(tmp_path)}
    listed = subprocess.run(["dpd", "cache", "--state-dir", str(state)], capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert m.digest[:12] in listed.stdout and "DIGEST" in listed.stdout and f"in {state / 'cache'}" in listed.stdout
    pruned = subprocess.run(["dpd", "cache", "prune", m.digest[:8], "--state-dir", str(state)], capture_output=True, text=True, env=env, timeout=60)
    assert pruned.returncode == 0 and "freed" in pruned.stdout, pruned.stderr
    assert Cache(state / "cache").entries() == []
