"""`dpctl priority JOB N` against a real Coordinator in this process (`peers.Running`): a value out
of range is refused as `submit --priority` refuses it (exit 2, the range named), before the wire: a
number past 64 bits cannot even be packed, and it ended in a traceback."""

from __future__ import annotations

import pytest
from peers import Running

from dpool.protocol import messages as m
from dpool.protocol.jobspec import PRIORITY_MAX, parse_job


@pytest.mark.parametrize("value", ["99999999999999999999", str(2**63 - 1), str(PRIORITY_MAX + 1), str(-PRIORITY_MAX - 1)])
def test_a_priority_out_of_range_is_refused_naming_the_range(coordinator: Running, value: str) -> None:
    doc = parse_job({"name": "p", "workers": {"min": 1, "max": 1}, "train": {"steps": 10, "warmup_steps": 1}}).to_dict()
    job = coordinator.call(m.Submit(job=doc, source="p.toml"), m.Submitted).job_id
    r = coordinator.dpctl("priority", job, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"priority {value}: must be an integer from {-PRIORITY_MAX} to {PRIORITY_MAX}" in r.stderr, r.stderr
    r = coordinator.dpctl("priority", job, str(PRIORITY_MAX))
    assert r.returncode == 0 and f"-> {PRIORITY_MAX}" in r.stdout, (r.stdout, r.stderr)
