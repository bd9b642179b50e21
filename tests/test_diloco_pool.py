"""The low-communication mode through real dpds: machines join and leave between outer steps, and
nothing already trained is recomputed (trainer/diloco.py, daemon/watch.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import LocalPool, Processes, trained_alone, wait_for
from jobs import NO_WARMUP, constant_lr, write_job

pytestmark = pytest.mark.slow

H, K = 4, 4
JOB_TIMEOUT = 300.0
# Endless, at a constant learning rate: its curve does not depend on its number of steps, so the job
# is cancelled a few outer steps after the last fault, and its first N steps are compared with one
# process's run of N steps (a job that had to end after the faults would make the test depend on the
# machine's speed, or train hundreds of steps no assertion looks at).
ENDLESS = {"steps": 100_000, "global_batch": 12, "lr_schedule": constant_lr(1e-3)}


def diloco_job(folder: Path, name: str, steps: int = 100_000) -> Path:
    return write_job(
        folder, name, base=NO_WARMUP, workers={"min": 1, "max": 3}, model={"layers": 2, "dim": 64},
        train={**ENDLESS, "steps": steps}, checkpoint={"every_steps": H},
        sync={"mode": "diloco", "replicas": K, "inner_steps": H, "outer_lr": 0.7, "outer_momentum": 0.9},  # momentum: outer state to carry
    )


def reference(root: Path, steps: int) -> dict[int, float]:
    """The fault-free curve of `steps` steps: one trainer process alone runs the four replicas."""
    return trained_alone(diloco_job(root, "ref", steps), root / "run", JOB_TIMEOUT)


def test_a_join_and_a_drain_between_outer_steps_recompute_nothing(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path / "pool", warm=True)
    pool.start(1, 1)
    job = pool.submit(diloco_job(tmp_path, "elastic"))
    pool.wait_status(job, "mid outer step 2", lambda s: s.state == "running" and s.step >= H + 2, timeout=120, every=0.05)
    pool.start_daemon("n2")  # joins mid outer step: takes replicas at the next one
    grown = pool.wait_status(job, "three workers", lambda s: s.state == "running" and s.world_size == 3, timeout=120, every=0.05)
    wait_for("a step past the grown group's first outer step", lambda: pool.status(job).step % H not in (0,) and pool.status(job).step > grown.step + H, 120)
    r = pool.dpctl("drain", "n1")  # mid outer step: leaves at the end of it
    assert r.returncode == 0, r.stderr
    shrunk = pool.wait_status(job, "two workers again", lambda s: s.state == "running" and s.world_size == 2 and s.generation == 3, timeout=120, every=0.05)
    wait_for("mid an outer step after the drain", lambda: pool.status(job).step > shrunk.step + H + 1, 120)
    (victim,) = pool.trainer_pids("n2", job, generation=3)
    os.kill(victim, signal.SIGKILL)  # a crash mid outer step: back to the newest outer step checkpointed
    back = pool.wait_status(job, "a new group after the crash", lambda s: s.state == "running" and s.generation == 4, timeout=120, every=0.05)
    wait_for("two outer steps after the crash", lambda: pool.status(job).step >= back.step + 2 * H, 120)
    assert pool.dpctl("cancel", job).returncode == 0
    final = pool.wait_end(job, JOB_TIMEOUT, every=0.05)
    events = pool.dpctl_json("events", job)
    assert final.state == "cancelled", (final, events, pool.dpctl("logs", job).stdout[-3000:])
    resumed = [e for e in events if e["kind"] == "group.resumed"]
    planned = [e for e in resumed if e["cause"] == "membership"]
    assert len(planned) >= 2 and all(e["steps_recomputed"] == 0 for e in planned), events
    (crash,) = [e for e in resumed if e["cause"] != "membership"]
    assert crash["from_step"] % H == 0 and crash["steps_recomputed"] <= 2 * H, crash  # every_steps = H: at most this outer step and the last
    assert not [e for e in events if e["kind"] == "group.stalled"], events
    # The victim, rank 1; rank 0 may also fail (its outer all_sum lost the peer) before it is stopped.
    failed = [e["rank"] for e in events if e["kind"] == "worker.failed"]
    assert 1 in failed and set(failed) <= {0, 1}, events
    assert {e["world_size"] for e in events if e["kind"] == "group.started"} >= {2, 3}
    rows = [r for r in pool.dpctl_json("metrics", job) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= back.step + 2 * H
    ref = reference(tmp_path / "reference", len(rows))
    worst = max(abs(r["loss"] - ref[r["step"]]) for r in rows)
    assert worst < 1e-4, worst
