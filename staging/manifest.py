"""What a tree of files is, by content: a manifest, its canonical bytes, and the digest they hash to.

A manifest lists every file of a tree by its path relative to the tree's root (POSIX, "corpus/a.txt"),
its size, the sha256 of the whole file and the sha256 of each `chunk_bytes` piece (the last one
shorter; none for an empty file). Nothing else: no absolute path, owner, mode or time, so the same
files under /home/alice/corpus and /Users/bob/data/corpus give the same bytes and the same digest.
Paths are taken as the filesystem spells them (no Unicode normalization); a folder is there only
through the files it holds (an empty folder is not part of a tree).

The bytes are canonical: orjson with sorted keys and no whitespace, entries sorted by path. A
manifest that arrives from a peer is checked by `Manifest.from_bytes` for everything a hostile peer
could send, and must be in canonical form, so one manifest has exactly one byte string and one digest.

`scan` makes a manifest of a folder, or of some files under it, reading each file once: every
regular file below the root, hidden ones included, except in folders named `.git` (a clone's history
duplicates what it checked out and changes with every fetch; list such files explicitly to stage
them). A symlink is followed when its target stays inside the root; one that leaves it, a loop and a
special file (a fifo, a socket, a device) are refused. A `HashCache` spares rehashing files that have
not changed since the last scan.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sqlite3
import stat
import threading
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

CHUNK_BYTES = 4 * 1024 * 1024
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
FORMAT_VERSION = 1
SKIPPED_FOLDERS = frozenset({".git"})  # not walked into by `scan` (they may still be listed in `files`)
_HEX = frozenset("0123456789abcdef")
_KEYS = frozenset({"version", "chunk_bytes", "entries"})
_ENTRY_KEYS = frozenset({"path", "size", "sha256", "chunks"})
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class ManifestError(ValueError):
    """A manifest (or a tree being scanned) that cannot be staged; the message names the entry."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds a manifest from the wire may not pass."""

    max_files: int = 100_000
    max_bytes: int = 1 << 40  # total size of the files
    max_path: int = 1024  # characters of one relative path
    # Bytes of the manifest itself: a 1 TiB tree in 4 MiB chunks is about 18 MB. (A tree that is
    # large in 64 KiB chunks passes this first: it needs larger chunks.)
    max_manifest_bytes: int = 64 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    path: str  # POSIX, relative to the tree's root: "corpus/a.txt"
    size: int
    sha256: str  # hex of the whole file
    chunks: tuple[str, ...]  # hex sha256 of each chunk_bytes piece (the last one shorter); () when empty

    def chunk_size(self, index: int, chunk_bytes: int) -> int:
        """Bytes of chunk `index` (every chunk is `chunk_bytes` long but the last)."""
        if not 0 <= index < len(self.chunks):
            raise IndexError(f"{self.path}: no chunk {index} (it has {len(self.chunks)})")
        return min(chunk_bytes, self.size - index * chunk_bytes)


