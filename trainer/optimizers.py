"""The job's optimizer and the learning rate of each step: one place for the loop and for diloco.

Without `train.optimizer`, dpool's own AdamW (betas 0.9/0.95, `train.weight_decay`); with it, the
class `mlx_lm lora` builds for that name, with `[train.optimizer_config]` (its defaults filled in by
protocol/optimizers.py). The optimizer is built with a fixed learning rate and told each step's:
the step, not the optimizer's own counter, decides it, so a resumed run (whose state holds the
counter too) cannot drift from the schedule.

With `[train.lr_schedule]` the learning rate of dpool step s (1-based, step 1 is the first update) is
mlx-lm's `build_schedule(config)(s - 1)`: MLX's optimizer evaluates its schedule at its step count
before incrementing it, and that count is s - 1 at dpool step s. It is evaluated in MLX, at a uint64
step as the optimizer's counter is, so the float32 value is bit for bit the one mlx-lm's optimizer
would use. Without a schedule, dpool's warm-up and cosine (`step.lr_at`) for any optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.optimizers as optim

from dpool.protocol.jobspec import TrainSpec
from dpool.protocol.optimizers import OPTIMIZERS, LrSchedule
from dpool.trainer.step import lr_at

Schedule = Callable[[mx.array], mx.array]


def build(train: TrainSpec) -> optim.Optimizer:
    """The job's optimizer (each step sets its learning rate: the one given here is step 1's)."""
    if train.optimizer is None:
        return optim.AdamW(learning_rate=train.lr, betas=[0.9, 0.95], weight_decay=train.weight_decay)
    cls = getattr(optim, OPTIMIZERS[train.optimizer].cls)
    # As mlx_lm/lora.py: `opt_class(learning_rate=lr, **optimizer_config)`.
    return cls(learning_rate=learning_rate(train)(1), **(train.optimizer_config or {}))


def schedule(cfg: LrSchedule) -> Schedule:
    """mlx-lm's `tuner.utils.build_schedule`, plus dpool's "constant" (mlx-lm without a schedule)."""
    if cfg.name == "constant":
        peak = cfg.arguments[0]

        def fn(step: mx.array) -> mx.array:
            return mx.array(peak, dtype=mx.float32)  # what an optimizer holds of a fixed learning rate
    else:
        fn = getattr(optim.schedulers, cfg.name)(*cfg.arguments)
    if not cfg.warmup:
        return fn
    warm = optim.schedulers.linear_schedule(cfg.warmup_init, cfg.arguments[0], cfg.warmup)
    return optim.schedulers.join_schedules([warm, fn], [cfg.warmup + 1])


def learning_rate(train: TrainSpec) -> Callable[[int], float]:
    """The learning rate of each (1-based) step: the float32 value, as a Python float (exact)."""
    if train.lr_schedule is None:
        return lambda step: lr_at(step, train.lr, train.warmup_steps, train.steps)
    fn = schedule(train.lr_schedule)
    return lambda step: fn(mx.array(step - 1, dtype=mx.uint64)).item()
