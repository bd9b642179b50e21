"""A node's half of `dpctl export`: make an export with the trainer, then serve its files in chunks.

The daemon never reads a checkpoint itself (it does not import MLX or the trainer): for
`export.prepare` it runs `python -m dpool.trainer JOB.toml --run-dir RUN_DIR --export OUT --step N`
as a child process, with the job file it wrote when the job started here and the run dir of one of
its slots that holds step N, into `<state>/exports/<export_id>/out`. The child runs with a timeout
and without blocking the daemon's loop (heartbeats and training reports go on); the files' sha256
are computed in a thread. Then `export.fetch` reads slices of those files, found by name in the
table made when the export was prepared (a name from the wire is never joined to a path).

An export's folder is deleted on `export.release`, when it has been idle for `idle_s` (a client or
coordinator that went away), when its preparation fails or times out, and, for anything a previous
daemon process left, when the daemon starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpool.daemon.childenv import die_with_parent, trainer_command, trainer_env
from dpool.daemon.children import clean, last_error_in
from dpool.protocol import messages as m
from dpool.protocol.checkpoints import listed_steps
from dpool.protocol.messages import ErrorCode
from dpool.protocol.payloads import ExportFile

EXPORT_TIMEOUT_S = 600.0  # the trainer's --export: loading a checkpoint of several GB and writing it again
IDLE_S = 900.0  # an export nobody read for this long is deleted (the coordinator gives up sooner)
MAX_EXPORTS = 8  # prepared or being prepared at once on this node
MAX_FILES = 1000
ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JOB_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,127}$")
HASH_BLOCK = 1 << 20
# The job as submitted, beside the job.toml a node's trainers run (whose paths may be this node's
# staged copies): an export says where the model came from as the user named it.
SUBMITTED_JOB = "submitted.toml"


class ExportError(Exception):
    """Why an export request cannot be served; `code` goes into the `error` reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(slots=True)
class Prepared:
    export_id: str
    folder: Path  # <state>/exports/<export_id>
    step: int
    files: dict[str, tuple[Path, int]]  # name -> (path, bytes)
    last_used: float


