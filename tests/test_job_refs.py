"""How dpctl names a job: an id, a unique id prefix, or a name (its newest job). A prefix that
starts several jobs' ids is refused naming them, not reported as "no job" (a real Coordinator in
this process, `peers.Running`, and dpctl as users run it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from peers import Running

from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Running]:
    c = Running(tmp_path)
    try:
        yield c
    finally:
        c.stop()


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
