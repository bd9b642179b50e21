"""A pool whose heartbeat period has grown long, as a big pool's does (daemon/cadence.py), still
recovers a running group as soon as with the default period: a group's failures are seen by what
already sees them, never by heartbeats. Forced here on three real dpds with `--heartbeat-rate`:
3 nodes at 0.2 heartbeats a second make a 16 s period (a node that went silent is lost after
96 s). Bounds are generous (one period); what they catch is a path that waits for heartbeats.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Processes, wait_for
from test_recovery import Pool, job_file, kinds, mid_run, reference_run

pytestmark = pytest.mark.slow

RATE = 0.2
PERIOD_S = 16.0  # 3 nodes at RATE: 0.25 s doubled until 3 <= 0.2 x period
STEPS = 60


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from reference_run(tmp_path_factory.mktemp("reference"), STEPS)


def period_told(log: Path) -> float | None:
    """The last heartbeat period a dpd's log says it was told (node.registered, heartbeat.adopted)."""
    told = None
    for line in log.read_text().splitlines():
        with_period = line.startswith("{") and ('"heartbeat.adopted"' in line or '"node.registered"' in line)
        if with_period and (e := json.loads(line)).get("heartbeat_s") is not None:
            told = e["heartbeat_s"]
    return told


def slow_pool(processes: Processes, tmp_path: Path) -> Pool:
    """n0 serving with the budget, n1 and n2 joining; returns once every dpd heartbeats every 16 s
    and has acknowledged it (the acknowledgement is what makes it answer a stop at once)."""
    pool = Pool(processes, tmp_path)
    pool.start_daemon("n0", serve=True, args=("--heartbeat-rate", str(RATE)))
    pool.start_daemon("n1")
    pool.start_daemon("n2")
    pool.wait_registered(3)
    wait_for("every dpd on a 16 s heartbeat", lambda: all(period_told(d.log) == PERIOD_S for d in pool.daemons.values()), 60)
    wait_for("every dpd acknowledged it", lambda: all('"heartbeat.adopted"' in d.log.read_text() for d in pool.daemons.values()), 30)
    return pool


def test_a_killed_trainer_is_reported_by_its_dpd_and_the_group_resumes_within_a_heartbeat_period(processes: Processes, tmp_path: Path, reference: Any) -> None:
    pool = slow_pool(processes, tmp_path)
    job = pool.submit(job_file(tmp_path, "slow-beat"))
    mid_run(pool, job)
    (victim,) = pool.trainer_pids("n1", job)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    events = pool.finish(job, reference)
    failed = [f for f in kinds(events, "worker.failed") if f["node"] == "n1" and f.get("code") == -9]
    assert failed and failed[0]["reason"] == "exit", kinds(events, "worker.failed")
    # Seen by its dpd's watch on the child and reported at once, not by a heartbeat 16 s apart.
    assert failed[0]["t"] - killed_at < PERIOD_S / 2, (failed[0], killed_at)
    resumed = kinds(events, "group.resumed")
    assert resumed and resumed[0]["cause"] == "failure" and resumed[0]["seconds_since_failure"] < PERIOD_S, resumed
    assert not any(n.state == "lost" for n in pool.nodes()), pool.nodes()
    assert kinds(events, "job.failed") == []
    # A dpd on a 16 s period stops when it is asked to, not at its next heartbeat.
    n1 = pool.daemons["n1"].proc
    asked = time.monotonic()
    n1.send_signal(signal.SIGTERM)
    assert n1.wait(timeout=2 * PERIOD_S) == 0
    assert time.monotonic() - asked < PERIOD_S / 2, time.monotonic() - asked


def test_a_killed_dpd_is_lost_on_its_unanswered_stop_not_after_its_heartbeats_expiry(processes: Processes, tmp_path: Path, reference: Any) -> None:
    pool = slow_pool(processes, tmp_path)
    job = pool.submit(job_file(tmp_path, "slow-beat-dpd"))
    mid_run(pool, job)
    assert pool.trainer_pids("n2", job)
    pool.daemons["n2"].proc.send_signal(signal.SIGKILL)
    events = pool.finish(job, reference)
    # Its peers' broken ring stopped the group; n2 did not answer the stop within 0.5 s (its
    # live peers did, at once), 96 s before its heartbeats' expiry would have said so.
    lost = [e for e in kinds(events, "node.lost") if e["node"] == "n2"]
    assert lost and "to the stop of its failed group" in lost[0]["reason"], lost
    resumed = kinds(events, "group.resumed")
    assert resumed and resumed[0]["seconds_since_failure"] < PERIOD_S, resumed
    assert [n.name for n in pool.nodes() if n.state == "lost"] == ["n2"]
