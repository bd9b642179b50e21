"""/metrics: the pool's snapshot (what `dpctl nodes/status/events --json` print) in Prometheus'
format, read back with prometheus_client's own parsers, as a scraper reads it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalPool, Processes, free_port, wait_for
from dashboard_harness import get, start_dashboard
from jobs import write_job
from peers import Running
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from dpool.dashboard import poller as poller_module
from dpool.dashboard.poller import Poller
from dpool.dashboard.prometheus import MAX_ACTIVE, MAX_ENDED, render, series_jobs
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

NODES = [
    {"name": "m1", "state": "busy", "memory_bytes": 68719476736, "slots": 2, "busy_slots": 2, "heartbeat_age_s": 0.25},
    {"name": "m2", "state": "idle", "memory_bytes": 17179869184, "slots": 1, "busy_slots": 0, "heartbeat_age_s": 1.5},
    {"name": "m3", "state": "lost", "memory_bytes": 17179869184, "slots": 1, "busy_slots": 0, "heartbeat_age_s": 42.0},
]


def status(id: str, state: str, **kw: Any) -> dict[str, Any]:
    """A `dpctl status --json` object."""
    row = {
        "id": id, "name": id.rsplit("-", 1)[0], "state": state, "step": 0, "steps": 100, "generation": 1, "world_size": 0,
        "workers": [], "checkpoint_step": None, "loss": None, "val_loss": None, "error": None,
        "submitted": 1000.0, "started": None, "finished": None, "elapsed_s": None, "eta_s": None,
    }
    return {**row, **kw}


RUNNING = status(
    "gpt-aaaaaa", "running", step=40, loss=2.5, val_loss=2.75, generation=3, world_size=2, eta_s=12.5,
    comm_share=0.35, comm={"bytes": 13_107_200, "every": 1, "ranks": 2, "measured_share": 0.3125},
    workers=[{"rank": 0, "node": "m1", "share": 4, "tokens_per_s": 1500.0}, {"rank": 1, "node": "m1", "share": 2, "tokens_per_s": 500.0}],
)
DONE = status("gpt-bbbbbb", "succeeded", step=100, loss=1.25, val_loss=1.5, finished=2000.0)
QUEUED = status("gpt-cccccc", "queued")
EVENTS = {
    "gpt-aaaaaa": [
        {"t": 1.0, "kind": "group.started", "generation": 1, "world_size": 3},
        {"t": 2.0, "kind": "worker.failed", "rank": 2, "node": "m3", "reason": "heartbeat"},
        {"t": 8.0, "kind": "group.resumed", "from_step": 12, "generation": 2, "seconds_since_failure": 6.0, "steps_recomputed": 3, "cause": "failure"},
        {"t": 20.0, "kind": "group.resumed", "from_step": 30, "generation": 3, "seconds_since_failure": 0.75, "steps_recomputed": 0, "cause": "membership"},
    ],
    # an older coordinator's event, without a cause: a failure
    "gpt-bbbbbb": [{"t": 5.0, "kind": "group.resumed", "from_step": 5, "generation": 2, "seconds_since_failure": 40.0, "steps_recomputed": 1}],
}


def scrape(nodes: list[dict[str, Any]], jobs: list[dict[str, Any]], events: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, keyed by (name, sorted labels)."""
    body, content_type = render(nodes, jobs, events)
    assert content_type.startswith("text/plain; version=")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"{key} twice"
            out[key] = s.value
    return out


def test_nodes_are_counted_by_state_and_each_node_has_its_memory_slots_and_heartbeat_age() -> None:
    got = scrape([*NODES, {**NODES[1], "name": "m4", "state": "yielding"}], [], {})
    assert {s: got["dpool_nodes", (("state", s),)] for s in ("idle", "busy", "draining", "lost", "yielding")} == {
        "idle": 1, "busy": 1, "draining": 0, "lost": 1, "yielding": 1,
    }
    assert got["dpool_node_memory_bytes", (("node", "m1"),)] == 68719476736
    assert got["dpool_node_slots", (("node", "m1"),)] == 2
    assert got["dpool_node_busy_slots", (("node", "m2"),)] == 0
    assert got["dpool_node_heartbeat_age_seconds", (("node", "m3"),)] == 42.0


