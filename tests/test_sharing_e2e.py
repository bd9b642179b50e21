"""Sharing the pool end to end: real dpd processes on loopback, real trainers, dpctl as a user runs
it. A job of higher priority makes a running elastic job shrink (and it grows back after), equal
jobs split the slots, a job at its minimum is preempted and resumes from its checkpoint, and a
small job backfills slots the head of the queue cannot use. Each job ends on the curve one trainer
alone draws for its job file (1e-3): a resize is a planned restart that recomputes no step.

Timings are not asserted (the timeouts are generous); the shrink and the growth back are printed
(`-s`) and measured figures go to BENCHMARKS.md ("Sharing the pool").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalPool, Processes, trained_alone
from jobs import NO_WARMUP, constant_lr, write_job

from dpool.protocol.payloads import JobStatus

pytestmark = pytest.mark.slow

TIMEOUT = 240.0
TOL = 1e-3
SHORT = 100  # steps of the job that comes and goes (the preempted ones are endless: cancelled on their curve)


def job_file(dir: Path, name: str, lo: int, hi: int, steps: int) -> Path:
    return write_job(dir, name, workers={"min": lo, "max": hi}, train={"steps": steps}, checkpoint={"every_steps": 10})


def endless_job(dir: Path, name: str, lo: int, hi: int, steps: int = 100_000) -> Path:
    """A job at a constant learning rate: its curve does not depend on its number of steps, so
    however far it got before it was cancelled, the first N steps of a run of N steps are its
    fault-free curve (a job that might end before the test is done with it would make the test
    depend on the machine's speed)."""
    return write_job(dir, name, base=NO_WARMUP, workers={"min": lo, "max": hi}, checkpoint={"every_steps": 10},
                     train={"steps": steps, "lr_schedule": constant_lr(3e-3)})


def alone(dir: Path, name: str, steps: int) -> dict[int, float]:
    """The curve of `endless_job(name)` cut at `steps`, trained by one trainer process alone."""
    return trained_alone(endless_job(dir, f"{name}-alone", 1, 1, steps), dir / f"{name}-alone", TIMEOUT)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], dict[int, float]]]:
    """The fault-free curve of the test job of `steps` steps: its job file trained by one trainer
    process alone (started at once, in the background; awaited when compared against)."""
    root = tmp_path_factory.mktemp("references")
    procs = Processes(root)
    runs = {}
    for steps in (SHORT,):
        job = job_file(root, f"ref-{steps}", 1, 1, steps)
        runs[steps] = procs.start([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(root / f"run-{steps}")], root / f"ref-{steps}.log")
    cache: dict[int, dict[int, float]] = {}

    def curve(steps: int) -> dict[int, float]:
        if steps not in cache:
            assert runs[steps].wait(timeout=TIMEOUT) == 0, (root / f"ref-{steps}.log").read_text()[-2000:]
            rows = [json.loads(line) for line in (root / f"run-{steps}" / "metrics.jsonl").read_text().splitlines()]
            cache[steps] = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
        return cache[steps]

    try:
        yield curve
    finally:
        procs.stop_all()


class Pool(LocalPool):
    def submit_with(self, path: Path, *args: str) -> str:
        r = self.dpctl("submit", str(path), *args)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def wait(self, job: str, what: str, check: Callable[[JobStatus], Any], timeout: float = TIMEOUT) -> JobStatus:
        return self.wait_status(job, f"{job}: {what}", check, timeout, every=0.05)

    def cancel_on_curve(self, job: str, dir: Path, name: str) -> list[dict[str, Any]]:
        """Cancel an endless job; it went on its fault-free curve up to where it got."""
        events = self.cancelled_on_curve(job, lambda steps: alone(dir, name, steps), TOL, timeout=60)
        assert all(e["steps_recomputed"] == 0 for e in kinds(events, "group.resumed")), events
        assert kinds(events, "worker.failed") == [], events
        return events

    def finish(self, job: str, curve: dict[int, float]) -> list[dict[str, Any]]:
        """Wait for the end; assert success on the reference curve with nothing recomputed; the events."""
        final = self.wait_end(job, TIMEOUT, every=0.1)
        events = self.dpctl_json("events", job)
        assert final.state == "succeeded", (final, events, self.dpctl("logs", job).stdout[-3000:])
        rows = [r for r in self.dpctl_json("metrics", job) if r["kind"] == "train"]
        assert [r["step"] for r in rows] == list(range(1, max(curve) + 1))
        worst = max(abs(r["loss"] - curve[r["step"]]) for r in rows)
        assert worst < TOL, (worst, [(r["step"], r["loss"], curve[r["step"]], r["generation"]) for r in rows])
        assert all(e["steps_recomputed"] == 0 for e in kinds(events, "group.resumed")), events
        assert kinds(events, "worker.failed") == [], events
        return events


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


@pytest.fixture
def pool(processes: Processes, tmp_path: Path) -> Pool:
    return Pool(processes, tmp_path)


