"""A run dir that was damaged between two starts of the trainer by hand: what the trainer derives
(its token cache) is built again, what it reads back (metrics rows) is kept only where it is
whole, and a folder that cannot be one is refused before any step. Real trainer processes on a
tiny GPT job; each case starts from a copy of one finished run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from jobs import write_job

from dpool.protocol.checkpoints import listed_steps, step_dir

STEPS = 6


def trainer(job: Path, run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DPOOL_WORKER_ADDR", "DPOOL_CACHE_DIR")}
    return subprocess.run([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def errors(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in r.stderr.splitlines() if "error" in line and not line.startswith("{")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("finished")
    job = write_job(root, "damage", train={"steps": STEPS, "global_batch": 4, "warmup_steps": 1}, checkpoint={"every_steps": 2, "keep": 3})
    r = trainer(job, root / "run")
    assert r.returncode == 0 and listed_steps(root / "run") == [6, 4, 2], r.stderr
    return job, root / "run"


def copy_of(finished: tuple[Path, Path], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished[1], run)
    shutil.rmtree(step_dir(run, STEPS))  # so that the next start resumes at step 4 and trains 5 and 6 again
    return run


def only(run: Path, pattern: str) -> Path:
    (found,) = (run / "cache").glob(pattern)
    return found


DAMAGE: dict[str, Callable[[Path], None]] = {
    "meta-not-json": lambda run: only(run, "tokens-*/meta.json").write_text("garbage"),
    "meta-empty-object": lambda run: only(run, "tokens-*/meta.json").write_text("{}"),
    "train-cut-short": lambda run: os.truncate(only(run, "tokens-*/train.bin"), 5000),
    "train-gone": lambda run: only(run, "tokens-*/train.bin").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_token_cache_is_built_again_and_the_run_resumes_on_its_curve(finished: tuple[Path, Path], tmp_path: Path, damage: str) -> None:
    run = copy_of(finished, tmp_path)
    DAMAGE[damage](run)
    r = trainer(finished[0], run)
    assert r.returncode == 0, r.stderr
    assert [(x["kind"], x["step"], x.get("loss")) for x in rows(run)] == [(x["kind"], x["step"], x.get("loss")) for x in rows(finished[1])]


def test_metrics_lines_that_are_no_rows_are_dropped_at_resume(finished: tuple[Path, Path], tmp_path: Path) -> None:
    run = copy_of(finished, tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('5\n{"step": "x"}\n["a list"]\n{"kind": "train", "step": 3.5}\n')
    r = trainer(finished[0], run)
    assert r.returncode == 0, r.stderr
    assert [(x["kind"], x["step"]) for x in rows(run)] == [(x["kind"], x["step"]) for x in rows(finished[1])]


def test_a_run_dir_or_its_checkpoints_folder_that_is_a_file_is_refused_before_any_step(tmp_path: Path, finished: tuple[Path, Path]) -> None:
    job = finished[0]
    (tmp_path / "a-file").write_text("mine")
    for run, said in ((tmp_path / "a-file", "a-file is a file, not a folder"), (tmp_path / "a-file" / "sub", "a-file is a file, not a folder")):
        r = trainer(job, run)
        assert r.returncode == 2 and any(said in e for e in errors(r)), r.stderr
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("mine")
    r = trainer(job, tmp_path / "run")
    assert r.returncode == 2 and any("checkpoints is a file" in e for e in errors(r)), r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "checkpoints").read_text() == "mine"
    r = trainer(job, "")
    assert r.returncode == 2 and "--run-dir: empty" in r.stderr
    for flag in ("--export", "--test"):  # an empty folder to write to trained the run on instead
        r = trainer(job, tmp_path / "run", flag, "")
        assert r.returncode == 2 and f"{flag}: empty" in r.stderr, r.stderr


def test_a_rank_or_hostfile_that_cannot_form_a_group_is_bad_input_naming_it(tmp_path: Path, finished: tuple[Path, Path]) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('[["127.0.0.1:5000"], ["127.0.0.1:5001"]]')
    for rank, path, said in (("5", hostfile, "MLX_RANK='5': expected a rank from 0 to 1"), ("x", hostfile, "MLX_RANK='x'"),
                             ("0", tmp_path / "missing.json", "cannot read the ring hostfile")):
        env = {k: v for k, v in os.environ.items() if k not in ("DPOOL_WORKER_ADDR", "DPOOL_CACHE_DIR")}
        r = subprocess.run([sys.executable, "-m", "dpool.trainer", str(finished[0]), "--run-dir", str(tmp_path / "run")],
                           capture_output=True, text=True, timeout=300, env={**env, "MLX_RANK": rank, "MLX_HOSTFILE": str(path)})
        assert r.returncode == 2 and said in r.stderr, (rank, r.stderr)


def test_export_of_a_step_that_has_no_checkpoint_lists_those_there_are(finished: tuple[Path, Path], tmp_path: Path) -> None:
    r = trainer(finished[0], finished[1], "--export", str(tmp_path / "out"), "--step", "5")
    assert r.returncode == 2 and any("no checkpoint of step 5 (its checkpoints: 2, 4, 6)" in e for e in errors(r)), r.stderr
    assert not (tmp_path / "out").exists()


def test_export_into_a_link_to_an_empty_folder_fills_that_folder_and_under_a_file_writes_nothing(finished: tuple[Path, Path], tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    r = trainer(finished[0], finished[1], "--export", str(tmp_path / "link"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "link").is_symlink() and sorted(p.name for p in (tmp_path / "target").iterdir()) == ["config.json", "model.safetensors"]
    (tmp_path / "a-file").write_text("mine")
    r = trainer(finished[0], finished[1], "--export", str(tmp_path / "a-file" / "out"))
    assert r.returncode == 2 and any("a-file is a file, not a folder; nothing was written" in e for e in errors(r)), r.stderr
    assert (tmp_path / "a-file").read_text() == "mine"
