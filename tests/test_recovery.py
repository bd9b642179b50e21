"""Elastic recovery end to end: real dpd processes on loopback, real trainers, real faults.

Every scenario runs the same tiny job file and ends with the job `succeeded` and a loss curve equal
(within 1e-3) to the reference: the same job file trained by one trainer process without any fault
(the curve does not depend on the membership, DESIGN.md). Faults are injected once the job is
mid-run; timings are never asserted here (bench/recovery.py measures them), only what a user sees:
the job survives, `dpctl events` tells what happened, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalPool, Processes, alive, trained_alone, wait_for
from jobs import NO_WARMUP, TINY, constant_lr, write_job

from dpool.daemon.coordinator import ALIVE_MARK_S
from dpool.protocol.payloads import JobStatus

pytestmark = pytest.mark.slow

STEPS = 60
JOB_TIMEOUT = 240.0
TOL = 1e-3


def job_file(dir: Path, name: str, *, lo: int = 1, hi: int = 3, steps: int = STEPS, every: int | str = 4, constant: bool = False) -> Path:
    """A job twice as deep and wide as the tests' TINY, with a checkpoint every 4 steps (`every`:
    "auto" is the default setting). `constant`: at a constant learning rate, so that its curve does
    not depend on its number of steps (an endless job, cancelled, is compared with a run of as many
    steps as it made)."""
    train: dict[str, Any] = {"steps": steps, "global_batch": 12}
    if constant:
        train["lr_schedule"] = constant_lr(1e-3)
    return write_job(
        dir, name, base=NO_WARMUP if constant else TINY, workers={"min": lo, "max": hi}, model={"layers": 2, "dim": 64},
        train=train, checkpoint={"every_steps": every},
    )


def reference_run(root: Path, steps: int) -> Iterator[Any]:
    """The fault-free curve of a job of `steps` steps: the job file trained by one trainer process
    alone (started at once, in the background, and awaited when a scenario compares against it)."""
    job = job_file(root, "ref", steps=steps)
    procs = Processes(root)
    proc = procs.start([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(root / "run")], root / "trainer.log")
    cache: dict[int, float] = {}

    def curve() -> dict[int, float]:
        if not cache:
            assert proc.wait(timeout=JOB_TIMEOUT) == 0, (root / "trainer.log").read_text()[-2000:]
            rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
            cache.update({r["step"]: r["loss"] for r in rows if r["kind"] == "train"})
        return cache

    try:
        yield curve
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from reference_run(tmp_path_factory.mktemp("reference"), STEPS)


class Pool(LocalPool):
    """A local pool of one-slot daemons, with warm trainers (the default of a real pool)."""

    def __init__(self, procs: Processes, root: Path, **kw: Any) -> None:
        super().__init__(procs, root, warm=True, **kw)

    def start(self, n: int) -> Pool:  # type: ignore[override]
        super().start(*[1] * n)
        return self

    def finish(self, job: str, reference: Any) -> list[dict[str, Any]]:
        """Wait for the end; assert success and the reference curve; return the job's events."""
        final = self.wait_end(job, JOB_TIMEOUT, every=0.05)
        events = self.dpctl_json("events", job)
        assert final.state == "succeeded", (final, events, self.dpctl("logs", job).stdout[-3000:])
        ref = reference()
        assert final.step == max(ref)
        rows = [r for r in self.dpctl_json("metrics", job) if r["kind"] == "train"]
        assert [r["step"] for r in rows] == list(range(1, max(ref) + 1))
        worst = max(abs(r["loss"] - ref[r["step"]]) for r in rows)
        assert worst < TOL, (worst, [(r["step"], r["loss"], ref[r["step"]], r["generation"]) for r in rows])
        return events


