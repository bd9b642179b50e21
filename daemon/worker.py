"""A trainer process as its dpd knows it (a worker of a running generation, or a spare waiting for
one), what it said before its dpd knew it, and the files it is given to read."""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpool.daemon.forkserver import REPLY_TIMEOUT_S, ForkedProcess
from dpool.protocol import messages as m

# A trainer runs from its fork (or exec) on, and the dpd records it only once the start returns
# (a forked one's pid comes back from the zygote on another pipe than the one its reports use), so
# its first reports can be read before its record is made. They are kept this long: the start's own
# deadline (the zygote's reply), twice over; a pid unclaimed by then is not one of ours.
EARLY_S = 2 * REPLY_TIMEOUT_S
EARLY_PIDS = 32  # trainers whose reports are kept before their record, at most (the oldest goes first)
EARLY_MESSAGES = 16  # reports kept per such trainer: its worker.ready or worker.hello, then its first steps


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
    last_step: int | None = None  # the newest of them
    waiting: tuple[int, float] | None = None  # the newest step it said it waits on its peers for (worker.waiting), and since when
    waiting_said: int | None = None  # the step a node.waiting was sent for
    stopped_since: float | None = None  # since when its process is seen stopped (SIGSTOP, job control)

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass(slots=True)
class Early:
    """What one trainer said before its dpd recorded it, in order."""

    pid: int
    peer: bytes  # its connection to the dpd's worker socket
    at: float  # when its first report was read (monotonic)
    messages: list[m.Message] = field(default_factory=list)
    dropped: int = 0  # reports past EARLY_MESSAGES


class EarlyReports:
    """Reports of trainers not yet recorded, kept by pid (`worker.ready` and `worker.hello` name
    theirs; what follows on the same connection joins them) until the record is made (`take`) or
    EARLY_S has passed (`expire`). Bounded: EARLY_PIDS trainers, EARLY_MESSAGES reports each."""

    def __init__(self) -> None:
        self.by_pid: dict[int, Early] = {}
        self.by_peer: dict[bytes, Early] = {}

    def hold(self, pid: int, peer: bytes, msg: m.Message, now: float) -> Early | None:
        """Keep `msg`, the first report naming `pid`; returns what was dropped to make room (the
        oldest trainer's reports), if anything."""
        early = self.by_pid.get(pid)
        if early is None:
            early = self.by_pid[pid] = Early(pid, peer, now)
            self.by_peer[peer] = early
        self._add(early, msg)
        if len(self.by_pid) <= EARLY_PIDS:
            return None
        return self._forget(min(self.by_pid.values(), key=lambda e: e.at).pid)

    def follow(self, peer: bytes, msg: m.Message) -> bool:
        """Keep `msg` if its connection's trainer has reports kept here."""
        early = self.by_peer.get(peer)
        if early is None:
            return False
        self._add(early, msg)
        return True

    def take(self, pid: int) -> Early | None:
        """What `pid` said before its record, now that it exists (or is not wanted)."""
        return self._forget(pid)

    def expire(self, now: float) -> list[Early]:
        """Drop (and return) what waited more than EARLY_S for its record."""
        old = [pid for pid, e in self.by_pid.items() if now - e.at > EARLY_S]
        return [e for pid in old if (e := self._forget(pid)) is not None]

    def _add(self, early: Early, msg: m.Message) -> None:
        if len(early.messages) < EARLY_MESSAGES:
            early.messages.append(msg)
        else:
            early.dropped += 1

    def _forget(self, pid: int) -> Early | None:
        early = self.by_pid.pop(pid, None)
        if early is not None and self.by_peer.get(early.peer) is early:
            del self.by_peer[early.peer]
        return early


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
