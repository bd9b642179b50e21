"""The low-communication mode (`[sync] mode = "diloco"`, trainer/diloco.py) with real ring groups:
the curve depends on the job file only, whoever runs the replicas, through kills and resumes."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ring
from jobs import SMALL, write_job

from dpool.protocol.shares import replica_ranges, replica_shares
from dpool.trainer.diloco import Rounds, outer_rounds

STEPS, H, K = 12, 4, 4
# The outer step with momentum (DiLoCo's 0.7 and Nesterov 0.9, not the defaults' plain averaging):
# its momentum is outer state that every kill, resume and move below must carry.
PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9}
TOL = 1e-4  # float32 sums in another order (as between world sizes in the synchronous mode)


def diloco_job(folder: Path, name: str, steps: int = STEPS, inner: int = H, **sections) -> Path:
    return write_job(
        folder, name, base=SMALL, train={"steps": steps, "micro_batch": 4, "lr": 1e-3},
        sync={"mode": "diloco", "replicas": K, "inner_steps": inner, **PAPER, **sections.pop("sync", {})},
        checkpoint=sections.pop("checkpoint", {"every_steps": inner}), eval={"every_steps": inner, "batches": 1, "sample_every_steps": 100, "sample_tokens": 4},
        **sections,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("diloco")


@pytest.fixture(scope="module")
def env(work) -> dict[str, str]:
    return {"DPOOL_CACHE_DIR": str(work / "tokens")}


@pytest.fixture(scope="module")
def reference(work, env) -> dict[int, float]:
    """One worker runs all four replicas, uninterrupted."""
    run_dir = work / "reference"
    ring.run(diloco_job(work, "ref"), str(run_dir / "r{rank}"), 1, work / "logs", env=env)
    return losses(run_dir / "r0")


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in ring.metrics(run_dir).items()}


def assert_same_curve(a: dict[int, float], b: dict[int, float], tol: float = TOL) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    worst = max(a, key=lambda s: abs(a[s] - b[s]))
    assert abs(a[worst] - b[worst]) <= tol, f"step {worst}: {a[worst]} vs {b[worst]}"


def test_replicas_follow_the_shares_and_outer_steps_cover_every_step() -> None:
    assert replica_ranges([12, 7, 5], 4, 24) == [range(0, 2), range(2, 3), range(3, 4)]
    assert replica_ranges([1, 1, 22], 4, 24) == [range(0, 1), range(1, 2), range(2, 4)]
    assert replica_ranges([24], 4, 24) == [range(0, 4)]
    # What each rank computes, said as its share: whole replicas (of 6 sequences here; of 7, 7, 6, 6
    # for 26), not the speeds' split (status said 16 / 16 / 16 while ranks computed 24 / 12 / 12).
    assert replica_shares([16, 16, 16], 4, 48) == [24, 12, 12]
    assert replica_shares([12, 7, 5], 4, 24) == [12, 6, 6]
    assert replica_shares([1, 1, 24], 4, 26) == [7, 7, 12]
    # The pool rounds, the trainer is handed the rounded shares: the same replicas, whatever sizes
    # (apportioning them again gave equal nodes 21 and 11 of 32 sequences in 12 replicas, not 18 and 14).
    assert replica_shares([16, 16], 12, 32) == [18, 14] and replica_ranges([18, 14], 12, 32) == [range(0, 6), range(6, 12)]
    rng = random.Random(5)
    for _ in range(2000):
        k = rng.randint(1, 16)
        gb = rng.randint(k, 200)
        world = rng.randint(1, k)
        cuts = sorted(rng.sample(range(1, gb), world - 1)) if world > 1 else []
        shares = [b - a for a, b in zip([0, *cuts], [*cuts, gb], strict=True)]
        rounded = replica_shares(shares, k, gb)
        assert sum(rounded) == gb and replica_ranges(rounded, k, gb) == replica_ranges(shares, k, gb), (shares, k, gb)
        assert replica_shares(rounded, k, gb) == rounded
    assert outer_rounds(0, 10, 4) == [range(1, 5), range(5, 9), range(9, 11)]
    assert outer_rounds(8, 10, 4) == [range(9, 11)]
    # Warm-up: the first 3 steps one each, then rounds of 4 from there; a resume may start at any boundary.
    assert outer_rounds(0, 12, 4, 3) == [range(1, 2), range(2, 3), range(3, 4), range(4, 8), range(8, 12), range(12, 13)]
    assert outer_rounds(2, 12, 4, 3) == [range(3, 4), range(4, 8), range(8, 12), range(12, 13)]
    assert outer_rounds(7, 12, 4, 3) == [range(8, 12), range(12, 13)]
    rounds = Rounds(4, 3)
    assert [s for s in range(13) if rounds.boundary(s)] == [0, 1, 2, 3, 7, 11]
    assert [rounds.index(s) for s in range(1, 13)] == [1, 2, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6]
    assert outer_rounds(0, 2, 4, 3) == [range(1, 2), range(2, 3)]  # a warm-up longer than the run


def test_one_worker_and_three_unequal_workers_give_the_same_curve(work, env, reference) -> None:
    run_dir = work / "three"
    ring.run(diloco_job(work, "three"), str(run_dir / "r{rank}"), 3, work / "logs", env=env, shares=[12, 7, 5])
    assert_same_curve(reference, losses(run_dir / "r0"))
    # Two replicas of 6 sequences on rank 0, one on each other: its rows say so, not the 12, 7, 5 asked.
    assert {tuple(r["shares"]) for r in ring.metrics(run_dir / "r0").values()} == {(12, 6, 6)}
    # Outer steps only: one all_sum per H steps, each carrying every replica's inner losses.
    outer = [json.loads(line) for line in (run_dir / "r0" / "metrics.jsonl").read_text().splitlines() if '"outer_step"' in line]
    assert {r["outer_step"] for r in outer} == {1, 2, 3}


def test_the_outer_step_is_not_the_synchronous_step(work, env, reference) -> None:
    """Within the first outer step each replica trains alone: the curve leaves the synchronous one."""
    run_dir = work / "sync"
    job = write_job(work, "sync", base=SMALL, train={"steps": STEPS, "micro_batch": 4, "lr": 1e-3},
                    checkpoint={"every_steps": 100}, eval={"every_steps": 100, "batches": 1, "sample_every_steps": 100, "sample_tokens": 4})
    ring.run(job, str(run_dir / "r{rank}"), 1, work / "logs", env=env)
    sync = losses(run_dir / "r0")
    assert max(abs(sync[s] - reference[s]) for s in range(2, STEPS + 1)) > 1e-3


def test_one_replica_one_inner_step_and_the_default_outer_step_is_synchronous_training(work, env) -> None:
    """DiLoCo with K = 1, H = 1 and the default outer step (lr 1, no momentum: plain averaging)
    applies the inner step as it is: the synchronous curve, step for step (checks the outer step's
    sign, weighting and scale, and that the defaults are plain averaging)."""
    common = {"base": SMALL, "train": {"steps": 6, "micro_batch": 4, "lr": 1e-3},
              "checkpoint": {"every_steps": "auto"}, "eval": {"every_steps": 3, "batches": 1, "sample_every_steps": 100, "sample_tokens": 4}}
    plain = write_job(work, "plain", **common)
    one = write_job(work, "k1h1", **common, sync={"mode": "diloco", "replicas": 1, "inner_steps": 1})
    ring.run(plain, str(work / "plain" / "r{rank}"), 1, work / "logs", env=env)
    ring.run(one, str(work / "k1h1" / "r{rank}"), 1, work / "logs", env=env)
    a, b = losses(work / "plain" / "r0"), losses(work / "k1h1" / "r0")
    assert sorted(a) == sorted(b) == list(range(1, 7)) and max(abs(a[s] - b[s]) for s in a) <= 1e-5, (a, b)
    # checkpoint.every_steps = "auto": the rows say the interval in force, in either mode (diloco's said none)
    for run in ("plain", "k1h1"):
        assert any("checkpoint_every" in r for r in ring.metrics(work / run / "r0").values()), run


def test_a_rank_killed_mid_inner_steps_resumes_on_fewer_workers_on_the_same_curve(work, env, reference) -> None:
    run_dir = work / "killed-inner"
    job = diloco_job(work, "killed-inner")
    g = ring.start(job, str(run_dir / "r{rank}"), 3, work / "logs", env=env, shares=[8, 8, 8])
    # Once outer step 1 is saved, in the middle of outer step 2's inner steps:
    codes = kill_rank_1(g, (0, '"event":"checkpoint.saved"', '"step":4'), (1, '"event":"inner.done"', '"step":6'))
    assert codes[1] == -signal.SIGKILL and codes[0] != 0 and codes[2] != 0, codes
    resumed = ring.run(job, str(run_dir / "r{rank}"), 2, work / "logs", env=env)
    # From the newest outer step saved: 4, or 8 where the machine was slow to deliver the kill.
    assert '"resume_step":4' in resumed.output(0) or '"resume_step":8' in resumed.output(0), resumed.output(0)[-2000:]
    assert_same_curve(reference, losses(run_dir / "r0"))
    assert ring.metrics(run_dir / "r0")[12]["generation"] == 2, "the second group by hand is generation 2"


def test_a_run_stopped_before_an_outer_steps_evaluation_writes_it_on_resume(work, env, reference) -> None:
    """Stopped once outer step 2's checkpoint (step 8) was handed to its writer and before its
    evaluation: resumed there, the evaluation of step 8 is written, then the rest as before."""
    import shutil

    run_dir = work / "eval-gap"
    shutil.copytree(work / "reference" / "r0", run_dir / "r0")
    shutil.rmtree(run_dir / "r0" / "checkpoints" / "step-12")
    metrics = run_dir / "r0" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 8 and not (r["step"] == 8 and r["kind"] == "eval")))
    g = ring.run(diloco_job(work, "ref"), str(run_dir / "r{rank}"), 1, work / "logs", env=env)
    assert '"resume_step":8' in g.output(0), g.output(0)[-2000:]
    got, want = ring.metrics(run_dir / "r0", "eval"), ring.metrics(work / "reference" / "r0", "eval")
    assert sorted(got) == sorted(want) == [0, 4, 8, 12], (got, want)
    assert max(abs(got[s]["val_loss"] - want[s]["val_loss"]) for s in want) <= TOL, (got, want)
    assert_same_curve(reference, losses(run_dir / "r0"))


def test_a_rank_killed_while_the_others_wait_in_the_outer_all_sum_resumes_on_the_same_curve(work, env, reference) -> None:
    run_dir = work / "killed-outer"
    job = diloco_job(work, "killed-outer")
    # Rank 0 runs one replica, rank 1 three: rank 0 reaches each outer all_sum first and waits there.
    g = ring.start(job, str(run_dir / "r{rank}"), 2, work / "logs", env=env, shares=[6, 18])
    codes = kill_rank_1(g, (0, '"event":"outer.summing"', '"step":8'))
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    resumed = ring.run(job, str(run_dir / "r{rank}"), 1, work / "logs", env=env)
    assert '"resume_step":4' in resumed.output(0) or '"resume_step":8' in resumed.output(0)
    assert_same_curve(reference, losses(run_dir / "r0"))


def test_unequal_replica_counts_and_moves_keep_the_curve(work, env, reference) -> None:
    """Rank 2 starts with two replicas and twice the work, with balancing on: whatever the balancer
    moves (a replica's inner AdamW state goes along), the curve stays the one of a single worker."""
    run_dir = work / "moved"
    steps = 16
    job = diloco_job(work, "moved", steps=steps, inner=2)
    moved = ring.run(job, str(run_dir / "r{rank}"), 3, work / "logs", env=env, shares=[1, 1, 22])
    ref_dir = work / "moved-ref"
    ring.run(diloco_job(work, "moved-ref", steps=steps, inner=2), str(ref_dir / "r{rank}"), 1, work / "logs", env=env)
    a, b = losses(ref_dir / "r0"), losses(run_dir / "r0")
    assert max(abs(a[s] - b[s]) for s in range(1, steps + 1)) <= TOL
    # Whether the balancer moves replicas here depends on the machine's timing (the ranks are
    # equally fast; rank 2 has twice the replicas): where it did, each move names replicas that
    # changed hands, and the curve above held through it.
    events = [json.loads(line) for line in moved.output(0).splitlines() if line.startswith("{") and '"rebalanced"' in line]
    assert all(set(e["moved"]) <= set(range(K)) for e in events), events


def kill_rank_1(g: ring.Group, *after: tuple[Any, ...]) -> list[int]:
    """SIGKILL rank 1's process group once each (rank, needle, ...) of `after` has been logged, in
    turn; the group's exit codes (the others fail on their own; whatever is left is ended)."""
    try:
        for rank, *needles in after:
            wait_for_line(g, rank, *needles)
        os.killpg(g.procs[1].pid, signal.SIGKILL)
        return g.wait(60)
    finally:
        g.kill()


def wait_for_line(g: ring.Group, rank: int, *needles: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(all(n in line for n in needles) for line in g.output(rank).splitlines()):
            return
        if g.procs[rank].poll() is not None:
            raise AssertionError(f"rank {rank} ended before {needles}:\n{g.output(rank)[-3000:]}")
        time.sleep(0.01)
    raise AssertionError(f"rank {rank}: no {needles} in {timeout} s:\n{g.output(rank)[-3000:]}")


def test_warm_up_steps_average_every_step_and_a_group_resumed_inside_them_on_fewer_workers_keeps_the_curve(work, env) -> None:
    """`sync.warmup_steps = 5`: steps 1-5 are outer steps of one step each, their average applied
    as it is whatever the outer lr and momentum (the curve of H = 1 with plain averaging), then
    outer steps of H. Killed after the first step's checkpoint, the job resumes inside the warm-up
    (or, on a slow machine, at its end) on one worker and ends on the uninterrupted curve."""
    warm = {"sync": {"warmup_steps": 5}, "checkpoint": {"every_steps": 1}}
    ring.run(diloco_job(work, "warm-ref", **warm), str(work / "warm-ref" / "r{rank}"), 1, work / "logs", env=env)
    ref = losses(work / "warm-ref" / "r0")
    h1 = diloco_job(work, "warm-h1", inner=1, sync={"outer_lr": 1.0, "outer_momentum": 0.0})  # the same schedule of lr
    ring.run(h1, str(work / "warm-h1" / "r{rank}"), 1, work / "logs", env=env)
    h1_losses = losses(work / "warm-h1" / "r0")
    assert_same_curve({s: ref[s] for s in range(1, 6)}, {s: h1_losses[s] for s in range(1, 6)}, 1e-5)
    outer = {r["step"]: r["outer_step"] for r in ring.metrics(work / "warm-ref" / "r0").values()}
    assert [outer[s] for s in range(1, STEPS + 1)] == [1, 2, 3, 4, 5, 6, 6, 6, 6, 7, 7, 7]

    run_dir = work / "warm-killed"
    job = diloco_job(work, "warm-killed", **warm)
    g = ring.start(job, str(run_dir / "r{rank}"), 3, work / "logs", env=env, shares=[12, 7, 5])
    codes = kill_rank_1(g, (0, '"event":"checkpoint.saved"', '"step":1'))
    assert codes[1] == -signal.SIGKILL, codes
    resumed = ring.run(job, str(run_dir / "r{rank}"), 1, work / "logs", env=env)
    start = next(json.loads(line)["resume_step"] for line in resumed.output(0).splitlines() if '"trainer.started"' in line)
    assert start in (1, 2, 3, 4, 5, 9), start  # a warm step (most often 1 or 2), or later where the kill came late
    assert_same_curve(ref, losses(run_dir / "r0"))


def test_a_group_by_hand_with_more_ranks_than_replicas_exits_2_naming_the_key(work, env) -> None:
    """Both ranks crashed with a traceback ("cannot give 2 ranks at least one of 1 sequences")."""
    job = diloco_job(work, "k1", sync={"replicas": 1})
    g = ring.start_ranks(work / "k1", [[str(job), "--run-dir", str(work / "k1" / f"r{r}")] for r in range(2)], env=env)
    assert ring.finish(g, 120) == [2, 2], g.output(0)[-2000:]
    for rank in (0, 1):
        out = g.output(rank)
        assert "error: sync.replicas = 1: a diloco group has at most one rank per replica, and this one has 2" in out and "Traceback" not in out, out[-2000:]
