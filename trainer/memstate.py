"""The state after every step, kept in memory so that it outlives the trainer process.

MLX cannot rebuild a group inside a running process, so every recovery starts new trainers. What
they resume from decides what a failure costs: the newest checkpoint on disk (written every few
steps, to keep its cost small) loses the steps since; the state of the last completed step loses
none. So after each step every rank hands its weights and optimizer state to a writer thread that
puts them in a folder its dpd gives it (`DPOOL_MEMORY_DIR`: on Linux under /dev/shm, which is RAM;
elsewhere a folder of the dpd's state dir, written without fsync, so it stays in the page cache).
The folder outlives the trainer (a killed one, or the survivors the pool stops to restart the
group) but not the machine; the dpd deletes it when the job ends or is removed.

The format is the checkpoint's (`checkpoints/step-N/`), without checksums or fsync
(`manifest.json` says `"memory": true`), so the resume code reads both alike (`loop._restore`).

What it costs and how that stays small:
- On the step path: numpy views of the arrays (no copy: they are immutable, and the views keep them
  alive until written).
- Off it: one write per step into memory, by a thread. A write still running when the next step
  ends makes that step skip its copy, so a slow write (a large model) never delays a step; the
  kept state is then a few steps old, and a failure recomputes those few.
- Memory: the newest two copies (`KEEP`) plus one being written. When three copies of the trained
  state would take more than `BUDGET` of the machine's memory, or more than the folder's free
  space, nothing is kept, and the trainer says so once (recovery then resumes from disk).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from dpool.trainer import checkpoint as ckpt

ENV_DIR = "DPOOL_MEMORY_DIR"
KEEP = 2  # the newest copy and the one before (the newest may be cut short by a kill)
BUDGET = 0.25  # of the machine's memory, for KEEP + 1 copies


def memory_dir() -> Path | None:
    """Where this trainer keeps its state in memory (None: not kept, e.g. a trainer run by hand)."""
    text = os.environ.get(ENV_DIR, "")
    return Path(text) if text else None


class MemoryState:
    """One rank's kept state: `offer` after each step, `completed` to collect what was written."""

    def __init__(self, root: Path, state_bytes: int, machine_bytes: int, log: Any) -> None:
        self.root, self.log = root, log
        self.writer: ckpt.CheckpointWriter | None = None
        self.off: str | None = None  # why nothing is kept
        need = (KEEP + 1) * state_bytes
        try:
            root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(root).free
        except OSError as e:
            self._turn_off(f"cannot use {root}: {e}")
            return
        if need > BUDGET * machine_bytes:
            self._turn_off(f"{KEEP + 1} copies of the trained state ({need >> 20} MiB) exceed {BUDGET:.0%} of this machine's memory")
        elif need > free:
            self._turn_off(f"{KEEP + 1} copies of the trained state ({need >> 20} MiB) exceed the free space of {root} ({free >> 20} MiB)")
        else:
            self.writer = ckpt.CheckpointWriter(root, KEEP, durable=False)

    def _turn_off(self, why: str) -> None:
        self.off = why
        self.log.warning("memory_state.off", reason=why, effect="a failure resumes from the newest checkpoint on disk")

    def offer(self, step: int, model: Any, optimizer: Any, manifest: dict[str, Any]) -> bool:
        """Keep the state after `step`, unless the previous write is still running; True if taken."""
        if self.writer is None or self.writer.pending:
            return False
        self.writer.submit(ckpt.Snapshot(
            step=step,
            model=ckpt.host_views(tree_flatten(model.trainable_parameters())),
            optimizer=ckpt.host_views(tree_flatten(optimizer.state)),
            manifest=manifest,
        ))
        return True

    def completed(self) -> list[tuple[int, float]]:
        """(step, seconds) of the copies written since the last call. A failed write (the folder
        full) turns keeping off, never fails the rank: the disk checkpoints are still there."""
        if self.writer is None:
            return []
        out = []
        for step, seconds, error, _ in self.writer.completed():
            if error:
                self._turn_off(f"the state after step {step} could not be kept: {error}")
                self.writer.close()
                self.writer = None
                break
            out.append((step, seconds))
        return out

    def close(self) -> list[tuple[int, float]]:
        """Finish the write in progress (a stopped group's survivors keep their last step)."""
        if self.writer is None:
            return []
        done = [(s, t) for s, t, error, _ in self.writer.close() if not error]
        self.writer = None
        return done
