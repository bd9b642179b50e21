"""Every reply the coordinator sends is within the bounds its own protocol declares, whatever valid
reports it derived it from (issue 21, part 4): a step of 115 days (the bound of a step's seconds)
of a 100,000-step job used to give an ETA of 1e12 s, above the status row's bound of 1e11, and a
rate of 2^53-1 tokens in 5e-324 s an infinite tokens/s; either made every `dpctl status` exit 2
("unreadable reply") for as long as the job ran.

The derived values are bounded where they are made (daemon/watch.py, daemon/pool.py), and every
message is fitted to its bounds before it is sent (protocol/fit.py): a value out of its bound is
clamped, or null where the field may be null, and a row that cannot be fixed is left out with a
log line, never the whole reply. A real Coordinator on a real socket in a thread of this process
(`peers.Running`), a fake node speaking the real protocol, and dpctl as users run it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import wait_for
from fakenode import FakeRank0
from peers import Running
from wire_samples import sample

from dpool.protocol import messages as m
from dpool.protocol.fit import fit
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import JobStatus, WorkerStatus
from dpool.protocol.schema import MAX_INT


def job_doc(name: str, steps: int) -> dict[str, object]:
    return parse_job({"name": name, "workers": {"min": 1, "max": 1}, "train": {"steps": steps, "warmup_steps": 1}}).to_dict()


@pytest.fixture
def node(coordinator: Running) -> Iterator[FakeRank0]:
    n = FakeRank0(coordinator.addr)
    try:
        yield n
    finally:
        n.close()


def dpctl(addr: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", addr, *args], capture_output=True, text=True, timeout=60)


def running(coordinator: Running, node: FakeRank0, steps: int = 100_000) -> str:
    job = coordinator.call(m.Submit(job=job_doc("long", steps), source="long.toml"), m.Submitted).job_id
    node.take(job)
    wait_for("the job to run", lambda: coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].state == "running", 20, every=0.05)
    return job


def status_json(addr: str, job: str) -> dict[str, object]:
    r = dpctl(addr, "status", job, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out[0] if isinstance(out, list) else out


def test_a_step_of_115_days_leaves_the_eta_unknown_and_status_readable(coordinator: Running, node: FakeRank0) -> None:
    job = running(coordinator, node)
    node.progress(1, seconds=1e7)  # valid: the bound of a step's seconds
    wait_for("step 1", lambda: coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].step == 1, 10, every=0.05)
    r = dpctl(coordinator.addr, "status")
    assert r.returncode == 0 and job in r.stdout, r.stderr  # exited 2: "unreadable reply ... eta_s"
    row = status_json(coordinator.addr, job)
    assert row["state"] == "running" and row["eta_s"] is None  # 1e12 s is no estimate
    for step in (2, 3, 4):  # a sane pace again: the median of the step intervals, and an ETA again
        node.progress(step, seconds=0.01)
    wait_for("an eta", lambda: coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].eta_s is not None, 10, every=0.05)


def test_a_rate_that_overflows_is_not_sent_as_infinity(coordinator: Running, node: FakeRank0) -> None:
    job = running(coordinator, node)
    node.progress(1, tokens=MAX_INT, seconds=5e-324)  # 2^53-1 tokens in the smallest double: inf tokens/s
    wait_for("step 1", lambda: coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].step == 1, 10, every=0.05)
    r = dpctl(coordinator.addr, "status", job)
    assert r.returncode == 0, r.stderr  # exited 2: "unreadable reply ... workers[0].tokens_per_s"
    (worker,) = status_json(coordinator.addr, job)["workers"]  # type: ignore[misc]
    assert worker["rank"] == 0 and 0 < worker["tokens_per_s"] < float("inf")


def test_a_row_out_of_bounds_is_fixed_and_never_hides_the_others(coordinator: Running, node: FakeRank0) -> None:
    job = running(coordinator, node)
    other = coordinator.call(m.Submit(job=job_doc("other", 10), source="other.toml"), m.Submitted).job_id  # queued: no slot
    live = coordinator.coord.pool.jobs[job]
    live.loss, live.step = float("inf"), 2**60  # a value no report can give: what a future bug would derive
    jobs = {j.id: j for j in coordinator.call(m.Status(), m.StatusReply).jobs}
    assert set(jobs) == {job, other}
    assert jobs[job].loss is None and jobs[job].step == MAX_INT  # null where it may be, else clamped into its bound
    assert jobs[other].state == "queued"
    (line, *_) = coordinator.events("message.fitted")
    assert line["type"] == "status.reply" and any("jobs[" in f and "step" in f for f in line["fixes"]), line


# -- fit, as a pure function ---------------------------------------------------------------------


def row(job: str, **kw: object) -> JobStatus:
    base: dict[str, object] = {"id": job, "name": "j", "state": "running", "step": 1, "steps": 10, "generation": 1, "world_size": 1, "workers": [], "checkpoint_step": None, "loss": 1.0, "val_loss": None, "error": None}
    return JobStatus(**(base | kw))  # type: ignore[arg-type]


def test_fit_leaves_a_valid_message_as_it_is() -> None:
    msg = m.StatusReply(jobs=[row("a-000001"), row("b-000002", eta_s=5.0)])
    fitted, fixes = fit(msg)
    assert fitted is msg and fixes == []


def test_fit_clamps_a_finite_number_and_nulls_what_may_be_null() -> None:
    (fitted, fixes) = fit(m.StatusReply(jobs=[row("a-000001", eta_s=1e12, loss=float("nan"))]))
    assert isinstance(fitted, m.StatusReply)
    assert fitted.jobs[0].eta_s == 1e11 and fitted.jobs[0].loss is None
    assert len(fixes) == 2 and all(f.startswith("jobs[0].") for f in fixes), fixes
    m.decode(fitted.to_frames(1))  # what a client reads


def test_fit_drops_a_row_it_cannot_fix_and_keeps_the_others() -> None:
    worker = WorkerStatus(rank=0, node="n", share=4, tokens_per_s=float("inf"))
    good = WorkerStatus(rank=1, node="m", share=4, tokens_per_s=10.0)
    msg = m.StatusReply(jobs=[row(""), row("b-000002", workers=[worker, good], world_size=2)])  # an empty id: no fix
    fitted, fixes = fit(msg)
    assert isinstance(fitted, m.StatusReply)
    assert [j.id for j in fitted.jobs] == ["b-000002"] and fitted.jobs[0].workers == [good]
    assert any("dropped" in f for f in fixes), fixes
    m.decode(fitted.to_frames(1))


def test_fit_of_a_message_it_cannot_fix_is_none() -> None:
    fitted, fixes = fit(m.Submitted(job_id=""))
    assert fitted is None and fixes


def test_fit_leaves_every_valid_message_of_every_type_as_it_is() -> None:
    """Valid messages of every registered type, made from the protocol's own types at and inside
    their bounds: none is changed, so fitting costs the check and nothing else."""
    rng = random.Random(21)
    for cls in m.REGISTRY.values():
        for i in range(20):
            msg = sample(cls, rng, edge=i % 2 == 0)
            fitted, fixes = fit(msg)
            assert fitted is msg and fixes == [], (cls.TYPE, fixes)
