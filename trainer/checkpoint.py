"""Checkpoints: one self-describing bundle per step, written off the step path, verified on load.

    checkpoints/step-N/model.safetensors      what is trained (all weights of the GPT or of a full
                                              fine-tune; the adapters of LoRA/DoRA: never a frozen
                                              base), in the model's own dtypes (bf16 stays bf16)
    checkpoints/step-N/optimizer.safetensors  the optimizer's state (step count, moments, whatever its tree): weights alone diverge
    checkpoints/step-N/manifest.json          step, job hash, world size, RNG and data position,
                                              file sizes and sha256; written last

The main thread copies the arrays to host memory (cheap, and the arrays it copies are immutable);
a writer thread writes them to `.tmp-step-N-PID/`, fsyncs, renames the folder into place, fsyncs
the parent, and prunes to the newest `keep`. A checkpoint exists only once its manifest does; one
whose files do not match their checksums is skipped in favour of the one before it.

What a fault may not cost:
- A write that fails (a full disk) removes its `.tmp-` folder and leaves every earlier checkpoint
  as it was; the trainer then exits with the reason (`CheckpointWriteError`), and the group
  restarts from the newest checkpoint.
- Re-saving a step renames the old copy aside (`.old-step-N-PID/`), renames the new one into place,
  and only then deletes the old one; a crash in between leaves the old copy, put back at resume.
- Pruning keeps the step just written and the `keep - 1` before it, and never touches a step above
  it; at resume, the checkpoints above the resume step (a timeline that was not resumed, damaged
  or not) are dropped first (`drop_above`), so they can neither outrank nor outlive new ones.
  One whose manifest cannot be read is moved aside whole (`checkpoints/damaged/`), not deleted:
  its files may be all there.
- A run dir whose checkpoints are all damaged is not started again from step 0 by hand: the
  trainer refuses, naming each and why (restore.py); nothing is deleted.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import queue
import re
import shutil
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dpool.protocol.checkpoints import (
    FORMAT_VERSION,
    MANIFEST,
    STEP_DIR_RE,
    checkpoint_root,
    listed_steps,
    read_manifest,
    step_dir,
)

OLD_DIR_RE = re.compile(r"^\.old-step-(\d+)-\d+$")
REQUIRED_FILES = frozenset({"model.safetensors", "optimizer.safetensors"})  # what load_arrays reads
DAMAGED_DIR = "damaged"  # checkpoints set aside whole (set_aside), never resumed, pruned or deleted

_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (damaged, or of another job)."""


class CheckpointMismatch(CheckpointError):
    """The run dir holds checkpoints of a different job file: refusing to mix them."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk): the rank fails with this reason (exit
    EXIT_DISK, blamed on its node), and the pool restarts the group from the newest checkpoint
    that was written."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Host copies of everything a resume needs, taken between steps."""

    step: int
    model: dict[str, tuple[np.ndarray, str]]  # name -> (host copy, safetensors dtype)
    optimizer: dict[str, tuple[np.ndarray, str]]
    manifest: dict[str, Any]


def run_manifest(spec: Any, job_hash: str, world: int, shares: list[int], generation: int, task: Any, step: int, **extra: Any) -> dict[str, Any]:
    """A checkpoint's manifest: the job, the group that wrote it and where the data stands after
    `step` (`extra`: what a mode adds, e.g. diloco's "mode")."""
    return {
        "job": spec.name, "job_hash": job_hash, "world_size": world, "shares": shares, "generation": generation,
        "kind": spec.model.kind, **extra,
        "rng": {"seed": spec.train.seed, "scheme": "stateless: batches, dropout and samples from (seed, step)"},
        "data_position": task.data_position(step + 1), "fingerprints": dict(task.fingerprints),  # what it trained on
        "mlx_version": mx.__version__, "time": time.time(),
    }


def to_host(flat: list[tuple[str, mx.array]]) -> dict[str, tuple[np.ndarray, str]]:
    """Host copies with their safetensors dtype; bfloat16, which numpy lacks, travels as its bits."""
    out = {}
    for k, v in flat:
        if v.dtype == mx.bfloat16:
            out[k] = (np.array(v.view(mx.uint16), copy=True), "BF16")
        else:
            a = np.array(v, copy=True)
            out[k] = (a, _ST_DTYPES[a.dtype])
    return out


