"""Whether a tree on disk still holds what was verified, checked with a stat of each file.

Hashing a model's gigabytes before every job would cost seconds; not checking let a node train on a
cached file truncated or overwritten after it was verified, and succeed with another job's numbers.
So a file is hashed again only when its stat says it may have changed:

- A blob of the cache is *sealed* when it is verified: its mtime is set to SEAL_NS, a moment no
  write leaves behind (every write sets the mtime to now). A cache tree's files are hard links to
  blobs, so a file of the size its manifest entry says and with the seal is as verified.
- An adopted folder holds the user's own files, not ours to touch: the mtimes they had when they
  were verified are recorded beside the adoption, and compared.

A file whose size differs is damaged; one whose mtime moved is hashed again: the same bytes (a
`touch`, a copy that kept the content) are sealed or recorded again, other bytes are damage.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from dpool.staging.manifest import Entry, Manifest, hash_file

SEAL_NS = 1_000_000_000 * 10**9  # 2001-09-09T01:46:40Z: a verified blob's mtime


def seal(path: Path) -> None:
    """Mark a verified file as such (its owner may set its times, read-only or not)."""
    os.utime(path, ns=(SEAL_NS, SEAL_NS))


def sealed(entry: Entry, st: os.stat_result) -> bool:
    return st.st_mtime_ns == SEAL_NS


def mtimes(folder: Path, manifest: Manifest) -> dict[str, int]:
    """Each file's mtime (ns) in `folder`, by its manifest path (what an adoption records)."""
    out = {}
    for e in manifest.entries:
        try:
            out[e.path] = os.stat(folder.joinpath(*e.path.split("/"))).st_mtime_ns
        except OSError:
            continue  # checked (and found missing) at the next use
    return out


def damage(folder: Path, manifest: Manifest, unchanged: Callable[[Entry, os.stat_result], bool]) -> tuple[list[tuple[Entry, str]], list[Entry]]:
    """(every damaged entry in `folder`, each with what is wrong with it; the entries hashed again
    and found intact). `unchanged(entry, stat)`: whether the file's stat shows it as verified (no
    hash needed). Every file is looked at, not only up to the first damaged one: a tree damaged in
    several files is repaired in one fetch, not one file per use."""
    found: list[tuple[Entry, str]] = []
    rehashed: list[Entry] = []
    for e in manifest.entries:
        problem = _problem(folder.joinpath(*e.path.split("/")), e, manifest.chunk_bytes, unchanged)
        if problem == "rehashed":
            rehashed.append(e)
        elif problem is not None:
            found.append((e, f"{e.path}: {problem}"))
    return found, rehashed


def described(found: list[tuple[Entry, str]]) -> str:
    """What `damage` found, in a line: the first file's problem, and how many more."""
    first = found[0][1]
    return first if len(found) == 1 else f"{first} (and {len(found) - 1} more file(s))"


def _problem(path: Path, e: Entry, chunk_bytes: int, unchanged: Callable[[Entry, os.stat_result], bool]) -> str | None:
    """What is wrong with one file, None when its stat shows it as verified, "rehashed" when it
    had to be hashed again and is intact."""
    try:
        st = os.stat(path)
    except OSError as err:
        return str(err.strerror or err)
    if not stat.S_ISREG(st.st_mode):
        return "no longer a regular file"
    if st.st_size != e.size:
        return f"{st.st_size} bytes where {e.size} were verified"
    if not e.size or unchanged(e, st):
        return None
    try:
        with open(path, "rb") as f:
            size, sha, _ = hash_file(f, chunk_bytes)
    except OSError as err:
        return str(err.strerror or err)
    if (size, sha) != (e.size, e.sha256):
        return f"its bytes changed since they were verified (sha256 {sha[:12]}, {e.sha256[:12]} expected)"
    return "rehashed"
