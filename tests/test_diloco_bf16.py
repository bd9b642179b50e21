"""DiLoCo with 16-bit outer sums (`[sync] mode = "diloco"`, `dtype = "bfloat16"`): half the bytes,
and still the same curve on any number of workers (trainer/diloco.py `outer_sums`). Real ring groups."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import ring
from jobs import write_job

from dpool.trainer.diloco import LEVELS, Alone, outer_sums

# The auditor's job: a small GPT, 4 replicas of 7 inner steps, DiLoCo's outer step (lr 0.7, Nesterov
# 0.9: its momentum carries an outer step's rounding into the next ones). With a bfloat16 all_sum,
# one worker and two ended up 6e-5 apart on the loss (three 1.3e-4; 4e-4 in 150 steps) and 1e-3 on
# the parameters; with the 16-bit integer sums, 6e-7 (float32's order in the loss sums) and 0.
STEPS = 56
TINY_GPT = {
    "model": {"layers": 2, "dim": 64, "heads": 4, "context": 64},
    "train": {"global_batch": 6, "lr": 1e-3, "warmup_steps": 3, "log_every_steps": 1},
}


def job(folder: Path, name: str, dtype: str) -> Path:
    return write_job(
        folder, name, base=TINY_GPT, train={"steps": STEPS, "micro_batch": 4},
        sync={"mode": "diloco", "replicas": 4, "inner_steps": 7, "outer_lr": 0.7, "outer_momentum": 0.9, "dtype": dtype},
        checkpoint={"every_steps": 1000}, eval={"every_steps": 1000, "batches": 1, "sample_every_steps": 1000, "sample_tokens": 4},
    )


def trained(folder: Path, name: str, dtype: str, world: int, shares: list[int] | None = None) -> tuple[dict[int, float], dict[str, mx.array]]:
    """The run's train losses by step and its final parameters."""
    run_dir = folder / name
    ring.run(job(folder, name, dtype), str(run_dir / "r{rank}"), world, folder / "logs", env={"DPOOL_CACHE_DIR": str(folder / "tokens")}, shares=shares)
    losses = {s: r["loss"] for s, r in ring.metrics(run_dir / "r0").items()}
    return losses, mx.load(str(run_dir / "r0" / "checkpoints" / f"step-{STEPS}" / "model.safetensors"))


def largest_gap(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (sorted(a), sorted(b))
    worst = max(a, key=lambda s: abs(a[s] - b[s]))
    return abs(a[worst] - b[worst]), worst


def test_sixteen_bit_outer_sums_give_the_same_model_on_one_two_and_three_unequal_workers(tmp_path) -> None:
    one, one_params = trained(tmp_path, "one", "bfloat16", 1)
    for name, world, shares in (("two", 2, None), ("three", 3, [3, 2, 1])):  # replicas 2+2; 2+1+1
        other, params = trained(tmp_path, name, "bfloat16", world, shares)
        # The outer sums are exact: the same parameters, bit for bit; the losses differ only by
        # the float32 order in which the control vector adds the replicas' loss sums.
        gap, step = largest_gap(one, other)
        assert gap <= 1e-5, f"{name} workers: loss {other[step]} at step {step}, one worker {one[step]}"
        unequal = [k for k in one_params if not mx.array_equal(one_params[k], params[k]).item()]
        assert not unequal, f"{name} workers end with other parameters than one worker: {unequal}"
    # And 16 bits carry the changes closely: one worker's curve stays by float32's (a sum that
    # lost the changes would be the same on every world size too).
    exact, _ = trained(tmp_path, "float32", "float32", 1)
    gap, step = largest_gap(one, exact)
    assert gap <= 1e-5, f"16-bit sums: loss {one[step]} at step {step}, float32 {exact[step]}"


def test_sixteen_bit_sums_round_each_replica_by_half_a_step_at_most_and_keep_a_nan() -> None:
    """One rank, four replicas of unequal weight: each tensor's sum is within K half steps of the
    float32 sum (step: the tensor's largest weighted change over the replicas / (LEVELS // K)), the
    control vector comes back as it was, and a NaN in one replica's change (a diverged replica)
    makes that tensor's sum NaN rather than a finite number."""
    theta = {"w": mx.zeros((16, 8)), "b": mx.full((8,), 0.5)}
    ends = {r: {k: v + 1e-3 * mx.random.normal(v.shape, key=mx.random.key(r)) for k, v in theta.items()} for r in range(4)}
    weights = {0: 30, 1: 20, 2: 64, 3: 1}
    vec = mx.array([3.0, 7.0, 0.25])
    exact, _ = outer_sums(Alone(), theta, ends, weights, vec, 4, sixteen=False)  # type: ignore[arg-type]
    sums, ctl = outer_sums(Alone(), theta, ends, weights, vec, 4, sixteen=True)  # type: ignore[arg-type]
    assert mx.array_equal(ctl, vec).item()
    for i, name in enumerate(theta):
        top = max(mx.abs((theta[name] - ends[r][name]) * w).max().item() for r, w in weights.items())
        gap = mx.abs(sums[i] - exact[i]).max().item()
        assert 0 < gap <= 4 * top / (LEVELS // 4) / 2 * 1.001, (name, gap, top)
    ends[2]["b"] = ends[2]["b"].at[3].add(float("nan"))
    sums, _ = outer_sums(Alone(), theta, ends, weights, vec, 4, sixteen=True)  # type: ignore[arg-type]
    assert mx.isnan(sums[1]).all().item() and not mx.isnan(sums[0]).any().item()
