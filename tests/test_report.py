"""[report] to = ["wandb"]: one job is one W&B run, in mlx-lm's keys, whatever kills and restarts it.

W&B runs offline here (WANDB_MODE=offline, as the issue asks: no network). What a run holds is read
back with wandb's own reader of its transaction logs, `wandb leet inspect --json RUN_DIR` (one JSON
record a line: the `run` record names the run id, each process's `environment` record its
`writer_id`, each `history` record one step), never with dpool's own reader of them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import LocalPool, Processes, share_mlx_kernels, wait_for
from jobs import write_job

from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import JobFileError, load_job, parse_job
from dpool.protocol.messages import Submit, decode
from dpool.trainer.report import writer_error
from dpool.trainer.wandb_writer import Tokens, Writer, logged_step, wandb_row

STEPS = 600  # long enough that W&B holds steps of the run well before its end (opening it takes a second or more)
UNREACHABLE_STEPS = 60
EVERY = 50  # a checkpoint every 50 steps: a restart recomputes steps W&B holds
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
TIMEOUT = 180.0


def wandb_job(folder: Path, name: str, steps: int = STEPS, **sections: Any) -> Path:
    return write_job(
        folder, name, train={"steps": steps, "log_every_steps": 1}, checkpoint={"every_steps": EVERY},
        eval={"every_steps": 100, "batches": 1, "sample_every_steps": 1000}, report={"to": ["wandb"], "project": "dpool-tests"}, **sections,
    )


def wandb_runs(wandb_dir: Path) -> list[dict[str, Any]]:
    """Each run folder under `wandb_dir` (one per process that reported), read by wandb's reader:
    its run ids, writer ids and history rows."""
    out = []
    for folder in sorted(wandb_dir.glob("*run-*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        r = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(folder)],
            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
        )
        assert r.returncode == 0, r.stderr
        run = {"folder": folder.name, "ids": set(), "writers": set(), "history": []}
        for line in r.stdout.splitlines():
            rec = json.loads(line)
            if rec["type"] == "run":
                run["ids"].add(rec["run"]["run_id"])
            elif rec["type"] == "environment":
                run["writers"].add(rec["environment"]["writer_id"])
            elif rec["type"] == "history":
                run["history"].append(rec["history"]["item"])
        out.append(run)
    return out


def assert_one_run_every_step_once(runs: list[dict[str, Any]], processes: int, metrics: Path) -> dict[int, dict[str, Any]]:
    """One run id in all; one writer per folder and `processes` of them; every training step once,
    with the loss dpool's own metrics.jsonl holds for it. Returns the train rows by step."""
    assert len(runs) == processes, [r["folder"] for r in runs]
    assert len(set().union(*(r["ids"] for r in runs))) == 1, [r["ids"] for r in runs]
    assert all(len(r["writers"]) == 1 for r in runs), [r["writers"] for r in runs]
    assert len(set().union(*(r["writers"] for r in runs))) == processes
    rows = [h for r in runs for h in r["history"]]
    steps = Counter(h["_step"] for h in rows)
    assert sorted(steps) == list(range(STEPS + 1)) and set(steps.values()) == {1}, [s for s, n in steps.items() if n > 1]
    train = {h["_step"]: h for h in rows if "train_loss" in h}
    assert sorted(train) == list(range(1, STEPS + 1))
    mine = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"}
    assert all(abs(train[s]["train_loss"] - mine[s]["loss"]) < 1e-6 for s in train)
    return train


# -- the job file --------------------------------------------------------------------------------


