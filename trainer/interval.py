"""`checkpoint.every_steps = "auto"`: checkpoint as often as an overhead budget allows (CheckFreq's idea).

What a checkpoint costs is what it takes from training: the host copy on the step path, and the
slowdown of the steps that run while its writer thread writes (on a machine whose cores the step
already uses, the writer takes them from the step: measured on two cores, the writer's own wall
time understated the cost ~5x). The slowdown of such a step is its time above the median time per
token of steps that ran with no write in flight, times its tokens (per token: batches of chat data
vary in length). Step times are noisy, so that slowdown can come out near zero; the writer thread's
own CPU time (hashing, copying, writing), times the ranks per core of its machine (they all write at
the same step), plus the host copy, is the cost's floor. The cost is
compared with the median step time; the interval is the fewest steps
between checkpoints that keeps the cost under `TARGET` of the training time:

    interval = max(1, ceil(cost / (TARGET * step_time)))

so a job whose trained state is small (LoRA/DoRA adapters) checkpoints every step, and a large
model on a slow disk rarely. The first checkpoint comes `FIRST_AFTER` steps after the start, to
measure the cost; until that measurement is in, no other is taken (but the last step and a stop
still save). Then the estimate follows the job: the cost is the mean of the last `COSTS`
checkpoints without the slowest and the fastest (one slow fsync is not a trend), the step time the
median of the last `WINDOW` steps without a write in flight,
and the interval changes without thrashing:
- it grows when the budget is exceeded (the need is above the interval);
- it shrinks only when the interval is clearly too long: to ceil(need x HEADROOM), and only when
  that is below the current interval, so a need that wanders by less than ~20% changes nothing;
- after a change it holds for `HOLD` steps, unless the need is above 1.5 x the interval.

Pure Python and deterministic: rank 0 runs it and its decision ("checkpoint after this step")
travels to every rank in the step's control vector (trainer/step.py), so all ranks save at the
same steps whatever their own timings.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

TARGET = 0.02  # the most of the training time spent on checkpoints
FIRST_AFTER = 2  # steps after the start (or resume) before the first, measuring checkpoint
WINDOW = 50  # step times in the median
COSTS = 9  # checkpoint costs in the (trimmed) mean
HEADROOM = 1.25  # a shrunk interval leaves this much room for the cost to grow back
HOLD = 10  # steps an interval is kept after a change (unless far over budget)


def interval_for(cost_s: float, step_s: float, target: float = TARGET) -> int:
    """The fewest steps between checkpoints whose cost stays within `target` of the step time."""
    if cost_s <= 0 or not math.isfinite(cost_s):
        return 1
    if step_s <= 0 or not math.isfinite(step_s):
        raise ValueError(f"step time must be a positive number, not {step_s!r}")
    return max(1, math.ceil(cost_s / (target * step_s)))


class AutoInterval:
    """Rank 0's checkpoint schedule for `every_steps = "auto"`.

    Per step: `observe_step(seconds)`; per finished checkpoint: `observe_checkpoint(seconds)`;
    before a step: `due(step)` says whether it checkpoints; after a checkpoint is taken for any
    reason: `saved(step)`. `interval` is None until the first cost is measured."""

    def __init__(self, start: int, *, target: float = TARGET, first_after: int = FIRST_AFTER, window: int = WINDOW,
                 costs: int = COSTS, headroom: float = HEADROOM, hold: int = HOLD):
        self.target, self.first_after, self.headroom, self.hold = target, max(1, first_after), headroom, hold
        self.start = start
        self.last = start  # the newest checkpoint taken (the resume step counts as one)
        self.interval: int | None = None
        self.times: deque[float] = deque(maxlen=window)
        self.per_token: deque[float] = deque(maxlen=window)  # seconds per token of those steps
        self._slowed = 0.0  # the slowdown of steps run while a write was in flight, since the last checkpoint finished
        self.costs: deque[float] = deque(maxlen=costs)
        self._measuring = False  # the first checkpoint was taken, its cost not yet seen
        self._held = 0  # steps since the interval last changed

    @property
    def cost(self) -> float | None:
        """Seconds per checkpoint: the mean of the recent ones, the slowest and fastest left out
        once there are 5 (one slow fsync is not a trend)."""
        if not self.costs:
            return None
        costs = sorted(self.costs)
        if len(costs) >= 5:
            costs = costs[1:-1]
        return sum(costs) / len(costs)

    def step_time(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def need(self) -> float | None:
        """Steps between checkpoints that spend exactly `target` on them (unrounded)."""
        step = self.step_time()
        if self.cost is None or step is None or step <= 0:
            return None
        return self.cost / (self.target * step)

    def observe_step(self, seconds: float, tokens: int = 0, *, writing: bool = False) -> bool:
        """A step's wall time (without evaluation), its tokens, and whether a checkpoint was being
        copied or written meanwhile; True when the interval changed."""
        if seconds > 0 and math.isfinite(seconds):
            if writing:
                self._slowed += max(0.0, seconds - self._expected(tokens))
            else:
                self.times.append(seconds)
                if tokens > 0:
                    self.per_token.append(seconds / tokens)
        self._held += 1
        return self._update()

    def _expected(self, tokens: int) -> float:
        """What a step of `tokens` takes with no write in flight (0 before any was timed)."""
        if tokens > 0 and self.per_token:
            return statistics.median(self.per_token) * tokens
        return self.step_time() or 0.0

    def observe_checkpoint(self, seconds: float) -> bool:
        """A checkpoint finished; `seconds` is what of it was timed directly: the host copy on the
        step path and the writer thread's CPU time, which a machine whose cores the ranks fill pays
        in full. Its cost is that or the slowdown of the steps it overlapped, whichever is more:
        the slowdown alone, read from noisy step times, can come out near zero. True when the
        interval changed."""
        cost = max(seconds, self._slowed)
        self._slowed = 0.0
        if cost >= 0 and math.isfinite(cost):
            self.costs.append(cost)
        self._measuring = False
        return self._update()

    def _update(self) -> bool:
        need = self.need()
        if need is None:
            return False
        current = self.interval
        if current is None:
            new = max(1, math.ceil(need))
        elif self._held < self.hold and need <= 1.5 * current:
            return False
        elif need > current:
            new = math.ceil(need)
        elif (shrunk := max(1, math.ceil(need * self.headroom))) < current:
            new = shrunk
        else:
            return False
        if new == current:
            return False
        self.interval, self._held = new, 0
        return True

    def due(self, step: int) -> bool:
        """Whether step `step` should checkpoint (the caller adds the last step and stops)."""
        if self.interval is None:
            return not self._measuring and self.cost is None and step >= self.start + self.first_after
        return step - self.last >= self.interval

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was taken (for any reason): the next one counts from here."""
        self.last = step
        if self.interval is None and self.cost is None:
            self._measuring = True


def overhead_target() -> float:
    """The checkpoint budget of `every_steps = "auto"`: TARGET, or DPOOL_CHECKPOINT_OVERHEAD (a
    fraction in (0, 1]; tests and benches use it to checkpoint more often)."""
    import os

    text = os.environ.get("DPOOL_CHECKPOINT_OVERHEAD", "")
    try:
        value = float(text) if text else TARGET
    except ValueError:
        value = TARGET
    return value if 0 < value <= 1 else TARGET
