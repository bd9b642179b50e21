"""Low-communication training (DiLoCo) on virtual replicas: one all_sum per `inner_steps` steps,
and a loss curve that depends on the job file alone.

The job names K = `sync.replicas` and H = `sync.inner_steps`. Global step s (1-based) belongs to
outer step t = (s - 1) // H (after the warm-up, below). Replica r trains on slice r of global
batch s (the sequences that rank r of a K-rank synchronous group would get), starting outer step t
from the outer parameters θ_t, with its own inner optimizer state (the job's optimizer:
trainer/optimizers.py), kept from one outer step to the next. At the end of outer step t, the
replicas' changes θ_t - θ_r are averaged, each weighted by the tokens it trained (a replica never
has more say than its tokens), and applied to θ_t by the outer step: SGD with `outer_lr` and
Nesterov `outer_momentum`, by default 1 and 0 (the average as it is: the best of those measured
on short runs, BENCHMARKS.md "Communication"); DiLoCo (Douillard et al., 2023) uses 0.7 and 0.9.
With `sync.warmup_steps = W`, the first W steps are outer steps of one step each, their average
applied as it is whatever the outer lr and momentum (H = 1: within 0.02% of synchronous training
on the bench's job; DiLoCo starts from a model trained synchronously, and replicas that drift
apart early cost the most); outer steps of H follow (protocol/rounds.py).

Replicas are virtual. The workers present run them: each a contiguous range, in proportion to its
share of the global batch (the pool's and the balancer's measure of its speed), interleaved step by
step. Which machine runs a replica, and how many there are, never changes what the replica
computes: one worker or five give the same curve (in float32, to its order of addition; with
16-bit sums, the same parameters bit for bit: outer_sums). Workers talk once per outer step: the
weighted changes (as many bytes a parameter as `sync.dtype`) and a small float32 control vector
(every inner step's loss and token sums, each rank's compute seconds and tokens, the stop and
checkpoint flags, rank 0's new split, and with 16-bit sums each tensor's largest change).

At an outer boundary the state is θ, the outer momentum and K inner optimizer states. θ and the
momentum are the same on every rank after the outer all_sum; an inner state lives on the rank that
runs its replica. A checkpoint (at outer boundaries only) first gathers them, an all_sum in which
each slot is filled by its owner alone (exact), so every rank writes the same full state and any
later group, of any size, resumes from it. A lost machine costs the inner steps since the newest
checkpoint; a planned stop (a drain, a join, a resize) is taken at the end of the current outer
step and costs none. The metrics of an outer step's inner steps (their loss over all replicas) are
written when it ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from dpool.protocol.jobspec import JobSpec
from dpool.protocol.rounds import Rounds
from dpool.protocol.shares import replica_ranges, replica_shares, replica_sizes
from dpool.trainer import checkpoint as ckpt
from dpool.trainer import optimizers
from dpool.trainer import report as reporting
from dpool.trainer.balance import Balancer, machine_memory_bytes, micro_from_memory
from dpool.trainer.blas import active_blas
from dpool.trainer.data import split_shares
from dpool.trainer.dist import Group
from dpool.trainer.interval import AutoInterval, overhead_target
from dpool.trainer.metrics import MetricsLog
from dpool.trainer.restore import generation_of, restore
from dpool.trainer.step import Stepper, held_out_loss
from dpool.trainer.task import Task

SCALARS = ("step", "learning_rate")  # an optimizer state's entries that are not per parameter


def outer_rounds(start: int, steps: int, inner: int, warmup: int = 0) -> list[range]:
    """`Rounds(inner, warmup).after(start, steps)`."""
    return Rounds(inner, warmup).after(start, steps)


class Alone:
    """A group of one: a replica's inner steps sum over its own slice only."""

    rank, size = 0, 1

    def wait_for_colocated(self) -> None:
        pass

    def all_sum(self, x: mx.array) -> mx.array:
        return x

    def all_sum_fused(self, arrays: list[mx.array], bucket_bytes: int | None = None) -> list[mx.array]:
        return list(arrays)


