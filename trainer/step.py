"""The training step: micro batches give sums, one fused all_sum, divide by the pool's tokens.

Every rank computes the *sum* of its token losses and the gradient of that sum over its share
(accumulated across micro batches), then one all_sum carries all gradient sums, the loss sum, the
token count and a small control vector. Every rank divides by the same total, clips by the same
global norm and applies the same AdamW update: the result does not depend on how the global batch
was split, only on its content.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from dpool.trainer.data import micro_batches
from dpool.trainer.dist import Group


def loss_sum(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    """Sum (not mean) of the token cross-entropies: sums add up across micro batches and ranks."""
    return nn.losses.cross_entropy(model(x), y, reduction="sum")


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it at `total` (1-based steps)."""
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@dataclass(frozen=True, slots=True)
class StepStats:
    loss: float  # token-weighted mean over the global batch
    tokens: int  # tokens in the global batch
    rank_seconds: list[float]  # each rank's compute time (without the collective): balance input
    grad_norm: float  # before clipping
    stop: bool  # some rank was asked to checkpoint and stop after this step
    new_shares: list[int] | None  # rank 0 announced a new split, used from the next step on


class Stepper:
    """Owns the compiled-once functions; `step()` is state in (model, optimizer) and state out."""

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, group: Group, micro: int, grad_clip: float):
        self.model, self.optimizer, self.group = model, optimizer, group
        self.micro, self.grad_clip = micro, grad_clip
        value_and_grad = nn.value_and_grad(model, loss_sum)
        # Compiled once per micro batch shape; the model's parameters are implicit inputs, re-read
        # at every call, so updates made by the optimizer are seen (bench/overhead.py: ~1.2x on CPU).
        self.loss_and_grad = mx.compile(
            lambda x, y: value_and_grad(model, x, y), inputs=model.state, outputs=model.state
        )

    def grad_sums(self, rows: np.ndarray) -> tuple[list[tuple[str, mx.array]], mx.array]:
        """Loss sum and gradient sums over `rows` (this rank's share), accumulated by micro batch."""
        acc: dict | None = None
        total = mx.array(0.0)
        chunks = micro_batches(len(rows), self.micro)
        for i, (off, n) in enumerate(chunks):
            chunk = mx.array(rows[off : off + n])
            loss, grads = self.loss_and_grad(chunk[:, :-1], chunk[:, 1:])
            acc = grads if acc is None else tree_map(mx.add, acc, grads)
            total = total + loss
            if i < len(chunks) - 1 or self.group.size > 1:
                # Sync point per micro batch: memory holds one micro batch of activations, not the
                # whole share. In a group the last one is evaluated too, so the compute time sent
                # with the gradients (the balancer's input) excludes waiting for peers; alone, it
                # stays lazy and joins the step's single eval.
                mx.eval(acc, total)
        assert acc is not None, "a rank's share is never empty (shares are >= 1)"
        return tree_flatten(acc), total

    def reduce(
        self, rows: np.ndarray, stop_requested: bool = False, announce: list[int] | None = None
    ) -> tuple[list[str], list[mx.array], mx.array]:
        """The pool's mean gradient (names, arrays) and the summed control vector, identical on every rank."""
        t0 = time.perf_counter()
        flat, loss = self.grad_sums(rows)
        compute = time.perf_counter() - t0
        tokens = rows.shape[0] * (rows.shape[1] - 1)
        world, rank = self.group.size, self.group.rank
        # Control vector: [loss sum, tokens, stop flag, seconds of ranks 0..w-1, shares 0..w-1].
        # Summing it gives every rank the pool's totals, each rank's time in its own slot, and
        # the split rank 0 announces (only rank 0 writes those slots; all zero: no change).
        control = [0.0] * (3 + 2 * world)
        control[1], control[2], control[3 + rank] = float(tokens), float(stop_requested), compute
        if announce and rank == 0:
            control[3 + world :] = [float(s) for s in announce]
        ctl = mx.concatenate([loss.reshape(1).astype(mx.float32), mx.array(control[1:], dtype=mx.float32)])
        summed = self.group.all_sum_fused([g for _, g in flat] + [ctl])
        ctl_sum = summed[-1]
        inv = 1.0 / ctl_sum[1]  # every rank divides by the pool's token count
        return [k for k, _ in flat], [g * inv for g in summed[:-1]], ctl_sum

    def step(
        self, rows: np.ndarray, lr: float, stop_requested: bool = False, announce: list[int] | None = None
    ) -> StepStats:
        names, grads, ctl_sum = self.reduce(rows, stop_requested, announce)
        norm = mx.sqrt(sum((g * g).sum() for g in grads))
        if self.grad_clip > 0:
            scale = mx.minimum(1.0, self.grad_clip / (norm + 1e-6))
            grads = [g * scale for g in grads]
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        self.optimizer.update(self.model, tree_unflatten(list(zip(names, grads, strict=True))))
        # The step's sync point: parameters, optimizer state and the statistics, in one eval.
        mx.eval(self.model.parameters(), self.optimizer.state, ctl_sum, norm)
        c = ctl_sum.tolist()
        world = self.group.size
        announced = [round(x) for x in c[3 + world :]]
        return StepStats(
            loss=c[0] / c[1], tokens=int(c[1]), rank_seconds=c[3 : 3 + world], grad_norm=float(norm.item()),
            stop=c[2] > 0, new_shares=announced if any(announced) else None,
        )

    def eval_loss(self, rows: np.ndarray) -> float:
        """Token-weighted mean held-out loss: this rank scores `rows`, the pool sums."""
        total, tokens = mx.array(0.0), 0
        for off, n in micro_batches(len(rows), self.micro):
            chunk = mx.array(rows[off : off + n])
            total = total + loss_sum(self.model, chunk[:, :-1], chunk[:, 1:])
            tokens += n * (rows.shape[1] - 1)
            mx.eval(total)
        both = self.group.all_sum(mx.stack([total.astype(mx.float32), mx.array(float(tokens))]))
        s, t = both.tolist()
        return s / t
