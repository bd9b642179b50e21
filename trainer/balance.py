"""Balance: faster ranks take bigger shares of the global batch, decided while the job runs.

Every step's all_sum already carries each rank's compute time (the time to produce its gradient
sums, without waiting for peers). Rank 0 turns those into sequences per second per rank, and when
a new split would shorten the step (the slowest rank's time) by enough to matter, announces it in
the next step's all_sum; every rank switches at the same step. Shares never change the math
(gradients are token sums over the whole global batch), only who computes which slice.

Pure functions and a small stateful tracker: no MLX, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dpool.protocol.shares import apportion


def step_time(shares: list[int], speeds: list[float]) -> float:
    """Predicted step time: the slowest rank's share / its speed (sequences per second)."""
    return max(s / max(v, 1e-12) for s, v in zip(shares, speeds, strict=True))


@dataclass
class Balancer:
    """Rank 0's view of the ranks' speeds; proposes new shares when they pay off.

    `window` steps of timings are kept per share layout (timings measured under old shares are
    dropped on a change); a proposal needs the predicted step time to drop by `min_gain`.
    """

    shares: list[int]
    window: int = 4
    min_gain: float = 0.10
    _seconds: deque[list[float]] = field(default_factory=deque)

    def observe(self, rank_seconds: list[float]) -> None:
        self._seconds.append(list(rank_seconds))
        while len(self._seconds) > self.window:
            self._seconds.popleft()

    def speeds(self) -> list[float] | None:
        """Median sequences/s per rank over the window, or None until the window is full."""
        if len(self._seconds) < self.window:
            return None
        out = []
        for r, share in enumerate(self.shares):
            times = sorted(row[r] for row in self._seconds)
            out.append(share / max(times[len(times) // 2], 1e-9))
        return out

    def propose(self) -> list[int] | None:
        speeds = self.speeds()
        if speeds is None or len(self.shares) == 1:
            return None
        new = apportion(speeds, sum(self.shares))
        if new == self.shares:
            return None
        if step_time(new, speeds) > (1 - self.min_gain) * step_time(self.shares, speeds):
            return None  # not worth it: timing noise must not make shares flap
        return new

    def adopt(self, shares: list[int]) -> None:
        """Shares changed (every rank switched): timings under the old split no longer apply."""
        self.shares = list(shares)
        self._seconds.clear()


# ---------------------------------------------------------------------------------------------
# Memory: micro batches sized to the machine, so a small-memory worker accumulates more, smaller ones.

ACTIVATION_BUDGET = 0.25  # of the machine's memory, for one micro batch's activations and gradients


def machine_memory_bytes() -> int:
    """Physical memory (unified memory on Apple silicon); DPOOL_MEMORY_BYTES overrides it."""
    import os

    override = os.environ.get("DPOOL_MEMORY_BYTES")
    if override:
        return int(override)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def bytes_per_sequence(layers: int, dim: int, heads: int, context: int, vocab: int) -> int:
    """A generous estimate of what one sequence keeps alive for the backward pass (float32):
    per token and layer ~16 activations of width dim plus the attention weights, and the logits
    with their softmax and gradient."""
    per_token = layers * (16 * dim + 2 * heads * context) + 3 * vocab
    return 4 * context * per_token


def auto_micro_batch(share: int, layers: int, dim: int, heads: int, context: int, vocab: int,
                     memory_bytes: int) -> int:
    """The most sequences per micro batch that fit this machine's budget, at least 1, at most `share`."""
    fit = int(memory_bytes * ACTIVATION_BUDGET) // bytes_per_sequence(layers, dim, heads, context, vocab)
    return max(1, min(share, fit))