@dataclass
class Holder:
    """What a checkpoint stores besides the model's trainable parameters (θ): an optimizer-like
    object for trainer/restore.py, whose state is the outer momentum and every replica's state."""

    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Control:
    """The float32 control vector of an outer step's all_sum: its layout and its reading."""

    inner: int  # H
    world: int

    def size(self) -> int:
        return 2 * self.inner + 3 * self.world + 2

    def build(self, rank: int, losses: list[float], tokens: list[float], seconds: float, mine: float,
              announce: list[int] | None, stop: bool, checkpoint: bool) -> mx.array:
        h, w = self.inner, self.world
        v = [0.0] * self.size()
        v[: len(losses)] = losses
        v[h : h + len(tokens)] = tokens
        v[2 * h + rank] = seconds
        v[2 * h + w + rank] = mine
        if rank == 0 and announce:
            v[2 * h + 2 * w : 2 * h + 3 * w] = [float(x) for x in announce]
        v[2 * h + 3 * w] = float(stop)
        if rank == 0:
            v[2 * h + 3 * w + 1] = float(checkpoint)
        return mx.array(v, dtype=mx.float32)

    def read(self, summed: list[float], n: int) -> dict[str, Any]:
        h, w = self.inner, self.world
        announced = [round(x) for x in summed[2 * h + 2 * w : 2 * h + 3 * w]]
        return {
            "losses": summed[:n], "tokens": [round(x) for x in summed[h : h + n]],
            "seconds": summed[2 * h : 2 * h + w], "rank_tokens": [round(x) for x in summed[2 * h + w : 2 * h + 2 * w]],
            "new_shares": announced if any(announced) else None, "stop": summed[2 * h + 3 * w] > 0,
            "checkpoint": summed[2 * h + 3 * w + 1] > 0,
        }


class Replicas:
    """This rank's replicas: their parameters and inner optimizer states, stepped in turn through one
    compiled step (the model and the optimizer state are swapped in and out, in place: the
    compiled functions read the same dicts every call)."""

    def __init__(self, task: Task, spec: JobSpec, micro: int) -> None:
        t = spec.train
        self.task, self.model = task, task.model
        self.optimizer = optimizers.build(t)
        self.stepper = Stepper(task, self.optimizer, Alone(), micro, t.grad_clip, t.seed)  # type: ignore[arg-type]
        fresh = self.optimizer.state
        self.states: list[dict[str, Any]] = [tree_map(lambda x: x, fresh) for _ in range(spec.sync.replicas)]
        self.params: dict[int, dict[str, Any]] = {}

    def begin(self, theta: dict[str, Any], mine: range) -> None:
        """An outer step starts: each of this rank's replicas from θ."""
        self.params = {r: theta for r in mine}

    def step(self, r: int, examples: list, lr: float) -> tuple[float, int]:
        """One inner step of replica r: (its loss sum, its trained tokens)."""
        self.model.update(self.params[r])
        live = self.optimizer.state
        live.clear()
        live.update(self.states[r])
        stats = self.stepper.step(examples, lr)
        self.params[r] = self.model.trainable_parameters()
        self.states[r] = dict(live)  # its per-parameter dicts were updated in place; the scalars are new
        return stats.loss * stats.tokens, stats.tokens

    def flat_state(self, r: int) -> list[tuple[str, mx.array]]:
        return [(k, v) for k, v in tree_flatten(self.states[r]) if k not in SCALARS]

    def gather(self, group: Group, owners: dict[int, int], which: list[int]) -> None:
        """Replicas `which` get their owner's inner state on every rank (one all_sum: each slot
        filled by its owner alone, so the sum is exact). The scalars (step count, learning rate)
        are the same for every replica: taken from one this rank owns."""
        if not which:
            return
        names = [[k for k, _ in self.flat_state(r)] for r in which]
        arrays = []
        for r in which:
            own = owners[r] == group.rank
            arrays += [v if own else mx.zeros_like(v) for _, v in self.flat_state(r)]
        summed = group.all_sum_fused(arrays)
        mine = next((r for r, o in owners.items() if o == group.rank), None)
        scalars = {k: self.states[mine][k] for k in SCALARS if mine is not None and k in self.states[mine]}
        i = 0
        for r, keys in zip(which, names, strict=True):
            flat = list(zip(keys, summed[i : i + len(keys)], strict=True))
            i += len(keys)
            state = tree_unflatten(flat)
            state.update(scalars)
            self.states[r] = state
        mx.eval(summed)

    def holder(self, outer: optim.Optimizer) -> Holder:
        return Holder({"outer": outer.state, "inner": {f"r{r}": s for r, s in enumerate(self.states)}})

    def adopt(self, holder: Holder, outer: optim.Optimizer) -> None:
        """After a restore: the outer state and every replica's state from the checkpoint."""
        outer.state = holder.state["outer"]
        self.states = [holder.state["inner"][f"r{r}"] for r in range(len(self.states))]