def kinds(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


def mid_run(pool: Pool, job: str, step: int = 6) -> JobStatus:
    return pool.wait_status(job, f"job {job} at step {step}", lambda s: s.state == "running" and s.step >= step, timeout=120, every=0.05)


def signal_mid_run(pool: Pool, tmp_path: Path, name: str, sig: signal.Signals) -> tuple[str, int]:
    """Submit job `name` on the started pool, and once it is mid-run send `sig` to n1's trainer:
    the job and the trainer's pid."""
    job = pool.submit(job_file(tmp_path, name))
    mid_run(pool, job)
    (victim,) = pool.trainer_pids("n1", job)
    os.kill(victim, sig)
    return job, victim


@pytest.fixture
def pool(processes: Processes, tmp_path: Path) -> Pool:
    return Pool(processes, tmp_path)


def test_sigkill_of_a_trainer_resumes_from_the_checkpoint(pool: Pool, tmp_path: Path, reference: Any) -> None:
    pool.start(3)
    job, _ = signal_mid_run(pool, tmp_path, "kill-trainer", signal.SIGKILL)
    events = pool.finish(job, reference)
    # Its peers' "connection lost" (exit 1) may reach the coordinator first; the kill is recorded
    # all the same, and blamed on its node.
    failed = [f for f in kinds(events, "worker.failed") if f.get("code") != 1]
    assert failed[0]["node"] == "n1" and failed[0]["reason"] == "exit" and failed[0]["code"] == -9, kinds(events, "worker.failed")
    # A peer's exit 1 says why (it often stops the group before the kill is in: the reason says
    # it lost a peer, not only "exit code 1").
    peers = [f for f in kinds(events, "worker.failed") if f.get("code") == 1]
    assert all(f.get("error") for f in peers), peers
    resumed = kinds(events, "group.resumed")
    assert resumed and resumed[0]["generation"] >= 2 and resumed[0]["cause"] == "failure"
    assert 0 <= resumed[0]["steps_recomputed"] < 4 + 6  # at most a checkpoint interval (plus steps in flight)
    assert kinds(events, "job.failed") == []


def test_with_default_settings_a_killed_trainer_costs_at_most_one_step_and_warm_trainers_take_over(pool: Pool, tmp_path: Path, reference: Any) -> None:
    """Every slot keeps a warm trainer once its worker runs; the next generation is those very
    processes (the killed one's slot too), resumed from the state of the last step kept in memory,
    whatever the checkpoint interval on disk."""
    pool.start(3)
    job = pool.submit(job_file(tmp_path, "warm", every="auto"))
    mid_run(pool, job)
    spares = {n: wait_for(f"a warm trainer on {n}", lambda n=n: pool.spare_pids(n, job), 60, every=0.05) for n in ("n0", "n1", "n2")}
    (victim,) = pool.trainer_pids("n1", job)
    os.kill(victim, signal.SIGKILL)
    status = pool.wait_status(job, "generation 2 running", lambda s: s.generation >= 2 and s.state == "running", timeout=120, every=0.05)
    if status.generation == 2:  # (a later generation, after some other hiccup, proves nothing about these spares)
        assert sorted(w.pid for w in status.workers) == sorted(p for pids in spares.values() for p in pids)
    events = pool.finish(job, reference)
    resumed = kinds(events, "group.resumed")
    assert resumed[0]["cause"] == "failure" and resumed[0]["steps_recomputed"] <= 1, resumed
    started = [line for line in pool.dpctl("logs", job).stdout.splitlines() if "trainer.started" in line and '"generation":2' in line]
    assert len(started) == 3 and all('"warm":true' in line for line in started), started
    # From memory (or a checkpoint on disk of that very step), or, where the killed rank had not
    # kept that last step, rank 0's copy sent to all.
    assert all(any(f'"restored":"{how}"' in line for how in ("memory", "local", "broadcast")) for line in started), started
    wait_for("no warm trainer left once the job is done", lambda: not any(pool.spare_pids(n, job) for n in spares), 30)
    # Those spares were forked from each dpd's pre-imported trainer, not started as interpreters.
    for n, pids in spares.items():
        started = {e["pid"]: e for e in map(json.loads, pool.daemons[n].log.read_text().splitlines()) if e.get("event") == "spare.started"}
        assert all(started[pid]["forked"] for pid in pids), (n, started)


def test_sigkill_of_a_non_serving_dpd_takes_its_trainer_and_the_job_goes_on(pool: Pool, tmp_path: Path, reference: Any) -> None:
    pool.start(3)
    job = pool.submit(job_file(tmp_path, "kill-dpd"))
    mid_run(pool, job)
    assert pool.trainer_pids("n2", job)
    pool.daemons["n2"].proc.send_signal(signal.SIGKILL)
    # Its trainer does not live on as an orphan (PR_SET_PDEATHSIG).
    wait_for("n2's trainer gone", lambda: not pool.trainer_pids("n2", job), 10)
    events = pool.finish(job, reference)
    assert kinds(events, "worker.failed") and kinds(events, "group.resumed")
    assert any(n.name == "n2" and n.state == "lost" for n in pool.nodes())
    # Its peers' failure stopped the group, and n2 did not answer the stop: lost then, well
    # before its heartbeats' expiry.
    lost = [e for e in kinds(events, "node.lost") if e["node"] == "n2"]
    assert lost and "to the stop of its failed group" in lost[0]["reason"], lost


def computing(pid: int) -> bool:
    """Whether a thread of process `pid` is running now: a trainer computes its share of a step on
    its threads, and sleeps while it waits on its peers (the barrier, the all_sum's sockets)."""
    tasks = Path(f"/proc/{pid}/task")
    states = []
    for t in tasks.iterdir():
        try:
            states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue
    return "R" in states


def test_a_hung_trainer_is_caught_by_the_progress_deadline(processes: Processes, tmp_path: Path, reference: Any) -> None:
    """A rank that runs no code, as a deadlock would leave it (here SIGSTOP while it computes, with
    the dpds told not to look at their trainers' process state): nothing exits, its peers wait
    inside the all_sum, and only the absence of step progress shows it. Every rank last reported
    the same step; its peers said they wait for the next one and it did not: the stall names it."""
    # Rank 1 (n1) computes 8 of each step's 12 sequences, so it is computing, not waiting, nearly
    # all the time its peers wait for it; it is stopped at a moment one of its threads runs.
    pool = Pool(processes, tmp_path, env={"DPOOL_STOPPED_S": "0", "DPOOL_SHARES": "2,8,2"}).start(3)
    job = pool.submit(write_job(
        tmp_path, "stop-trainer", base=TINY, workers={"min": 1, "max": 3, "balance": False}, model={"layers": 2, "dim": 64},
        train={"steps": STEPS, "global_batch": 12}, checkpoint={"every_steps": 4},
    ))
    mid_run(pool, job)
    (victim,) = pool.trainer_pids("n1", job)
    wait_for("n1's trainer computing", lambda: computing(victim), 30, every=0.001)
    os.kill(victim, signal.SIGSTOP)
    events = pool.finish(job, reference)
    failed = kinds(events, "worker.failed")
    assert failed and failed[0]["reason"] == "stalled", failed
    assert [(f["rank"], f["node"]) for f in failed if f["reason"] == "stalled"] == [(1, "n1")], failed
    assert kinds(events, "group.resumed")
    wait_for("the stopped trainer reaped", lambda: not alive(victim), 10)


def test_a_stopped_trainer_is_killed_by_its_dpd_and_the_group_resumes(pool: Pool, tmp_path: Path, reference: Any) -> None:
    """SIGSTOP (or job control) shows in the process state: the trainer's dpd kills it after
    0.25 s, long before the progress deadline, and says why."""
    pool.start(3)
    job, victim = signal_mid_run(pool, tmp_path, "stopped", signal.SIGSTOP)
    events = pool.finish(job, reference)
    # Its peers' "connection lost" (exit 1) may reach the coordinator first, as for a kill.
    failed = [f for f in kinds(events, "worker.failed") if f.get("code") != 1]
    assert failed and failed[0]["reason"] != "stalled" and "stopped (SIGSTOP" in json.dumps(failed[0]), kinds(events, "worker.failed")
    resumed = kinds(events, "group.resumed")
    assert resumed and resumed[0]["steps_recomputed"] <= 1, resumed
    assert not alive(victim)


def test_sigkill_of_the_serving_dpd_then_restart_with_the_same_state(pool: Pool, tmp_path: Path, reference: Any) -> None:
    pool.start(3)
    job = pool.submit(job_file(tmp_path, "kill-coordinator"))
    mid_run(pool, job)
    killed = time.time()
    pool.daemons["n0"].proc.send_signal(signal.SIGKILL)
    pool.daemons["n0"].proc.wait()
    wait_for("n0's trainer gone", lambda: not pool.trainer_pids("n0", job), 10)
    time.sleep(1.0)  # the pool without its control plane: the other daemons keep their state
    pool.start_daemon("n0", serve=True)  # same name, same state dir: the coordinator reloads its SQLite
    events = pool.finish(job, reference)
    resumed = kinds(events, "group.resumed")
    assert resumed
    # What the failure cost counts from the dead coordinator's last mark of life (at most
    # ALIVE_MARK_S and a tick before the kill), not from when its successor found n0's rank gone.
    failed_at = resumed[0]["t"] - resumed[0]["seconds_since_failure"]
    assert killed - ALIVE_MARK_S - 1.0 <= failed_at <= killed + 0.1, (killed, resumed[0])
    names = {n.name: n.state for n in pool.nodes()}
    assert names.keys() == {"n0", "n1", "n2"} and "lost" not in names.values()


def test_a_group_that_trains_through_a_coordinator_restart_keeps_every_metrics_row(pool: Pool, tmp_path: Path) -> None:
    """The serving dpd runs no trainer (drained), so its death stops no group: the group trains on
    while the coordinator is away and after it is back. The rows its rank 0 sent in the second or
    so before its dpd noticed the silence went into a connection that was then closed; they are
    sent again after the re-registration, and the record has every step (it once lost 100-170)."""
    pool.start(3)
    assert pool.dpctl("drain", "n0").returncode == 0
    job = pool.submit(job_file(tmp_path, "coordinator-away", lo=2, hi=2, steps=100_000, constant=True))
    mid_run(pool, job)
    pool.daemons["n0"].proc.send_signal(signal.SIGKILL)
    pool.daemons["n0"].proc.wait()
    time.sleep(2.0)  # away for longer than the other daemons take to notice (6 heartbeats of 0.25 s)
    pool.start_daemon("n0", serve=True)
    back = pool.wait_status(job, "the job reported again", lambda s: s.state == "running", timeout=60, every=0.05)
    pool.wait_status(job, "steps after the restart", lambda s: s.step >= back.step + 5, timeout=120, every=0.05)
    alone = lambda steps: trained_alone(job_file(tmp_path, "alone", steps=steps, constant=True), tmp_path / "alone", JOB_TIMEOUT)  # noqa: E731
    events = pool.cancelled_on_curve(job, alone, TOL, JOB_TIMEOUT)
    assert not kinds(events, "group.resumed"), events  # one group throughout: nothing was recomputed to fill a gap


def test_a_fourth_node_joins_mid_run_without_recomputing(pool: Pool, tmp_path: Path) -> None:
    pool.start(3)
    job = pool.submit(job_file(tmp_path, "grow", hi=4, steps=100_000, constant=True))
    mid_run(pool, job, step=2)
    pool.start_daemon("n3")
    grown = pool.wait_status(job, "the job on four workers", lambda s: s.state == "running" and s.world_size == 4, timeout=120, every=0.05)
    pool.wait_status(job, "steps on four workers", lambda s: s.step >= grown.step + 10, timeout=120, every=0.05)
    alone = lambda steps: trained_alone(job_file(tmp_path, "alone", steps=steps, constant=True), tmp_path / "alone", JOB_TIMEOUT)  # noqa: E731
    events = pool.cancelled_on_curve(job, alone, TOL, JOB_TIMEOUT)
    # The group trained on while n3 warmed a trainer; only then did it stop to take n3 in.
    warmed = kinds(events, "group.warmed")
    assert kinds(events, "group.warming") and warmed and warmed[0]["node"] == "n3" and "error" not in warmed[0], events
    grew = next(e for e in kinds(events, "group.starting") if "n3" in e["nodes"])
    assert grew["t"] >= warmed[0]["t"]
    resumed = kinds(events, "group.resumed")
    assert resumed and all(e["steps_recomputed"] == 0 and e["cause"] == "membership" for e in resumed), events
    assert any(e["world_size"] == 4 for e in kinds(events, "group.started"))
    assert kinds(events, "rebalanced") and kinds(events, "worker.failed") == []
    assert any(e["node"] == "n3" for e in kinds(events, "node.joined"))


def test_drain_moves_work_off_a_node_without_recomputing(pool: Pool, tmp_path: Path, reference: Any) -> None:
    pool.start(3)
    job = pool.submit(job_file(tmp_path, "drain"))
    mid_run(pool, job, step=4)
    r = pool.dpctl("drain", "n2")
    assert r.returncode == 0 and "n2" in r.stdout, r.stderr
    events = pool.finish(job, reference)
    resumed = kinds(events, "group.resumed")
    assert resumed and resumed[0]["steps_recomputed"] == 0 and resumed[0]["cause"] == "membership", events
    assert kinds(events, "node.drained") and kinds(events, "worker.failed") == [], events
    assert any(e["world_size"] == 2 for e in kinds(events, "group.started"))
    n2 = next(n for n in pool.nodes() if n.name == "n2")
    assert (n2.state, n2.reason, n2.busy_slots) == ("draining", "drained", 0)  # out of service until undrained, not idle
    assert pool.dpctl("undrain", "n2").returncode == 0
    n2 = next(n for n in pool.nodes() if n.name == "n2")
    assert n2.reason is None
    assert pool.dpctl("drain", "no-such-node").returncode == 2


def test_drain_of_the_one_machine_a_job_runs_on_moves_its_checkpoint_too(pool: Pool, tmp_path: Path, reference: Any) -> None:
    """Checkpoints stay where they were written: a one-machine job drained onto a machine that
    holds none started again from step 0. The drained machine runs one rank of the next group,
    whose collective carries its state to the new machine, and then leaves: nothing recomputed."""
    pool.start(2)
    job = pool.submit(job_file(tmp_path, "drain-one", hi=1))
    mid_run(pool, job, step=6)
    (here,) = [n for n in ("n0", "n1") if pool.trainer_pids(n, job)]
    assert pool.dpctl("drain", here).returncode == 0
    events = pool.finish(job, reference)
    resumed = kinds(events, "group.resumed")
    assert resumed and all(r["steps_recomputed"] == 0 and r["from_step"] >= 6 for r in resumed), resumed
    # One rank more while the drained machine hands its state over, then without it (unless the
    # job, near its end on a loaded machine, finished first).
    started = [s["world_size"] for s in kinds(events, "group.started")]
    assert started in ([1, 2, 1], [1, 2]), started
    assert kinds(events, "worker.failed") == [] and kinds(events, "node.drained"), events


def test_below_workers_min_the_job_waits_queued_then_finishes(pool: Pool, tmp_path: Path, reference: Any) -> None:
    pool.start(2)
    job = pool.submit(job_file(tmp_path, "below-min", lo=2, hi=2))
    mid_run(pool, job)
    # A checkpoint reached the coordinator (written off the step path, it can trail the steps on
    # a busy machine): the job must go back to the queue with it.
    pool.wait_status(job, "a checkpoint reported", lambda s: s.checkpoint_step is not None, timeout=60, every=0.05)
    pool.daemons["n1"].proc.send_signal(signal.SIGKILL)
    pool.daemons["n1"].proc.wait()
    queued = pool.wait_status(job, "the job back in the queue", lambda s: s.state == "queued", timeout=60, every=0.05)
    assert queued.checkpoint_step is not None
    wait_for("n1 lost", lambda: any(n.name == "n1" and n.state == "lost" for n in pool.nodes()), 30)
    pool.start_daemon("n1")  # the node comes back (same state dir, so it still holds its checkpoints)
    events = pool.finish(job, reference)
    assert kinds(events, "job.queued") and kinds(events, "group.resumed")
