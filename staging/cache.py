"""A node's content-addressed cache of staged trees, under its state dir (`STATE/cache`).

    manifests/<digest>        a manifest's bytes (their sha256 is the digest)
    blobs/<sha256>            a complete file, verified whole (read-only); one per content, however
                              many files of however many trees hold it
    partial/<sha256>          a file being fetched, written chunk by chunk in place (sparse until full)
    partial/<sha256>.have     which of its chunks are written and verified: a header line
                              `dpool-partial 1 <size> <chunk_bytes>`, then `<index> <chunk sha256>` a line
    trees/<digest>/<path>     hard links to blobs (empty files are plain empty files): the stable,
                              read-only folder a job reads; built in trees/.tmp-* and renamed in place
    adopted/<digest>          the absolute path of a folder outside the cache that holds this manifest's
                              files (the caller verified it): served from there, never copied
    adopted/<digest>.mtimes   its files' mtimes when they were verified (staging/integrity.py)
    used/<digest>             its mtime is the tree's last use, for least-recently-used eviction

Durability. A chunk is written and its line appended to `.have` without fsync: a daemon killed
mid-fetch loses at most what the kernel had not written, and since a `.have` line may reach the disk
before its chunk does, the first use of a partial file in a process re-hashes every chunk `.have`
lists and keeps only those that match (a torn chunk is fetched again). A blob is fsynced before it is
renamed into blobs/. A tree or a manifest is written whole under a temporary name and renamed.

Integrity. A tree is checked as it is used (`tree`), with a stat of each file (staging/integrity.py):
a blob is sealed when verified, an adoption records its files' mtimes. A damaged file (truncated,
overwritten, gone) drops the tree (and that blob), or the adoption, so the node fetches the files
again instead of training on other bytes. A cache folder removed under a running daemon is made
again, empty, at its next use.

Space. A blob is freed when no tree links it (`st_nlink == 1`), and never while a manifest that
holds it is pinned (a live job reads it) or in flight (`missing` or `reserve` was asked about it, and
neither `complete` nor `release` has been since): a fetch's finished blobs are safe before its tree
exists. `reserve` makes room for what a manifest still needs within `max_bytes` and the disk
(keeping `min_free` free), dropping unreferenced blobs and partial files first, then unpinned trees
least recently used first.

One process uses a root at a time. Within it every method is safe to call from any thread: the data
channel writes and serves chunks from a thread of its own while the daemon reads. Hashing and file
I/O of one blob hold only that blob's lock; building a tree and evicting hold the tree lock, which
chunk reads and writes never wait for.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dpool.protocol.logs import get_logger
from dpool.staging.integrity import damage, described, mtimes, seal, sealed
from dpool.staging.manifest import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Entry,
    Limits,
    Manifest,
    ManifestError,
    hash_file,
)

HEX64 = re.compile(r"[0-9a-f]{64}")
PARTIAL_HEADER = "dpool-partial 1"
# Our own manifests, read back from our own disk: checked for shape, not held to a peer's limits.
_OWN = Limits(max_files=1 << 62, max_bytes=1 << 62, max_path=1 << 20, max_manifest_bytes=1 << 62)
_LAYOUT = ("manifests", "blobs", "partial", "trees", "adopted", "used")


class CacheFull(Exception):
    """There is no room for a manifest's missing bytes, even with every unpinned tree evicted."""


class Incomplete(Exception):
    """`complete` was asked for a tree whose files are not all in the cache yet."""


@dataclass(frozen=True)
class CacheEntry:
    digest: str
    bytes: int
    files: int
    last_used: float  # unix time; 0.0 when never used
    complete: bool  # its tree is there (or it is adopted)
    pinned_by: tuple[str, ...]
    adopted: str | None  # the folder it is served from, when adopted
    held: int = 0  # of `bytes`, what this cache holds verified (all of them when complete)


@dataclass
class _Partial:
    """A partial file's verified chunks: index -> the chunk's sha256. `whole` hashes the file as
    its chunks land, in order (`hashed`: how many so far), so the last chunk needs no second read
    of the whole file to check it."""

    size: int
    chunk_bytes: int
    have: dict[int, str] = field(default_factory=dict)
    whole: Any = field(default_factory=hashlib.sha256)
    hashed: int = 0


def _is_hex(value: object) -> bool:
    return isinstance(value, str) and HEX64.fullmatch(value) is not None