def test_jobs_are_counted_by_state_and_a_running_job_has_its_progress_loss_and_speed() -> None:
    got = scrape(NODES, [RUNNING, DONE, QUEUED], EVENTS)
    assert got["dpool_jobs", (("state", "running"),)] == 1
    assert got["dpool_jobs", (("state", "failed"),)] == 0
    job = (("job", "gpt-aaaaaa"),)
    assert got["dpool_job_step", job] == 40
    assert got["dpool_job_steps", job] == 100
    assert got["dpool_job_loss", job] == 2.5
    assert got["dpool_job_val_loss", job] == 2.75
    assert got["dpool_job_tokens_per_second", job] == 2000.0  # its workers together
    assert got["dpool_job_world_size", job] == 2
    # no group, no world size: not the ended job's last group (status --json still says 2), not the queued job's 0
    idle = scrape(NODES, [status("gpt-eeeeee", "succeeded", world_size=2), QUEUED], {})
    assert ("dpool_job_step", (("job", "gpt-eeeeee"),)) in idle and not [k for k in idle if k[0] == "dpool_job_world_size"], idle
    assert got["dpool_job_generation", job] == 3
    assert got["dpool_job_eta_seconds", job] == 12.5
    assert got["dpool_job_comm_share", job] == 0.35  # predicted
    assert got["dpool_job_comm_share_measured", job] == 0.3125  # as the steps timed their all_sum
    assert ("dpool_job_comm_share", (("job", "gpt-cccccc"),)) not in got  # not running: not known
    # unknown values are left out, not written as 0: the queued job has no loss yet, the ended one no speed
    assert ("dpool_job_loss", (("job", "gpt-cccccc"),)) not in got
    assert ("dpool_job_tokens_per_second", (("job", "gpt-bbbbbb"),)) not in got
    assert got["dpool_job_step", (("job", "gpt-cccccc"),)] == 0


def test_restarts_are_a_counter_by_cause_and_recoveries_a_histogram_of_seconds() -> None:
    got = scrape(NODES, [RUNNING, DONE, QUEUED], EVENTS)
    a, b = "gpt-aaaaaa", "gpt-bbbbbb"
    assert got["dpool_job_restarts_total", (("cause", "failure"), ("job", a))] == 1
    assert got["dpool_job_restarts_total", (("cause", "membership"), ("job", a))] == 1
    assert got["dpool_job_restarts_total", (("cause", "failure"), ("job", b))] == 1  # no cause: a failure
    assert got["dpool_job_restarts_total", (("cause", "membership"), ("job", b))] == 0  # there from the start, at 0
    assert got["dpool_job_restarts_total", (("cause", "failure"), ("job", "gpt-cccccc"))] == 0
    failure = (("cause", "failure"), ("job", a))
    assert got["dpool_recovery_seconds_count", failure] == 1
    assert got["dpool_recovery_seconds_sum", failure] == 6.0
    assert got["dpool_recovery_seconds_bucket", (*failure, ("le", "5.0"))] == 0
    assert got["dpool_recovery_seconds_bucket", (*failure, ("le", "10.0"))] == 1
    assert got["dpool_recovery_seconds_bucket", (*failure, ("le", "+Inf"))] == 1
    assert got["dpool_recovery_seconds_bucket", (("cause", "membership"), ("job", a), ("le", "1.0"))] == 1
    assert got["dpool_recovery_seconds_sum", (("cause", "failure"), ("job", b))] == 40.0


def test_only_the_jobs_not_ended_and_the_last_that_ended_get_series_of_their_own() -> None:
    ended = [status(f"old-{i:06d}", "succeeded", step=100, loss=1.0, finished=10_000.0 + i) for i in range(3000)]
    active = [status(f"new-{i:06d}", "running" if i < 2 else "queued", submitted=20_000.0 + i) for i in range(MAX_ACTIVE + 5)]
    jobs = ended + active
    got = scrape(NODES, jobs, {})
    labelled = {dict(labels)["job"] for (name, labels) in got if name == "dpool_job_step"}
    newest_ended = {f"old-{i:06d}" for i in range(3000 - MAX_ENDED, 3000)}
    assert labelled == set(series_jobs(jobs))
    assert len(labelled) == MAX_ACTIVE + MAX_ENDED
    assert newest_ended <= labelled
    assert {"new-000000", "new-000001"} <= labelled  # the running ones come first
    assert got["dpool_jobs", (("state", "succeeded"),)] == 3000  # the counts still count every job