def host_views(flat: list[tuple[str, mx.array]]) -> dict[str, tuple[np.ndarray, str]]:
    """As `to_host`, without the copy: numpy views of the (evaluated, immutable) arrays, which they
    keep alive, and so out of MLX's reach to reuse, until the views are dropped. For the state kept
    in memory after every step, where a copy on the step path would cost more than the write."""
    bf16 = {k: v.view(mx.uint16) for k, v in flat if v.dtype == mx.bfloat16}
    if bf16:
        mx.eval(list(bf16.values()))
    out = {}
    for k, v in flat:
        a = np.asarray(bf16.get(k, v))
        out[k] = (a, "BF16" if k in bf16 else _ST_DTYPES[a.dtype])
    return out


def _write_safetensors(path: Path, arrays: dict[str, tuple[np.ndarray, str]], durable: bool = True) -> tuple[int, str | None]:
    """Write the safetensors format (8-byte header size, JSON header, raw little-endian data);
    `durable`: with its sha256, fsynced (a copy in memory is neither: it never outlives the
    machine, and it is read back by the machine that wrote it)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (a, dtype) in arrays.items():
        n = a.nbytes
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256() if durable else None
    # Not durable: a file left by an earlier copy is overwritten in place (`_reuse_oldest`).
    with open(path, "r+b" if not durable and path.is_file() else "wb") as f:
        for chunk in (struct.pack("<Q", len(raw)), raw, *(memoryview(np.ascontiguousarray(a)).cast("B") for a, _ in arrays.values())):
            f.write(chunk)
            if h is not None:
                h.update(chunk)
        f.truncate()
        if durable:
            f.flush()
            os.fsync(f.fileno())
    return path.stat().st_size, h.hexdigest() if h is not None else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(run_dir: Path, snap: Snapshot, keep: int, durable: bool = True) -> tuple[Path, list[str]]:
    """Write one checkpoint atomically and prune; returns its folder and any pruning problems.
    Raises OSError with nothing changed but a `.tmp-` folder removed again. Not `durable` (the
    state kept in memory): no checksums and no fsync; the manifest, written last, says so."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(run_dir, snap.step)
    tmp = root / f".tmp-step-{snap.step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if durable or not _reuse_oldest(run_dir, keep, snap.step, tmp):
            tmp.mkdir()
        files = {}
        for name, arrays in (("model.safetensors", snap.model), ("optimizer.safetensors", snap.optimizer)):
            size, digest = _write_safetensors(tmp / name, arrays, durable)
            files[name] = {"bytes": size, "sha256": digest}
        manifest = {**snap.manifest, "format": FORMAT_VERSION, "step": snap.step, "files": files}
        if not durable:
            manifest["memory"] = True
        with open(tmp / MANIFEST, "wb") as f:
            f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if durable:
            _fsync_dir(tmp)
        _move_into_place(tmp, final, durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        _fsync_dir(root)
    return final, prune(run_dir, keep, newest=snap.step)


def _reuse_oldest(run_dir: Path, keep: int, step: int, tmp: Path) -> bool:
    """The state kept in memory: the folder that pruning would delete after this write becomes
    this write's `.tmp-` folder (its manifest first removed), and its files are overwritten in
    place. In a RAM file system that halves a write's cost: the pages are already there."""
    steps = [s for s in listed_steps(run_dir) if s < step]
    if len(steps) < max(keep, 1):
        return False
    folder = step_dir(run_dir, steps[-1])  # the oldest
    try:
        (folder / MANIFEST).unlink(missing_ok=True)
        os.rename(folder, tmp)
    except OSError:
        return False
    return True


def _move_into_place(tmp: Path, final: Path, durable: bool = True) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is renamed aside
    first and deleted only once the new one is in place, or put back when that rename fails.
    Ranks that share a run dir (one machine, `--run-dir` without `{rank}`) write the same state: a
    `final` that another one put in place between the check and the rename stands, and this copy
    goes."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if not final.exists() or not _aside(final, old):  # (a sharing rank's prune may remove it meanwhile)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if not _stands(e, final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        os.rename(tmp, final)
    except OSError as e:
        if not _stands(e, final):
            os.rename(old, final)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        os.rename(old, final)
        raise
    if durable:
        _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)  # the new copy is in place: what is left, clean_partial takes


def _stands(e: OSError, final: Path) -> bool:
    """A rename onto `final` failed because another writer's complete copy is there now."""
    return e.errno in (errno.ENOTEMPTY, errno.EEXIST) and (final / MANIFEST).is_file()


