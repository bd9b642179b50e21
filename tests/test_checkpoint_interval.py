"""`checkpoint.every_steps = "auto"`: the interval policy (pure), and the trainer that uses it.

The policy: interval = ceil(cost / (2% x step time)), at least 1, first measured early, smoothed,
without thrashing. The trainer: rank 0 decides, every rank checkpoints at the same steps, and a
resume from such a checkpoint is exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ring
from jobs import SMALL, write_job

from dpool.protocol.checkpoints import listed_steps
from dpool.protocol.jobspec import JobFileError, parse_job
from dpool.trainer.interval import AutoInterval, interval_for

# -- the policy --------------------------------------------------------------------------------


def test_interval_is_the_fewest_steps_within_two_percent():
    assert interval_for(0.01, 0.1) == 5  # 10 ms every 5 steps of 100 ms: exactly 2%
    assert interval_for(0.0101, 0.1) == 6
    assert interval_for(2.0, 0.5) == 200
    assert interval_for(0.0001, 0.5) == 1, "a tiny checkpoint (LoRA adapters): every step"
    assert interval_for(0.0, 0.5) == 1
    assert interval_for(1.0, 1.0, target=0.5) == 2
    with pytest.raises(ValueError):
        interval_for(1.0, 0.0)


def test_first_checkpoint_comes_early_then_waits_for_its_cost():
    a = AutoInterval(start=0)
    a.observe_step(1.0)  # step 1: compile time, an outlier the median drops
    assert not a.due(1)
    assert a.due(2), "the first, measuring checkpoint comes after two steps"
    a.saved(2)
    for step in (3, 4, 5):
        a.observe_step(0.1)
        assert not a.due(step), "no second checkpoint before the first one's cost is known"
    assert a.observe_checkpoint(0.05) is True
    assert a.interval == interval_for(0.05, 0.1) == 25
    assert not a.due(26) and a.due(27)  # counted from the last checkpoint (step 2)


def test_resume_counts_from_the_resume_step():
    a = AutoInterval(start=40)
    a.observe_step(0.2)
    assert not a.due(41) and a.due(42)


def measured(cost_s: float, step_s: float = 0.1) -> AutoInterval:
    """A policy that has seen ten steps and its first checkpoint."""
    a = AutoInterval(start=0)
    for _ in range(10):
        a.observe_step(step_s)
    a.saved(2)
    a.observe_checkpoint(cost_s)
    return a


def test_cost_is_smoothed_and_small_wobbles_change_nothing():
    a = measured(0.02)
    assert a.interval == 10
    changes = 0
    for i in range(200):  # the cost wanders +-15% around 20 ms, the step time +-10% around 100 ms
        changes += a.observe_checkpoint(0.02 * (1.15 if i % 2 else 0.85))
        changes += a.observe_step(0.1 * (1.1 if i % 3 else 0.9))
    assert changes <= 1, f"the interval changed {changes} times under noise"
    assert 9 <= (a.interval or 0) <= 13


def test_one_slow_write_does_not_set_the_interval():
    a = measured(0.01)
    for _ in range(4):
        a.observe_checkpoint(0.01)
    assert a.interval == 5
    a.observe_checkpoint(0.1)  # ten times slower once (a busy disk): left out, not a trend
    for _ in range(20):
        a.observe_step(0.1)
    assert a.interval == 5


def run_schedule(a: AutoInterval, steps: range, step_s: float, cost_s: float) -> list[int]:
    """Drive the policy as the trainer does; the steps that checkpointed."""
    saved = []
    for step in steps:
        due = a.due(step)
        a.observe_step(step_s)
        if due:
            a.saved(step)
            a.observe_checkpoint(cost_s)  # the write is done by the next step
            saved.append(step)
    return saved


def test_interval_grows_and_shrinks_with_headroom():
    a = AutoInterval(start=0)
    assert run_schedule(a, range(1, 21), 0.1, 0.01)[:3] == [2, 7, 12]
    assert a.interval == 5
    run_schedule(a, range(21, 400), 0.1, 0.04)  # checkpoints got 4x dearer: the budget is kept
    assert a.interval == 20
    run_schedule(a, range(400, 800), 0.1, 0.01)  # and cheap again: back down, with room to spare
    assert a.interval is not None and 5 <= a.interval <= 7
    need = a.need()
    assert need is not None and a.interval >= need, "never above the budget"


def test_interval_holds_after_a_change_unless_far_over_budget():
    a = AutoInterval(start=0)
    run_schedule(a, range(1, 4), 0.1, 0.01)
    assert a.interval == 5
    for _ in range(9):
        a.observe_checkpoint(0.007)  # 30% cheaper at once: held (fewer than HOLD steps since)
    assert a.interval == 5
    for _ in range(9):
        a.observe_checkpoint(0.02)  # twice dearer: over 1.5x the budget, no waiting
    assert a.interval is not None and a.interval > 7
    for _ in range(10):
        a.observe_step(0.1)
    assert a.interval == 10, "and exactly on budget once held long enough"


def test_slower_steps_checkpoint_more_often():
    a = AutoInterval(start=0, window=5)
    for _ in range(5):
        a.observe_step(0.1)
    a.saved(2)
    a.observe_checkpoint(0.02)
    assert a.interval == 10
    for _ in range(5):
        a.observe_step(2.0)
    assert a.interval == 10, "held for a while"
    for _ in range(5):
        a.observe_step(2.0)
    assert a.interval == 1


# -- the job file ------------------------------------------------------------------------------


def test_job_file_takes_auto_or_an_int():
    assert parse_job({"name": "a"}).checkpoint.every_steps == "auto", "auto is the default"
    assert parse_job({"name": "a", "checkpoint": {"every_steps": 7}}).checkpoint.every_steps == 7
    for bad in ("sometimes", 0, -1, 2.5, True):
        with pytest.raises(JobFileError, match=r"checkpoint\.every_steps .*must be 'auto'.* or an integer >= 1"):
            parse_job({"name": "a", "checkpoint": {"every_steps": bad}})


# -- the trainer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("auto")


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return {"DPOOL_CACHE_DIR": str(tmp_path_factory.mktemp("tokens"))}


def auto_job(folder: Path) -> Path:
    return write_job(
        folder, "auto", base=SMALL, train={"steps": 12, "micro_batch": 24},
        checkpoint={"every_steps": "auto", "keep": 100},
        eval={"every_steps": 1000, "batches": 1, "sample_every_steps": 1000, "sample_tokens": 8},
    )


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in ring.metrics(run_dir).items()}


def events(text: str, name: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if f'"event":"{name}"' in line]


def test_auto_ranks_agree_and_a_resume_is_exact(work, env):
    job = auto_job(work)
    # Two ranks: rank 0 decides, both save the same steps.
    # A budget of 50% (not 2%): this tiny model's checkpoint then comes about every step, whatever
    # this machine's timings, so the ranks have many decisions to agree on.
    two = ring.run(job, str(work / "two" / "r{rank}"), 2, work / "logs", shares=[10, 14],
                   env={**env, "DPOOL_CHECKPOINT_OVERHEAD": "0.5"})
    steps = [sorted(listed_steps(work / "two" / f"r{r}")) for r in range(2)]
    assert steps[0] == steps[1], "every rank checkpoints at the same steps"
    assert steps[0][0] == 2, "the first checkpoint comes early, to measure its cost"
    assert steps[0][-1] == 12 and len(steps[0]) >= 5, steps[0]
    chosen = events(two.output(0), "checkpoint.interval")
    assert chosen and chosen[0]["every_steps"] >= 1 and chosen[0]["overhead"] <= 0.5
    assert not events(two.output(1), "checkpoint.interval"), "only rank 0 decides"
    rows = ring.metrics(work / "two" / "r0")
    shown = {r["checkpoint_every"] for r in rows.values() if "checkpoint_every" in r}
    assert shown and shown <= {c["every_steps"] for c in chosen}, "the interval in force is in the metrics"
    assert "checkpoint_every" in rows[12]

    # One rank, killed right after its first (auto) checkpoint, resumed: the same curve as uninterrupted.
    whole = work / "whole"
    ring.run(job, str(whole), 1, work / "logs", env=env)
    killed = work / "killed"
    ring.kill_at_checkpoint(job, killed, 2, work / "logs", env=env)
    resumed = ring.run(job, str(killed), 1, work / "logs", env=env)
    assert '"resume_step":2' in resumed.output(0)
    a, b = losses(whole), losses(killed)
    assert sorted(b) == list(range(1, 13))
    assert max(abs(a[s] - b[s]) for s in range(3, 13)) <= 1e-6
    # and the same curve as two ranks (checkpoints do not touch the math)
    two_curve = losses(work / "two" / "r0")
    assert max(abs(a[s] - two_curve[s]) for s in range(1, 13)) <= 1e-4
    assert re.search(r'"event":"checkpoint.saved"', resumed.output(0))


def test_the_cost_is_the_slowdown_of_the_steps_a_write_overlaps_per_token():
    """The writer took the cores: the two steps during the write ran 0.3 s over what their tokens
    take (batches of 100 and 200 tokens at 1 ms a token), against a host copy of 0.01 s. The cost is
    the slowdown, and the interval follows it; steps during a write do not count as step times."""
    auto = AutoInterval(0, target=0.02, first_after=2)
    for tokens in (100, 200, 100, 200):
        auto.observe_step(tokens * 0.001, tokens)
    auto.saved(4)
    auto.observe_step(100 * 0.001 + 0.1, 100, writing=True)
    auto.observe_step(200 * 0.001 + 0.2, 200, writing=True)
    auto.observe_checkpoint(0.01)
    assert auto.cost == pytest.approx(0.3)
    assert auto.step_time() == pytest.approx(0.15)  # the four steps without a write
    assert auto.interval == 100  # ceil(0.3 / (0.02 * 0.15))
    # A copy that costs more than any slowdown seen (a write that finished before the next step).
    quick = AutoInterval(0, target=0.02, first_after=2)
    quick.observe_step(0.1, 100)
    quick.observe_checkpoint(0.004)
    assert quick.cost == pytest.approx(0.004) and quick.interval == 2