def test_values_that_are_not_numbers_are_left_out_and_label_values_are_escaped() -> None:
    odd = [{"name": 'a"b\\c\nd', "state": "idle", "memory_bytes": "lots", "slots": True, "busy_slots": None, "heartbeat_age_s": 2}]
    job = status("gpt-dddddd", "running", step="many", loss=float("nan"), workers=[{"tokens_per_s": None}, "junk"])
    events = {"gpt-dddddd": [{"kind": "group.resumed", "seconds_since_failure": "soon"}, "junk", {"kind": "group.resumed", "cause": "failure", "seconds_since_failure": -1}]}
    got = scrape(odd, [job], events)
    assert got["dpool_up", ()] == 1 and ("dpool_coordinator_answered_timestamp_seconds", ()) not in got  # no answer time given
    assert got["dpool_node_heartbeat_age_seconds", (("node", 'a"b\\c\nd'),)] == 2
    assert ("dpool_node_memory_bytes", (("node", 'a"b\\c\nd'),)) not in got
    assert ("dpool_node_slots", (("node", 'a"b\\c\nd'),)) not in got
    assert ("dpool_job_step", (("job", "gpt-dddddd"),)) not in got
    assert got["dpool_job_tokens_per_second", (("job", "gpt-dddddd"),)] == 0
    # both resumptions count; neither has seconds to put in the histogram
    assert got["dpool_job_restarts_total", (("cause", "failure"), ("job", "gpt-dddddd"))] == 2
    # the histogram's series are there, at 0 (an increase() from them counts the first recovery)
    assert got["dpool_recovery_seconds_count", (("cause", "failure"), ("job", "gpt-dddddd"))] == 0


def test_a_scraper_that_asks_for_openmetrics_gets_it() -> None:
    body, content_type = render(NODES, [RUNNING], EVENTS, accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in openmetrics_families(body.decode())}
    assert families["dpool_job_restarts"].type == "counter"
    assert families["dpool_recovery_seconds"].type == "histogram"
    assert families["dpool_recovery_seconds"].unit == "seconds"


def test_before_any_snapshot_only_dpool_up_is_said() -> None:
    body, _ = render([], [], {}, up=False, known=False)
    assert [(s.name, s.value) for f in text_string_to_metric_families(body.decode()) for s in f.samples] == [("dpool_up", 0)]


# -- a scrape of a real pool ---------------------------------------------------------------------


def test_a_dashboard_whose_coordinator_never_answered_says_dpool_up_0_and_counts_nothing(processes: Processes, tmp_path: Path) -> None:
    """No node or job counted at 0: nobody has seen the pool, which a 0 would claim is empty."""
    d = start_dashboard(processes, tmp_path, f"tcp://127.0.0.1:{free_port()}", "--timeout", "1")
    status, headers, body = get(d.url + "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, body[:500])
    samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(body) for s in f.samples]
    assert samples == [("dpool_up", {}, 0)], body


def scrape_url(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = get(url)
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, body[:500])
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(body) for s in f.samples}


@pytest.mark.slow
def test_a_scrape_of_a_pool_holds_its_nodes_and_job_and_counts_the_restart_after_a_kill(processes: Processes, tmp_path: Path) -> None:
    """Two dpds, a job on both, `dpctl dashboard` as a user starts it; /metrics scraped as
    Prometheus does, parsed by prometheus_client. A trainer killed with SIGKILL: the restart
    counter goes from 0 to 1 (cause failure) and the recovery histogram holds its seconds."""
    pool = LocalPool(processes, tmp_path)
    pool.start(1, 1)
    job = pool.submit(write_job(tmp_path, "scraped", workers={"min": 2, "max": 2}, train={"steps": 100_000}))
    pool.wait_status(job, "the job running at step 5", lambda s: s.state == "running" and s.step >= 5, 120)
    d = start_dashboard(processes, tmp_path, pool.addr, poll=0.2)
    label = (("job", job),)
    failure = (("cause", "failure"), ("job", job))

    def running() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        got = scrape_url(d.url + "metrics")
        return got if got.get(("dpool_job_world_size", label)) == 2 and ("dpool_job_loss", label) in got else None

    before = wait_for("the running job in /metrics", running, 60)
    assert before["dpool_nodes", (("state", "busy"),)] == 2
    assert before["dpool_jobs", (("state", "running"),)] == 1
    for node in ("n0", "n1"):
        assert before["dpool_node_slots", (("node", node),)] == 1
        assert before["dpool_node_busy_slots", (("node", node),)] == 1
        assert before["dpool_node_memory_bytes", (("node", node),)] > 0
        assert before["dpool_node_heartbeat_age_seconds", (("node", node),)] >= 0
    assert before["dpool_job_step", label] >= 5 and before["dpool_job_tokens_per_second", label] > 0
    assert before["dpool_job_restarts_total", failure] == 0
    # the recovery histogram is there before any recovery, at 0: a series that first appeared at
    # 1 would be a recovery Prometheus' increase() and rate() never count
    assert before["dpool_recovery_seconds_count", failure] == 0 and before["dpool_recovery_seconds_bucket", (*failure, ("le", "+Inf"))] == 0

    (victim,) = pool.trainer_pids("n1", job)
    os.kill(victim, signal.SIGKILL)
    after = wait_for("the restart counted in /metrics", lambda: (got := scrape_url(d.url + "metrics")).get(("dpool_job_restarts_total", failure), 0) >= 1 and got, 120)
    assert after["dpool_job_restarts_total", failure] == 1
    assert after["dpool_job_restarts_total", (("cause", "membership"), ("job", job))] == 0
    assert after["dpool_recovery_seconds_count", failure] == 1
    assert after["dpool_recovery_seconds_sum", failure] > 0
    assert after["dpool_recovery_seconds_bucket", (*failure, ("le", "+Inf"))] == 1
    assert after["dpool_job_generation", label] == 2
    assert after["dpool_up", ()] == 1 and after["dpool_coordinator_answered_timestamp_seconds", ()] > time.time() - 60
    pool.dpctl("cancel", job)
    # The coordinator gone (both dpds stopped, the dashboard runs on): /metrics says so, with the
    # last snapshot it had and when the coordinator last answered
    for daemon in pool.started:
        os.kill(daemon.pid, signal.SIGTERM)
        assert daemon.proc.wait(60) == 0
    down = wait_for("dpool_up 0", lambda: (got := scrape_url(d.url + "metrics"))[("dpool_up", ())] == 0 and got, 60)
    assert after["dpool_coordinator_answered_timestamp_seconds", ()] <= down["dpool_coordinator_answered_timestamp_seconds", ()] <= time.time()
    assert down["dpool_nodes", (("state", "busy"),)] >= 0


