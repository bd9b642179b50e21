"""Naming and listing jobs against a real Coordinator in this process (`peers.Running`): an id, a
unique id prefix or a name (its newest job), a prefix that starts several ids refused naming
them, not reported as "no job"; and the active jobs, however many ended since."""

from __future__ import annotations

from peers import Running

from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job


def submit(c: Running, name: str) -> str:
    doc = parse_job({"name": name, "workers": {"min": 1, "max": 1}, "train": {"steps": 10, "warmup_steps": 1}}).to_dict()
    return str(c.call(m.Submit(job=doc, source=f"{name}.toml"), m.Submitted).job_id)


def test_a_prefix_of_several_ids_is_refused_naming_them_and_a_unique_one_is_taken(coordinator: Running) -> None:
    first, second = submit(coordinator, "tiny"), submit(coordinator, "tiny")  # queued: no node
    assert first != second and first.startswith("tiny-") and second.startswith("tiny-")
    r = coordinator.dpctl("status", "tiny-")
    assert r.returncode == 2 and "'tiny-' is the start of several jobs' ids" in r.stderr and first in r.stderr and second in r.stderr, r.stderr
    r = coordinator.dpctl("status", "tiny")  # a name: its newest job
    assert r.returncode == 0 and second in r.stdout and first not in r.stdout, r.stdout
    unique = next(first[:n] for n in range(len("tiny-") + 1, len(first) + 1) if not second.startswith(first[:n]))
    r = coordinator.dpctl("status", unique)
    assert r.returncode == 0 and first in r.stdout, (unique, r.stdout, r.stderr)
    r = coordinator.dpctl("status", "nothing-like-it")
    assert r.returncode == 2 and "no job 'nothing-like-it'" in r.stderr, r.stderr


def test_the_pool_page_lists_every_active_job_however_many_ended_since(coordinator: Running) -> None:
    """The pool's page showed the active jobs of the job list's first page (the 50 newest): one
    submitted before 50 others that ended was missing, and the count said 50. Status(active=True)
    gives every job not finished; the page asks for it when the first page has older jobs."""
    from dpool.dashboard.poller import Poller

    waiting = submit(coordinator, "waiting")  # no node: it stays queued
    for _ in range(55):
        coordinator.call(m.Cancel(job=submit(coordinator, "gone")), m.CancelReply)
    active = coordinator.call(m.Status(active=True), m.StatusReply).jobs
    assert [(j.id, j.state) for j in active] == [(waiting, "queued")]
    published: dict[str, object] = {}
    p = Poller(coordinator.addr, None, lambda view, rendered: published.__setitem__(view, rendered), poll_s=1.0, timeout_s=5.0)
    p.round(["pool"])
    assert p.conn.ok and p.first.more and [j.id for j in p.active] == [waiting]
    page = published["pool"]
    assert "<b>1</b> active job" in str(page.fragments) and waiting in str(page.fragments)  # type: ignore[attr-defined]
