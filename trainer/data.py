"""Data: documents to byte tokens, a held-out split by document, and global batches from (seed, step).

The token stream is built once and cached (keyed by a hash of the sources and the split), so a
restarted worker maps it in milliseconds. Documents are split train/validation by a seeded hash of
their identity, never by position. Global batch s is `global_batch` windows of `context + 1` tokens
taken from a seeded permutation per epoch: it depends on (seed, s) alone, so every rank, every
world size and every restart sees the same batch, and a rank's share is a contiguous slice of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpool.protocol.content import source_root
from dpool.protocol.jobspec import JobSpec, data_files

VOCAB_SIZE = 256  # byte-level tokens
DOC_SEPARATOR = 0  # NUL between documents: it never occurs in text, so the model learns document ends
CACHE_FORMAT = 2  # 2: documents named relative to the source's root (1: by absolute path)


class DataError(RuntimeError):
    """The job's data cannot be read or is too small for the job."""


@dataclass(frozen=True, slots=True)
class Document:
    ident: str  # its identity for the split: the path relative to the source's root (and line for .jsonl)
    text: bytes


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _stdlib_files() -> list[Path]:
    """The standard library's .py files; installed packages are pruned from the walk, not filtered
    after it (site-packages can hold far more files than the standard library: a restart pays this)."""
    out = []
    for folder, dirs, files in os.walk(stdlib_root()):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        out += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def source_files(spec: JobSpec) -> list[Path]:
    if spec.data.source == "stdlib":
        return _stdlib_files()
    files = [Path(p) for p in data_files(spec)]
    if not files:
        raise DataError(f"data.source = {spec.data.source!r}: no .txt or .jsonl files found")
    return files


def iter_documents(spec: JobSpec, files: list[Path]) -> Iterator[Document]:
    """The documents of `files`, each named by its path relative to the source's root
    (protocol/content.py), never by an absolute path: the same files in another folder, or under
    another user's home, split the same way."""
    root = stdlib_root() if spec.data.source == "stdlib" else source_root(spec.resolved_source())
    for path in files:
        ident = Path(os.path.relpath(path, root)).as_posix()
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError) as e:
                        raise DataError(f"{path}:{lineno}: expected a JSON object with a 'text' string ({e})") from None
                    if not isinstance(text, str):
                        raise DataError(f"{path}:{lineno}: 'text' must be a string")
                    try:
                        encoded = text.encode("utf-8")
                    except UnicodeEncodeError as e:  # JSON's \ud800 escapes: a lone surrogate is no text
                        raise DataError(f"{path}:{lineno}: 'text' holds {text[e.start:e.end]!r} at character {e.start}, half of a "
                                        "UTF-16 surrogate pair: not text; mend or drop the line") from None
                    yield Document(f"{ident}:{lineno}", encoded)
        else:
            yield Document(ident, path.read_bytes())


def split_score(ident: str, seed: int) -> float:
    """A seeded hash of the document's identity in [0, 1): stable whatever order files are listed in."""
    h = hashlib.sha256(f"{seed}:{ident}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64


def is_validation(ident: str, seed: int, val_fraction: float) -> bool:
    return split_score(ident, seed) < val_fraction


def file_stamp(path: Path) -> bytes:
    """What a cache of tokens made from `path` is keyed on: its name, size, modification time, and
    its inode and change time, which nobody can set back. A file replaced by another of the same
    size with its time put back (a staged tree fetched again after damage: the cache gives every
    file one fixed time) is a new stamp, so the tokens made from the damaged bytes are not reused."""
    st = path.stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}\n".encode()


def sources_key(spec: JobSpec, files: list[Path]) -> str:
    """Hash of what the token stream is made of: the files' stamps, and the split."""
    h = hashlib.sha256(f"v{CACHE_FORMAT}:{spec.data.val_fraction}:{spec.train.seed}".encode())
    for p in files:
        h.update(file_stamp(p))
    return h.hexdigest()[:20]


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 token streams (memory-mapped from the cache)
    val: np.ndarray
    key: str
    fingerprint: int  # content hash, compared across ranks so a pool never trains on different data

    @property
    def sizes(self) -> tuple[int, int]:
        return len(self.train), len(self.val)


