"""Ranks started by hand agree on the job and the shares before they train (INTERFACE.md "The trainer
by hand"), with real processes and a real ring group on loopback.

A group whose ranks were given different shares or different job files would otherwise train:
shares that add up to more than the global batch, or weights that drift apart, with exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ring
from jobs import write_job

TIMEOUT_S = 120  # far more than the check takes: a rank that trains on instead fails the test, not hangs it


def tiny(folder: Path, file: str = "job.toml", lr: float = 1e-3) -> Path:
    return write_job(folder, "agree", file=file, train={"steps": 3, "global_batch": 8, "lr": lr}, checkpoint={"every_steps": 1})


def alone(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dpool.trainer", *args], env=ring.trainer_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp,
    )


def error_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("error: "))


def test_ranks_given_different_shares_all_exit_2_naming_both(tmp_path):
    job = tiny(tmp_path)
    run_dir = str(tmp_path / "m-{rank}")
    g = ring.start_ranks(tmp_path, [[str(job), "--run-dir", run_dir, "--shares", s] for s in ("5,3", "4,4")])
    assert ring.finish(g, TIMEOUT_S) == [2, 2], g.output(0)[-2000:] + g.output(1)[-2000:]
    for rank in range(2):
        assert error_line(g.output(rank)) == (
            "error: rank 1's --shares 4,4 differ from rank 0's 5,3: every rank must be given the same --shares"
        ), g.output(rank)[-2000:]
    assert not (tmp_path / "m-0" / "metrics.jsonl").exists(), "refused before training"
    assert not list(tmp_path.glob("m-*/checkpoints/step-*"))


def test_ranks_whose_job_files_differ_in_eval_exit_2_instead_of_waiting_for_each_other(tmp_path):
    """The same training, evaluations every 2 steps on one rank and every 3 on the other: the first
    evaluation's all_sum had one rank waiting for good (its peer trained on into the next step's)."""
    job = write_job(tmp_path, "agree", file="job.toml", train={"steps": 3, "global_batch": 8}, eval={"every_steps": 2})
    other = write_job(tmp_path, "agree", file="copy.toml", train={"steps": 3, "global_batch": 8}, eval={"every_steps": 3})
    g = ring.start_ranks(tmp_path, [[str(j), "--run-dir", str(tmp_path / "m-{rank}")] for j in (job, other)])
    assert ring.finish(g, TIMEOUT_S) == [2, 2], g.output(0)[-2000:] + g.output(1)[-2000:]
    for rank in range(2):
        assert "rank 1's job file differs from rank 0's in [eval] or [checkpoint]" in error_line(g.output(rank)), g.output(rank)[-2000:]


def test_ranks_given_different_job_files_all_exit_2_naming_the_hashes(tmp_path):
    from dpool.protocol.jobspec import load_job

    job, other = tiny(tmp_path), tiny(tmp_path, file="copy.toml", lr=2e-3)
    h0, h1 = load_job(str(job)).training_hash(), load_job(str(other)).training_hash()
    assert h0 != h1
    run_dir = str(tmp_path / "m-{rank}")
    g = ring.start_ranks(tmp_path, [[str(j), "--run-dir", run_dir] for j in (job, other)])
    assert ring.finish(g, TIMEOUT_S) == [2, 2], g.output(0)[-2000:] + g.output(1)[-2000:]
    for rank in range(2):
        assert error_line(g.output(rank)) == (
            f"error: rank 1's job file differs from rank 0's (training hash {h1} vs {h0}): every rank must run the same job file"
        ), g.output(rank)[-2000:]
    assert not list(tmp_path.glob("m-*/checkpoints/step-*")), "refused before training"


def test_a_rank_whose_own_shares_are_refused_takes_its_peer_with_it(tmp_path):
    """Rank 1's shares do not add up: it says why, and rank 0 exits 2 too instead of waiting for it."""
    job = tiny(tmp_path)
    run_dir = str(tmp_path / "m-{rank}")
    g = ring.start_ranks(tmp_path, [[str(job), "--run-dir", run_dir, "--shares", s] for s in ("5,3", "4,5")])
    assert ring.finish(g, TIMEOUT_S) == [2, 2], g.output(0)[-2000:] + g.output(1)[-2000:]
    assert error_line(g.output(1)) == "error: --shares '4,5': they add up to 9, train.global_batch is 8"
    assert error_line(g.output(0)) == (
        "error: rank 1 refused its --shares (its own error says why): every rank must be given the same --shares"
    )


