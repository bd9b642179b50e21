"""Balance: faster ranks take bigger shares of the global batch, decided while the job runs.

Every step's all_sum already carries each rank's compute time (the time to produce its gradient
sums, without waiting for peers) and the tokens it trained. Rank 0 turns those into tokens per
second per rank (examples of a language model differ in length: a rank's count of examples says
little about its work), and when
a new split would shorten the step (the slowest rank's time) by enough to matter, announces it in
the next step's all_sum; every rank switches at the same step. Shares never change the math
(gradients are token sums over the whole global batch), only who computes which slice.

Pure functions and a small stateful tracker: no MLX, no I/O.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from dpool.protocol.shares import MIN_GAIN, apportion

SHARES_ENV = "DPOOL_SHARES"  # a fixed split for benchmarks ("12,6,6"), with workers.balance = false
MEMORY_MAX = 16  # a split's record lasts at most this many times Balancer.memory steps


def step_time(shares: list[int], speeds: list[float]) -> float:
    """Predicted step time: the slowest rank's share / its speed. Speeds are tokens per second, so
    this is the step time over the pool's mean tokens per sequence: a constant that cancels in every
    comparison of two splits."""
    return max(s / max(v, 1e-12) for s, v in zip(shares, speeds, strict=True))


@dataclass
class Balancer:
    """Rank 0's view of the ranks' speeds; proposes new shares when they pay off.

    Fast first, then hard to move:
    - The first proposal needs `window` steps of timings (the first step's compile time is one
      outlier the median ignores) and jumps straight to the speed-proportional split.
    - After a change, timings under the old split are dropped, the first step under the new one is
      not learned from (it compiles its shapes), and the next proposal needs `hold` steps.
    - A proposal must shorten the step (the slowest rank's time) by `min_gain` at the median speeds,
      and be faster in all but a quarter of the kept steps one by one: a few slow steps of one
      rank (another process on its machine) must not make shares flap.
    Speeds are work (trained tokens) per second of each rank's own compute, measured before the
    all_sum: a rank that waits for its peers does not look slow.

    Ranks that share cores are not independent: at [11, 7, 6], with ranks 1 and 2 on one core
    and rank 0 alone on another, rank 2 finishes first and rank 1 then has the core to itself, so
    the core's ranks take 13 units where [12, 6, 6] takes 12. The speeds measured at [11, 7, 6]
    predict that (rank 1 measures 7/13 of a core, rank 2 6/12), but the gain is 7.7%: with a 10%
    `min_gain` every neighbour of the best split stayed where it landed (BENCHMARKS.md, "Unlike machines").

    What a split did is remembered, not only what the speeds predict. A rank's speed is not always
    the same at every share: on a core it shares with its dpd and the coordinator, a rank measured
    at 5-8 ms a sequence while it had 12 took 8-9 ms at 14, so the speeds at [12, 6, 6] kept
    proposing [14, 5, 5], and the balancer went there and back every `hold` steps (bench/balance.py
    through dpds, 2026-12-02). So each split left records its measured step (the slowest rank's
    compute over the step's work, median of the kept steps), and for `memory` steps a move back to
    it is made only if it measured `min_gain` faster than the split trained now measures. A split
    left again is remembered twice as long each time (up to `MEMORY_MAX` times `memory`): a split
    the speeds misjudge for good is tried ever more rarely. A lasting change of the machines is not
    held up by this: once the split trained now slows, the one remembered compares better again.
    """

    shares: list[int]
    window: int = 3
    min_gain: float = MIN_GAIN
    hold: int = 8
    memory: int = 40
    _rates: deque[list[float]] = field(default_factory=deque)
    _times: deque[float] = field(default_factory=deque)  # kept steps' slowest compute per unit of work
    _tried: dict[tuple[int, ...], tuple[float, int, int]] = field(default_factory=dict)  # split -> (measured step, step left, steps remembered)
    _skip: int = 0  # steps not to learn from: the first under a new split compiles its new shapes
    _changes: int = 0
    _step: int = 0

    def observe(self, rank_seconds: list[float], rank_work: list[float] | None = None) -> None:
        """One step's compute seconds per rank, and the work each did in them (trained tokens;
        default: its share of sequences, all of one length)."""
        self._step += 1
        if self._skip:
            self._skip -= 1
            return
        work = rank_work if rank_work is not None else self.shares
        self._rates.append([w / max(t, 1e-9) for w, t in zip(work, rank_seconds, strict=True)])
        self._times.append(max(rank_seconds) / max(sum(work), 1e-12))
        while len(self._rates) > max(self.window, self.hold):
            self._rates.popleft()
            self._times.popleft()

    def speeds(self) -> list[float] | None:
        """Median work per second per rank over the kept steps, or None until `window` are kept."""
        if len(self._rates) < self.window:
            return None
        out = []
        for r in range(len(self.shares)):
            rates = sorted(row[r] for row in self._rates)
            out.append(rates[len(rates) // 2])
        return out

    def propose(self) -> list[int] | None:
        speeds = self.speeds()
        needed = self.window if self._changes == 0 else max(self.window, self.hold)
        if speeds is None or len(self._rates) < needed or len(self.shares) == 1:
            return None
        new = apportion(speeds, sum(self.shares))
        if new == self.shares:
            return None
        if step_time(new, speeds) > (1 - self.min_gain) * step_time(self.shares, speeds):
            return None  # not worth it: timing noise must not make shares flap
        faster = sum(step_time(new, row) < step_time(self.shares, row) for row in self._rates)
        if faster < len(self._rates) - len(self._rates) // 4:
            return None  # the median's gain comes from a few steps: wait for steadier evidence
        if self._measured_no_faster(new):
            return None  # trained on lately, and slower than the speeds say: they mislead here
        return new

    def _measured_no_faster(self, split: list[int]) -> bool:
        """Whether `split` was trained lately (within the steps its record lasts) and measured less than `min_gain`
        faster than the current split measures now."""
        tried = self._tried.get(tuple(split))
        if tried is None or self._step - tried[1] > tried[2] or len(self._times) < self.window:
            return False
        return tried[0] > (1 - self.min_gain) * statistics.median(self._times)

    def adopt(self, shares: list[int]) -> None:
        """Shares changed (every rank switched): timings under the old split no longer apply."""
        if len(self._times) >= self.window:
            key = tuple(self.shares)
            before = self._tried.get(key)
            span = self.memory if before is None else min(2 * before[2], MEMORY_MAX * self.memory)
            self._tried[key] = (statistics.median(self._times), self._step, span)
        self.shares = list(shares)
        self._rates.clear()
        self._times.clear()
        self._skip = 1
        self._changes += 1


def fixed_shares(world: int, global_batch: int, env: Mapping[str, str] = os.environ) -> list[int] | None:
    """The split DPOOL_SHARES fixes (a benchmark's fixed-ideal run through the pool, as
    `bench/balance.py` sets it on its dpds), or None: unset, or naming another number of ranks (a
    group that lost a node trains at the split its dpds gave). Read only with workers.balance =
    false; a list that does not split the global batch is an error, not a silent fallback."""
    text = env.get(SHARES_ENV, "").strip()
    if not text:
        return None
    try:
        shares = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{SHARES_ENV}={text!r}: expected comma-separated integers, e.g. 12,6,6") from None
    if len(shares) != world:
        return None
    if any(x < 1 for x in shares) or sum(shares) != global_batch:
        raise ValueError(f"{SHARES_ENV}={text!r}: expected {world} shares of at least 1 adding up to train.global_batch = {global_batch}")
    return shares


# ---------------------------------------------------------------------------------------------
# Memory: micro batches sized to the machine, so a small-memory worker accumulates more, smaller ones.

ACTIVATION_BUDGET = 0.5  # of the memory free once the model is loaded: one micro batch's activations


def machine_memory_bytes() -> int:
    """Physical memory (unified memory on Apple silicon); DPOOL_MEMORY_BYTES overrides it."""
    override = os.environ.get("DPOOL_MEMORY_BYTES")
    if override:
        return int(override)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def micro_from_memory(share: int, bytes_per_example: int, free_bytes: int) -> int:
    """The most examples per micro batch that fit the budget, at least 1, at most `share`.

    `bytes_per_example` is measured (a probe step's peak memory at the widest shape), so the same
    rule serves a 1M-parameter GPT and a quantized 8B model."""
    fit = int(max(free_bytes, 0) * ACTIVATION_BUDGET) // max(bytes_per_example, 1)
    return max(1, min(share, fit))