def test_a_report_section_is_checked_by_key_and_stays_out_of_the_hash() -> None:
    base = {"name": "r", "train": {"steps": 200}}
    plain = parse_job(base)
    reported = parse_job({**base, "report": {"to": ["wandb"], "project": "p", "entity": "lab", "run_name": "first try"}})
    assert reported.report.to == ("wandb",) and reported.report.run_name == "first try"
    assert plain.training_hash() == reported.training_hash()
    assert "report" not in plain.to_dict()  # left off the wire while unset: older peers read the job as before
    sent, _ = decode(Submit(job=reported.to_dict(), source="r.toml").to_frames(1))
    assert parse_job(sent.job).report == reported.report
    assert parse_job(dict(reported.to_dict())).report == reported.report
    assert "[report]" in dump_job(reported)
    refused = {
        "report.to": {"to": "wandb"},
        "report.project": {"project": "p"},  # naming a run that is not reported anywhere
        "report.entity": {"to": ["wandb"], "entity": "a/b"},
        "report.run_name": {"to": ["wandb"], "run_name": ""},
        "report.colour": {"to": ["wandb"], "colour": "red"},
    }
    for key, table in refused.items():
        with pytest.raises(JobFileError, match=key.replace(".", r"\.")):
            parse_job({**base, "report": table}, source="r.toml")
    with pytest.raises(JobFileError, match=r"report\.to.*'wandb'"):
        parse_job({**base, "report": {"to": ["wandb", "wandb"]}})


# -- rows ----------------------------------------------------------------------------------------


def test_rows_are_logged_with_mlx_lm_keys_and_trained_tokens_count_every_step() -> None:
    tokens = Tokens()
    first = wandb_row({"kind": "train", "step": 1, "loss": 2.5, "lr": 1e-3, "tokens": 100, "tokens_per_s": 400.0, "world_size": 2, "generation": 1, "peak_memory": 1.5}, tokens)
    assert first == {
        "iteration": 1, "train_loss": 2.5, "learning_rate": 1e-3, "iterations_per_second": 4.0, "tokens_per_second": 400.0,
        "trained_tokens": 100, "generation": 1, "world_size": 2, "peak_memory": 1.5,
    }
    # logged every 10 steps: the row stands for the 10 steps since the last one
    later = wandb_row({"kind": "train", "step": 11, "loss": None, "lr": 1e-3, "tokens": 120, "tokens_per_s": 240.0, "world_size": 3, "generation": 2}, tokens)
    assert later is not None and later["trained_tokens"] == 100 + 10 * 120 and later["generation"] == 2
    assert later["train_loss"] != later["train_loss"]  # a diverged step's loss (null in metrics.jsonl): NaN
    assert wandb_row({"kind": "eval", "step": 11, "val_loss": 2.0, "val_time": 0.5}, tokens) == {"iteration": 11, "val_loss": 2.0, "val_time": 0.5}
    assert wandb_row({"kind": "test", "step": 11, "test_loss": 1.9}, tokens) == {"iteration": 11, "test_loss": 1.9}


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[int] = []

    def log(self, row: dict[str, Any], step: int) -> None:
        self.logged.append(step)


def test_steps_the_run_holds_are_not_logged_again_and_the_rest_are(tmp_path: Path) -> None:
    spec = parse_job({"name": "r", "train": {"steps": 200}, "report": {"to": ["wandb"]}})
    writer = Writer(spec, tmp_path, generation=2)
    writer.last = 57  # the run holds steps up to 57; the trainer resumed from its checkpoint of step 50
    run = FakeRun()
    for step in range(40, 66):  # metrics.jsonl's rows up to 50, then the recomputed and the new ones
        writer.write(run, {"kind": "train", "step": step, "loss": 1.0, "lr": 1e-3, "tokens": 10, "tokens_per_s": 1.0, "world_size": 1})
    writer.write(run, {"kind": "train", "step": "60"})  # not a row
    assert run.logged == list(range(58, 66))
    assert writer.tokens.total == 65 * 10  # every row counts its tokens, logged or not


# -- a trainer ---------------------------------------------------------------------------------


def trainer(job: Path, run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir), *args]