LEVELS = 2**15 - 1  # int16's largest


def outer_sums(
    group: Group, theta: dict[str, mx.array], ends: dict[int, dict[str, mx.array]], weights: dict[int, int],
    vec: mx.array, replicas: int, sixteen: bool,
) -> tuple[list[mx.array], mx.array]:
    """The outer all_sum: the sum over all K replicas of their changes θ - θ_r, each weighted by its
    tokens (float32, one array per name of `theta`, in its order), and the summed control vector
    `vec`. This rank adds its own replicas: `ends` (each one's θ_r) and `weights` (its tokens).

    float32: each rank adds its replicas' changes and the ring adds the ranks' sums, so the sum
    depends on the number of workers through float32's order of addition alone.

    16 bits (sync.dtype = "bfloat16": half the bytes): the sum is the same, bit for bit, on any
    number of workers and any split of the replicas. A bfloat16 all_sum cannot be: each rank
    rounds the sum of its own replicas (4 on one worker, 2 and 2 on two) and the ring rounds at
    each addition, in an order set by the ranks; and unlike a gradient rounded in sync mode (which
    AdamW normalises), an outer step applies its change as it is, with momentum. On the tiny GPT of
    tests/test_diloco_bf16.py (lr 0.7, Nesterov 0.9) one worker and two ended 4e-4 apart on the loss
    over 150 steps that way (float32: 6e-7; sync mode in bfloat16: 3e-5). Integers add exactly in
    any order, so the changes travel as int16 on a scale every rank knows before the sum:
    - step = top / L per tensor, with top its largest |change| over all K replicas (each rank's
      top, in its own slot of one small float32 all_sum with the control vector: exact, its max
      the same in any order) and L = LEVELS // K;
    - each replica's change is rounded alone to a multiple of step, at most L of them in size, so
      any sum of K of them fits in int16; each rank adds its replicas' integers, the ring adds the
      ranks' (exact), and every rank multiplies the sum by the same step.
    What is rounded, each replica's change (by step / 2 at most: 1/16382 of the tensor's top at
    K = 4, 1/62 at K = 1024), depends on the replica alone; the sum is exact. The control vector's
    float32 loss and token sums keep float32's order. A NaN or inf change makes its tensor's step,
    and so its sum, non-finite, as in float32."""
    names, mine = list(theta), list(ends)

    def change(r: int, name: str) -> mx.array:  # lazy: computed where it is summed, never held
        return (theta[name] - ends[r][name]).astype(mx.float32) * weights[r]

    if not sixteen:
        summed = group.all_sum_fused([*(reduce(mx.add, [change(r, name) for r in mine]) for name in names), vec])
        return summed[:-1], summed[-1]
    levels, world = LEVELS // replicas, group.size
    tops = mx.stack([reduce(mx.maximum, [mx.abs(change(r, name)).max() for r in mine]) for name in names])
    slots = mx.zeros((world, len(names)), dtype=mx.float32).at[group.rank].add(tops)
    first = group.all_sum(mx.concatenate([vec, slots.reshape(-1)]))
    mx.eval(first)  # one collective per evaluation (Group._ring_sum: a dead peer's failure must raise)
    ctl, top = first[: vec.size], first[vec.size :].reshape(world, -1).max(axis=0)
    step = mx.where(top == 0, 1.0, top / levels)  # NaN and inf stay (== 0 is false for them)

    def units(r: int, i: int) -> mx.array:
        return mx.clip(mx.round(change(r, names[i]) / step[i]), -levels, levels).astype(mx.int32)

    summed = group.all_sum_fused([reduce(mx.add, [units(r, i) for r in mine]).astype(mx.int16) for i in range(len(names))])
    return [s.astype(mx.float32) * step[i] for i, s in enumerate(summed)], ctl


