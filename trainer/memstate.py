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
- Off it: one write per step into memory, by a thread, into the files of the copy it replaces
  (their pages are already there). A step that ends while the previous write still runs queues its
  copy behind it, in the place of any older one still waiting: a slow write never delays a step,
  and the newest completed step is always written or next in line (a failing rank lets both land,
  `finish_writes`).
- The write still takes CPU time from the step on a machine whose cores the ranks fill. So it is
  kept at most `SHARE` of the step time, on average: with writes that take longer than that (a
  large model, small steps), every `k`th step is kept, and a failure recomputes up to `k - 1`
  steps more. `k` is 1 for models whose state writes in under 10% of a step (the trainer logs
  `memory_state.interval` when it changes).
- Memory: the newest two copies (`KEEP`) plus one being written; in the process, the arrays of
  the copy being written and of the one waiting stay alive until written. When three copies of the trained
  state would take more than `BUDGET` of the machine's memory, or more than the folder's free
  space, nothing is kept, and the trainer says so once (recovery then resumes from disk).
"""

from __future__ import annotations

import collections
import math
import os
import shutil
import statistics
import weakref
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from dpool.trainer import checkpoint as ckpt

ENV_DIR = "DPOOL_MEMORY_DIR"
KEEP = 2  # the newest copy and the one before (the newest may be cut short by a kill)
BUDGET = 0.25  # of the machine's memory, for KEEP + 1 copies
SHARE = 0.10  # of a step's time that keeping its state may take, on average (its CPU time, in a thread)
RECENT = 8  # writes and steps whose median times set the interval
FINISH_S = 2.0  # the most a failing rank waits for its last state to land


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
        self.every = 1  # keep every `every`th step
        self.last = 0  # the step kept last
        self.writes: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.steps: collections.deque[float] = collections.deque(maxlen=RECENT)
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
            _LIVE.add(self)

    def _turn_off(self, why: str) -> None:
        self.off = why
        self.log.warning("memory_state.off", reason=why, effect="a failure resumes from the newest checkpoint on disk")

    def offer(self, step: int, model: Any, optimizer: Any, manifest: dict[str, Any], step_s: float = 0.0) -> bool:
        """Keep the state after `step` (which took `step_s`), unless the interval says to skip it;
        True if taken. Behind a write still running, it waits in the place of an older one."""
        if step_s > 0:
            self.steps.append(step_s)
        if self.writer is None or step - self.last < self.every:
            return False
        self.last = step
        self.writer.submit(ckpt.Snapshot(
            step=step,
            model=ckpt.host_views(tree_flatten(model.trainable_parameters())),
            optimizer=ckpt.host_views(tree_flatten(optimizer.state)),
            manifest=manifest,
        ), replace_waiting=True)
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
            self.writes.append(self.writer.cpu_s.pop(step, seconds))  # CPU time: what a busy machine pays
        if out:
            self._retune(out[-1][0])
        return out

    def _retune(self, step: int) -> None:
        if not self.steps or not self.writes:
            return
        write_s, step_s = statistics.median(self.writes), statistics.median(self.steps)
        every = max(1, math.ceil(write_s / (SHARE * step_s)))
        if every != self.every:
            self.every = every
            self.log.info("memory_state.interval", step=step, every_steps=every, write_s=round(write_s, 4), step_s=round(step_s, 4))

    def close(self) -> list[tuple[int, float]]:
        """Finish the write in progress (a stopped group's survivors keep their last step)."""
        if self.writer is None:
            return []
        done = [(s, t) for s, t, error, _ in self.writer.close() if not error]
        self.writer = None
        return done


_LIVE: weakref.WeakSet[MemoryState] = weakref.WeakSet()  # those whose writer thread runs


def finish_writes(timeout_s: float = FINISH_S) -> None:
    """A failing rank's last act, before it leaves: the state of its last completed step, if it
    is being written, lands (within `timeout_s`), so the restart resumes from that step rather
    than the one before."""
    for kept in list(_LIVE):
        writer, kept.writer = kept.writer, None  # keeps nothing more: the rank is leaving
        _LIVE.discard(kept)
        if writer is not None:
            writer.finish(timeout_s)