QUEUES = parse_job({"name": "waits", "workers": {"min": 64, "max": 64}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()  # more workers than any pool here


def test_jobs_that_queued_and_were_cancelled_are_counted_as_the_coordinator_lists_them_with_no_series_left_from_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """199 jobs queue (a coordinator with no node) and /metrics gives series to the 100 newest.
    Half of those are cancelled: read every poll, they count as cancelled at once, before the
    whole list is read again. Then every job is cancelled: the scrape counts 199 cancelled and none
    queued, as `dpctl status` does, and only the 10 that ended last keep series, none left from
    when they queued. The dashboard's poller, in this process, against a real coordinator."""
    coordinator = Running(tmp_path / "coordinator")
    try:
        ids = [coordinator.call(m.Submit(job=QUEUES, source="test"), m.Submitted).job_id for _ in range(199)]
        p = Poller(coordinator.addr, None, lambda view, rendered: None, poll_s=1.0, timeout_s=5.0)

        def scraped() -> tuple[dict[str, float], set[str]]:
            p.round(["metrics"])
            assert p.conn.ok and p.metrics_snapshot is not None, p.conn
            body, _ = render(*p.metrics_snapshot)
            families = {f.name: f for f in text_string_to_metric_families(body.decode())}
            counts = {s.labels["state"]: s.value for s in families["dpool_jobs"].samples}
            return counts, {s.labels["job"] for s in families["dpool_job_step"].samples}

        counts, labelled = scraped()
        assert counts["queued"] == 199 and labelled == set(ids[-MAX_ACTIVE:]), (counts, len(labelled))
        monkeypatch.setattr(poller_module, "METRICS_LIST_S", 1e9)  # the whole list is not read again
        shown = ids[-MAX_ACTIVE:-50]  # with series, older than the newest page of the list (50)
        for job in shown:
            coordinator.call(m.Cancel(job=job), m.CancelReply)
        counts, labelled = scraped()
        assert (counts["cancelled"], counts["queued"]) == (len(shown), 199 - len(shown)), counts
        assert len(labelled & set(shown)) == MAX_ENDED and len(labelled) == MAX_ACTIVE + MAX_ENDED, labelled  # 10 of them: the last that ended
        monkeypatch.setattr(poller_module, "METRICS_LIST_S", 0.0)  # now read every poll (15 s apart otherwise)
        for job in ids:
            if job not in shown:
                coordinator.call(m.Cancel(job=job), m.CancelReply)
        listed = coordinator.call(m.Status(), m.StatusReply).jobs
        assert {j.state for j in listed} == {"cancelled"} and len(listed) == 199
        finished = {j.id: j.finished or 0.0 for j in listed}
        for _ in range(3):
            counts, labelled = scraped()
            assert counts["cancelled"] == 199 and counts["queued"] == 0, counts
            assert len(labelled) == MAX_ENDED and min(finished[j] for j in labelled) >= max(t for j, t in finished.items() if j not in labelled), labelled
    finally:
        coordinator.stop()
