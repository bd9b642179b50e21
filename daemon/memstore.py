"""Where a dpd's trainers keep their state in memory (`trainer/memstate.py`), and its clean-up.

One folder per job and slot, `ROOT/JOB/slot-K/checkpoints/step-N/`, handed to the trainer in
`DPOOL_MEMORY_DIR`. ROOT is on a RAM file system where the machine has one the user may write
(Linux: `/dev/shm/dpool-UID-HASH`, HASH naming the state dir, so two dpds never share it:
protocol/checkpoints.memory_root), else
`STATE/memory` (macOS: written without fsync, it stays in the page cache). It outlives the trainers
and the dpd (a restarted dpd offers what it finds as holdings), not the machine.

The dpd deletes a job's folders once the job finished on this node, when it is removed, and when
no worker of it has run here for `IDLE_S` (a cancelled job, or one that moved to other machines:
the state in memory is worth its RAM only for a restart soon). Job ids are checked before they
become paths (`valid_job_id`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from dpool.protocol.checkpoints import newest_step, valid_job_id

IDLE_S = 600.0


class MemoryStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.last_used: dict[str, float] = {}  # job -> monotonic time a worker of it last ran here

    def prepare(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # this user's alone, as the state dir

    def close(self) -> None:
        """The dpd is stopping: an empty root goes (nothing in it to offer after a restart, which
        makes it again); one that holds state stays for the next dpd on this state dir."""
        with contextlib.suppress(OSError):
            self.root.rmdir()

    def folder(self, job: str, slot: int) -> Path:
        assert valid_job_id(job), job
        return self.root / job / f"slot-{slot}"

    def used(self, job: str, now: float) -> None:
        self.last_used[job] = now

    def holdings(self) -> list[tuple[str, int, int]]:
        """(job, slot, newest step kept) of every folder here."""
        out: list[tuple[str, int, int]] = []
        if not self.root.is_dir():
            return out
        for job_dir in sorted(self.root.iterdir()):
            if not valid_job_id(job_dir.name):
                continue
            for slot_dir in sorted(job_dir.glob("slot-*")):
                slot = slot_dir.name.split("-", 1)[1]
                step = newest_step(slot_dir)
                if slot.isdigit() and step is not None:
                    out.append((job_dir.name, int(slot), step))
        return out

    def remove(self, job: str, slot: int | None = None) -> None:
        """Forget what is kept of `job` (on `slot` only, or on all)."""
        if not valid_job_id(job):
            return
        target = self.root / job if slot is None else self.folder(job, slot)
        shutil.rmtree(target, ignore_errors=True)
        if slot is None:
            self.last_used.pop(job, None)
        else:
            with contextlib.suppress(OSError):
                (self.root / job).rmdir()  # the job's last slot here

    def sweep(self, now: float, running: set[str]) -> list[str]:
        """Delete what no worker has used for IDLE_S (jobs this dpd has not seen since its start:
        IDLE_S after it). Returns the jobs removed."""
        gone: list[str] = []
        if not self.root.is_dir():
            return gone
        for job_dir in self.root.iterdir():
            job = job_dir.name
            if job in running:
                self.last_used[job] = now
                continue
            since = self.last_used.setdefault(job, now)
            if now - since >= IDLE_S:
                self.remove(job)
                gone.append(job)
        return gone