@dataclass(frozen=True, slots=True)
class Manifest:
    """A tree of files by content. Built by `scan` or `from_bytes`, which check it; one built by hand
    is taken as it is."""

    entries: tuple[Entry, ...]  # sorted by path, unique
    chunk_bytes: int = CHUNK_BYTES
    _encoded: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def to_bytes(self) -> bytes:
        """The canonical bytes: the same tree gives the same bytes on every machine."""
        if self._encoded is None:
            body = {
                "version": FORMAT_VERSION,
                "chunk_bytes": self.chunk_bytes,
                "entries": [{"path": e.path, "size": e.size, "sha256": e.sha256, "chunks": list(e.chunks)} for e in self.entries],
            }
            object.__setattr__(self, "_encoded", orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
        assert self._encoded is not None
        return self._encoded

    @property
    def digest(self) -> str:
        """sha256 hex of `to_bytes()`: the manifest's name, in caches and on the wire."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    @classmethod
    def from_bytes(cls, data: bytes, limits: Limits = Limits()) -> Manifest:
        """Parse and check bytes from a peer. Raises ManifestError naming what is wrong."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ManifestError(f"manifest: expected bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > limits.max_manifest_bytes:
            raise ManifestError(f"manifest: {len(data)} bytes, more than the limit of {limits.max_manifest_bytes}")
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ManifestError(f"manifest: not valid JSON ({e})") from None
        manifest = _parse(doc, limits)
        if manifest.to_bytes() != data:
            raise ManifestError("manifest: not in canonical form (sorted keys, no whitespace, as to_bytes writes it), so its digest would not name it")
        return manifest


# -- checks ----------------------------------------------------------------------------------------


def _shown(path: str) -> str:
    """A path fit for a message: as it is when printable and short, else escaped and cut."""
    return path if path.isprintable() and len(path) <= 200 else repr(path[:200])


def _int(value: Any, where: str, name: str, low: int, high: int) -> int:
    if type(value) is not int:  # bool is an int too, and a float is never a size
        raise ManifestError(f"{where}: {name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ManifestError(f"{where}: {name} is {value}, expected {low} to {high}")
    return value


def _sha(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise ManifestError(f"{where}: {name} must be 64 lowercase hex digits, got {_shown(str(value))}")
    return value


def path_problem(path: str, max_path: int) -> str | None:
    """What makes `path` unfit as a relative path in a manifest, or None."""
    if not path:
        return "the path is empty"
    if len(path) > max_path:
        return f"the path has {len(path)} characters, more than the limit of {max_path}"
    if path.startswith("/"):
        return "the path is absolute; paths are relative to the tree's root"
    if "\\" in path:
        return "the path holds a backslash; parts are separated by '/'"
    if any(unicodedata.category(c) == "Cc" for c in path):
        return "the path holds a NUL or control character"
    for part in path.split("/"):
        if part == "":
            return "the path has an empty part ('//', or '/' at its end)"
        if part in (".", ".."):
            return f"the path has a {part!r} part"
    return None


def _parse(doc: Any, limits: Limits) -> Manifest:
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest: expected a JSON object, got {type(doc).__name__}")
    if set(doc) != _KEYS:
        unknown, absent = sorted(set(doc) - _KEYS), sorted(_KEYS - set(doc))
        raise ManifestError(f"manifest: expected the keys {sorted(_KEYS)}" + (f"; unknown: {unknown}" if unknown else "") + (f"; missing: {absent}" if absent else ""))
    _int(doc["version"], "manifest", "version", FORMAT_VERSION, FORMAT_VERSION)
    chunk_bytes = _int(doc["chunk_bytes"], "manifest", "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    raw = doc["entries"]
    if not isinstance(raw, list):
        raise ManifestError(f"manifest: entries must be a list, got {type(raw).__name__}")
    if len(raw) > limits.max_files:
        raise ManifestError(f"manifest: {len(raw)} files, more than the limit of {limits.max_files}")
    entries = tuple(_entry(i, item, chunk_bytes, limits) for i, item in enumerate(raw))
    check(entries, limits)
    return Manifest(entries, chunk_bytes)


def _entry(i: int, item: Any, chunk_bytes: int, limits: Limits) -> Entry:
    if not isinstance(item, dict):
        raise ManifestError(f"entry {i}: expected a JSON object, got {type(item).__name__}")
    path = item.get("path")
    if not isinstance(path, str):
        raise ManifestError(f"entry {i}: path must be a string, got {type(path).__name__}")
    where = _shown(path)
    if set(item) != _ENTRY_KEYS:
        raise ManifestError(f"{where}: expected the keys {sorted(_ENTRY_KEYS)}, got {sorted(map(str, item))}")
    problem = path_problem(path, limits.max_path)
    if problem:
        raise ManifestError(f"{where}: {problem}")
    size = _int(item["size"], where, "size", 0, limits.max_bytes)
    sha = _sha(item["sha256"], where, "sha256")
    chunks = item["chunks"]
    if not isinstance(chunks, list):
        raise ManifestError(f"{where}: chunks must be a list, got {type(chunks).__name__}")
    expected = -(-size // chunk_bytes)
    if len(chunks) != expected:
        raise ManifestError(f"{where}: {len(chunks)} chunks for {size} bytes, expected {expected} of {chunk_bytes} bytes")
    entry = Entry(path, size, sha, tuple(_sha(c, where, f"chunk {k}") for k, c in enumerate(chunks)))
    # A file of one chunk is hashed twice over the same bytes, and an empty one has one known hash.
    if size == 0 and sha != EMPTY_SHA256:
        raise ManifestError(f"{where}: an empty file's sha256 is {EMPTY_SHA256}, got {sha}")
    if len(entry.chunks) == 1 and entry.chunks[0] != sha:
        raise ManifestError(f"{where}: a file of one chunk has that chunk's sha256, got {entry.chunks[0]} and {sha}")
    return entry


def check(entries: Sequence[Entry], limits: Limits) -> None:
    """What a tree's entries must be together: sorted by path, unique, no path both a file and a
    folder, within the limits."""
    if len(entries) > limits.max_files:
        raise ManifestError(f"manifest: {len(entries)} files, more than the limit of {limits.max_files}")
    total = 0
    for before, entry in itertools.pairwise(entries):
        if entry.path == before.path:
            raise ManifestError(f"{_shown(entry.path)}: listed twice")
        if entry.path < before.path:
            raise ManifestError(f"{_shown(entry.path)}: out of order (entries are sorted by path; it comes after {_shown(before.path)})")
    paths = {e.path for e in entries}
    for entry in entries:
        parts = entry.path.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in paths:
                raise ManifestError(f"{_shown(entry.path)}: {_shown(folder)} is listed as a file and is a folder here")
        total += entry.size
        if total > limits.max_bytes:
            raise ManifestError(f"manifest: more than the limit of {limits.max_bytes} bytes in all (past {_shown(entry.path)})")


# -- hashing ---------------------------------------------------------------------------------------


def _fill(f: BinaryIO, view: memoryview) -> int:
    """Read until `view` is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    return got


def hash_file(f: BinaryIO, chunk_bytes: int, buffer: bytearray | None = None) -> tuple[int, str, tuple[str, ...]]:
    """(size, sha256, chunk sha256s) of an open file, read once from where it stands."""
    view = memoryview(buffer if buffer is not None and len(buffer) == chunk_bytes else bytearray(chunk_bytes))
    whole, chunks, size = hashlib.sha256(), [], 0
    while n := _fill(f, view):
        piece = view[:n]
        whole.update(piece)  # hashlib lets the GIL go on large buffers
        chunks.append(hashlib.sha256(piece).hexdigest())
        size += n
        if n < chunk_bytes:
            break
    return size, whole.hexdigest(), tuple(chunks)


# A file changed within this long of its hash being recorded could change again without its mtime
# moving (the kernel stamps writes from a coarse clock; FAT keeps 2 s): such a hash is not kept.
RACY_NS = 2_000_000_000


class HashCache:
    """A file's hashes, remembered by (absolute path, size, mtime_ns, inode, device) in a small SQLite
    file, so a node need not rehash a 1 GiB model at every check. A lost or corrupt file only costs a
    rehash: it is started again empty. Safe to share between threads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._db = self._open()
        except sqlite3.DatabaseError:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
            self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a cache: a lost last write is a rehash
            db.execute(
                "CREATE TABLE IF NOT EXISTS hashes (path TEXT NOT NULL, chunk_bytes INTEGER NOT NULL,"
                " size INTEGER NOT NULL, mtime_ns INTEGER NOT NULL, inode INTEGER NOT NULL, dev INTEGER NOT NULL,"
                " sha256 TEXT NOT NULL, chunks BLOB NOT NULL, PRIMARY KEY (path, chunk_bytes))"
            )
            db.execute("SELECT count(*) FROM hashes").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def get(self, path: Path, st: os.stat_result, chunk_bytes: int) -> tuple[str, tuple[str, ...]] | None:
        """The (sha256, chunk sha256s) recorded for this file as it stands (`st`), or None."""
        try:
            with self._lock:
                row = self._db.execute(
                    "SELECT size, mtime_ns, inode, dev, sha256, chunks FROM hashes WHERE path = ? AND chunk_bytes = ?",
                    (os.fsdecode(path), chunk_bytes),
                ).fetchone()
        except sqlite3.Error:
            return None
        if row is None or tuple(row[:4]) != (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev):
            return None
        raw = row[5]
        if not isinstance(raw, bytes) or len(raw) % 32 or len(raw) // 32 != -(-st.st_size // chunk_bytes):
            return None
        return row[4], tuple(raw[k : k + 32].hex() for k in range(0, len(raw), 32))

    def put(self, path: Path, st: os.stat_result, chunk_bytes: int, sha256: str, chunks: Sequence[str]) -> None:
        """Record a file's hashes, read while it stood as `st` (not when it changed too recently)."""
        if time.time_ns() - st.st_mtime_ns < RACY_NS:
            return
        row = (os.fsdecode(path), chunk_bytes, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, sha256, b"".join(bytes.fromhex(c) for c in chunks))
        try:
            with self._lock:
                self._db.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?, ?, ?, ?)", row)
        except sqlite3.Error:
            pass  # not remembered: hashed again next time

    def close(self) -> None:
        with self._lock:
            self._db.close()


def hash_path(path: Path, chunk_bytes: int, hashes: HashCache | None = None, buffer: bytearray | None = None) -> tuple[int, str, tuple[str, ...]]:
    """(size, sha256, chunk sha256s) of the file at `path` (symlinks followed), from `hashes` when it
    has not changed since. OSError when it cannot be read; ManifestError when it changes meanwhile."""
    real = Path(os.path.realpath(path))
    # O_NONBLOCK: a fifo put in a file's place since it was looked at must not block the open.
    with os.fdopen(os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        before = os.fstat(f.fileno())
        if not stat.S_ISREG(before.st_mode):
            raise ManifestError(f"{path}: not a regular file")
        known = hashes.get(real, before, chunk_bytes) if hashes is not None else None
        if known is not None:
            return before.st_size, known[0], known[1]
        size, sha, chunks = hash_file(f, chunk_bytes, buffer)
        after = os.fstat(f.fileno())
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or size != after.st_size:
        raise ManifestError(f"{path}: changed while it was being read; scan it again once it is written")
    if hashes is not None:
        hashes.put(real, after, chunk_bytes, sha, chunks)
    return size, sha, chunks


# -- scanning --------------------------------------------------------------------------------------


def scan(
    root: Path,
    files: Sequence[Path] | None = None,
    *,
    limits: Limits = Limits(),
    hashes: HashCache | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Manifest:
    """The manifest of `root`'s files, or of `files` (paths under `root`, absolute or relative to it;
    a folder among them stands for every file below it). Raises ManifestError naming the path that
    cannot be staged, and OSError for one that cannot be read."""
    root = Path(root)
    if not root.is_dir():
        raise ManifestError(f"{root}: not a folder")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ManifestError(f"chunk_bytes is {chunk_bytes}, expected {MIN_CHUNK_BYTES} to {MAX_CHUNK_BYTES}")
    walker = _Walker(root, limits)
    if files is None:
        walker.folder(walker.real_root, "", frozenset({walker.real_root}))
    else:
        for f in files:
            walker.listed(Path(f))
    buffer = bytearray(chunk_bytes)
    entries = []
    for rel in sorted(walker.found):
        problem = path_problem(rel, limits.max_path)
        if problem:
            raise ManifestError(f"{_shown(rel)}: {problem}")
        size, sha, chunks = hash_path(walker.found[rel], chunk_bytes, hashes, buffer)
        entries.append(Entry(rel, size, sha, chunks))
    check(entries, limits)
    return Manifest(tuple(entries), chunk_bytes)


def link_roots(root: Path) -> list[Path]:
    """Where a symlink under `root` may lead (real paths): inside `root`, and for a Hugging Face
    cache snapshot (`models--ORG--NAME/snapshots/REV`, whose files are links to `../../blobs/`), that
    repo's blobs."""
    real = Path(os.path.realpath(root))
    blobs = real.parent.parent / "blobs"
    return [real, blobs] if real.parent.name == "snapshots" and blobs.is_dir() else [real]


def _within(real: Path, roots: list[Path]) -> bool:
    return any(real == r or r in real.parents for r in roots)


class _Walker:
    """Collects relative path -> real file path under a root, following symlinks that stay inside
    (or, in a Hugging Face cache snapshot, lead to its repo's blobs: `link_roots`)."""

    def __init__(self, root: Path, limits: Limits) -> None:
        self.root, self.limits = root, limits
        self.abs_root = Path(os.path.abspath(root))
        self.real_root = Path(os.path.realpath(root))
        self.roots = link_roots(root)
        self.found: dict[str, Path] = {}

    def _inside(self, path: Path, rel: str) -> Path:
        """The real path a symlink leads to, refused when it leaves the root or leads nowhere."""
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise ManifestError(f"{rel}: leads nowhere (a broken symlink, or a symlink loop)") from None
        if not _within(real, self.roots):
            raise ManifestError(
                f"{rel}: a symlink to {real}, outside {self.root}; only links that stay inside the folder (or, in a Hugging Face "
                "cache snapshot, lead to its repo's blobs) are followed"
            )
        return real

    def _add(self, rel: str, real: Path) -> None:
        if rel not in self.found and len(self.found) >= self.limits.max_files:
            raise ManifestError(f"{self.root}: more than the limit of {self.limits.max_files} files")
        self.found[rel] = real

    def _any(self, rel: str, real: Path, ancestors: frozenset[Path]) -> None:
        """One path found at `rel` whose real path is `real`: a folder, a file or refused."""
        mode = os.stat(real).st_mode
        if stat.S_ISDIR(mode):
            if real in ancestors:
                raise ManifestError(f"{rel}: a symlink loop (it leads back to {real})")
            self.folder(real, rel, ancestors | {real})
        elif stat.S_ISREG(mode):
            self._add(rel, real)
        else:
            raise ManifestError(f"{rel}: a special file (fifo, socket or device); only regular files, folders and symlinks to them are staged")

    def folder(self, real: Path, rel: str, ancestors: frozenset[Path]) -> None:
        with os.scandir(real) as it:
            children = sorted(it, key=lambda e: e.name)
        for child in children:
            if child.name in SKIPPED_FOLDERS and child.is_dir():
                continue
            child_rel = f"{rel}/{child.name}" if rel else child.name
            if child.is_symlink():
                self._any(child_rel, self._inside(Path(child.path), child_rel), ancestors)
            elif child.is_dir(follow_symlinks=False) or child.is_file(follow_symlinks=False):
                self._any(child_rel, real / child.name, ancestors)
            else:
                raise ManifestError(f"{child_rel}: a special file (fifo, socket or device); only regular files, folders and symlinks to them are staged")

    def listed(self, path: Path) -> None:
        """A path the caller named: its place under the root as written, its content where it leads."""
        full = Path(os.path.normpath(path if path.is_absolute() else self.abs_root / path))
        for base in (self.abs_root, self.real_root):
            if full == base or base in full.parents:
                rel = full.relative_to(base).as_posix()
                break
        else:
            raise ManifestError(f"{path}: not under {self.root}")
        if rel == ".":
            self.folder(self.real_root, "", frozenset({self.real_root}))
            return
        if not os.path.lexists(full):
            raise ManifestError(f"{rel}: no such file under {self.root}")
        real = self._inside(full, rel)
        self._any(rel, real, frozenset({self.real_root}) | _real_parents(real, self.real_root))


def _real_parents(real: Path, real_root: Path) -> frozenset[Path]:
    """The folders between `real_root` and `real`: where a listed folder's loop would lead back to."""
    return frozenset(p for p in real.parents if p == real_root or real_root in p.parents)


# -- comparing a folder with a manifest ------------------------------------------------------------


def differences(root: Path, manifest: Manifest, *, hashes: HashCache | None = None) -> list[str]:
    """What keeps `root` from holding `manifest`'s tree, one line per file by relative path; [] when
    it holds it. Files in `root` that the manifest does not list are not differences."""
    root = Path(root)
    roots = link_roots(root)
    buffer = bytearray(manifest.chunk_bytes)
    out = []
    for entry in manifest.entries:
        path = root.joinpath(*entry.path.split("/"))
        real = Path(os.path.realpath(path))
        if not os.path.exists(real):
            out.append(f"{entry.path}: missing")
            continue
        if not _within(real, roots) or real in roots:
            out.append(f"{entry.path}: a symlink to {real}, outside {root}")
            continue
        try:
            st = os.stat(real)
            if not stat.S_ISREG(st.st_mode):
                out.append(f"{entry.path}: not a regular file")
                continue
            if st.st_size != entry.size:
                out.append(f"{entry.path}: {st.st_size} bytes, expected {entry.size}")
                continue
            _, sha, _ = hash_path(real, manifest.chunk_bytes, hashes, buffer)
        except (OSError, ManifestError) as e:
            out.append(f"{entry.path}: unreadable ({e})")
            continue
        if sha != entry.sha256:
            out.append(f"{entry.path}: content differs (sha256 {sha[:12]}..., expected {entry.sha256[:12]}...)")
    return out
