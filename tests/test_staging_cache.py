"""Staging's bottom layers on real files: manifests (what a tree is, by content; what a peer may not
send) and the node's content-addressed cache (chunks verified as they land, resumed after a crash,
evicted least recently used first, never while a job holds them)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

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
