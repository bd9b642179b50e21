"""A run resumed by hand on files other than those its checkpoint was trained on is refused (exit
2, naming the key), with real processes: a checkpoint's manifest keeps the fingerprints of the data
and model it trained on. The resume went on silently before, from a state of other data: neither
the old run nor a new one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jobs import write_job
from ring import finish, start_ranks


def corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(8):
        (folder / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40)
    return folder


def test_a_resume_on_changed_data_is_refused_naming_the_key_and_the_checkpoint_stays(tmp_path: Path) -> None:
    data = corpus(tmp_path / "corpus")
    job = write_job(tmp_path, "changed", data={"source": str(data / "*.txt"), "val_fraction": 0.2},
                    train={"steps": 4, "global_batch": 8}, checkpoint={"every_steps": 2, "keep": 3})
    run_dir = tmp_path / "run"
    args = [str(job), "--run-dir", str(run_dir)]
    assert finish(start_ranks(tmp_path, [args])) == [0]
    manifest = json.loads((run_dir / "checkpoints" / "step-4" / "manifest.json").read_text())
    assert set(manifest["fingerprints"]) == {"data"}, manifest
    shutil.rmtree(run_dir / "checkpoints" / "step-4")  # as if stopped after step 2's checkpoint
    original = (data / "doc3.txt").read_bytes()
    (data / "doc3.txt").write_text("edited since the checkpoint\n" * 30)
    again = start_ranks(tmp_path, [args])
    assert finish(again) == [2]
    log = again.logs[0].read_text()
    assert "data.source" in log and "not the ones the checkpoint of step 2 was trained on" in log, log[-2000:]
    assert (run_dir / "checkpoints" / "step-2" / "manifest.json").is_file(), "nothing saved is lost"
    (data / "doc3.txt").write_bytes(original)  # the files back: the run resumes
    resumed = start_ranks(tmp_path, [args])
    assert finish(resumed) == [0], resumed.logs[0].read_text()[-2000:]
    assert '"resume_step":2' in resumed.logs[0].read_text()