def _rename_durably(src: Path, dst: Path) -> None:
    """Rename `src` (its bytes already on disk) to `dst`, and make the rename reach the disk too."""
    os.replace(src, dst)
    folder = os.open(dst.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _rename_durably(tmp, path)


def _read_have(data: bytes) -> tuple[int, int, dict[int, str]] | None:
    """A partial file's record (PARTIAL_HEADER SIZE CHUNK_BYTES, then `INDEX SHA256` a line): its
    size, chunk size and the chunks it claims; None when its header is not one."""
    lines = data.split(b"\n")
    header = lines[0].decode("ascii", "replace").rsplit(" ", 2)
    try:
        size, chunk_bytes = int(header[1]), int(header[2])
    except (IndexError, ValueError):
        return None
    if header[0] != PARTIAL_HEADER or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        return None
    claimed: dict[int, str] = {}
    for line in lines[1:-1]:  # the last one is empty, or a line torn by a crash
        parts = line.decode("ascii", "replace").split(" ")
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) * chunk_bytes < size and _is_hex(parts[1]):
            claimed[int(parts[0])] = parts[1]
    return size, chunk_bytes, claimed


def _never(_entry: Entry, _st: os.stat_result) -> bool:
    """No stat shows a file as verified: hash it (a full check)."""
    return False


def _pread(path: Path, offset: int, length: int) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _unique(manifests: Iterable[Manifest]) -> dict[str, tuple[Entry, int]]:
    """sha256 -> (an entry holding it, its manifest's chunk_bytes), over non-empty files."""
    out: dict[str, tuple[Entry, int]] = {}
    for m in manifests:
        for e in m.entries:
            if e.size:
                out.setdefault(e.sha256, (e, m.chunk_bytes))
    return out


