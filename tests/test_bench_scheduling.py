"""bench/scheduling.py's simulation keeps its books (pure, fast): every job of the trace ends
with all its work done, no policy ever holds more slots than the pool has, and the figures it
prints are the ones it computed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scheduling.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_scheduling", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_scheduling"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("policy", ["fifo", "shared"])
def test_every_job_of_the_trace_ends_with_its_work_done(bench: Any, policy: str) -> None:
    jobs = bench.trace(7, 40, 8, 3.0, 0.9)
    run = bench.fifo if policy == "fifo" else bench.shared(bench.sched.Policy())
    out = bench.simulate(jobs, 8, run, 1.3, 0.5, 60.0)  # asserts the slots held each round
    assert out["jobs"] == 40 and all(j.finished is not None and j.done >= j.work - 1e-6 for j in jobs)
    assert all(j.started_at is not None and j.arrival <= j.started_at <= j.finished for j in jobs)
    assert 0 < out["utilization_while_waiting"] <= 1.0


def test_the_shared_policy_starts_priority_jobs_at_once_and_fifo_does_not(bench: Any) -> None:
    fifo = bench.simulate(bench.trace(3, 60, 8, 4.0, 0.9), 8, bench.fifo, 1.3, 0.5, 60.0)
    shared = bench.simulate(bench.trace(3, 60, 8, 4.0, 0.9), 8, bench.shared(bench.sched.Policy()), 1.3, 0.5, 60.0)
    # A priority job waits for at most a victim's stop at its step boundary and a restart (1.3 + 0.5 s),
    # or for a victim still starting (another 1.3 s).
    assert shared["urgent_wait_max_s"] <= 2 * 1.3 + 0.5 + 1e-9
    assert fifo["urgent_wait_max_s"] > shared["urgent_wait_max_s"]


def test_the_json_holds_what_was_printed(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sched.json"
    bench.main(["--jobs", "30", "--hours", "2", "--seeds", "1,2", "--json", str(out)])
    data = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert len(data["results"]["fifo"]) == 2 and len(data["results"]["shared"]) == 2
    assert "average completion" in printed and "priority-10 wait" in printed
