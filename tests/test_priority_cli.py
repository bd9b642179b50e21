"""`dpctl priority JOB N` against a real Coordinator in this process (`peers.Running`): a value out
of range is refused as `submit --priority` refuses it (exit 2, the range named), before the wire: a
number past 64 bits cannot even be packed, and it ended in a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from peers import Running

from dpool.client.keys import Pair, add_key, init_keys
from dpool.protocol import messages as m
from dpool.protocol.jobspec import PRIORITY_MAX, parse_job
from dpool.protocol.messages import MsgType
from dpool.protocol.security import READ_ONLY, client_keys, server_keys


@pytest.mark.parametrize("value", ["99999999999999999999", str(2**63 - 1), str(PRIORITY_MAX + 1), str(-PRIORITY_MAX - 1)])
def test_a_priority_out_of_range_is_refused_naming_the_range(coordinator: Running, value: str) -> None:
    doc = parse_job({"name": "p", "workers": {"min": 1, "max": 1}, "train": {"steps": 10, "warmup_steps": 1}}).to_dict()
    job = coordinator.call(m.Submit(job=doc, source="p.toml"), m.Submitted).job_id
    r = coordinator.dpctl("priority", job, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"priority {value}: must be an integer from {-PRIORITY_MAX} to {PRIORITY_MAX}" in r.stderr, r.stderr
    r = coordinator.dpctl("priority", job, str(PRIORITY_MAX))
    assert r.returncode == 0 and f"-> {PRIORITY_MAX}" in r.stdout, (r.stdout, r.stderr)


def test_a_viewer_key_refused_a_priority_names_every_request_it_may_send(tmp_path: Path) -> None:
    """`dpctl priority` with a viewer's key: refused, and the refusal lists what a viewer may send,
    `queue` included (it listed six of the eight read-only requests), as the coordinator checks it."""
    keys = tmp_path / "keys"
    init_keys(keys, nodes=["a"])
    add_key(keys, Pair("viewer", "dash"))
    c = Running(tmp_path, keys=server_keys(keys), client=client_keys(keys, "client"))
    try:
        doc = parse_job({"name": "p", "workers": {"min": 1, "max": 1}, "train": {"steps": 10, "warmup_steps": 1}}).to_dict()
        job = c.call(m.Submit(job=doc, source="p.toml"), m.Submitted).job_id
        viewer = ["--keys", str(keys / "bundles" / "dash")]
        r = c.dpctl(*viewer, "priority", job, "3")
        assert r.returncode != 0 and "viewer key (viewer:dash)" in r.stderr, r.stderr
        allowed = r.stderr.partition("viewer keys only ")[2].strip()
        assert allowed == ", ".join(str(t) for t in MsgType if t in READ_ONLY) and "queue" in allowed, r.stderr
        assert c.dpctl(*viewer, "queue").returncode == 0  # what it says a viewer may do, it may
    finally:
        c.stop()
