"""The serving dpd stopped for a while (SIGSTOP, a starved machine) with real processes: its
nodes' trainers go on, and once it runs again what they said meanwhile reaches it. It used to judge
their silence by its own clock at once, call the group stalled and restart it (an 8 s pause
cost a restart from the newest checkpoint)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from conftest import LocalPool, Processes
from jobs import NO_WARMUP, constant_lr, write_job

PAUSE_S = 8.0


def test_a_pause_of_the_serving_dpd_is_not_taken_for_a_stalled_group(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path / "pool").start(1, 1)
    endless = {"steps": 100_000, "lr_schedule": constant_lr(3e-3)}
    job_id = pool.submit(write_job(tmp_path, "paused", workers={"min": 2, "max": 2}, train=endless, base=NO_WARMUP))
    before = pool.wait_status(job_id, "the job on two nodes", lambda s: s.state == "running" and s.step >= 3, 180)
    served = pool.daemons["n0"]
    os.kill(served.pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)  # the pause under test: the coordinator does not run for this long
    finally:
        os.kill(served.pid, signal.SIGCONT)
    after = pool.wait_status(job_id, "steps after the pause", lambda s: s.step >= before.step + 40, 120)
    events = pool.dpctl_json("events", job_id)
    assert after.state == "running" and after.generation == 1, (after, events)
    assert not [e for e in events if e["kind"] in ("worker.failed", "group.stopped", "node.lost")], events
    assert pool.dpctl("cancel", job_id).returncode == 0
    pool.wait_end(job_id, 120)