def test_a_higher_priority_job_shrinks_a_running_one_which_grows_back_after(pool: Pool, tmp_path: Path, references: Any) -> None:
    pool.start(1, 1, 1)
    low = pool.submit(endless_job(tmp_path, "low", 1, 3))
    pool.wait(low, "running on 3 past step 5", lambda s: s.state == "running" and s.world_size == 3 and s.step >= 5)
    high = pool.submit_with(job_file(tmp_path, "high", 1, 2, SHORT), "--priority", "5")
    pool.wait(high, "running on 2", lambda s: s.state == "running" and s.world_size == 2, timeout=60)
    pool.wait(low, "shrunk to 1", lambda s: s.world_size == 1, timeout=60)
    queue = pool.dpctl_json("queue")
    assert [(r["id"], r["priority"], r["target"]) for r in queue] == [(high, 5, 2), (low, 0, 1)]

    high_events = pool.finish(high, references(SHORT))
    grown = pool.wait(low, "grown back to 3", lambda s: s.world_size == 3 and s.state == "running", timeout=60)
    pool.wait(low, "a few steps on 3", lambda s: s.step >= grown.step + 5)
    events = pool.cancel_on_curve(low, tmp_path, "low")
    (shr,) = kinds(events, "job.shrunk")
    assert shr["from"] == 3 and shr["to"] == 1 and shr["by"] == [high] and shr["steps_lost"] == 0, shr
    (grew,) = kinds(events, "job.grown")
    assert grew["from"] == 1 and grew["to"] == 3 and grew["steps_lost"] == 0, grew

    h = pool.status(high)
    assert h is not None and h.submitted is not None and h.finished is not None

    def after(t0: float, evs: list[dict[str, Any]], kind: str, **match: Any) -> str:
        t = next(e["t"] for e in evs if e["kind"] == kind and all(e.get(k) == v for k, v in match.items()))
        return f"{t - t0:.2f} s"

    shrink_stop = next(e for e in kinds(events, "group.stopped") if "shrinking" in e["reason"])
    grow_stop = next(e for e in kinds(events, "group.stopped") if "growing" in e["reason"])
    print(
        f"\nhigh submitted -> low asked to shrink {after(h.submitted, [shrink_stop], 'group.stopped')}, low resumed on 1 "
        f"{after(h.submitted, events, 'job.shrunk')} (its pause {shr['restart_s']:.2f} s), high given its slots "
        f"{after(h.submitted, high_events, 'group.starting')} and its group up {after(h.submitted, high_events, 'group.started')}; high finished -> low asked to grow {after(h.finished, [grow_stop], 'group.stopped')}, "
        f"low resumed on 3 {after(h.finished, events, 'job.grown')} (its pause {grew['restart_s']:.2f} s)"
    )


@pytest.mark.long
def test_two_equal_jobs_split_four_slots_two_and_two(pool: Pool, tmp_path: Path) -> None:
    pool.start(2, 2)
    first = pool.submit(job_file(tmp_path, "first", 1, 4, 100_000))
    pool.wait(first, "running on 4", lambda s: s.state == "running" and s.world_size == 4 and s.step >= 2)
    second = pool.submit(job_file(tmp_path, "second", 1, 4, 100_000))
    pool.wait(second, "running on 2", lambda s: s.state == "running" and s.world_size == 2, timeout=60)
    pool.wait(first, "running on 2", lambda s: s.state == "running" and s.world_size == 2, timeout=60)
    events = pool.dpctl_json("events", first)
    assert [(e["from"], e["to"], e["by"]) for e in kinds(events, "job.shrunk")] == [(4, 2, [second])]
    assert all(e["steps_recomputed"] == 0 for e in kinds(events, "group.resumed"))
    for job in (first, second):
        assert pool.dpctl("cancel", job).returncode == 0


def test_a_job_at_its_minimum_is_requeued_with_its_checkpoint_and_resumes_with_no_step_lost(pool: Pool, tmp_path: Path, references: Any) -> None:
    pool.start(1, 1)
    low = pool.submit(endless_job(tmp_path, "low", 2, 2))
    pool.wait(low, "running past step 5", lambda s: s.state == "running" and s.step >= 5)
    high = pool.submit_with(job_file(tmp_path, "high", 1, 1, SHORT), "--priority", "1")
    queued = pool.wait(low, "back in the queue", lambda s: s.state == "queued", timeout=60)
    assert queued.checkpoint_step is not None and queued.checkpoint_step == queued.step
    assert queued.waiting is not None and f"held by {high} (1, priority 1)" in queued.waiting, queued
    pool.finish(high, references(SHORT))
    back = pool.wait(low, "running again", lambda s: s.state == "running" and s.generation > queued.generation)
    pool.wait(low, "a few steps past its resume", lambda s: s.step >= back.step + 5)
    events = pool.cancel_on_curve(low, tmp_path, "low")
    (pre,) = kinds(events, "job.preempted")
    assert pre["by"] == [high] and pre["steps_lost"] == 0 and pre["step"] == queued.checkpoint_step, pre
    resumed = kinds(events, "group.resumed")
    assert resumed and resumed[0]["from_step"] == queued.checkpoint_step


def test_a_small_job_backfills_what_the_head_of_the_queue_cannot_use(pool: Pool, tmp_path: Path) -> None:
    pool.start(1, 1)
    first = pool.submit(job_file(tmp_path, "first", 1, 1, 100_000))
    pool.wait(first, "running", lambda s: s.state == "running")
    big = pool.submit(job_file(tmp_path, "big", 2, 2, 20))
    small = pool.submit(job_file(tmp_path, "small", 1, 1, 20))
    done = pool.wait_end(small, TIMEOUT)
    assert done.state == "succeeded"
    waiting = pool.status(big)
    assert waiting is not None and waiting.state == "queued"
    assert waiting.waiting is not None and "2 free slot(s) (workers.min)" in waiting.waiting and first in waiting.waiting
    rows = pool.dpctl_json("queue")
    assert [(r["position"], r["id"], r["state"]) for r in rows] == [(1, first, "running"), (2, big, "queued")]
    r = pool.dpctl("status", "--state", "queued")
    assert r.returncode == 0 and "WAITS FOR" in r.stdout and "2 free slot(s) (workers.min)" in r.stdout, r.stdout
    assert pool.dpctl("cancel", first).returncode == 0
    assert pool.wait_end(big, TIMEOUT).state == "succeeded"
