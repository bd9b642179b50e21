"""The training step: micro batches give sums, one all_sum (in buckets), divide by the pool's tokens.

Every rank computes the *sum* of its trained tokens' losses and the gradient of that sum over its
share (accumulated across micro batches, in float32), then one all_sum carries all gradient sums,
the loss sum, the trained-token count and a small control vector. Every rank divides by the same total, clips by the same
global norm and applies the same optimizer update (trainer/optimizers.py): the result does not depend on how the global batch
was split, only on its content.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from dpool.trainer.dist import Group
from dpool.trainer.task import Example, MicroBatch, Task, pack

StopFlag = bool | Callable[[], bool]  # whether this rank was asked to stop, or what tells it


def masked_loss_sum(model: nn.Module, tokens: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """Sum (not mean) of the trained tokens' cross-entropies, and their count.

    The mask is mlx-lm's (`tuner.trainer.default_loss`): the target at position p (predicting token
    p + 1) is trained when offset <= p + 1 <= length. That includes one target past the last token
    (the padding after it), as mlx-lm counts it; so dpool's losses are the ones `mlx_lm lora`
    reports for the same examples. Sums add up across micro batches and ranks; means would not."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    ce = nn.losses.cross_entropy(model(inputs), targets) * mask
    return ce.astype(mx.float32).sum(), mask.sum().astype(mx.float32)


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it at `total` (1-based steps)."""
    if warmup and step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@dataclass(frozen=True, slots=True)
class StepStats:
    loss: float  # token-weighted mean over the global batch's trained tokens
    tokens: int  # trained tokens in the global batch
    rank_seconds: list[float]  # each rank's compute time (without the collective): balance input
    rank_tokens: list[int]  # each rank's trained tokens: what its time was spent on
    grad_norm: float  # before clipping
    stop: bool  # some rank was asked to checkpoint and stop after this step
    new_shares: list[int] | None  # rank 0 announced a new split, used from the next step on
    checkpoint: bool = False  # rank 0 asked every rank to checkpoint after this step (every_steps = "auto")
    all_sum_s: float = 0.0  # this rank's seconds in the step's all_sum, its wait for slower ranks included (0: alone)


def dropout_keys(seed: int, idents: np.ndarray) -> np.ndarray:
    """One PRNG key per example from (seed, example identity): the identity is the example's place
    in the run (step and position), so the keys do not depend on how the batch was split."""
    idents = idents.astype(np.uint64)
    hi = (idents >> np.uint64(32)).astype(np.uint32) ^ np.uint32(seed & 0xFFFFFFFF)
    return np.stack([hi, (idents & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=1)


class Stepper:
    """Owns the compiled-once functions; `step()` is state in (model, optimizer) and state out."""

    def __init__(
        self, task: Task, optimizer: optim.Optimizer, group: Group, micro: int, grad_clip: float, seed: int,
        comm_dtype: str = "float32",
    ):
        self.task, self.model, self.optimizer, self.group = task, task.model, optimizer, group
        self.micro, self.grad_clip, self.seed = micro, grad_clip, seed
        # What the gradient sums travel as (sync.dtype): bfloat16 halves the bytes. The control
        # vector (loss and token sums, flags, timings) is always float32: counts must stay exact.
        self.comm_dtype = mx.bfloat16 if comm_dtype == "bfloat16" else None
        model = self.model
        value_and_grad = nn.value_and_grad(model, masked_loss_sum)

        def loss_and_grad(tokens, lengths, keys):
            task.set_dropout_keys(keys)  # read by the dropout layers, as traced inputs
            return value_and_grad(model, tokens, lengths)

        # Compiled once per micro batch shape (widths are padded to few sizes); the model's
        # parameters are implicit inputs, re-read at every call, so updates made by the optimizer
        # are seen (bench/overhead.py: ~1.2x on CPU).
        self.loss_and_grad = mx.compile(loss_and_grad, inputs=model.state, outputs=model.state)
        flat = tree_flatten(model.trainable_parameters())
        self.names = [k for k, _ in flat]
        self.dtypes = {k: v.dtype for k, v in flat}
        # The update, compiled too (as mlx-lm compiles its whole step): divide the pool's sums by
        # its token count, clip by the global norm, the optimizer's update. Its state is the model's and the
        # optimizer's, read and written in place (set up before compiling, so the dicts stay).
        optimizer.init(model.trainable_parameters())
        state = [model.state, optimizer.state]
        self.apply = mx.compile(self._apply, inputs=state, outputs=state)

    def _apply(self, sums: list[mx.array], ctl_sum: mx.array) -> mx.array:
        grads = self._mean(sums, ctl_sum)
        norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum() for g in grads))
        if self.grad_clip > 0:
            scale = mx.minimum(1.0, self.grad_clip / (norm + 1e-6))
            grads = [(g * scale).astype(g.dtype) for g in grads]
        self.optimizer.update(self.model, tree_unflatten(list(zip(self.names, grads, strict=True))))
        return norm

    def _mean(self, sums: list[mx.array], ctl_sum: mx.array) -> list[mx.array]:
        """Every rank divides the pool's gradient sums by the pool's trained-token count."""
        inv = 1.0 / ctl_sum[1]
        return [(g * inv).astype(self.dtypes[k]) for k, g in zip(self.names, sums, strict=True)]

    def batches(self, examples: list[Example]) -> list[MicroBatch]:
        return pack(examples, self.micro, self.task.pad_to, self.task.width_cap)

    def grad_sums(self, examples: list[Example]) -> tuple[list[tuple[str, mx.array]], mx.array, mx.array]:
        """Loss sum, trained-token count and gradient sums (float32) over this rank's examples."""
        acc: dict | None = None
        total, tokens = mx.array(0.0), mx.array(0.0)
        chunks = self.batches(examples)
        for i, mb in enumerate(chunks):
            keys = mx.array(dropout_keys(self.seed, mb.idents))
            (loss, ntok), grads = self.loss_and_grad(mx.array(mb.tokens), mx.array(mb.lengths), keys)
            grads = tree_map(lambda g: g.astype(mx.float32), grads)
            acc = grads if acc is None else tree_map(mx.add, acc, grads)
            total, tokens = total + loss, tokens + ntok
            if i < len(chunks) - 1 or self.group.size > 1:
                # Sync point per micro batch: memory holds one micro batch of activations, not the
                # whole share. In a group the last one is evaluated too, so the compute time sent
                # with the gradients (the balancer's input) excludes waiting for peers; alone, it
                # stays lazy and joins the step's single eval.
                mx.eval(acc, total, tokens)
        assert acc is not None, "a rank's share is never empty (shares are >= 1)"
        return tree_flatten(acc), total, tokens

    def reduce(
        self, examples: list[Example], stop_requested: StopFlag = False, announce: list[int] | None = None
    ) -> tuple[list[str], list[mx.array], mx.array]:
        """The pool's mean gradient (names, arrays) and the summed control vector, identical on every rank."""
        sums, ctl_sum, _ = self.reduce_sums(examples, stop_requested, announce)
        return self.names, self._mean(sums, ctl_sum), ctl_sum

    def reduce_sums(
        self, examples: list[Example], stop_requested: StopFlag = False, announce: list[int] | None = None,
        checkpoint: bool = False, computed: Callable[[], None] | None = None,
    ) -> tuple[list[mx.array], mx.array, float]:
        """The pool's gradient sums (in `names` order), the summed control vector, and the seconds
        the all_sum took this rank (its wait for slower ranks included; 0 alone): each bucket is
        summed as it is sent (Group.all_sum_fused), so this is what the step spends communicating,
        measured rather than inferred (metrics' all_sum_s). `computed` is called once this rank's
        gradients are evaluated, before it waits on its peers."""
        t0 = time.perf_counter()
        flat, loss, tokens = self.grad_sums(examples)
        compute = time.perf_counter() - t0
        if computed is not None:
            computed()
        # Read after the compute, just before the all_sum: a stop asked for during this step's
        # micro batches still ends the group after this step, not the next.
        stop = stop_requested() if callable(stop_requested) else stop_requested
        world, rank = self.group.size, self.group.rank
        # Control vector: [loss sum, tokens, stop flag, seconds of ranks 0..w-1, shares 0..w-1,
        # tokens of ranks 0..w-1, checkpoint flag]. Summing it gives every rank the pool's totals,
        # each rank's time and work in its own slots, and what rank 0 announces: the split (only
        # rank 0 writes those slots; all zero: no change) and whether this step checkpoints.
        known = [0.0] * (4 + 3 * world)
        known[2], known[3 + rank] = float(stop), compute
        if rank == 0:
            known[3 + 3 * world] = float(checkpoint)
            if announce:
                known[3 + world : 3 + 2 * world] = [float(s) for s in announce]
        # The loss and token sums are still lazy: placed into their slots without a sync.
        control = mx.array(known, dtype=mx.float32).at[0].add(loss).at[1].add(tokens).at[3 + 2 * world + rank].add(tokens)
        assert [k for k, _ in flat] == self.names, "gradients come in the trainable parameters' order"
        # The gradients are evaluated (grad_sums): ranks sharing this machine wait here, asleep,
        # rather than spinning in the all_sum while a neighbour still computes (trainer/colocate.py).
        self.group.wait_for_colocated()
        grads = [g for _, g in flat]
        if self.comm_dtype is not None:
            # Rounded on every world size alike, one worker too, so the curve still depends on
            # the job file alone (to bfloat16's precision: README "Communication").
            grads = [g.astype(self.comm_dtype) for g in grads]
        t_sum = time.perf_counter()
        summed = self.group.all_sum_fused([*grads, control])
        all_sum_s = time.perf_counter() - t_sum if self.group.size > 1 else 0.0
        if self.comm_dtype is not None:
            summed[:-1] = [g.astype(mx.float32) for g in summed[:-1]]
        return summed[:-1], summed[-1], all_sum_s

    def step(
        self, examples: list[Example], lr: float, stop_requested: StopFlag = False, announce: list[int] | None = None,
        checkpoint: bool = False, computed: Callable[[], None] | None = None,
    ) -> StepStats:
        """One optimizer step; `checkpoint` (read on rank 0 only) asks every rank to checkpoint after it."""
        sums, ctl_sum, all_sum_s = self.reduce_sums(examples, stop_requested, announce, checkpoint, computed)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        norm = self.apply(sums, ctl_sum)
        # The step's sync point: parameters, optimizer state and the statistics, in one eval.
        mx.eval(self.model.parameters(), self.optimizer.state, ctl_sum, norm)
        c = ctl_sum.tolist()
        world = self.group.size
        announced = [round(x) for x in c[3 + world : 3 + 2 * world]]
        return StepStats(
            loss=c[0] / c[1], tokens=int(c[1]), rank_seconds=c[3 : 3 + world],
            rank_tokens=[round(x) for x in c[3 + 2 * world : 3 + 3 * world]], grad_norm=float(norm.item()),
            stop=c[2] > 0, new_shares=announced if any(announced) else None, checkpoint=c[3 + 3 * world] > 0,
            all_sum_s=all_sum_s,
        )

    def eval_loss(self, examples: list[Example]) -> float:
        """Token-weighted mean held-out loss over the trained tokens: this rank scores `examples`,
        the pool sums."""
        return held_out_loss(self.model, self.batches(examples), self.group)

    def probe_bytes(self) -> int:
        """Peak memory of one example at the widest shape, forward and backward: what each example
        of a micro batch costs this model on this machine (the basis of micro_batch = "auto")."""
        width = self.task.width_cap
        tokens = mx.zeros((1, width), dtype=mx.int32)
        lengths = mx.array([[0, width]], dtype=mx.int32)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        (loss, _), grads = self.loss_and_grad(tokens, lengths, mx.zeros((1, 2), dtype=mx.uint32))
        mx.eval(loss, grads)
        peak = mx.get_peak_memory() - before
        del grads
        return max(int(peak), 1)


def held_out_loss(model: nn.Module, batches: list[MicroBatch], group: Group) -> float:
    """Token-weighted mean loss of `batches` (this rank's part) over the whole group, in eval mode."""
    model.eval()
    total, tokens = mx.array(0.0), mx.array(0.0)
    try:
        for mb in batches:
            loss, ntok = masked_loss_sum(model, mx.array(mb.tokens), mx.array(mb.lengths))
            total, tokens = total + loss, tokens + ntok
            mx.eval(total, tokens)
    finally:
        model.train()
    both = group.all_sum(mx.stack([total.astype(mx.float32), tokens]))
    s, t = both.tolist()
    return s / t