class Cache:
    def __init__(self, root: Path, *, max_bytes: int | None = None, min_free: int = 1 << 30) -> None:
        self.root = Path(root)
        self.max_bytes, self.min_free = max_bytes, min_free
        self.log = get_logger(component="cache")
        self._make_layout()
        self._lock = threading.Lock()  # the maps below; held briefly, never while hashing or waiting
        self._tree_lock = threading.RLock()  # building, pruning and evicting trees
        self._blob_locks: dict[str, threading.Lock] = {}  # one blob's partial file: writes, loading
        self._manifests: dict[str, Manifest] = {}
        self._partials: dict[str, _Partial] = {}
        self._pins: dict[str, set[str]] = {}  # owner -> digests
        self._active: dict[str, Manifest] = {}  # digest -> manifest being fetched
        self._adopted: dict[str, Path] = {}
        self._adopted_files: dict[str, list[tuple[str, Entry, int]]] | None = None  # sha256 -> (digest, entry, chunk_bytes); None: to build
        self._callbacks: list[Callable[[str, int], None]] = []
        self._dropped: list[Callable[[str], None]] = []  # told each adoption dropped (its digest)
        self._recover()

    def _make_layout(self) -> bool:
        """Make the cache's folders that are missing; whether any was."""
        made = False
        for name in _LAYOUT:
            folder = self.root / name
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                made = True
        return made

    def _layout(self) -> None:
        """Before a use: the folders are there. Removed under a running daemon (`rm -rf` of the
        cache), they are made again, empty, and what this process knew of their content is
        forgotten: the trees are fetched again when a job needs them."""
        if not self._make_layout():
            return
        with self._lock:
            self._manifests.clear()
            self._partials.clear()
            self._adopted.clear()
            self._adopted_files = None
        self.log.warning("cache.recreated", root=str(self.root), reason="its folders were removed while the daemon ran; they start empty")

    # -- paths -------------------------------------------------------------------------------------

    def _blob(self, sha: str) -> Path:
        return self.root / "blobs" / sha

    def _partial(self, sha: str) -> Path:
        return self.root / "partial" / sha

    def _have_file(self, sha: str) -> Path:
        return self.root / "partial" / f"{sha}.have"

    def _tree(self, digest: str) -> Path:
        return self.root / "trees" / digest

    def _touch(self, digest: str) -> None:
        self._layout()
        (self.root / "used" / digest).touch()  # now, also when it exists

    def _recover(self) -> None:
        """Undo what a process killed mid-way left: half-built trees, temporary files, partial files
        whose blob was completed; and read back the adoptions."""
        for folder in ("trees", "manifests", "adopted"):
            for p in (self.root / folder).glob(".tmp-*"):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        for p in (self.root / "partial").iterdir():
            sha = p.name.removesuffix(".have")
            if not _is_hex(sha) or self._blob(sha).exists():
                p.unlink(missing_ok=True)
        for p in (self.root / "adopted").iterdir():
            if _is_hex(p.name):
                self._adopted[p.name] = Path(os.fsdecode(p.read_bytes()))

    # -- manifests ---------------------------------------------------------------------------------

    def put_manifest(self, data: bytes, limits: Limits = Limits()) -> Manifest:  # noqa: B008 (frozen)
        """Check a manifest's bytes (ManifestError) and keep them under their digest."""
        m = Manifest.from_bytes(data, limits)
        self._layout()
        path = self.root / "manifests" / m.digest
        if not path.exists():
            _write_atomic(path, m.to_bytes())
        with self._lock:
            self._manifests[m.digest] = m
        return m

    def manifest(self, digest: str) -> Manifest | None:
        if not _is_hex(digest):
            return None
        with self._lock:
            if digest in self._manifests:
                return self._manifests[digest]
        try:
            data = (self.root / "manifests" / digest).read_bytes()
            m = Manifest.from_bytes(data, _OWN)
            if m.digest != digest:
                raise ManifestError(f"manifests/{digest}: its bytes hash to {m.digest}")
        except FileNotFoundError:
            return None
        except ManifestError as e:
            self.log.warning("cache.manifest_corrupt", digest=digest, error=str(e)[:300])
            (self.root / "manifests" / digest).unlink(missing_ok=True)
            return None
        with self._lock:
            self._manifests[digest] = m
        return m

    # -- trees -------------------------------------------------------------------------------------

    def tree(self, digest: str) -> Path | None:
        """The folder holding `digest`'s complete tree (its own, or the adopted one), checked
        intact (a stat a file; a file whose stat moved is hashed again) and marked used. None when
        there is none, or it was damaged (then dropped: fetch it again)."""
        return self.check(digest)[0]

    def check(self, digest: str, *, full: bool = False) -> tuple[Path | None, str | None]:
        """`tree`, and what was wrong with the tree it dropped (None when it held none, or an
        intact one). `full`: hash every file, whatever its stat says (a trainer found its input
        not what the pool's other copies hold: damage a stat cannot show, such as bytes changed
        with their times put back, or a disk's)."""
        if not _is_hex(digest):
            return None, None
        self._layout()
        with self._lock:
            folder = self._adopted.get(digest)
        if folder is not None:
            return self._adopted_tree(digest, folder, full)
        if not self._tree(digest).is_dir():
            return None, None
        m = self.manifest(digest)
        hashed = None
        if full and m is not None:
            # Every byte hashed (a model's gigabytes: minutes), not under the tree lock: fetches,
            # uploads and evictions go on meanwhile. What it found is dropped under the lock.
            hashed = damage(self._tree(digest), m, _never)
        with self._tree_lock:
            found, rehashed = hashed or (damage(self._tree(digest), m, sealed) if m is not None else ([], []))
            for e in rehashed:
                seal(self._blob(e.sha256))  # the same bytes, touched (or from before blobs were sealed)
            if found or m is None:
                problem = described(found) if found else "its manifest is gone"
                self.log.warning("cache.damaged", digest=digest, problem=problem, files=len(found), then="the tree is dropped and fetched again")
                shutil.rmtree(self._tree(digest), ignore_errors=True)
                for bad, _ in found:  # every damaged file's blob: one fetch brings them all back
                    if bad.size:
                        self._blob(bad.sha256).unlink(missing_ok=True)
                return None, f"{problem} (in this node's cache)"
        self._touch(digest)
        return self._tree(digest), None

    def _adopted_tree(self, digest: str, folder: Path, full: bool = False) -> tuple[Path | None, str | None]:
        m = self.manifest(digest)
        if not folder.is_dir() or m is None:
            why = f"{folder} is no longer a folder" if m is not None else "its manifest is gone"
            self._unadopt(digest, why)
            return None, why
        record = self.root / "adopted" / f"{digest}.mtimes"
        try:
            verified = orjson.loads(record.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            verified = {}  # adopted before mtimes were recorded: every file is hashed once
        found, rehashed = damage(folder, m, _never if full else lambda e, st: verified.get(e.path) == st.st_mtime_ns)
        if found:
            why = f"{described(found)}, in {folder}"
            self._unadopt(digest, why)
            return None, why
        if rehashed or not verified:
            _write_atomic(record, orjson.dumps(mtimes(folder, m)))
        self._touch(digest)
        return folder, None

    def adopt(self, digest: str, folder: Path) -> None:
        """Serve `digest` from `folder`, which the caller verified holds its files (`differences`)."""
        if self.manifest(digest) is None:
            raise ValueError(f"cannot adopt {digest}: no manifest with that digest in {self.root / 'manifests'}; put it first")
        folder = Path(folder).resolve()
        if not folder.is_dir():
            raise ValueError(f"cannot adopt {digest}: {folder} is not a folder")
        self._layout()
        m = self.manifest(digest)
        assert m is not None
        _write_atomic(self.root / "adopted" / f"{digest}.mtimes", orjson.dumps(mtimes(folder, m)))
        _write_atomic(self.root / "adopted" / digest, os.fsencode(folder))
        with self._lock:
            self._adopted[digest] = folder
            self._adopted_files = None
        self._touch(digest)

    def on_adoption_dropped(self, callback: Callable[[str], None]) -> None:
        """Call `callback(digest)` (from any thread) when an adopted folder is found gone or changed:
        what this cache holds changed without a fetch or a prune."""
        with self._lock:
            self._dropped.append(callback)

    def _unadopt(self, digest: str, why: str) -> None:
        with self._lock:
            folder = self._adopted.pop(digest, None)
            self._adopted_files = None
            callbacks = list(self._dropped)
        if folder is not None:
            (self.root / "adopted" / digest).unlink(missing_ok=True)
            (self.root / "adopted" / f"{digest}.mtimes").unlink(missing_ok=True)
            self.log.warning("cache.adoption_dropped", digest=digest, folder=str(folder), reason=why)
            for callback in callbacks:
                callback(digest)

    def complete(self, manifest: Manifest) -> Path:
        """`manifest`'s tree, built from its blobs (Incomplete when some are missing); marked used."""
        digest = manifest.digest
        with self._lock:
            adopted = self._adopted.get(digest)
        if adopted is not None and adopted.is_dir():
            self.release(digest)
            self._touch(digest)
            return adopted
        final = self._tree(digest)
        with self._tree_lock:
            if not final.is_dir():
                absent = [e.path for e in manifest.entries if e.size and not self._blob(e.sha256).exists()]
                if absent:
                    raise Incomplete(f"{digest}: {len(absent)} of {len(manifest.entries)} files are not in the cache yet ({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''})")
                if not (self.root / "manifests" / digest).exists():
                    _write_atomic(self.root / "manifests" / digest, manifest.to_bytes())
                self._build(manifest, final)
            self.release(digest)
            self._touch(digest)
        return final

    def _build(self, manifest: Manifest, final: Path) -> None:
        tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}-{threading.get_ident()}")
        try:
            for e in manifest.entries:
                dst = tmp.joinpath(*e.path.split("/"))
                dst.parent.mkdir(parents=True, exist_ok=True)
                if not e.size:
                    # Not a link: a tree of 100,000 empty files would pass a filesystem's link limit.
                    dst.touch(mode=0o444)
                    continue
                try:
                    os.link(self._blob(e.sha256), dst)
                except OSError as err:
                    if err.errno != errno.EMLINK:
                        raise
                    shutil.copyfile(self._blob(e.sha256), dst)  # the blob has as many links as it can
                    os.chmod(dst, 0o444)
                    seal(dst)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    # -- chunks ------------------------------------------------------------------------------------

    def on_chunk(self, callback: Callable[[str, int], None]) -> None:
        """Call `callback(sha256, index)` after each chunk is verified and written."""
        with self._lock:
            self._callbacks.append(callback)

    def _blob_lock(self, sha: str) -> threading.Lock:
        with self._lock:
            return self._blob_locks.setdefault(sha, threading.Lock())

    def _state(self, sha: str) -> _Partial | None:
        """The partial file's verified chunks, read (and re-hashed) at its first use in this process.
        The caller holds the blob's lock."""
        with self._lock:
            p = self._partials.get(sha)
        if p is None:
            p = self._load(sha)
            if p is not None:
                with self._lock:
                    self._partials[sha] = p
        return p

    def _loaded(self, sha: str) -> _Partial | None:
        """The partial file's state, read when this process has not read it yet."""
        with self._lock:
            p = self._partials.get(sha)
        if p is None and self._have_file(sha).exists():
            with self._blob_lock(sha):
                p = self._state(sha)
        return p

    def _load(self, sha: str) -> _Partial | None:
        try:
            data = self._have_file(sha).read_bytes()
        except FileNotFoundError:
            return None
        record = _read_have(data)
        try:
            on_disk: int | None = os.stat(self._partial(sha)).st_size
        except FileNotFoundError:
            on_disk = None
        if record is None or on_disk != record[0]:
            self._discard(sha, "unreadable")
            return None
        size, chunk_bytes, claimed = record
        p = _Partial(size, chunk_bytes)
        # A `.have` line may have reached the disk before its chunk did: trust none unread.
        with open(self._partial(sha), "rb") as f:
            for index, chunk_sha in sorted(claimed.items()):
                f.seek(index * chunk_bytes)
                if hashlib.sha256(f.read(min(chunk_bytes, size - index * chunk_bytes))).hexdigest() == chunk_sha:
                    p.have[index] = chunk_sha
        if len(p.have) != len(claimed):
            self.log.warning("cache.chunks_torn", sha256=sha, torn=len(claimed) - len(p.have), kept=len(p.have))
        if len(p.have) == -(-size // chunk_bytes):  # killed after its last chunk, before it became a blob
            self._finish(sha, p)
            return None
        if len(p.have) != len(claimed) or data.count(b"\n") != len(claimed) + 1:  # a torn or stray line: written again
            self._write_have(sha, p)
        return p

    def _write_have(self, sha: str, p: _Partial) -> None:
        body = f"{PARTIAL_HEADER} {p.size} {p.chunk_bytes}\n" + "".join(f"{i} {h}\n" for i, h in sorted(p.have.items()))
        _write_atomic(self._have_file(sha), body.encode())

    def _discard(self, sha: str, why: str) -> None:
        """Drop a partial file (the caller holds its lock)."""
        with self._lock:
            self._partials.pop(sha, None)
        for path in (self._have_file(sha), self._partial(sha)):
            path.unlink(missing_ok=True)
        self.log.info("cache.partial_dropped", sha256=sha, reason=why)

    def has_chunk(self, sha256: str, index: int) -> bool:
        """Whether chunk `index` of the file `sha256` can be read here (a complete blob has every
        chunk; a partial file those verified; an adopted folder those its manifest lists)."""
        if not _is_hex(sha256) or index < 0:
            return False
        p = self._loaded(sha256)  # first: it may find a partial file complete, and make it a blob
        if self._blob(sha256).exists():
            return True
        if p is not None:
            with self._lock:
                if index in p.have:
                    return True
        return any(index < len(e.chunks) for _, _, e, _ in self._adopted_holders(sha256))

    def read_chunk(self, sha256: str, index: int, chunk_bytes: int) -> bytes | None:
        """Chunk `index` of the file `sha256`, or None when it is not here."""
        if not _is_hex(sha256) or index < 0 or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            return None
        offset = index * chunk_bytes
        p = self._loaded(sha256)  # first: it may find a partial file complete, and make it a blob
        data = self._read_blob(sha256, offset, chunk_bytes)
        if data is not None:
            return data
        with self._lock:
            expected = p.have.get(index) if p is not None and p.chunk_bytes == chunk_bytes else None
        if p is not None and expected is not None:
            data = _pread(self._partial(sha256), offset, min(chunk_bytes, p.size - offset))
            if data is not None and hashlib.sha256(data).hexdigest() == expected:
                return data
            data = self._read_blob(sha256, offset, chunk_bytes)  # it became a blob meanwhile
            if data is not None:
                return data
        return self._read_adopted(sha256, index, chunk_bytes)

    def _read_blob(self, sha: str, offset: int, chunk_bytes: int) -> bytes | None:
        path = self._blob(sha)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if offset >= size:
            return None
        return _pread(path, offset, min(chunk_bytes, size - offset))

    def _adopted_holders(self, sha: str) -> list[tuple[str, Path, Entry, int]]:
        """(digest, folder, entry, chunk_bytes) of each adopted tree that holds the file `sha`."""
        with self._lock:
            adopted, index = dict(self._adopted), self._adopted_files
        if index is None:
            index = {}
            for digest in adopted:
                m = self.manifest(digest)
                if m is None:
                    continue
                for e in m.entries:
                    index.setdefault(e.sha256, []).append((digest, e, m.chunk_bytes))
            with self._lock:
                if self._adopted == adopted:
                    self._adopted_files = index
        return [(d, adopted[d], e, cb) for d, e, cb in index.get(sha, ()) if d in adopted]

    def _read_adopted(self, sha: str, index: int, chunk_bytes: int) -> bytes | None:
        for digest, folder, entry, cb in self._adopted_holders(sha):
            if cb != chunk_bytes or index >= len(entry.chunks):
                continue
            try:
                with open(folder.joinpath(*entry.path.split("/")), "rb") as f:
                    f.seek(index * chunk_bytes)
                    data = f.read(entry.chunk_size(index, chunk_bytes))
            except OSError as e:
                self._unadopt(digest, f"{entry.path}: {e.strerror or e}")
                continue
            if hashlib.sha256(data).hexdigest() == entry.chunks[index]:
                return data
            self._unadopt(digest, f"{entry.path}: chunk {index} no longer matches its sha256")
        return None

    def write_chunk(self, entry: Entry, index: int, data: bytes, chunk_bytes: int) -> bool:
        """Write chunk `index` of `entry`'s file when `data` is that chunk (False, nothing written,
        when it is not). The file's last chunk completes it: checked whole, it moves to blobs/."""
        sha = entry.sha256
        if not _is_hex(sha) or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES or len(entry.chunks) != -(-entry.size // chunk_bytes):
            return False
        if not 0 <= index < len(entry.chunks) or len(data) != entry.chunk_size(index, chunk_bytes):
            return False
        if hashlib.sha256(data).hexdigest() != entry.chunks[index]:
            return False
        self._layout()
        with self._blob_lock(sha):
            if self._blob(sha).exists():
                return True
            p = self._state(sha)
            if p is not None and (p.size, p.chunk_bytes) != (entry.size, chunk_bytes):
                self._discard(sha, f"restarted in chunks of {chunk_bytes} bytes (it had {p.chunk_bytes})")
                p = None
            if p is None:
                p = _Partial(entry.size, chunk_bytes)
                with open(self._partial(sha), "wb") as f:
                    f.truncate(entry.size)
                self._write_have(sha, p)
                with self._lock:
                    self._partials[sha] = p
            if index in p.have:
                return True
            fd = os.open(self._partial(sha), os.O_WRONLY)
            try:
                os.pwrite(fd, data, index * chunk_bytes)
            finally:
                os.close(fd)
            with open(self._have_file(sha), "ab") as f:
                f.write(f"{index} {entry.chunks[index]}\n".encode())
            with self._lock:
                p.have[index] = entry.chunks[index]
            self._hash_on(sha, p, index, data)
            if len(p.have) == len(entry.chunks) and not self._finish(sha, p):
                return False
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            try:
                callback(sha, index)
            except Exception as e:
                self.log.error("cache.callback_failed", sha256=sha, index=index, error=repr(e)[:300])
        return True

    def _hash_on(self, sha: str, p: _Partial, index: int, data: bytes) -> None:
        """Feed the whole-file hash the chunks that are now in order (the one just written from
        memory, those that landed ahead of it from the page cache). The caller holds the blob's lock."""
        while p.hashed in p.have:
            if p.hashed == index:
                piece: bytes | None = data
            else:
                piece = _pread(self._partial(sha), p.hashed * p.chunk_bytes, min(p.chunk_bytes, p.size - p.hashed * p.chunk_bytes))
            if piece is None:
                return  # unreadable now: _finish hashes the file whole instead
            p.whole.update(piece)
            p.hashed += 1

    def _finish(self, sha: str, p: _Partial) -> bool:
        """Every chunk is in: check the file whole, make it durable and read-only, move it to blobs/.
        The caller holds the blob's lock."""
        with open(self._partial(sha), "rb") as f:
            if p.hashed * p.chunk_bytes >= p.size:  # hashed in order as the chunks landed
                size, whole = p.size, p.whole.hexdigest()
            else:
                size, whole, _ = hash_file(f, p.chunk_bytes)
            if (size, whole) != (p.size, sha):
                self._discard(sha, f"its chunks matched but the whole file hashes to {whole} ({size} bytes)")
                return False
            os.fsync(f.fileno())
        os.chmod(self._partial(sha), 0o444)
        seal(self._partial(sha))
        _rename_durably(self._partial(sha), self._blob(sha))
        self._have_file(sha).unlink(missing_ok=True)
        with self._lock:
            self._partials.pop(sha, None)
        return True

    def missing(self, manifest: Manifest) -> list[tuple[Entry, int]]:
        """The chunks still to fetch for `manifest`, each file's content once (however many entries or
        manifests hold it), without those a partial file already holds. Marks the manifest in flight:
        its blobs are kept until `complete` or `release`."""
        with self._lock:
            if manifest.digest in self._adopted:
                return []
            self._active[manifest.digest] = manifest
        out = []
        for sha, (entry, chunk_bytes) in _unique([manifest]).items():
            p = self._loaded(sha)  # first: it may find a partial file complete, and make it a blob
            if self._blob(sha).exists():
                continue
            with self._lock:
                have = dict(p.have) if p is not None and p.chunk_bytes == chunk_bytes else {}
            out += [(entry, i) for i, c in enumerate(entry.chunks) if have.get(i) != c]
        return out

    def release(self, digest: str) -> None:
        """`digest` is no longer being fetched (done, failed or cancelled): its blobs may be evicted."""
        with self._lock:
            self._active.pop(digest, None)

    # -- pins, room, eviction ----------------------------------------------------------------------

    def pin(self, digest: str, owner: str) -> None:
        """`owner` (a job) reads `digest`'s tree: it is not evicted until `unpin(owner)`."""
        if not _is_hex(digest):
            raise ValueError(f"cannot pin {digest!r}: not a sha256 digest")
        with self._lock:
            self._pins.setdefault(owner, set()).add(digest)

    def unpin(self, owner: str) -> None:
        with self._lock:
            self._pins.pop(owner, None)

    def _pinned(self) -> dict[str, tuple[str, ...]]:
        """digest -> its owners."""
        with self._lock:
            by: dict[str, list[str]] = {}
            for owner, digests in self._pins.items():
                for d in digests:
                    by.setdefault(d, []).append(owner)
        return {d: tuple(sorted(o)) for d, o in by.items()}

    def _kept(self) -> dict[str, tuple[Entry, int]]:
        """The files that must stay: those of pinned manifests and of manifests in flight."""
        with self._lock:
            active = list(self._active.values())
        pinned = [m for d in self._pinned() if (m := self.manifest(d)) is not None]
        return _unique(active + pinned)

    def _sizes(self, folder: str) -> dict[str, os.stat_result]:
        self._layout()
        out = {}
        for p in (self.root / folder).iterdir():
            if _is_hex(p.name):
                with contextlib.suppress(FileNotFoundError):
                    out[p.name] = p.stat()
        return out

    def _to_write(self, manifests: Iterable[Manifest]) -> int:
        return sum(e.chunk_size(i, m.chunk_bytes) for m in manifests for e, i in self.missing(m))

    def reserve(self, manifest: Manifest) -> None:
        """Make room for what `manifest` still needs (marking it in flight), within the budget and the
        disk: unreferenced files go first, then unpinned trees least recently used first. CacheFull
        when even that would not do (and then nothing is evicted)."""
        digest = manifest.digest
        with self._lock:
            was_active = digest in self._active
        with self._tree_lock:
            need = self._to_write([manifest])  # marks it in flight
            if need == 0:
                return
            try:
                self._make_room(digest, need)
            except CacheFull:
                if not was_active:
                    self.release(digest)
                raise

    def _make_room(self, digest: str, need: int) -> None:
        """Evict until what the fetches in flight need fits (the caller holds the tree lock)."""
        tried: set[str] = set()  # evicted already ("": unreferenced files), in case one frees nothing
        while True:
            with self._lock:
                active = list(self._active.values())
            kept = self._kept()
            blobs, partials = self._sizes("blobs"), self._sizes("partial")
            flying = {sha: e.size for sha, (e, _) in _unique(active).items() if sha not in blobs}
            # What the cache will hold once every fetch in flight is done, and what that frees.
            final = sum(s.st_size for s in blobs.values()) + sum(flying.values()) + sum(s.st_size for sha, s in partials.items() if sha not in flying)
            freeable = sum(s.st_size for sha, s in blobs.items() if sha not in kept) + sum(s.st_size for sha, s in partials.items() if sha not in kept)
            to_write = self._to_write(active)
            free = shutil.disk_usage(self.root).free
            over = 0 if self.max_bytes is None else final - self.max_bytes
            short = to_write + self.min_free - free
            if over <= 0 and short <= 0:
                return
            if over > freeable or short > freeable:
                raise CacheFull(self._full(digest, need, final, free))
            if self._evict_one(tried, kept, for_digest=digest) is None:
                raise CacheFull(self._full(digest, need, final, free))

    def trim(self) -> int:
        """Evict least recently used unpinned trees (and unreferenced files) until the cache is
        within `max_bytes` (a budget lowered since they were fetched: `dpd run --cache-max`, at
        start). Bytes freed; what cannot go (pinned, adopted) stays."""
        if self.max_bytes is None:
            return 0
        freed, tried = 0, set[str]()
        with self._tree_lock:
            while True:
                held = sum(st.st_size for folder in ("blobs", "partial") for st in self._sizes(folder).values())
                if held <= self.max_bytes:
                    return freed
                gone = self._evict_one(tried, self._kept(), why="over --cache-max")
                if gone is None:
                    self.log.warning("cache.over_budget", held=held, budget=self.max_bytes, why="what is left is in use")
                    return freed
                freed += gone

    def _evict_one(self, tried: set[str], kept: dict[str, tuple[Entry, int]], **why: str) -> int | None:
        """Drop the files no tree links (once), else the least recently used evictable tree; the
        bytes freed, None when nothing is left to evict. `tried` gains what was evicted ("": the
        unreferenced files); `why` goes into the log line."""
        victim = "" if "" not in tried and self._has_orphans(kept) else self._victim(tried)
        if victim is None:
            return None
        tried.add(victim)
        freed = self._drop_orphans(kept) if victim == "" else self._drop(victim, kept)
        self.log.info("cache.evicted", digest=victim or "unreferenced files", freed=freed, **why)
        return freed

    def _full(self, digest: str, need: int, final: int, free: int) -> str:
        """Why `digest` does not fit, and what would make room: only the remedies that apply."""
        others = {d: o for d, o in self._pinned().items() if d != digest}  # not the tree being made room for
        too_big = self.max_bytes is not None and final > self.max_bytes
        budget = "no budget" if self.max_bytes is None else f"a budget of {self.max_bytes} bytes ({final} once the fetches in flight are done)"
        remedies = []
        if too_big:
            remedies.append("raise the cache's budget (dpd run --cache-max)")
        if need + self.min_free > free:
            remedies.append("free disk space")
        if others:
            remedies.append("end the jobs that pin trees")
        uses = ", ".join(f"{d[:12]} by {' '.join(o)}" for d, o in others.items())
        pinned = f"; pinned: {uses}" if others else ""
        return (
            f"the cache at {self.root} has no room for {digest[:12]}: {need} more bytes needed, {budget}{pinned}; "
            f"{free} bytes free on its disk, keeping {self.min_free} free. "
            f"{' or '.join(remedies).capitalize() or 'Free disk space'}."
        )

    def _has_orphans(self, kept: dict[str, tuple[Entry, int]]) -> bool:
        if any(s.st_nlink == 1 and sha not in kept for sha, s in self._sizes("blobs").items()):
            return True
        return any(sha not in kept for sha in self._sizes("partial"))

    def _victim(self, tried: set[str]) -> str | None:
        """The least recently used digest that is neither pinned, nor in flight, nor adopted (its
        files are not ours), nor evicted already."""
        pinned = self._pinned()
        with self._lock:
            busy = set(self._active) | set(self._adopted) | set(pinned) | tried
        candidates = [d for d in self._digests() if d not in busy]
        if not candidates:
            return None
        return min(candidates, key=self._last_used)

    def _digests(self) -> set[str]:
        self._layout()
        found = set()
        for folder in ("manifests", "trees", "adopted", "used"):
            found |= {p.name for p in (self.root / folder).iterdir() if _is_hex(p.name)}
        return found

    def _last_used(self, digest: str) -> float:
        try:
            return (self.root / "used" / digest).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def _drop(self, digest: str, kept: dict[str, tuple[Entry, int]]) -> int:
        """Remove `digest`'s tree and records, then its blobs that nothing else links. Bytes freed."""
        m = self.manifest(digest)
        shutil.rmtree(self._tree(digest), ignore_errors=True)
        for folder in ("manifests", "used"):
            (self.root / folder / digest).unlink(missing_ok=True)
        with self._lock:
            self._manifests.pop(digest, None)
        self._unadopt(digest, "pruned")
        if m is None:  # which blobs it linked is not known: every unlinked one goes
            return self._drop_orphans(kept)
        freed = 0
        for sha in _unique([m]):
            freed += self._drop_blob(sha, kept)
        return freed

    def _drop_blob(self, sha: str, kept: dict[str, tuple[Entry, int]]) -> int:
        path = self._blob(sha)
        try:
            st = path.stat()
        except FileNotFoundError:
            return 0
        if st.st_nlink != 1 or sha in kept:
            return 0
        path.unlink(missing_ok=True)
        return st.st_size

    def _drop_orphans(self, kept: dict[str, tuple[Entry, int]]) -> int:
        """Blobs no tree links and partial files no fetch in flight needs. Bytes freed."""
        freed = sum(self._drop_blob(sha, kept) for sha in self._sizes("blobs"))
        for sha, st in self._sizes("partial").items():
            lock = self._blob_lock(sha)
            if sha in kept or not lock.acquire(blocking=False):
                continue
            try:
                self._discard(sha, "evicted")
                freed += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
            finally:
                lock.release()
        return freed

    def prune(self, digest: str | None = None) -> int:
        """Remove one tree (ValueError when it is pinned), or every unpinned one and every file no
        tree links; a blob is deleted once no tree links it. Returns the bytes freed."""
        with self._tree_lock:
            kept = self._kept()
            pinned = self._pinned()
            if digest is not None:
                if not _is_hex(digest):
                    raise ValueError(f"cannot prune {digest!r}: not a sha256 digest")
                with self._lock:
                    active = set(self._active)
                if digest in pinned:
                    raise ValueError(f"cannot prune {digest}: pinned by {', '.join(pinned[digest])}")
                if digest in active:
                    raise ValueError(f"cannot prune {digest}: it is being fetched")
                return self._drop(digest, kept)
            with self._lock:
                active = set(self._active)
            freed = sum(self._drop(d, kept) for d in self._digests() - set(pinned) - active)
            return freed + self._drop_orphans(kept)

    def _held(self, m: Manifest) -> int:
        """The bytes of an incomplete tree this cache holds: its files' blobs, and the chunks of
        those still being fetched. A listing, on the caller's thread: it reads what the partial
        files' records claim, never hashes, and changes nothing."""
        held = 0
        for e in m.entries:
            if not e.size or self._blob(e.sha256).exists():
                held += e.size
                continue
            with self._lock:
                p = self._partials.get(e.sha256)
                have = list(p.have) if p is not None and p.chunk_bytes == m.chunk_bytes else None
            if have is None:
                have = self._claimed(e.sha256, m.chunk_bytes)
            held += sum(min(m.chunk_bytes, e.size - i * m.chunk_bytes) for i in have if 0 <= i * m.chunk_bytes < e.size)
        return held

    def _claimed(self, sha: str, chunk_bytes: int) -> list[int]:
        """The chunks a partial file's record lists (unverified: `_load` checks them)."""
        try:
            record = _read_have(self._have_file(sha).read_bytes())
        except OSError:
            return []
        return list(record[2]) if record is not None and record[1] == chunk_bytes else []

    def entries(self, *, held: bool = True) -> list[CacheEntry]:
        """Every manifest the cache knows, most recently used first (`held`: with what it holds of
        each incomplete one; without, 0 for those)."""
        pinned = self._pinned()
        with self._lock:
            adopted = dict(self._adopted)
        for d, where in list(adopted.items()):
            if not where.is_dir():  # moved or removed: it holds nothing now (a stat a folder)
                self._unadopt(d, f"{where} is no longer a folder")
                del adopted[d]
        out = []
        for d in self._digests():
            m = self.manifest(d)
            folder = adopted.get(d)
            complete = folder is not None or self._tree(d).is_dir()
            total = m.total_bytes if m is not None else 0
            out.append(
                CacheEntry(
                    digest=d,
                    bytes=total,
                    files=len(m.entries) if m is not None else 0,
                    last_used=self._last_used(d),
                    complete=complete,
                    pinned_by=pinned.get(d, ()),
                    adopted=str(folder) if folder is not None else None,
                    held=total if complete else self._held(m) if m is not None and held else 0,
                )
            )
        return sorted(out, key=lambda e: (-e.last_used, e.digest))
