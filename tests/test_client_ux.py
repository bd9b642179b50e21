"""The user-facing views: `dpctl demo`, `dpctl plot` and `dpctl watch`, with real processes.

The demo test runs the README's first command, shortened (30 steps, a worker killed at step 12):
a real local pool, a real SIGKILL, a real automatic resume. It takes about a minute on two cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalPool, Processes, alive, pids_with, share_mlx_kernels, wait_for
from jobs import write_job

from dpool.client.plot import JobRecord, restarts
from dpool.client.watch import render
from dpool.protocol.payloads import EventRow, JobStatus, MetricRow, TrainRow

ROOT = Path(__file__).resolve().parent.parent


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and header chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def dpctl(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpool.client.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def demo_env(tmp_path: Path) -> dict[str, str]:
    """The demo's environment: TMPDIR puts its pool under tmp_path, so the fixture can clean it up if
    a test fails; its MLX kernel cache is the machine's own."""
    share_mlx_kernels(tmp_path)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("DPOOL_COORDINATOR", None)
    return env


def test_the_packaged_demo_job_is_examples_demo_toml() -> None:
    from dpool.client.demo import demo_job_text, demo_spec

    assert (ROOT / "client" / "demo.toml").read_bytes() == (ROOT / "examples" / "demo.toml").read_bytes()
    assert demo_job_text() == (ROOT / "examples" / "demo.toml").read_text()
    assert demo_spec(None).train.steps == 200
    assert demo_spec(40).train.steps == 40


def test_demo_refuses_bad_flags() -> None:
    r = dpctl("demo", "--steps", "40", "--kill-at", "40")
    assert r.returncode == 2 and "--kill-at 40" in r.stderr and "between 1 and 39" in r.stderr
    r = dpctl("demo", "--workers", "0")
    assert r.returncode == 2 and "--workers 0" in r.stderr


def test_demo_in_a_folder_it_cannot_write_is_refused_before_it_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """From a read-only folder it trained the whole job, then failed writing demo-loss.png naming
    a `-o` flag nobody gave (exit 2), and left its pool's state behind."""
    from dpool.client import cli, demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo.os, "access", lambda path, mode: False)  # as a read-only mount answers (root passes mode bits)
    assert cli.main(["demo", "--steps", "10"]) == 2
    assert f"cannot write demo-loss.png in {tmp_path}" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_demo_kills_a_worker_resumes_and_leaves_nothing_running(processes: Processes, tmp_path: Path) -> None:
    env = demo_env(tmp_path)
    log = tmp_path / "demo.out"
    demo = processes.start([sys.executable, "-m", "dpool.client.cli", "demo", "--workers", "2", "--steps", "30", "--kill-at", "12"], log, cwd=tmp_path, env=env)
    code = demo.wait(timeout=400)
    out = log.read_text()
    assert code == 0, out[-4000:]

    # The kill, its detection and the automatic resume as generation 2 from a checkpoint.
    kill = re.search(r"SIGKILL -> trainer of rank (\d+) on (\S+) \(pid (\d+)\) at step (\d+)", out)
    assert kill, out
    killed_pid, killed_step = int(kill.group(3)), int(kill.group(4))
    assert killed_step >= 12
    assert re.search(r"worker\.failed +rank \d+ on \S+: exit \(killed by signal 9\)", out), out
    resumed = re.search(r"group\.resumed +generation 2 resumed from step (\d+): ([\d.]+)s after the failure, (\d+) steps recomputed", out)
    assert resumed, out
    from_step, recomputed = int(resumed.group(1)), int(resumed.group(3))
    # From the last step the survivors kept in memory, whatever demo.toml's checkpoint interval on
    # disk: at most one step recomputed (the demo saw step `killed_step` before it killed).
    assert killed_step - 1 <= from_step and recomputed <= 1
    assert killed_step <= from_step + recomputed <= killed_step + 5

    final = re.search(r"validation loss: ([\d.]+) at step 30 \(from ([\d.]+) at step 0\)", out)
    assert final, out
    assert float(final.group(1)) < float(final.group(2))  # it learned something
    assert "sample at step 30:" in out

    width, height = png_size(tmp_path / "demo-loss.png")
    assert width > 400 and height > 300

    # Nothing of the pool is left: not its daemons, not the trainers, not the one it killed.
    pool = re.search(r"\(dpd pids ([\d, ]+)\); control plane \S+; state in (\S+)", out)
    assert pool, out
    daemon_pids = [int(p) for p in pool.group(1).split(", ")]
    assert len(daemon_pids) == 2
    assert not [p for p in [*daemon_pids, killed_pid] if alive(p)]
    assert pids_with(pool.group(2)) == []
    assert out.rstrip().endswith("pool stopped")
    assert not Path(pool.group(2)).exists()  # a successful demo cleans up its state


