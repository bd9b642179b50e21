"""Machines prepared differently (issue 18), with real dpds, each with its own HOME: the same files
under two homes train together on the single-process curve; a node whose files differ, or that
lacks the model, sits the job out with `node.unfit` naming why, and the job goes on elsewhere; a job
no node can serve fails at once, without burning restarts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import HomesPool, Processes, trained_alone, wait_for
from jobs import NO_WARMUP, constant_lr, write_job

JOB_TIMEOUT = 180.0


def corpus(folder: Path, count: int = 16) -> Path:
    """`count` text files (standard-library sources, the same bytes on every run)."""
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for i, name in enumerate(sorted(p.name for p in stdlib.glob("*.py"))[:count]):
        shutil.copyfile(stdlib / name, folder / f"doc{i:02d}.txt")
    return folder


def dpctl(pool: HomesPool, *args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home)} if home is not None else None
    cmd = [sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=pool.root, env=env)


def events(pool: HomesPool, job: str, kind: str) -> list[dict]:
    return [e for e in pool.dpctl_json("events", job) if e["kind"] == kind]


@pytest.fixture
def pool(processes: Processes, tmp_path: Path) -> HomesPool:
    return HomesPool(processes, tmp_path / "pool")


def test_the_same_files_under_two_homes_train_together_on_the_single_process_curve(pool: HomesPool, processes: Processes, tmp_path: Path) -> None:
    pool.start(1, 1)
    for name in ("n0", "n1"):
        corpus(pool.home(name) / "corpus")
    job = write_job(tmp_path, "homes", workers={"min": 2, "max": 2}, data={"source": "~/corpus/*.txt"})
    # submitted from n0's home: the job names its files by content, and both nodes have them
    r = dpctl(pool, "submit", str(job), home=pool.home("n0"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    final = pool.wait_end(job_id, JOB_TIMEOUT)
    assert final.state == "succeeded" and final.world_size == 2 and final.generation == 1, (final, pool.dpctl("logs", job_id).stdout[-2000:])
    assert pool.dpctl_json("status", job_id)["staging"] == []
    # the same job, alone, on the files in a third folder of another name
    elsewhere = corpus(tmp_path / "other-place" / "texts")
    alone_job = write_job(tmp_path, "homes", file="alone.toml", workers={"min": 1, "max": 1}, data={"source": str(elsewhere / "*.txt")})
    alone_loss = trained_alone(alone_job, tmp_path / "alone", JOB_TIMEOUT)
    pooled = [r for r in pool.dpctl_json("metrics", job_id) if r["kind"] == "train"]
    assert [r["step"] for r in pooled] == list(range(1, 21))
    for r in pooled:
        assert abs(r["loss"] - alone_loss[r["step"]]) < 1e-4, (r["step"], r["loss"], alone_loss[r["step"]])


def test_a_node_whose_files_differ_sits_the_job_out_naming_the_file(pool: HomesPool, tmp_path: Path) -> None:
    pool.start(1, 1)
    corpus(pool.home("n0") / "corpus")
    theirs = corpus(pool.home("n1") / "corpus")
    (theirs / "doc03.txt").write_text("not the same text\n")
    job = write_job(tmp_path, "differ", workers={"min": 1, "max": 2}, data={"source": "~/corpus/*.txt"})
    r = dpctl(pool, "submit", str(job), home=pool.home("n0"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    final = pool.wait_end(job_id, JOB_TIMEOUT)
    assert final.state == "succeeded" and final.world_size == 1, final
    (unfit,) = events(pool, job_id, "node.unfit")
    assert unfit["node"] == "n1" and "doc03.txt" in unfit["reason"], unfit


def test_a_job_no_node_can_serve_fails_at_once_naming_each_node(pool: HomesPool, tmp_path: Path) -> None:
    pool.start(1, 1)
    nowhere = write_job(tmp_path, "nowhere", data={"source": "~/missing/*.txt"})
    job_id = pool.submit(nowhere)
    final = pool.wait_end(job_id, 60)
    assert final.state == "failed" and final.generation == 0, final
    assert (final.error or "").startswith("no node can serve this job: n0: data.source = '~/missing/*.txt': no such files"), final.error
    assert "; n1: data.source" in (final.error or ""), final.error


def test_a_node_without_the_data_joins_a_running_job_stages_and_takes_part_with_nothing_recomputed(pool: HomesPool, processes: Processes, tmp_path: Path) -> None:
    pool.start(1, 1)
    for name in ("n0", "n1"):
        corpus(pool.home(name) / "corpus")
    # Endless, at a constant learning rate: its curve does not depend on its number of steps, so it
    # is cancelled once the joined node has taken part, and its first N steps are compared with a run
    # of N steps (one that had to end after the join would make the test depend on the machine's speed).
    endless = {"steps": 100_000, "lr_schedule": constant_lr(3e-3)}
    job = write_job(tmp_path, "join", workers={"min": 2, "max": 3}, data={"source": "~/corpus/*.txt"}, train=endless, base=NO_WARMUP)
    r = dpctl(pool, "submit", str(job), home=pool.home("n0"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    pool.wait_status(job_id, "the job running on two nodes", lambda s: s.state == "running" and s.step >= 3, JOB_TIMEOUT)
    pool.start_daemon("n2", env={"DPOOL_WARM": "1"})  # its HOME has no corpus: it fetches the job's files from the others
    grown = pool.wait_status(job_id, "the job running on three nodes", lambda s: s.state == "running" and s.world_size == 3, JOB_TIMEOUT)
    pool.wait_status(job_id, "steps on three nodes", lambda s: s.step >= grown.step + 20, JOB_TIMEOUT)
    assert pool.dpctl("cancel", job_id).returncode == 0
    pool.wait_end(job_id, JOB_TIMEOUT)
    events = pool.dpctl_json("events", job_id)
    assert [e["node"] for e in events if e["kind"] == "node.staged"] == ["n2"], events
    (resumed,) = [e for e in events if e["kind"] == "group.resumed"]
    assert resumed["cause"] == "membership" and resumed["steps_recomputed"] == 0, resumed
    assert not [e for e in events if e["kind"] == "worker.failed"], events
    # n2's warm trainer read the files where n2 staged them, not the path of the submitting machine
    warmed = [e for e in events if e["kind"] == "group.warmed" and e["node"] == "n2"]
    assert warmed and not [e for e in warmed if e.get("error")], warmed
    pooled = [r for r in pool.dpctl_json("metrics", job_id) if r["kind"] == "train"]
    steps = len(pooled)
    assert [r["step"] for r in pooled] == list(range(1, steps + 1)) and {r["world_size"] for r in pooled} == {2, 3}
    # the job went on the curve of one process training the same files
    alone_job = write_job(tmp_path, "join", file="alone.toml", workers={"min": 1, "max": 1}, data={"source": str(corpus(tmp_path / "texts") / "*.txt")},
                          train={**endless, "steps": steps}, base=NO_WARMUP)
    alone_loss = trained_alone(alone_job, tmp_path / "alone", JOB_TIMEOUT)
    for r in pooled:
        assert abs(r["loss"] - alone_loss[r["step"]]) < 1e-4, (r["step"], r["loss"], alone_loss[r["step"]])


def test_dpctl_cache_lists_what_each_node_holds_and_prune_frees_what_no_live_job_uses(pool: HomesPool, tmp_path: Path) -> None:
    pool.start(1, 1)
    laptop = tmp_path / "home-laptop"  # the files are only where dpctl runs: they are sent into the pool
    corpus(laptop / "corpus")
    job = write_job(tmp_path, "cached", workers={"min": 2, "max": 2}, data={"source": "~/corpus/*.txt"})
    r = dpctl(pool, "submit", str(job), home=laptop)
    assert r.returncode == 0, r.stderr
    assert pool.wait_end(r.stdout.strip(), JOB_TIMEOUT).state == "succeeded"
    rows = pool.dpctl_json("cache")
    assert {row["node"] for row in rows} == {"n0", "n1"} and len({row["digest"] for row in rows}) == 1, rows
    assert all(row["complete"] and row["bytes"] > 0 and row["files"] == 16 for row in rows), rows
    # the job is over: nothing pins its files any more
    wait_for("the nodes to say the job's files are no longer in use", lambda: not any(row["pinned"] for row in pool.dpctl_json("cache")), 30)
    listing = dpctl(pool, "cache")
    assert listing.returncode == 0 and "n0" in listing.stdout and "n1" in listing.stdout, listing.stdout
    assert pool.dpctl_json("cache", "prune", "n1") == {"nodes": ["n1"]}
    wait_for("n1's cache to empty", lambda: pool.dpctl_json("cache", "n1") == [], 30)
    assert [row["node"] for row in pool.dpctl_json("cache")] == ["n0"]  # n0 was not asked: it keeps its copy
    local = subprocess.run([sys.executable, "-m", "dpool.daemon.cli", "cache", "--state-dir", str(pool.daemons["n0"].state_dir), "--json"], capture_output=True, text=True, timeout=60)
    assert local.returncode == 0 and [row["files"] for row in json.loads(local.stdout)] == [16], local.stdout + local.stderr


def test_with_keys_a_client_uploads_only_what_it_offered_and_nodes_fetch_from_each_other_over_curve(processes: Processes, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "dpool.client.cli", "keys", "init", str(keys), "--node", "n0", "--node", "n1", "--client", "laptop"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    pool = HomesPool(processes, tmp_path / "pool")
    pool.start_daemon("n0", serve=True, args=("--keys", str(keys)))
    pool.start_daemon("n1", args=("--keys", str(keys / "bundles" / "n1")))
    laptop = tmp_path / "home-laptop"
    corpus(laptop / "corpus")
    job = write_job(tmp_path, "keyed", workers={"min": 2, "max": 2}, data={"source": "~/corpus/*.txt"})
    base = [sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "--keys", str(keys / "bundles" / "laptop")]
    env = {**os.environ, "HOME": str(laptop)}
    from conftest import wait_for

    wait_for("both nodes registered", lambda: len(json.loads(subprocess.run([*base, "nodes", "--json"], capture_output=True, text=True, env=env, timeout=30).stdout or "[]")) == 2, 60)
    r = subprocess.run([*base, "submit", str(job)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "sending" in r.stderr, r.stderr
    job_id = r.stdout.strip()

    def ended() -> dict | None:
        st = json.loads(subprocess.run([*base, "status", job_id, "--json"], capture_output=True, text=True, env=env, timeout=30).stdout)
        return st if st["state"] in ("succeeded", "failed", "cancelled") else None

    final = wait_for(f"job {job_id} to end", ended, JOB_TIMEOUT)
    events = json.loads(subprocess.run([*base, "events", job_id, "--json"], capture_output=True, text=True, env=env, timeout=30).stdout)
    assert final["state"] == "succeeded" and final["world_size"] == 2, (final, events)
    assert len([e for e in events if e["kind"] == "node.staged"]) == 1, events  # one node took the upload, the other fetched over CURVE


def test_files_that_differ_where_no_content_was_named_leave_the_node_out_before_any_rank(pool: HomesPool, tmp_path: Path) -> None:
    """Submitted from a machine without the files: the first node to answer names the content,
    and the node whose copy differs sits out, naming the file, without a rank failing."""
    pool.start(1, 1)
    corpus(pool.home("n0") / "corpus")
    theirs = corpus(pool.home("n1") / "corpus")
    (theirs / "doc05.txt").write_text("something else entirely\n" * 50)
    job_id = pool.submit(write_job(tmp_path, "differ-late", workers={"min": 1, "max": 2}, data={"source": "~/corpus/*.txt"}, recovery={"max_restarts": 0}))
    final = pool.wait_end(job_id, JOB_TIMEOUT)
    events = pool.dpctl_json("events", job_id)
    assert final.state == "succeeded" and final.world_size == 1 and final.generation == 1, (final, events)
    (named,) = [e for e in events if e["kind"] == "job.content"]
    (unfit,) = [e for e in events if e["kind"] == "node.unfit"]
    assert unfit["node"] != named["node"] and "doc05.txt" in unfit["reason"], (named, unfit)
    assert not [e for e in events if e["kind"] == "worker.failed"], events


def test_a_node_whose_cache_cannot_hold_the_files_sits_the_job_out_and_harms_nothing_else(pool: HomesPool, tmp_path: Path) -> None:
    pool.start_daemon("n0", serve=True)
    pool.start_daemon("n1", args=("--cache-max", "10KB"))
    pool.wait_registered(2)
    laptop = tmp_path / "home-laptop"
    corpus(laptop / "corpus")
    job = write_job(tmp_path, "full", workers={"min": 1, "max": 2}, data={"source": "~/corpus/*.txt"}, train={"steps": 400})  # long enough for n1's answer
    r = dpctl(pool, "submit", str(job), home=laptop)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    final = pool.wait_end(job_id, JOB_TIMEOUT)
    events = pool.dpctl_json("events", job_id)
    assert final.state == "succeeded", (final, events)
    unfit = [e for e in events if e["kind"] == "node.unfit"]
    assert [e["node"] for e in unfit] == ["n1"] and "no room in this node's cache" in unfit[0]["reason"], events


@pytest.mark.parametrize("flag", ["--cache-max", "--stage-rate"])
def test_a_size_flag_that_is_not_a_size_is_refused_naming_it(tmp_path: Path, flag: str) -> None:
    r = subprocess.run([sys.executable, "-m", "dpool.daemon.cli", "run", "--join", "tcp://127.0.0.1:9", flag, "lots", "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{flag} 'lots'" in r.stderr and "such as" in r.stderr, r.stderr
    assert not (tmp_path / "state").exists()


def test_watch_and_its_line_mode_show_each_nodes_staging() -> None:
    from dpool.client.watch import render, status_line
    from dpool.protocol.payloads import JobStatus, StageRow

    rows = [
        StageRow(node="n2", state="staging", bytes=300_000_000, total=1_000_000_000, rate_bps=50e6, eta_s=14.0),
        StageRow(node="n3", state="unfit", bytes=0, total=0, rate_bps=0.0, reason="data.source: corpus/a.txt: content differs"),
    ]
    s = JobStatus(id="j-1", name="j", state="running", step=5, steps=50, generation=1, world_size=2, workers=[],
                  checkpoint_step=None, loss=None, val_loss=None, error=None, staging=rows)
    screen = "\n".join(render(s, [], width=160))
    assert "n2" in screen and "300/1000 MB" in screen and "50.0 MB/s" in screen and "14s" in screen, screen
    assert "corpus/a.txt: content differs" in screen, screen
    line = status_line(s)
    assert "n2 staging 300/1000 MB" in line and "n3 unfit (data.source: corpus/a.txt: content differs)" in line, line


def test_files_on_one_node_only_reach_the_others(pool: HomesPool, tmp_path: Path) -> None:
    """Submitted from a machine without the files: the node that has them names their content,
    and the other fetches them from it."""
    pool.start(1, 1)
    corpus(pool.home("n0") / "corpus")
    job_id = pool.submit(write_job(tmp_path, "one-holder", workers={"min": 2, "max": 2}, data={"source": "~/corpus/*.txt"}))
    final = pool.wait_end(job_id, JOB_TIMEOUT)
    events = pool.dpctl_json("events", job_id)
    assert final.state == "succeeded" and final.world_size == 2 and final.generation == 1, (final, events)
    (named,) = [e for e in events if e["kind"] == "job.content"]
    assert named["node"] == "n0" and len(named["data"]) == 64, named
    assert [e["node"] for e in events if e["kind"] == "node.staged"] == ["n1"], events
    assert pool.dpctl_json("status", job_id)["state"] == "succeeded"


def test_a_bad_line_in_staged_data_is_named_at_the_users_path_not_the_cache(pool: HomesPool, tmp_path: Path) -> None:
    """Files sent by the submitting machine are read from each node's cache; an error about one of
    them (a bad JSON line) named the cache's folder (STATE/cache/trees/<digest>/...), a path the
    user never saw. It names the file where the user has it."""
    pool.start(1, 1)
    client = tmp_path / "client-home"
    data = corpus(client / "corpus", count=4)
    (data / "notes.jsonl").write_text('{"text": "a good line"}\nnot json\n')
    job = write_job(tmp_path, "badline", workers={"min": 1, "max": 1}, data={"source": "~/corpus/*"})
    r = dpctl(pool, "submit", str(job), home=client)
    assert r.returncode == 0, r.stderr
    final = pool.wait_end(r.stdout.strip(), JOB_TIMEOUT)
    assert final.state == "failed", final
    assert "n0: rank 0: ~/corpus/notes.jsonl:2: expected a JSON object" in (final.error or "") and "/cache/" not in (final.error or ""), final.error


def test_dpd_cache_of_a_state_dir_that_does_not_exist_is_refused_not_listed_empty(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "dpool.daemon.cli", "cache", "--state-dir"]
    wrong = subprocess.run([*cmd, str(tmp_path / "no-such-dir"), "--json"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stdout == "" and "no-such-dir: no such folder" in wrong.stderr, (wrong.stdout, wrong.stderr)
    fresh = subprocess.run([*cmd, str(tmp_path), "--json"], capture_output=True, text=True, timeout=60)  # a dpd that never staged
    assert fresh.returncode == 0 and json.loads(fresh.stdout) == [], fresh.stderr


def test_a_node_whose_files_change_during_a_job_is_left_out_at_the_next_start_not_the_others(pool: HomesPool, processes: Processes, tmp_path: Path) -> None:
    """Files edited under a running job, in the folder a node serves the job from: at the group's
    next start that node refuses (it rechecks what it staged), sits the job out naming the file,
    and the job goes on with the others. The trainer alone compared each rank with rank 0's copy:
    where the edited node held rank 0, the nodes with the job's files were the ones left out, and
    the edited files were trained on."""
    pool.start(1, 1)
    for name in ("n0", "n1"):
        corpus(pool.home(name) / "corpus")
    endless = {"steps": 100_000, "lr_schedule": constant_lr(3e-3)}
    job = write_job(tmp_path, "edited", workers={"min": 1, "max": 2}, data={"source": "~/corpus/*.txt"}, train=endless, base=NO_WARMUP)
    # Submitted from n0's home: dpctl sends the files into n0's cache (the first node by name), and
    # n1 serves the job from its own ~/corpus, which holds the same bytes.
    r = dpctl(pool, "submit", str(job), home=pool.home("n0"))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    pool.wait_status(job_id, "the job on two nodes", lambda s: s.state == "running" and s.world_size == 2 and s.step >= 2, JOB_TIMEOUT)
    (pool.home("n1") / "corpus" / "doc03.txt").write_text("edited while the job ran\n")
    for pid in pool.trainer_pids("n0", job_id):
        os.kill(pid, 9)  # a restart: the group starts again on the nodes that can serve it
    alone = pool.wait_status(job_id, "the job on n0 alone", lambda s: s.state == "running" and s.world_size == 1 and s.step > 0, JOB_TIMEOUT)
    assert alone.workers[0].node == "n0", alone
    unfit = events(pool, job_id, "node.unfit")
    assert unfit and {e["node"] for e in unfit} == {"n1"}, unfit
    assert "changed since it was staged" in unfit[0]["reason"] and "doc03.txt" in unfit[0]["reason"], unfit
    assert pool.dpctl("cancel", job_id).returncode == 0
    pool.wait_end(job_id, JOB_TIMEOUT)


def test_a_cached_copy_damaged_where_no_stat_shows_it_is_left_out_checked_in_full_and_fetched_again(pool: HomesPool, processes: Processes, tmp_path: Path) -> None:
    """n0's cached copy of a job's data has bytes overwritten with their times put back (what a
    stat cannot show: a disk's damage, a tool that keeps times), and n0 holds rank 0. Rank 0's copy
    was the reference: n1, whose copy is the job's, was left out and the job trained on the damage.
    Now the ranks hash their copies against the job's digest: n0 sits out, its dpd checks its cache
    in full, drops the damaged file, fetches it again from n1 and trains with the group again."""
    pool.start(1, 1)
    for name in ("n0", "n1"):
        corpus(pool.home(name) / "corpus")
    away = tmp_path / "laptop"  # submitted from a home no node has: the files go into n0's cache
    corpus(away / "corpus")
    first = write_job(tmp_path, "first", workers={"min": 1, "max": 2}, data={"source": "~/corpus/*.txt"}, train={"steps": 3}, base=NO_WARMUP)
    r = dpctl(pool, "submit", str(first), home=away)
    assert r.returncode == 0, r.stderr
    assert pool.wait_end(r.stdout.strip(), JOB_TIMEOUT).state == "succeeded"
    (cached,) = list((pool.root / "state-n0" / "cache" / "trees").rglob("doc03.txt"))
    st = cached.stat()
    os.chmod(cached, 0o644)
    with open(cached, "r+b") as f:
        f.seek(10)
        f.write(b"#####")
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))

    endless = {"steps": 100_000, "lr_schedule": constant_lr(3e-3)}
    job = write_job(tmp_path, "damaged", workers={"min": 1, "max": 2}, data={"source": "~/corpus/*.txt"}, train=endless, base=NO_WARMUP)
    r = dpctl(pool, "submit", str(job), home=away)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    unfit = wait_for("n0 left out", lambda: events(pool, job_id, "node.unfit"), JOB_TIMEOUT)
    assert {e["node"] for e in unfit} == {"n0"} and "not the job's content" in unfit[0]["reason"], unfit
    back = pool.wait_status(job_id, "n0 back with a good copy", lambda s: s.state == "running" and s.world_size == 2 and s.step > 0, JOB_TIMEOUT)
    assert {w.node for w in back.workers} == {"n0", "n1"}, back
    log = (pool.root / "dpd-n0.log").read_text()
    assert '"event":"job.verified"' in log and '"intact":false' in log, "n0 checked its copy in full"
    assert pool.dpctl("cancel", job_id).returncode == 0
    pool.wait_end(job_id, JOB_TIMEOUT)
    refused = [e for e in pool.dpctl_json("events", job_id) if e["kind"] == "worker.failed" and e.get("code") == 2]
    assert refused and {e["node"] for e in refused} == {"n0"}, refused  # n1 never refused its (good) copy