class Exporter:
    def __init__(self, state_dir: Path, node: str, *, timeout_s: float = EXPORT_TIMEOUT_S, idle_s: float = IDLE_S) -> None:
        self.root = state_dir / "exports"
        self.jobs = state_dir / "jobs"
        self.node, self.timeout_s, self.idle_s = node, timeout_s, idle_s
        self.ready: dict[str, Prepared] = {}
        self.preparing: set[str] = set()

    def clear_stale(self) -> int:
        """Delete what a previous daemon process left under exports/ (nobody can read it now)."""
        if not self.root.is_dir():
            return 0
        n = 0
        for entry in self.root.iterdir():
            shutil.rmtree(entry, ignore_errors=True)
            n += 1
        return n

    # -- prepare -------------------------------------------------------------------------------

    async def prepare(self, msg: m.ExportPrepare) -> m.NodeExportReady:
        """Run the trainer's export; raises ExportError. Cancelling it kills the trainer."""
        if not ID_RE.match(msg.export_id):
            raise ExportError(ErrorCode.BAD_REQUEST, f"export id {msg.export_id[:80]!r} is not a valid id")
        if msg.export_id in self.ready or msg.export_id in self.preparing:
            raise ExportError(ErrorCode.BAD_REQUEST, f"export {msg.export_id} already exists on node {self.node}")
        if len(self.ready) + len(self.preparing) >= MAX_EXPORTS:
            raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node} already has {MAX_EXPORTS} exports open; try again later")
        if msg.step is not None and msg.step < 0:
            raise ExportError(ErrorCode.BAD_REQUEST, f"step {msg.step}: must be >= 0")
        run_dir, step = self._run_dir(msg.job, msg.step)
        job_file = self.jobs / msg.job / "job.toml"
        if not job_file.is_file():
            raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: the job file of {msg.job} is missing ({job_file})")
        folder = self.root / msg.export_id
        self.preparing.add(msg.export_id)
        ok = False
        try:
            folder.mkdir(parents=True)
            out = folder / "out"
            flags = ["--fuse"] * bool(msg.fuse) + ["--dequantize"] * bool(msg.dequantize)
            await self._run_trainer(job_file, run_dir, out, step, folder / "trainer.log", flags, test=bool(msg.test))
            await asyncio.to_thread(as_submitted, out, job_file.parent / SUBMITTED_JOB)
            files = await asyncio.to_thread(_manifest, out)
            if not files:
                raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: the trainer's export of step {step} wrote no files")
            self.ready[msg.export_id] = Prepared(msg.export_id, folder, step, {f["name"]: (out / f["name"], f["bytes"]) for f in files}, time.monotonic())
            ok = True
            return m.NodeExportReady(export_id=msg.export_id, step=step, files=[ExportFile(**f) for f in files])
        except OSError as e:
            raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: {e}") from None
        finally:
            self.preparing.discard(msg.export_id)
            if not ok:
                _remove(folder, wait=False)

    def _run_dir(self, job: str, step: int | None) -> tuple[Path, int]:
        """The run dir of one of this node's slots that holds `step` (None: the newest it holds)."""
        if not JOB_RE.match(job):
            raise ExportError(ErrorCode.BAD_REQUEST, f"job {job[:80]!r} is not a valid job id")
        best: tuple[int, Path] | None = None
        held: set[int] = set()
        for run_dir in sorted((self.jobs / job).glob("slot-*")):
            steps = listed_steps(run_dir)
            held.update(steps)
            if step is not None and step in steps:
                return run_dir, step
            if step is None and steps and (best is None or steps[0] > best[0]):
                best = (steps[0], run_dir)
        if best is not None:
            return best[1], best[0]
        what = f"step {step} of job {job}" if step is not None else f"a checkpoint of job {job}"
        has = f" (it holds step{'s' if len(held) > 1 else ''} {', '.join(map(str, sorted(held)))})" if held else ""
        raise ExportError(ErrorCode.NOT_FOUND, f"node {self.node} holds no {what}{has}")

    async def _run_trainer(self, job_file: Path, run_dir: Path, out: Path, step: int, log_path: Path, flags: list[str], test: bool = False) -> None:
        what = "--test" if test else "--export"  # --test: the checkpoint's test loss, as OUT/test.json
        cmd = trainer_command(str(job_file), "--run-dir", str(run_dir), what, str(out), "--step", str(step), *flags)
        with open(log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=trainer_env(),
                cwd=str(run_dir),
                start_new_session=True,  # its own process group: a timeout kills its children too
                preexec_fn=die_with_parent(os.getpid()),
            )
        try:
            code = await asyncio.wait_for(proc.wait(), self.timeout_s)
        except TimeoutError:
            raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: the trainer's export of step {step} did not finish within {self.timeout_s:g}s") from None
        finally:
            if proc.returncode is None:  # timed out, or the daemon is stopping
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if code == 0:
            return
        output = await asyncio.to_thread(_tail, log_path)
        message = last_error_in(output, str(job_file))
        if code == 2:
            # The trainer refused its input (no such checkpoint, a path missing on this machine).
            raise ExportError(ErrorCode.BAD_REQUEST, f"node {self.node}: {message or 'the trainer refused the export (exit code 2)'}")
        last = message or clean(output.decode("utf-8", "replace").strip().splitlines()[-1] if output.strip() else "")
        raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: the trainer's export of step {step} failed (exit code {code})" + (f": {last}" if last else ""))

    # -- fetch ---------------------------------------------------------------------------------

    async def fetch(self, msg: m.ExportFetch) -> m.NodeExportData:
        """Exactly min(size, file size - offset) bytes; raises ExportError."""
        prep = self.ready.get(msg.export_id)
        if prep is None:
            raise ExportError(ErrorCode.NOT_FOUND, f"no export {msg.export_id[:80]!r} on node {self.node} (finished, expired, or never made)")
        entry = prep.files.get(msg.name)
        if entry is None:
            raise ExportError(ErrorCode.NOT_FOUND, f"export {msg.export_id} has no file {msg.name[:200]!r}")
        path, size = entry
        if not 0 <= msg.offset <= size:
            raise ExportError(ErrorCode.BAD_REQUEST, f"{msg.name}: offset {msg.offset} is outside the file (0..{size})")
        if not 0 < msg.size <= m.EXPORT_CHUNK_MAX:
            raise ExportError(ErrorCode.BAD_REQUEST, f"size {msg.size}: must be 1..{m.EXPORT_CHUNK_MAX}")
        prep.last_used = time.monotonic()
        want = min(msg.size, size - msg.offset)
        try:
            data = await asyncio.to_thread(_read_at, path, msg.offset, want)
        except OSError as e:
            raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: {msg.name}: {e}") from None
        if len(data) != want:
            raise ExportError(ErrorCode.EXPORT_FAILED, f"node {self.node}: {msg.name} changed while it was being read")
        prep.last_used = time.monotonic()
        return m.NodeExportData(export_id=msg.export_id, name=msg.name, offset=msg.offset, data=data)

    # -- clean-up ------------------------------------------------------------------------------

    def release(self, export_id: str, wait: bool = False) -> bool:
        """Forget an export and delete its files: in a thread unless `wait` (unlinking a file of
        several GB can take a while, and the daemon's loop must keep heartbeating)."""
        prep = self.ready.pop(export_id, None)
        if prep is None:
            return False
        _remove(prep.folder, wait)
        return True

    def expire(self, now: float) -> list[str]:
        """Delete exports idle for idle_s (monotonic clock); returns their ids."""
        gone = [e for e, p in self.ready.items() if now - p.last_used > self.idle_s]
        for export_id in gone:
            self.release(export_id)
        return gone

    def close(self) -> None:
        for export_id in list(self.ready):
            self.release(export_id, wait=True)


