"""Which global steps each outer step of a diloco job holds (`[sync] mode = "diloco"`). Pure.

The trainer (trainer/diloco.py) cuts its run so, and the coordinator's progress watch
(daemon/watch.py) expects an outer all_sum where an outer step of `inner_steps` ends. A function of
the job alone, so every group, of any size, cuts the run the same way, and a checkpoint (taken at
the end of an outer step) can be resumed by any of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rounds:
    """The first `warmup` steps are outer steps of one step each (the replicas' AdamW steps averaged
    every step: the curve of H = 1, within 0.02% of synchronous training on bench/comm.py's job;
    DiLoCo starts from a model trained synchronously), then outer steps of `inner` steps."""

    inner: int  # H
    warmup: int = 0  # sync.warmup_steps

    def boundary(self, step: int) -> bool:
        """Whether an outer step ends at `step` (0: the start), so a checkpoint may resume there."""
        return step <= self.warmup or (step - self.warmup) % self.inner == 0

    def index(self, step: int) -> int:
        """The (1-based) outer step that global step `step` belongs to."""
        return step if step <= self.warmup else self.warmup + (step - self.warmup - 1) // self.inner + 1

    def warm(self, step: int) -> bool:
        """Whether `step` is one of the warm-up's steps (an outer step of its own)."""
        return step <= self.warmup

    def ending(self, step: int) -> range:
        """The global steps of the outer step that ends at `step` (a boundary past 0; a run's
        short last outer step ends at its last step, which a caller knows apart)."""
        return range(step, step + 1) if step <= self.warmup else range(step - self.inner + 1, step + 1)

    def after(self, start: int, steps: int) -> list[range]:
        """The global steps of each outer step from `start` (a boundary) to the end; the last may be short."""
        out = [range(s, s + 1) for s in range(start + 1, min(self.warmup, steps) + 1)]
        first = max(start, self.warmup) + 1
        return out + [range(s, min(s + self.inner, steps + 1)) for s in range(first, steps + 1, self.inner)]