def test_a_trainer_without_wandb_stops_at_the_start_naming_the_extra(tmp_path: Path) -> None:
    job = wandb_job(tmp_path, "nowandb")
    hidden = tmp_path / "hide"  # a machine without wandb: its import fails in the trainer (and any process it starts)
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    path = os.pathsep.join(p for p in (str(hidden), os.environ.get("PYTHONPATH")) if p)
    r = subprocess.run(trainer(job, tmp_path / "run"), capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **OFFLINE, "PYTHONPATH": path})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pip install 'dpool[wandb]'" in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or "step" not in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_trainer_killed_and_started_again_leaves_one_wandb_run_with_every_step_once(tmp_path: Path) -> None:
    job, run_dir = wandb_job(tmp_path, "killed"), tmp_path / "run"
    procs = Processes(str(tmp_path))
    try:
        first = procs.start(trainer(job, run_dir), tmp_path / "first.log", env={**os.environ, **OFFLINE})
        # Once W&B holds 60 steps, the trainer alone is killed: its writer logs what it was handed.
        wait_for("W&B holding 60 steps of the first trainer's", lambda: first.poll() is not None or held(run_dir) >= 60, TIMEOUT)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
        second = procs.start(trainer(job, run_dir, "--generation", "2"), tmp_path / "second.log", env={**os.environ, **OFFLINE})
        assert second.wait(TIMEOUT) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        procs.stop_all()
    started = [json.loads(line) for line in (tmp_path / "second.log").read_text().splitlines() if '"trainer.started"' in line]
    resumed = started[0]["resume_step"]
    assert 50 <= resumed < STEPS and resumed % EVERY == 0
    train = assert_one_run_every_step_once(wandb_runs(run_dir / "wandb"), 2, run_dir / "metrics.jsonl")
    assert {train[s]["generation"] for s in range(1, resumed + 1)} == {1}
    assert train[STEPS]["generation"] == 2
    assert all(set(train[s]) >= {"learning_rate", "tokens_per_second", "trained_tokens", "iterations_per_second", "peak_memory"} for s in train)


def held(run_dir: Path) -> int:
    """The newest step W&B holds of a by-hand trainer's run (its id kept in the run dir)."""
    try:
        rid = json.loads((run_dir / "report.json").read_text())["wandb_run_id"]
    except (OSError, ValueError, KeyError):
        return 0
    return logged_step(run_dir / "wandb", rid) or 0


def _step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.startswith("{") and line.endswith("}")]
    return max(steps, default=0)


def test_the_writers_last_error_is_found_at_the_end_of_its_log(tmp_path: Path) -> None:
    """The trainer's `report.unfinished` said "W&B unreachable?" where the writer knew the cause
    ("No API key configured"), in its report.log only."""
    log = tmp_path / "report.log"
    assert writer_error(log) is None  # no log at all
    log.write_text(
        '{"event":"report.starting","level":"info"}\n'
        "wandb: a line that is no JSON\n"
        '{"to":"wandb","error":"No API key configured. Use `wandb login` to log in.","event":"report.unavailable","level":"warning"}\n'
        '{"event":"report.exiting","level":"info"}\n'
    )
    assert writer_error(log) == "No API key configured. Use `wandb login` to log in."
    later = log.stat().st_size  # the next generation's writer: an earlier one's error is not its own
    with open(log, "a") as f:
        f.write('{"event":"report.abandoned","why":"the W&B run was not open 30 s after the trainer ended"}\n')
        f.write('{"event":"report.row_skipped","error":"not why it gave up"}\n')
    assert writer_error(log, later) is None
    log.write_text('{"event":"report.done"}\n')
    assert writer_error(log) is None