def train(
    spec: JobSpec, group: Group, task: Task, run_dir: Path, shares: list[int], generation: int | None, link: Any, log: Any,
    resume_max: int | None, describe: dict[str, Any], stop_requested: Callable[[], bool] | None = None,
) -> bool:
    """Train from the newest checkpoint to the end (or a stop); True if stopped on request."""
    t, sync = spec.train, spec.sync
    rank, world, K, H = group.rank, group.size, sync.replicas, sync.inner_steps
    model = task.model
    # Nesterov needs a momentum (MLX refuses one of 0): without it the outer step is plain SGD.
    outer = optim.SGD(learning_rate=sync.outer_lr, momentum=sync.outer_momentum, nesterov=sync.outer_momentum > 0)
    outer.init(model.trainable_parameters())
    slices = split_shares(replica_sizes(K, t.global_batch))  # replica r's slice of each batch
    reps = Replicas(task, spec, 1)
    lr_of = optimizers.learning_rate(t)
    largest = max(n for _, n in slices)
    if isinstance(t.micro_batch, int):
        micro = min(t.micro_batch, largest)
    else:
        micro = micro_from_memory(largest, reps.stepper.probe_bytes(), machine_memory_bytes() - mx.get_active_memory())
    reps.stepper.micro = micro
    holder = reps.holder(outer)
    resumed = restore(spec, run_dir, group, model, holder, log, None, resume_max, task.fingerprints)
    start, how = resumed.step, resumed.how
    generation = generation_of(generation, resumed)  # by hand: from the resumed checkpoint
    log = log.bind(generation=generation)
    reps.adopt(holder, outer)
    rounds = Rounds(H, sync.warmup_steps)
    if not rounds.boundary(start) and start < t.steps:
        raise ckpt.CheckpointError(
            f"step {start} is not the end of an outer step (sync.inner_steps = {H}, warmup_steps = {sync.warmup_steps}); cannot resume there"
        )
    sixteen = sync.dtype == "bfloat16"  # the changes travel in 16 bits a parameter (outer_sums)
    # Work moves in whole replicas: the split in force is the sequences of each rank's replicas
    # (reported as such), whatever split of the batch the pool or --shares proposed.
    ranges, asked = replica_ranges(shares, K, t.global_batch), shares
    shares = replica_shares(shares, K, t.global_batch)
    if shares != asked:
        log.info("shares.rounded", asked=asked, shares=shares, why=f"diloco moves whole replicas ({K} of {t.global_batch // K}-{-(-t.global_batch // K)} sequences)")
    log.info(
        "trainer.started", world_size=world, shares=shares, resume_step=start, restored=how, mode="diloco",
        replicas=list(ranges[rank]), inner_steps=H, micro_batch=micro, blas=active_blas(),
        **describe,
    )
    if link:
        # The ring's probe and what an outer step all_sums (the pool's comm_share divides it by H).
        link.hello(rank=rank, world_size=world, generation=generation, pid=os.getpid(), resume_step=start, ring=group.link,
                   params=sum(v.size for _, v in tree_flatten(model.trainable_parameters())))
    control = Control(H, world)
    balancer = Balancer(shares) if spec.workers.balance and world > 1 and rank == 0 else None
    announce: list[int] | None = None
    metrics = MetricsLog(run_dir, start, enabled=rank == 0)
    reporting.attach(spec, metrics, generation)  # [report]: rank 0's rows to W&B too
    writer = ckpt.CheckpointWriter(run_dir, spec.checkpoint.keep)
    every = spec.checkpoint.every_steps
    auto = AutoInterval(start, target=overhead_target()) if every == "auto" and rank == 0 else None
    job_hash = spec.training_hash()
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    gb = t.global_batch

    def evaluate(step: int) -> None:
        offset, share = split_shares(shares)[rank]
        mine = [i for i in range(task.val_count) if offset <= i % gb < offset + share]
        t_eval = time.perf_counter()
        val_loss = held_out_loss(model, reps.stepper.batches(task.val_examples(mine)), group)
        row = {"kind": "eval", "step": step, "val_loss": val_loss}
        metrics.append(metrics.metrics, row, val_time=time.perf_counter() - t_eval)
        if rank == 0:
            log.info("eval.done", step=step, val_loss=round(val_loss, 4))
            if link:
                link.metric(row)

    gathers: dict[int, float] = {}  # a checkpoint's gather on the step path, until its write is done

    def report(done: list[tuple[int, float, str | None, list[str]]]) -> None:
        for step, seconds, error, problems in done:
            gather_s = gathers.pop(step, 0.0)
            if error:
                log.error("checkpoint.failed", step=step, error=error)
                raise ckpt.CheckpointWriteError(f"checkpoint of step {step} not written: {error}")
            cpu = writer.cpu_s.pop(step, 0.0)
            log.info("checkpoint.saved", step=step, seconds=round(seconds, 3), gather_s=round(gather_s, 4), cpu_s=round(cpu, 4))
            for p in problems:
                log.warning("checkpoint.prune_failed", problem=p)
            if link:
                link.checkpoint(step=step, seconds=seconds)
            if auto:
                auto.observe_checkpoint(gather_s + cpu * group.crowding())

    if start == 0:
        evaluate(0)
    else:
        metrics.catch_up(group, spec, start, rounds.ending(start), link, evaluate, task)  # the outer step that ended there
    stopped = False
    for steps in rounds.after(start, t.steps):
        mine = ranges[rank]
        theta = model.trainable_parameters()
        reps.begin(theta, mine)
        losses, tokens = [0.0] * len(steps), [0.0] * len(steps)
        rep_tokens = dict.fromkeys(mine, 0)
        compute = 0.0
        last = steps[-1]
        due_auto = bool(auto and any(auto.due(s) for s in steps))  # rank 0's decision (auto changes only after an outer step)
        # Whether this outer step gathers replica states (a checkpoint, or replicas changing hands:
        # rank 0 announced a split). Said with the round's last inner step, so that the progress
        # watch allows the gather's time; a stop's checkpoint the coordinator knows of itself.
        will_gather = last == t.steps or due_auto or announce is not None or (every != "auto" and any(s % int(every) == 0 for s in steps))
        t_round = time.perf_counter()
        for h, step in enumerate(steps):
            t0 = time.perf_counter()
            lr = lr_of(step)
            for r in mine:
                offset, count = slices[r]
                loss_sum, n = reps.step(r, task.examples(step, offset, count), lr)
                losses[h] += loss_sum
                tokens[h] += n
                rep_tokens[r] += n
            seconds = time.perf_counter() - t0
            compute += seconds
            if link:
                link.progress(step=step, loss=losses[h] / max(tokens[h], 1.0), tokens=int(tokens[h]), seconds=seconds, gather=will_gather and step == last)
            if step % t.log_every_steps == 0:
                log.info("inner.done", step=step, replicas=len(mine), loss=round(losses[h] / max(tokens[h], 1.0), 4), seconds=round(seconds, 4))
        # The outer step. Read the stop flag now: a stop asked for during the inner steps ends the
        # group after this outer step, with a checkpoint, and nothing is recomputed.
        stop = bool(link.stop_requested()) if link else bool(stop_requested and stop_requested())  # by hand: a signal (handstop)
        start_flat = dict(tree_flatten(theta))
        ends = {r: dict(tree_flatten(reps.params[r])) for r in mine}
        vec = control.build(rank, losses, tokens, compute, float(sum(rep_tokens.values())), announce, stop, due_auto)
        group.wait_for_colocated()
        log.info("outer.summing", step=last, outer_step=rounds.index(last))
        t_sum = time.perf_counter()
        sums, ctl = outer_sums(group, start_flat, ends, rep_tokens, vec, K, sixteen)
        got = control.read(ctl.tolist(), len(steps))
        sum_s = time.perf_counter() - t_sum
        total = float(sum(got["tokens"]))
        delta = [(n, (s / total).astype(start_flat[n].dtype)) for n, s in zip(names, sums, strict=True)]
        if rounds.warm(last):
            model.update(tree_unflatten([(n, start_flat[n] - d) for n, d in delta]))  # a warm-up step: the average as it is
        else:
            model.update(theta)
            outer.update(model, tree_unflatten(delta))
        mx.eval(model.parameters(), outer.state)
        round_s = time.perf_counter() - t_round
        log.info("outer.done", step=last, outer_step=rounds.index(last), seconds=round(round_s, 4), all_sum_s=round(sum_s, 4),
                 compute_s=round(compute, 4), tokens=int(total))
        if auto:
            for _ in steps:
                auto.observe_step(round_s / len(steps), int(total / len(steps)))
        if rank == 0:
            for h, step in enumerate(steps):
                if step % t.log_every_steps == 0 or step == t.steps:
                    row = {
                        "kind": "train", "step": step, "loss": got["losses"][h] / max(got["tokens"][h], 1),
                        "lr": lr_of(step), "tokens": got["tokens"][h],
                        "tokens_per_s": total / round_s, "world_size": world, "generation": generation, "shares": shares,
                        "outer_step": rounds.index(last), "all_sum_s": sum_s,
                        "rank_tokens_per_s": [n / max(c, 1e-9) for n, c in zip(got["rank_tokens"], got["seconds"], strict=True)],
                    }
                    if auto and auto.interval is not None:
                        row["checkpoint_every"] = auto.interval
                    metrics.append(metrics.metrics, row)
                    if link:
                        link.metric(row)
        due = got["checkpoint"] if every == "auto" else any(s % int(every) == 0 for s in steps)
        owners = {r: i for i, rr in enumerate(ranges) for r in rr}
        if due or last == t.steps or got["stop"]:
            t_gather = time.perf_counter()
            reps.gather(group, owners, list(range(K)))
            gathers[last] = time.perf_counter() - t_gather
            holder = reps.holder(outer)
            writer.submit(ckpt.Snapshot(
                step=last, model=ckpt.to_host(tree_flatten(model.trainable_parameters())),
                optimizer=ckpt.to_host(tree_flatten(holder.state)), manifest=ckpt.run_manifest(spec, job_hash, world, shares, generation, task, last, mode="diloco"),
            ))
            if auto:
                auto.saved(last)
        if any(s % spec.eval.every_steps == 0 for s in steps) or last == t.steps:
            evaluate(last)
        if rank == 0 and (any(s % spec.eval.sample_every_steps == 0 for s in steps) or last == t.steps):
            metrics.sample(last, task.sample(last), link)
        report(writer.completed())
        # Balance: replicas follow the ranks' measured speed, from the next outer step on. A
        # replica that changes hands takes its inner state along (gathered from its old owner).
        announce = None
        proposed = replica_shares(got["new_shares"], K, t.global_batch) if got["new_shares"] else shares
        if proposed != shares:
            moved_to = replica_ranges(got["new_shares"], K, t.global_batch)
            moved = [r for r in range(K) if owners[r] != next(i for i, rr in enumerate(moved_to) if r in rr)]
            reps.gather(group, owners, moved)
            log.info("rebalanced", step=last, old=shares, shares=proposed, replicas=list(moved_to[rank]), moved=moved)
            shares, ranges = proposed, moved_to
            if balancer:
                balancer.adopt(shares)
        elif balancer:
            balancer.observe(got["seconds"], [float(x) for x in got["rank_tokens"]])
            announce = balancer.propose()
        if got["stop"]:
            stopped = True
            log.info("trainer.stopping", step=last, reason="stop requested")
            break
    report(writer.close())
    return stopped
