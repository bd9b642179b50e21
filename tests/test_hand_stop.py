"""A trainer run by hand stops cleanly on its first SIGTERM (INTERFACE.md "The trainer by hand"),
with real processes and a real ring group on loopback: every rank checkpoints the step under way
and exits 75, and the next start resumes there. A signal used to kill the rank at once, and the
steps since the newest checkpoint were trained again."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from jobs import write_job
from ring import finish, start_ranks


def rows(run_dir: Path) -> list[dict]:
    """rank 0's train rows so far (a line still being written is left for the next look)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def test_a_sigterm_to_one_rank_checkpoints_the_step_on_every_rank_and_the_next_start_resumes_there(tmp_path: Path) -> None:
    job = write_job(tmp_path, "handstop", train={"steps": 100_000, "global_batch": 8, "log_every_steps": 1}, checkpoint={"every_steps": 100_000})
    args = [str(job), "--run-dir", str(tmp_path / "r-{rank}")]
    group = start_ranks(tmp_path, [args, args])
    try:
        deadline = time.monotonic() + 120
        while len(rows(tmp_path / "r-0")) < 3:  # training, with no checkpoint yet
            assert time.monotonic() < deadline and all(p.poll() is None for p in group.procs), [log.read_text()[-2000:] for log in group.logs]
            time.sleep(0.05)
        group.procs[1].send_signal(signal.SIGTERM)  # one rank: the step's all_sum tells the other
    finally:
        codes = finish(group)
    assert codes == [75, 75], [log.read_text()[-2000:] for log in group.logs]
    last = rows(tmp_path / "r-0")[-1]["step"]
    for rank in (0, 1):
        steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / f"r-{rank}" / "checkpoints").glob("step-*"))
        assert steps == [last], (rank, steps, last)
    assert "trainer.stop_requested" in group.logs[1].read_text()
    again = start_ranks(tmp_path, [args, args])  # ended (by PID) once it has said where it resumed
    try:
        deadline = time.monotonic() + 120
        while '"trainer.started"' not in again.logs[0].read_text():
            assert time.monotonic() < deadline, again.logs[0].read_text()[-2000:]
            time.sleep(0.05)
    finally:
        again.kill()
    started = next(json.loads(line) for line in again.logs[0].read_text().splitlines() if '"trainer.started"' in line)
    assert started["resume_step"] == last, started
