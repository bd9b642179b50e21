"""The on-disk checkpoint layout, as a contract between the trainer (which writes it) and the daemon
(which reports what it holds without importing the trainer or MLX).

    RUN_DIR/checkpoints/step-<N>/manifest.json     written last: a checkpoint exists only once it is there
    RUN_DIR/checkpoints/step-<N>/model.safetensors
    RUN_DIR/checkpoints/step-<N>/optimizer.safetensors
    RUN_DIR/checkpoints/.tmp-step-<N>-<pid>/       being written; renamed into place when complete
    RUN_DIR/checkpoints/.old-step-<N>-<pid>/       step N's previous copy while a re-save replaces it

A dpd keeps a rank's run dir at `STATE/jobs/<job id>/slot-<K>`; a job id becomes a path only once it
matches JOB_ID_RE (`<job name>-<6 hex digits>`, as the coordinator makes them): never `..` or `/`.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

import orjson

# A rank that fails because this machine could not write its run dir or a checkpoint (a full disk, a
# read-only or failing filesystem) exits with this code (EX_IOERR) after its `error: ...` line; its
# dpd reports a job folder it cannot write at a group start the same way. The pool blames the node
# (exit 1 is what a rank's peers exit with, and is not blamed), so a full disk sets it aside.
EXIT_DISK = 74

RAM_ROOT = Path("/dev/shm")


def memory_root(state_dir: Path) -> Path:
    """Where the dpd of `state_dir` keeps its trainers' state in memory (daemon/memstore.py): on a
    RAM file system where the machine has one this user may write, named after the state dir, else
    under the state dir. Known here so that a local pool can free it with its state dirs."""
    tag = hashlib.sha256(str(state_dir.absolute()).encode()).hexdigest()[:12]
    if sys.platform.startswith("linux") and RAM_ROOT.is_dir() and os.access(RAM_ROOT, os.W_OK | os.X_OK):
        return RAM_ROOT / f"dpool-{os.getuid()}-{tag}"
    return state_dir / "memory"


STEP_DIR_RE = re.compile(r"^step-(0|[1-9][0-9]*)$")  # as step_dir names them: "step-08" is none
JOB_ID_RE = re.compile(r"[a-z0-9-]{1,63}-[0-9a-f]{6}")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def valid_job_id(job: str) -> bool:
    """Whether `job` is a job id, safe as one path component."""
    return JOB_ID_RE.fullmatch(job) is not None


def checkpoint_root(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return checkpoint_root(run_dir) / f"step-{step}"


def listed_steps(run_dir: str | os.PathLike[str]) -> list[int]:
    """Steps that have a complete-looking checkpoint (a manifest), newest first. Not verified."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = STEP_DIR_RE.match(entry.name)
        if m and (entry / MANIFEST).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps, reverse=True)


def read_manifest(run_dir: str | os.PathLike[str], step: int) -> dict | None:
    """The manifest of one checkpoint, or None when it is missing or unreadable."""
    try:
        data = orjson.loads((step_dir(run_dir, step) / MANIFEST).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def newest_step(run_dir: str | os.PathLike[str], job_hash: str | None = None) -> int | None:
    """The newest step whose manifest is readable (and of `job_hash`, when given). Cheap: no checksums."""
    for step in listed_steps(run_dir):
        manifest = read_manifest(run_dir, step)
        if manifest is not None and (job_hash is None or manifest.get("job_hash") == job_hash):
            return step
    return None