@pytest.mark.parametrize("shares, value", [("0", 0), ("-8", -8)])
def test_a_share_below_one_is_named_with_its_rank(tmp_path, shares, value):
    done = alone(tmp_path, str(tiny(tmp_path)), "--run-dir", str(tmp_path / "run"), "--shares", shares)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert error_line(done.stderr) == (
        f"error: --shares {shares!r}: every rank needs at least one sequence (a share of {value} at rank 0)"
    )


def test_a_zero_share_in_a_group_is_named_with_its_rank(tmp_path):
    job = tiny(tmp_path)
    g = ring.start_ranks(tmp_path, [[str(job), "--run-dir", str(tmp_path / "m-{rank}"), "--shares", "8,0"]] * 2)
    assert ring.finish(g, TIMEOUT_S) == [2, 2], g.output(0)[-2000:] + g.output(1)[-2000:]
    for rank in range(2):
        assert error_line(g.output(rank)) == "error: --shares '8,0': every rank needs at least one sequence (a share of 0 at rank 1)"


def test_agreeing_ranks_train(tmp_path):
    """The check passes ranks that agree: they train to the end, each rank's checkpoint written."""
    job = tiny(tmp_path)
    g = ring.start_ranks(
        tmp_path, [[str(job), "--run-dir", str(tmp_path / "m-{rank}"), "--shares", "5,3"]] * 2,
        env={"DPOOL_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert ring.finish(g, TIMEOUT_S) == [0, 0], g.output(0)[-2000:] + g.output(1)[-2000:]
    assert ring.metrics(tmp_path / "m-0")[3]["shares"] == [5, 3]
    assert all((tmp_path / f"m-{r}" / "checkpoints" / "step-3" / "manifest.json").is_file() for r in range(2))
    assert os.path.getsize(tmp_path / "m-0" / "metrics.jsonl") > 0


def test_the_message_names_every_rank_that_differs_and_both_kinds_of_difference():
    from dpool.trainer.agreement import OK, REFUSED, describe

    def row(h: str, shares: list[int], status: int = OK, schedule: str = "0") -> list[int]:
        v, w = int(h, 16), int(schedule, 16)
        return [status, v >> 32, v & 0xFFFFFFFF, w >> 32, w & 0xFFFFFFFF, *shares]

    a, b = "0123456789abcdef", "fedcba9876543210"
    assert describe([row(a, [4, 2, 2])] * 3) is None
    assert describe([row(a, [4, 2, 2]), row(a, [2, 4, 2]), row(a, [2, 2, 4])]) == (
        "rank 1's --shares 2,4,2 differ from rank 0's 4,2,2 (rank 2 too): every rank must be given the same --shares"
    )
    assert describe([row(a, [4, 2, 2]), row(b, [2, 2, 4]), row(b, [4, 2, 2])]) == (
        f"rank 1's job file differs from rank 0's (training hash {b} vs {a}) (rank 2 too): every rank must run the same job file; "
        "rank 1's --shares 2,2,4 differ from rank 0's 4,2,2: every rank must be given the same --shares"
    )
    # [eval] every 5 steps on rank 2, 10 on the others: both waited for good in the evaluation's all_sum
    assert describe([row(a, [4, 2, 2], schedule=a), row(a, [4, 2, 2], schedule=a), row(a, [4, 2, 2], schedule=b)]) == (
        "rank 2's job file differs from rank 0's in [eval] or [checkpoint]: every rank must run the same job file "
        "(they decide when the ranks meet to evaluate and checkpoint)"
    )
    assert describe([row(a, [0, 0, 0], REFUSED), row(a, [4, 2, 2]), row(a, [0, 0, 0], REFUSED)]) == (
        "rank 0 refused its --shares (its own error says why) (rank 2 too): every rank must be given the same --shares"
    )


def copies(tmp_path: Path, count: int) -> list[Path]:
    """`count` folders holding the same corpus (standard-library sources)."""
    import shutil
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = sorted(p.name for p in stdlib.glob("*.py"))[:12]
    out = []
    for i in range(count):
        folder = tmp_path / f"copy{i}"
        folder.mkdir()
        for name in names:
            shutil.copyfile(stdlib / name, folder / f"{name}.txt")
        out.append(folder)
    return out


def damage_in_place(folder: Path) -> None:
    """A few bytes of one file overwritten, its size and times kept: what no stat shows."""
    victim = sorted(folder.iterdir())[3]
    st = victim.stat()
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"#####")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))


