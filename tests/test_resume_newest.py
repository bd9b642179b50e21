"""Ranks started by hand resume from the newest checkpoint any of them holds, with real processes
and a real ring group on loopback: rank 0's newest was damaged, and the group resumed from an older
one, making rank 1 delete its own intact copy of the newest (saved work lost)."""

from __future__ import annotations

from pathlib import Path

from jobs import write_job
from ring import finish, start_ranks


def test_a_damaged_newest_checkpoint_on_rank_0_is_read_from_the_rank_that_holds_it_intact(tmp_path: Path) -> None:
    job = write_job(tmp_path, "newest", train={"steps": 4, "global_batch": 8}, checkpoint={"every_steps": 2, "keep": 3})
    args = [str(job), "--run-dir", str(tmp_path / "r-{rank}")]
    assert finish(start_ranks(tmp_path, [args, args])) == [0, 0]
    for rank in (0, 1):
        assert (tmp_path / f"r-{rank}" / "checkpoints" / "step-4").is_dir()
    (tmp_path / "r-0" / "checkpoints" / "step-4" / "manifest.json").write_text("{garbage")
    again = start_ranks(tmp_path, [args, args])
    assert finish(again) == [0, 0], [log.read_text()[-2000:] for log in again.logs]
    logs = [log.read_text() for log in again.logs]
    assert '"resume_step":4' in logs[1] and '"checkpoint.dropped"' not in logs[1], logs[1][-3000:]
    assert (tmp_path / "r-1" / "checkpoints" / "step-4" / "manifest.json").is_file()  # the intact copy stays
    rows = [line for line in (tmp_path / "r-0" / "metrics.jsonl").read_text().splitlines() if '"kind":"train"' in line.replace(" ", "")]
    assert len(rows) == 4, rows  # steps 3 and 4 were not trained again