def test_an_unreachable_wandb_holds_neither_the_training_nor_the_trainers_exit(tmp_path: Path) -> None:
    # W&B never opens the run, so the trainer's end, not a step count, is what the writer waits
    # for: a short run (60 steps, 6 s here) tests what 600 do
    job, run_dir = wandb_job(tmp_path, "unreachable", steps=UNREACHABLE_STEPS), tmp_path / "run"
    tmp = tmp_path / "tmp"  # the machine's temporary folder, as the trainer and its writer see it
    tmp.mkdir()
    share_mlx_kernels(tmp)
    env = {**os.environ, "WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "x" * 40, "TMPDIR": str(tmp)}
    r = subprocess.run(trainer(job, run_dir), capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _step(run_dir / "metrics.jsonl") == UNREACHABLE_STEPS
    assert '"report.unfinished"' in r.stdout + r.stderr  # the trainer says so, in its own output
    said = (run_dir / "report.log").read_text()  # and the writer why, in its own file
    assert '"report.abandoned"' in said or '"report.unavailable"' in said, said[-2000:]
    if (why := writer_error(run_dir / "report.log")) is not None:  # the writer's own reason reaches the trainer's output
        assert why in r.stdout + r.stderr, why
    # and the writer is gone too, by itself
    wait_for("the W&B writer to exit", lambda: not [p for p in psutil.process_iter(["cmdline"]) if "dpool.trainer.wandb_writer" in " ".join(p.info["cmdline"] or ()) and _cwd(p) == str(run_dir)], 60)
    # A writer that gives up leaves nothing in the machine's temporary folder (wandb's own folders
    # live in the run's, emptied by the next writer).
    assert not [p.name for p in tmp.iterdir() if "wandb" in p.name], list(tmp.iterdir())


def _cwd(p: psutil.Process) -> str:
    try:
        return p.cwd()
    except psutil.Error:
        return ""


# -- a pool ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.long
def test_a_pool_job_killed_mid_run_leaves_one_wandb_run_written_by_rank_0_alone(processes: Processes, tmp_path: Path) -> None:
    """Two ranks on one dpd with a shared WANDB_DIR: rank 0's trainer and its W&B writer are
    killed together (their process group, as the machine would lose them), the job restarts from
    its checkpoint, and the run, whose id comes from the job's id, holds each step once, written
    by one process per generation."""
    pool = LocalPool(processes, tmp_path, env={**OFFLINE, "WANDB_DIR": str(tmp_path / "wb")})
    pool.start(2)
    job_file = wandb_job(tmp_path, "pooled", workers={"min": 2, "max": 2})
    job = pool.submit(job_file)
    rid = f"{job}-{load_job(job_file).training_hash()[:8]}"  # the run's id: the job's id and training hash
    held = lambda: logged_step(tmp_path / "wb" / "wandb", rid) or 0  # noqa: E731
    pool.wait_status(job, "W&B holding 20 steps of the job, past step 60", lambda s: s.state == "running" and s.step >= 60 and held() >= 20, TIMEOUT, every=0.05)
    reporting = [pid for pid in pool.trainer_pids("n0", job) if _has_writer(pid)]
    assert len(reporting) == 1, "one rank reports"
    # The writer and its wandb-core hold none of the trainer's output, which its dpd reads to the
    # end before it takes the trainer's exit (else a killed trainer's exit would wait for them).
    ours = {_fd(reporting[0], n) for n in (1, 2)}
    helpers = psutil.Process(reporting[0]).children(recursive=True)
    assert len(helpers) >= 2 and not any(_fd(h.pid, n) in ours for h in helpers for n in (1, 2)), [(h.name(), _fd(h.pid, 1)) for h in helpers]
    os.killpg(reporting[0], signal.SIGKILL)
    final = pool.wait_end(job, TIMEOUT)
    assert final.state == "succeeded" and final.generation == 2, final
    runs = wandb_runs(tmp_path / "wb" / "wandb")
    assert runs and runs[0]["ids"] == {rid}
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in pool.dpctl_json("metrics", job)) + "\n")
    assert_one_run_every_step_once(runs, 2, metrics)


def _fd(pid: int, n: int) -> str:
    return os.readlink(f"/proc/{pid}/fd/{n}")


def _has_writer(pid: int) -> bool:
    try:
        return any("dpool.trainer.wandb_writer" in " ".join(c.cmdline()) for c in psutil.Process(pid).children())
    except psutil.Error:
        return False


def test_an_mlx_lm_config_that_reports_to_wandb_is_a_job_that_does(tmp_path: Path) -> None:
    from dpool.protocol.mlxlm_config import job_document, read_config

    for text in ("report_to: wandb\nproject_name: sql\n", "wandb: sql\n"):  # mlx-lm's --report-to and its older --wandb
        config = tmp_path / "lora.yaml"
        config.write_text("model: m\ndata: d\n" + text)
        made = job_document(read_config(str(config)), str(config), "sql")
        spec = parse_job(made.job, source=str(config), base_dir=str(tmp_path))
        assert (spec.report.to, spec.report.project) == (("wandb",), "sql"), text