@pytest.mark.slow
def test_demo_lm_fine_tunes_resumes_exports_and_generates(processes: Processes, tmp_path: Path) -> None:
    env = demo_env(tmp_path)
    log = tmp_path / "demo.out"
    cmd = [sys.executable, "-m", "dpool.client.cli", "demo", "--lm", "--workers", "2", "--steps", "20", "--kill-at", "8"]
    demo = processes.start(cmd, log, cwd=tmp_path, env=env)
    code = demo.wait(timeout=400)
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert "made a tiny llama model and chat data offline" in out
    assert re.search(r"SIGKILL -> trainer of rank \d+ on \S+ \(pid \d+\) at step \d+", out), out
    assert re.search(r"group\.resumed +generation 2 resumed from step \d+", out), out
    final = re.search(r"validation loss: ([\d.]+) at step 20 \(from ([\d.]+) at step 0\)", out)
    assert final and float(final.group(1)) < float(final.group(2)), out
    assert re.search(r"export: +exported job tiny-lora-\S+ step 20 from node node-\d", out), out
    answer = out.split("--prompt 'What is 12 + 30?':", 1)[1].splitlines()[1]
    assert answer.startswith("    | "), out
    pool = re.search(r"control plane \S+; state in (\S+)", out)
    assert pool and pids_with(pool.group(1)) == [] and out.rstrip().endswith("pool stopped")
    assert not Path(pool.group(1)).exists()
    # The printed command works after the demo: its model and adapters are kept in ./dpool-demo-lm.
    line = re.search(r"mlx_lm generate --model (\S+) --adapter-path (\S+) --prompt", out)
    assert line, out
    model, adapters = Path(line.group(1)), Path(line.group(2))
    assert (model, adapters) == (tmp_path / "dpool-demo-lm" / "model", tmp_path / "dpool-demo-lm" / "adapters")
    assert sorted(p.name for p in (tmp_path / "dpool-demo-lm").iterdir()) == ["adapters", "model"]
    assert json.loads((adapters / "adapter_config.json").read_text())["model"] == str(model)
    load = "import sys; from mlx_lm import load; load(sys.argv[1], adapter_path=sys.argv[2]); print('loaded')"
    done = subprocess.run([sys.executable, "-c", load, str(model), str(adapters)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]


def test_the_lm_demo_replaces_only_what_it_kept(tmp_path: Path) -> None:
    from dpool.client.demo_lm import AssetsFailed, check_keep, replace_kept

    dest = tmp_path / "dpool-demo-lm"
    check_keep(dest)  # free
    for run in ("first", "second"):
        new = tmp_path / f"new-{run}"
        (new / "model").mkdir(parents=True)
        (new / "adapters").mkdir()
        (new / "model" / "which").write_text(run)
        replace_kept(new, dest)
        assert (dest / "model" / "which").read_text() == run and not new.exists()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(AssetsFailed, match="is not a folder an earlier `dpctl demo --lm` kept"):
        check_keep(dest)
    assert (dest / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_pool(processes: Processes, tmp_path: Path) -> None:
    env = demo_env(tmp_path)
    log = tmp_path / "demo.out"
    demo = processes.start([sys.executable, "-m", "dpool.client.cli", "demo", "--workers", "2"], log, cwd=tmp_path, env=env)
    wait_for("the demo's group to start", lambda: "group.started" in log.read_text(), 120, every=0.2)
    pool = re.search(r"\(dpd pids ([\d, ]+)\); control plane \S+; state in (\S+)", log.read_text())
    assert pool
    assert len(pids_with(pool.group(2))) >= 4  # two daemons, two trainers
    os.kill(demo.pid, signal.SIGINT)
    assert demo.wait(timeout=60) == 130
    out = log.read_text()
    assert "interrupted: stopping the pool" in out and "pool stopped" in out
    assert not [p for p in pool.group(1).split(", ") if alive(int(p))]
    assert pids_with(pool.group(2)) == []


def submit(pool: LocalPool, name: str, workers: int = 1) -> str:
    """A 12-step job with 3 evaluations (steps 0, 6, 12) that needs `workers` workers."""
    return pool.submit(write_job(pool.root, name, workers={"min": workers, "max": workers}, train={"steps": 12, "global_batch": 4}, eval={"every_steps": 6}))


@pytest.mark.slow
def test_watch_follows_a_job_to_the_end_and_plot_draws_it(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path).start(1)
    # The job waits (its only node drained) until watch follows it: it trains in about a second.
    assert pool.dpctl("drain", "n0").returncode == 0
    job = submit(pool, "watched")

    # Not a terminal: one line per change, until the job ends; exit 0 because it succeeded.
    watching = subprocess.Popen([sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "watch", job], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watching.stdout is not None
    first, line = "", ""
    while "queued" not in line:  # up to its status line, while nothing trains
        line = watching.stdout.readline()
        assert line, first
        first += line
    assert pool.dpctl("undrain", "n0").returncode == 0
    rest, err = watching.communicate(timeout=120)
    stdout = first + rest
    assert watching.returncode == 0, stdout[-2000:] + err
    lines = stdout.splitlines()
    steps = [int(s) for s in re.findall(r"step (\d+)/12", stdout)]
    assert steps == sorted(steps) and steps[-1] == 12 and len(set(steps)) > 1, stdout
    assert "succeeded" in lines[-1] and "val_loss" in lines[-1]
    assert any("group.started" in line for line in lines)

    # On a finished job it shows the end at once.
    r = pool.dpctl("watch", job, timeout=20)
    assert r.returncode == 0 and "succeeded" in r.stdout

    out = tmp_path / "plots" / "watched.png"
    r = pool.dpctl("plot", job, "-o", str(out), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "12 steps, 3 evaluations, 0 restarts" in r.stdout
    width, height = png_size(out)
    assert width > 400 and height > 300
    # -o without a suffix is a PNG and says the file it wrote; one it cannot write is exit 2, naming why
    r = pool.dpctl("plot", job, "-o", str(tmp_path / "plots" / "bare"), timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(f"{tmp_path / 'plots' / 'bare.png'}: ") and png_size(tmp_path / "plots" / "bare.png")[0] > 400, (r.stdout, r.stderr)
    (tmp_path / "afile").write_text("")
    for where, said in ((tmp_path / "plots" / "x.txt", "cannot write a '.txt' figure"), (tmp_path / "plots", "is a folder"), (tmp_path / "afile" / "x.png", "is not a folder")):
        r = pool.dpctl("plot", job, "-o", str(where), timeout=60)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, (where, r.stderr)

    # A job that cannot start (it needs 2 workers, the pool has 1), then cancelled: watch exits 1.
    queued = submit(pool, "needs-two", workers=2)
    watcher = subprocess.Popen([sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "watch", queued], stdout=subprocess.PIPE, text=True)
    try:
        assert pool.dpctl("cancel", queued).returncode == 0
        assert watcher.wait(timeout=30) == 1
        assert "cancelled" in (watcher.stdout.read() if watcher.stdout else "")
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()

    r = pool.dpctl("plot", "no-such-job", "-o", str(tmp_path / "x.png"))
    assert r.returncode == 2 and not (tmp_path / "x.png").exists()


def test_restarts_come_from_resume_events_and_generation_changes() -> None:
    rows: list[MetricRow] = [
        TrainRow(kind="train", step=s, loss=3.0, lr=1e-3, tokens=64, tokens_per_s=900.0, world_size=2, generation=1 if s <= 12 else 2 if s <= 30 else 3) for s in range(1, 41)
    ]
    events = [EventRow.from_wire({"t": 1.0, "kind": "group.resumed", "generation": 2, "from_step": 10, "seconds_since_failure": 2.5, "steps_recomputed": 3})]
    status = JobStatus(id="j", name="j", state="succeeded", step=40, steps=40, generation=3, world_size=0, workers=[], checkpoint_step=40, loss=3.0, val_loss=None, error=None)
    rec = JobRecord(status, rows, events)
    assert restarts(rec) == [
        {"generation": 2, "from_step": 10, "steps_recomputed": 3, "seconds": 2.5},
        {"generation": 3, "from_step": 30, "steps_recomputed": 0, "seconds": None},  # no event: from the metrics
    ]


def test_the_terminal_view_shows_workers_and_recent_events() -> None:
    status = {
        "id": "stdlib-gpt-1a2b3c", "name": "stdlib-gpt", "state": "running", "step": 57, "steps": 200, "generation": 2,
        "world_size": 2, "checkpoint_step": 50, "loss": 2.5123, "val_loss": 2.61, "error": None,
        "workers": [{"rank": 0, "node": "node-0", "share": 8, "tokens_per_s": 4400.0}, {"rank": 1, "node": "node-1", "share": 8, "tokens_per_s": 4410.0}],
    }
    events = [{"t": 1.0 + i, "kind": "checkpoint.saved", "step": i} for i in range(10)] + [
        {"t": 20.0, "kind": "worker.failed", "rank": 1, "node": "node-1", "reason": "exit", "code": -9},
        {"t": 22.0, "kind": "group.resumed", "generation": 2, "from_step": 50, "seconds_since_failure": 2.0, "steps_recomputed": 3},
    ]
    text = "\n".join(render(JobStatus.from_wire(status), [EventRow.from_wire(e) for e in events], width=200))
    assert "RUNNING" in text and "step 57/200" in text and "generation 2" in text and "tokens/s 8810" in text
    assert re.search(r"1 +node-1 +8 +4410", text)
    assert "worker.failed" in text and "steps_recomputed=3" in text
    assert "checkpoint.saved" not in text  # frequent events do not push the interesting ones out


def test_a_short_demo_scales_its_warm_up_instead_of_being_refused() -> None:
    """`dpctl demo --steps 5` is a valid job: its warm-up keeps its share of the run (20 of 200
    steps), rounded down, rather than the 20 steps that made a job of 5 invalid."""
    from dpool.client.demo import demo_spec
    from dpool.client.demo_lm import lm_spec

    assert [demo_spec(n).train.warmup_steps for n in (2, 19, 100, 200, 1000)] == [0, 1, 10, 20, 20]
    assert [lm_spec(n).train.warmup_steps for n in (2, 30, 60, 600)] == [0, 2, 5, 5]
    assert demo_spec(None).train.steps == 200 and demo_spec(7).train.steps == 7


def test_generated_text_reaches_the_terminal_with_its_control_characters_escaped() -> None:
    """`dpctl samples` prints what a model generated: an ESC in it (a byte-level model makes any
    byte) would be obeyed by the terminal. Lines, tabs and any other printable character stay."""
    from dpool.client.tables import shown

    assert shown("one\n\ttwo é ✓") == "one\n\ttwo é ✓"
    assert shown("a\x1b[2Jb\x07c\x7f") == "a\\x1b[2Jb\\x07c\\x7f"


def test_an_empty_job_is_refused_before_the_pool_is_asked() -> None:
    """`dpctl status ""` listed every job, where every other command refused it; no coordinator
    is reached for it (this address answers nothing)."""
    import subprocess
    import sys

    for args, said in ((["status", ""], "JOB is empty"), (["logs", " "], "JOB is empty"), (["submit", ""], "the job file's path is empty")):
        r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", "tcp://127.0.0.1:9", "--timeout", "1", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and said in r.stderr and not r.stdout, (args, r.stderr)


def test_a_submit_that_no_pool_of_today_can_start_says_so_and_queues(coordinator, tmp_path) -> None:
    """A job whose workers.min is more than the pool's slots waits for machines to join: submit
    queues it (not an error) and says so, where it said nothing and the job just sat there."""
    import subprocess
    import sys

    from jobs import write_job

    job = write_job(tmp_path, "toobig", workers={"min": 3, "max": 3})
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", coordinator.addr, "submit", str(job)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().startswith("toobig-"), r.stderr
    assert "workers.min = 3 is more than the 0 worker slot(s) of the pool's 0 serving node(s)" in r.stderr, r.stderr