def _aside(final: Path, old: Path) -> bool:
    """Rename an existing checkpoint folder aside; False if it is gone already."""
    shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(final, old)
    except FileNotFoundError:
        return False
    return True


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder, its manifest first: cut short, it is no checkpoint at all."""
    (folder / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(folder)


def prune(run_dir: Path, keep: int, newest: int | None = None) -> list[str]:
    """Delete all but the newest `keep` (at least 1) checkpoints at or below `newest` (default:
    all of them), so the one just written is never deleted; steps above `newest` are left to the
    next resume (`drop_above`). One failed deletion does not stop the others."""
    problems = []
    steps = [s for s in listed_steps(run_dir) if newest is None or s <= newest]
    for step in steps[max(keep, 1):]:
        try:
            _remove(step_dir(run_dir, step))
        except OSError as e:
            problems.append(f"step-{step}: {e}")
    return problems


def drop_above(run_dir: Path, step: int, job_hash: str) -> tuple[list[int], list[Path]]:
    """At resume from `step`: delete this job's checkpoints above it, and move those whose manifest
    cannot be read, or names no job or no files, aside (`set_aside`: their files may be whole, and
    are not this code's to judge lost); another job's are left for `verify` to refuse. Returns the steps dropped and where the
    set-aside ones went."""
    dropped: list[int] = []
    moved: list[Path] = []
    for s in listed_steps(run_dir):
        if s <= step:
            break
        manifest = read_manifest(run_dir, s)
        try:
            if manifest is None or not isinstance(manifest.get("job_hash"), str) or _files_problem(manifest.get("files")):
                moved.append(set_aside(run_dir, s))
            elif manifest["job_hash"] == job_hash:
                _remove(step_dir(run_dir, s))
                dropped.append(s)
        except OSError:
            pass  # left for the next resume; pruning never reaches above the newest step written
    return dropped, moved


def set_aside(run_dir: Path, step: int) -> Path:
    """Move checkpoint `step` out of the way, whole, to `checkpoints/damaged/step-N-TIME` (no
    longer listed, resumed, pruned or exported): where it went."""
    target = checkpoint_root(run_dir) / DAMAGED_DIR / f"step-{step}-{time.time_ns()}"
    target.parent.mkdir(exist_ok=True)
    os.rename(step_dir(run_dir, step), target)
    return target


def clean_partial(run_dir: Path) -> None:
    """Remove what writes that never finished left (a crash mid-checkpoint): `.tmp-` folders, and
    step folders without a manifest; a re-save cut between its renames gets its old copy back."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        old = OLD_DIR_RE.match(entry.name)
        if entry.name.startswith(".tmp-step-"):
            shutil.rmtree(entry, ignore_errors=True)
        elif old is not None:
            final = step_dir(run_dir, int(old.group(1)))
            try:
                if not (final / MANIFEST).is_file() and (entry / MANIFEST).is_file():
                    shutil.rmtree(final, ignore_errors=True)
                    os.rename(entry, final)
                else:
                    shutil.rmtree(entry)
            except OSError:
                continue
        elif STEP_DIR_RE.match(entry.name) and entry.is_dir() and not (entry / MANIFEST).is_file():
            shutil.rmtree(entry, ignore_errors=True)


def verify(run_dir: Path, step: int, job_hash: str) -> dict[str, Any]:
    """The manifest of a checkpoint whose files match it; raises CheckpointError otherwise."""
    folder = step_dir(run_dir, step)
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("step") != step:
        raise CheckpointError(f"{folder}: the manifest is not that of step {step}")
    problem = _files_problem(manifest.get("files"))
    if problem is not None:
        raise CheckpointError(f"{folder}: the manifest's files: {problem}")
    if not isinstance(manifest.get("job_hash"), str):
        raise CheckpointError(f"{folder}: the manifest names no job (job_hash)")
    if manifest.get("job_hash") != job_hash:
        raise CheckpointMismatch(
            f"{folder} belongs to another job file (job hash {manifest.get('job_hash')}, this job {job_hash}); "
            "use a new --run-dir, or the job file that wrote it"
        )
    for name, want in manifest["files"].items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: missing") from None
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, manifest says {want['bytes']} (truncated?)")
        if want.get("sha256") is None:
            if manifest.get("memory") is True:
                continue  # the state kept in memory: complete once its manifest exists, sizes checked
            raise CheckpointError(f"{path}: the manifest has no checksum for it")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != want["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch")
    return manifest


def _files_problem(files: Any) -> str | None:
    """What is wrong with a manifest's `files` (each file's bytes and sha256, the model's and the
    optimizer's among them), or None."""
    if not isinstance(files, dict):
        return f"expected a table of file names, got {type(files).__name__}"
    missing = sorted(REQUIRED_FILES - files.keys())
    if missing:
        return f"{', '.join(missing)} not listed"
    for name, want in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return f"{name!r} is not a file name"
        if not isinstance(want, dict) or type(want.get("bytes")) is not int or want["bytes"] < 0:
            return f"{name}: expected its bytes (an integer) and sha256"
        if not (want.get("sha256") is None or isinstance(want["sha256"], str)):
            return f"{name}: sha256 is not a string"
    return None


def newest_valid(
    run_dir: Path, job_hash: str, log, at_most: int | None = None, skipped: list[str] | None = None,
) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint (at or below `at_most`) that verifies; damaged ones are reported (and
    added to `skipped`, why) and skipped, other jobs' refused."""
    for step in listed_steps(run_dir):
        if at_most is not None and step > at_most:
            continue
        try:
            return step, verify(run_dir, step, job_hash)
        except CheckpointMismatch:
            raise
        except CheckpointError as e:
            log.warning("checkpoint.skipped", step=step, reason=str(e))
            if skipped is not None:
                skipped.append(str(e))
    return None


def load_arrays(run_dir: Path, step: int) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    folder = step_dir(run_dir, step)
    return mx.load(str(folder / "model.safetensors")), mx.load(str(folder / "optimizer.safetensors"))


def check_trained(weights: dict[str, mx.array], model, run_dir: Path, step: int) -> None:
    """A checkpoint's weights must be exactly what the model trains, name, shape and dtype:
    loading them non-strictly (a frozen base stays as loaded) must not skip or misplace one."""
    want = {k: v for k, v in tree_flatten(model.trainable_parameters())}
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    wrong = [k for k in want if k in weights and (weights[k].shape != want[k].shape or weights[k].dtype != want[k].dtype)]
    if missing or extra or wrong:
        raise CheckpointError(
            f"{step_dir(run_dir, step)}: does not fit the model it is loaded into "
            f"(missing {missing[:3]}, unexpected {extra[:3]}, other shape or dtype {wrong[:3]})"
        )


class CheckpointWriter:
    """One background thread that writes snapshots in order; results are collected by the loop."""

    def __init__(self, run_dir: Path, keep: int, durable: bool = True):
        self.run_dir, self.keep, self.durable = run_dir, keep, durable
        self.cpu_s: dict[int, float] = {}  # step -> the writer thread's CPU time for it (its cost to a busy machine)
        self._todo: collections.deque[Snapshot] = collections.deque()
        self._closing = False
        self._wake = threading.Condition()
        self._done: queue.Queue[tuple[int, float, str | None, list[str]]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot, replace_waiting: bool = False) -> None:
        """Queue `snap`; with `replace_waiting`, it takes the place of those not yet started (a
        newer state makes them worthless), so at most one waits behind the write in progress."""
        with self._wake:
            if replace_waiting:
                self._todo.clear()
            self._todo.append(snap)
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._todo and not self._closing:
                    self._wake.wait()
                if not self._todo:
                    return
                snap = self._todo.popleft()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                _, problems = write_checkpoint(self.run_dir, snap, self.keep, self.durable)
                self.cpu_s[snap.step] = time.thread_time() - c0
                self._done.put((snap.step, time.perf_counter() - t0, None, problems))
            except Exception as e:  # a full disk: reported (the trainer exits with it), the older ones kept
                self._done.put((snap.step, time.perf_counter() - t0, str(e) or type(e).__name__, []))

    def completed(self) -> list[tuple[int, float, str | None, list[str]]]:
        """(step, seconds, error, pruning problems) of writes finished since the last call."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def _stop(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()

    def finish(self, timeout_s: float) -> None:
        """Let the writes already submitted land, waiting at most `timeout_s` (a failing rank's
        last act; their results are not collected)."""
        self._stop()
        self._thread.join(timeout_s)

    def close(self) -> list[tuple[int, float, str | None, list[str]]]:
        """Finish every pending write (a checkpoint that was promised must land before exit)."""
        self._stop()
        self._thread.join()
        return self.completed()