def as_submitted(out: Path, submitted: Path) -> None:
    """An adapter directory's `model` as the job named it, not this node's staged copy of it (a
    cache folder that means nothing on the machine the adapters are exported to)."""
    config = out / "adapter_config.json"
    if not (config.is_file() and submitted.is_file()):
        return
    try:
        given = tomllib.loads(submitted.read_text()).get("model", {}).get("path")
        body = json.loads(config.read_text())
    except (OSError, ValueError, AttributeError):
        return  # the trainer's own file stands
    if isinstance(given, str) and isinstance(body, dict) and body.get("model") != given:
        config.write_text(json.dumps({**body, "model": given}, indent=4) + "\n")


def _manifest(out: Path) -> list[dict[str, Any]]:
    """[{name, bytes, sha256}] of every regular file under `out`, names relative with "/"."""
    if not out.is_dir():
        return []
    files: list[dict[str, Any]] = []
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames.sort()
        for fn in sorted(filenames):
            path = Path(dirpath) / fn
            if not path.is_file():
                continue  # a socket, a dangling link: not part of a model
            if len(files) >= MAX_FILES:
                raise ExportError(ErrorCode.EXPORT_FAILED, f"the export has more than {MAX_FILES} files")
            digest = hashlib.sha256()
            size = 0
            with open(path, "rb") as f:
                while block := f.read(HASH_BLOCK):
                    digest.update(block)
                    size += len(block)
            files.append({"name": path.relative_to(out).as_posix(), "bytes": size, "sha256": digest.hexdigest()})
    return files


def _remove(folder: Path, wait: bool) -> None:
    if wait:
        shutil.rmtree(folder, ignore_errors=True)
    else:  # what a dpd leaves behind if it stops meanwhile, its next start removes (clear_stale)
        threading.Thread(target=shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, daemon=True).start()


def _read_at(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def _tail(path: Path, limit: int = 64 * 1024) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - limit))
        return f.read()