def _build(spec: JobSpec, files: list[Path], out: Path) -> None:
    train, val = bytearray(), bytearray()
    docs = [(split_score(d.ident, spec.train.seed), d.ident, d.text) for d in iter_documents(spec, files)]
    # A corpus of a few documents can draw none below val_fraction: then the lowest-scoring one that
    # holds text is held out, so there is a validation split when two documents or more do.
    cut = spec.data.val_fraction
    texts = [score for score, _, text in docs if text.strip(b"\x00")]
    if len(texts) >= 2 and not any(score < cut for score, _, _ in docs):
        cut = min(texts) + 1e-12
    for score, _, text in docs:
        dest = val if score < cut else train
        dest += text.replace(b"\x00", b"")
        dest.append(DOC_SEPARATOR)
    digest = hashlib.sha256(bytes(train)).digest()[:4] + hashlib.sha256(bytes(val)).digest()[:3]
    meta = {"train": len(train), "val": len(val), "fingerprint": int.from_bytes(digest, "little")}
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    (tmp / "train.bin").write_bytes(bytes(train))
    (tmp / "val.bin").write_bytes(bytes(val))
    (tmp / "meta.json").write_text(json.dumps(meta))
    try:
        os.rename(tmp, out)
    except OSError:  # another rank on this machine built it first: theirs is identical
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def _cached_meta(out: Path) -> dict[str, int] | None:
    """The token cache's meta.json where the cache is whole (its files the sizes it says); a cache
    that is not (cut short, edited, half deleted) is moved out of the way, to be built again from
    the data it was made from, and None."""
    if not out.exists():
        return None
    try:
        meta = json.loads((out / "meta.json").read_text())
        whole = isinstance(meta, dict) and all(type(meta.get(k)) is int for k in ("train", "val", "fingerprint"))
        if whole and all((out / f"{k}.bin").stat().st_size == meta[k] for k in ("train", "val")):
            return meta
    except (OSError, ValueError):
        pass
    aside = out.with_name(f".damaged-{out.name}-{os.getpid()}")
    with contextlib.suppress(OSError):  # another rank on this machine may have moved it first
        os.rename(out, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return None


def load_corpus(spec: JobSpec, cache_dir: str | os.PathLike[str]) -> Corpus:
    files = source_files(spec)
    key = sources_key(spec, files)
    out = Path(cache_dir) / f"tokens-{key}"
    meta = _cached_meta(out)
    if meta is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        _build(spec, files, out)
        meta = _cached_meta(out)
        if meta is None:
            raise DataError(f"{out}: the token cache just built does not read back (is {out.parent} on a failing disk?)")
    train = np.memmap(out / "train.bin", dtype=np.uint8, mode="r") if meta["train"] else np.zeros(0, np.uint8)
    val = np.memmap(out / "val.bin", dtype=np.uint8, mode="r") if meta["val"] else np.zeros(0, np.uint8)
    return Corpus(train=train, val=val, key=key, fingerprint=int(meta["fingerprint"]))


class ExampleOrder:
    """Which examples make global batch s: a function of (seed, s) alone, whatever the split.

    Each epoch is a seeded permutation of the examples (every example once per epoch), cut into
    pools of BUCKET_BATCHES global batches; within a pool the examples are sorted by length and the
    batches they form are shuffled. Batches hold examples of similar lengths, so micro batches pad
    little (as mlx-lm's length-sorted batching does), while the order stays random from epoch to
    epoch. Global batch s is examples [(s-1)*B, s*B) of that stream."""

    BUCKET_BATCHES = 16

    def __init__(self, count: int, global_batch: int, seed: int, lengths: np.ndarray | None = None):
        self.count, self.global_batch, self.seed = count, global_batch, seed
        self.lengths = lengths
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.count)
            if self.lengths is not None:
                pool = self.global_batch * self.BUCKET_BATCHES
                parts = []
                for first in range(0, self.count, pool):
                    chunk = perm[first : first + pool]
                    chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
                    batches = [chunk[i : i + self.global_batch] for i in range(0, len(chunk), self.global_batch)]
                    parts += [batches[i] for i in rng.permutation(len(batches))]
                perm = np.concatenate(parts)
            self._order, self._epoch = perm, epoch
        return self._order

    def indices(self, step: int, start: int, count: int) -> list[int]:
        """Examples [start, start + count) of global batch `step` (1-based)."""
        first = (step - 1) * self.global_batch + start
        out = []
        for i in range(first, first + count):
            epoch, pos = divmod(i, self.count)
            out.append(int(self._epoch_order(epoch)[pos]))
        return out

    def position(self, step: int) -> dict[str, int]:
        """Where global batch `step` starts: recorded in checkpoints for the reader."""
        index = (step - 1) * self.global_batch
        return {"epoch": index // self.count, "index": index % self.count}


class BatchSampler:
    """Windows of `context + 1` tokens; global batch s is fixed by (seed, s): the windows are the
    examples of an `ExampleOrder` (a seeded permutation per epoch)."""

    def __init__(self, tokens: np.ndarray, context: int, global_batch: int, seed: int, what: str = "train"):
        self.tokens, self.context = tokens, context
        windows = (len(tokens) - 1) // context
        if windows < 1:
            raise DataError(
                f"the {what} split has {len(tokens)} tokens, fewer than one sequence of context + 1 = {context + 1}; "
                "add data, lower model.context, or change data.val_fraction"
            )
        self.order = ExampleOrder(windows, global_batch, seed)

    def position(self, step: int) -> dict[str, int]:
        return self.order.position(step)

    def sequences(self, step: int, start: int, count: int) -> np.ndarray:
        """Sequences [start, start + count) of global batch `step` (1-based), shape (count, context + 1)."""
        c = self.context
        return np.stack([self.tokens[w * c : w * c + c + 1] for w in self.order.indices(step, start, count)]).astype(np.int32, copy=False)


def eval_windows(tokens: np.ndarray, context: int, count: int, seed: int) -> np.ndarray:
    """A fixed set of held-out windows (the same at every evaluation), shape (count, context + 1)."""
    windows = (len(tokens) - 1) // context
    if windows < 1:
        raise DataError(
            f"the validation split has {len(tokens)} tokens, fewer than one sequence of context + 1 = {context + 1}; "
            "raise data.val_fraction or add data"
        )
    picks = np.random.default_rng([seed, 0xE7A1]).choice(windows, size=count, replace=count > windows)
    return np.stack([tokens[w * context : w * context + context + 1] for w in picks]).astype(np.int32)


def split_shares(shares: list[int], start: int = 0) -> list[tuple[int, int]]:
    """Contiguous (offset, count) slices of a batch for each rank, in rank order."""
    out, offset = [], start
    for s in shares:
        out.append((offset, s))
        offset += s
    return out


def micro_batches(count: int, micro: int) -> list[tuple[int, int]]:
    """(offset, size) chunks of at most `micro` sequences covering `count`."""
    return [(o, min(micro, count - o)) for o in range(0, count, micro)]
