"""A trainer process as its dpd knows it (a worker of a running generation, or a spare waiting for
one), and the files it is given to read."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpool.daemon.forkserver import ForkedProcess
from dpool.protocol import messages as m


@dataclass(slots=True)
class Worker:
    job: str
    generation: int
    rank: int
    slot: int
    run_dir: Path
    proc: asyncio.subprocess.Process | ForkedProcess
    peer: bytes | None = None
    stopping: bool = False  # the daemon stopped (or is stopping) it
    stop_at_checkpoint: bool = False  # worker.stop is owed once its hello arrives
    lines: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    error: str | None = None  # the last `error: ...` line it printed (the trainer's reason for exit 2)
    warm: bool = False  # a spare: started with --warm, not yet given a rank (generation and rank mean nothing)
    go: m.WorkerGo | None = None  # worker.go owed once it says worker.ready
    idle_since: float | None = None  # a spare: since when no worker of its job runs on this node
    steps: int = 0  # steps it reported
    stopped_since: float | None = None  # since when its process is seen stopped (SIGSTOP, job control)

    @property
    def pid(self) -> int:
        return self.proc.pid


def write_file(path: Path, data: bytes) -> None:
    """`path` holds `data`: left alone when it does already, else written aside and renamed over
    it, so a full disk never leaves a job file cut short."""
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