def per_rank_jobs(tmp_path: Path, folders: list[Path], content: str | None) -> list[Path]:
    extra = {"content": {"data": content}} if content else {}
    return [
        write_job(tmp_path, "same", file=f"rank{r}.toml", train={"steps": 3, "global_batch": 8}, data={"source": str(f)}, checkpoint={"every_steps": 1}, **extra)
        for r, f in enumerate(folders)
    ]


def test_a_damaged_copy_on_rank_0_leaves_rank_0_out_not_the_good_copies(tmp_path):
    """Data named by content (`[content]`, as dpctl submit writes it), each rank's copy in a folder
    of its own; rank 0's has a few bytes overwritten with its times put back. Rank 0 was the
    reference: the good node exited 2 (left out of the job) and the damaged copy was trained on.
    Now each rank hashes its copy against the job's digest: rank 0 refuses its input (exit 2,
    its node sits the job out), rank 1 fails as its peer (exit 1)."""
    from dpool.protocol.content import data_tree
    from dpool.protocol.jobspec import load_job
    from dpool.staging.manifest import scan

    folders = copies(tmp_path, 2)
    digest = scan(*data_tree(load_job(str(per_rank_jobs(tmp_path, folders[:1], None)[0])))).digest
    damage_in_place(folders[0])
    jobs = per_rank_jobs(tmp_path, folders, digest)
    g = ring.start_ranks(tmp_path, [[str(j), "--run-dir", str(tmp_path / f"m-{r}")] for r, j in enumerate(jobs)])
    assert ring.finish(g, TIMEOUT_S) == [2, 1], g.output(0)[-2000:] + g.output(1)[-2000:]
    assert "this machine's copy is not the job's content (its files hash to" in error_line(g.output(0)), g.output(0)[-2000:]
    assert "rank(s) 0 hold a copy of the job's files that is not its content (data differs)" in g.output(1), g.output(1)[-2000:]
    assert not list(tmp_path.glob("m-*/checkpoints/step-*"))


def test_without_content_the_copy_most_ranks_hold_is_the_reference(tmp_path):
    """By hand, no digest, `~/corpus` in each rank's own HOME: rank 0's copy differs from the two
    others'; rank 0 is the one left out, not the two good ones."""
    homes = [tmp_path / f"home{r}" for r in range(3)]
    for home, folder in zip(homes, copies(tmp_path, 3), strict=True):
        home.mkdir()
        folder.rename(home / "corpus")
    damage_in_place(homes[0] / "corpus")
    job = write_job(tmp_path, "same", train={"steps": 3, "global_batch": 8}, data={"source": "~/corpus"}, checkpoint={"every_steps": 1})
    g = ring.start_ranks(tmp_path, [[str(job), "--run-dir", str(tmp_path / f"m-{r}")] for r in range(3)], envs=[{"HOME": str(h)} for h in homes])
    assert ring.finish(g, TIMEOUT_S) == [2, 1, 1], "".join(g.output(r)[-1500:] for r in range(3))
    assert "this machine's data differs from the copy 2 of the group's 3 ranks hold (rank 1's)" in error_line(g.output(0)), g.output(0)[-2000:]
    assert "rank(s) 0 hold different data than the other ranks" in g.output(1), g.output(1)[-2000:]
