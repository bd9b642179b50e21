"""dpctl as people who use ray, kubectl and brew use it, against one real local pool.

One pool (a serving dpd with one slot) serves the whole module: global flags anywhere on the line,
`--json` on every command, `submit --set/--dry-run`, status times and filters, shell completion,
`logs -f` and `watch` on a failed job, the live view in a real terminal (tmux), and, last, `watch`
riding out a coordinator that is SIGKILLed and started again on the same state dir and port.
dpctl runs as its own process where the process is the point (the console flow, completion, a
terminal, a restart); elsewhere `cli.main` runs here, against the same real pool, to save the
interpreter's start-up on two busy cores.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import LocalPool, Processes, free_port, wait_for
from jobs import write_job

from dpool.client import cli
from dpool.client.demo import Screen
from dpool.client.jobtimes import JobTimes
from dpool.protocol.payloads import EventRow, JobStatus, WorkerStatus

JOB_TIMEOUT = 120.0
Ctl = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPool]:
    root = tmp_path_factory.mktemp("cli")
    procs = Processes(root)
    try:
        yield LocalPool(procs, root).start(1)
    finally:
        procs.stop_all()


@pytest.fixture
def ctl(pool: LocalPool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Ctl:
    """`dpctl ARGS` in this process, the pool's address in $DPOOL_COORDINATOR: (code, stdout, stderr)."""
    monkeypatch.setenv("DPOOL_COORDINATOR", pool.addr)
    monkeypatch.delenv("DPOOL_KEYS", raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def ctl_json(ctl: Ctl, *args: str) -> Any:
    code, out, err = ctl(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def env_without_pool(**extra: str) -> dict[str, str]:
    unset = ("DPOOL_COORDINATOR", "DPOOL_KEYS", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "TMUX")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, **extra}


def dpctl(*args: str, env: dict[str, str] | None = None, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """dpctl as typed: no --coordinator unless the test gives one (where it likes)."""
    return subprocess.run([sys.executable, "-m", "dpool.client.cli", *args], capture_output=True, text=True, timeout=timeout, env=env or env_without_pool())


def complete(line: str, tmp_path: Path) -> list[str]:
    """What the shell would offer for `line` (argcomplete's protocol, as its shell scripts drive it)."""
    out = tmp_path / "completions"
    env = env_without_pool(_ARGCOMPLETE="1", _ARGCOMPLETE_SHELL="bash", COMP_LINE=line, COMP_POINT=str(len(line)), COMP_TYPE="9",
                           _ARGCOMPLETE_IFS="\n", _ARGCOMPLETE_STDOUT_FILENAME=str(out))
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return [word.strip() for word in out.read_text().split("\n")]


def tiny(pool: LocalPool, name: str, **sections: dict[str, Any]) -> Path:
    """The tests' TINY job on one worker (about 50 steps a second here)."""
    return write_job(pool.root, name, workers={"min": 1, "max": 1}, **sections)


# -- no pool needed ------------------------------------------------------------------------------


def test_version_and_completion_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and re.fullmatch(r"dpctl \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
    for shell, marker in (("bash", "complete "), ("zsh", "compdef"), ("fish", "complete --command dpctl")):
        assert cli.main(["completion", shell]) == 0
        out = capsys.readouterr().out
        assert marker in out and "dpctl" in out, (shell, out[:400])


@pytest.mark.parametrize(("given", "said"), [
    ("train.steps=abc", "train.steps = 'abc': must be an integer"),
    ("train.nope=1", "train.nope = 1: unknown key"),
    ("workers.max", "must be KEY=VALUE"),
    ("train..lr=1", "must be KEY=VALUE"),
    ("a.b.c=1", "a = {b = {c = 1}}: unknown key"),
    ("train.steps.x=1", "has `train.steps` as a value, not a [train.steps] table"),
    ("train.optimizer_config.nope=1", "train.optimizer_config = {nope = 1}: only with train.optimizer set"),
    ("workers.max=0", "workers.max = 0"),
])
def test_a_bad_set_names_the_key_the_value_and_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str, said: str) -> None:
    job = write_job(tmp_path, "bad-set")
    assert cli.main(["submit", str(job), "--set", given, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert said in err and (given in err or "KEY=VALUE" in err), err


def test_flags_after_the_subcommand_are_read_and_json_where_it_does_not_apply_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --keys after the subcommand is read: a folder without keys is refused (exit 2).
    assert cli.main(["status", "--keys", str(tmp_path / "no-keys")]) == 2
    assert "--keys" in capsys.readouterr().err
    assert cli.main(["status", "--timeout", "0"]) == 2
    assert "--timeout 0" in capsys.readouterr().err
    assert cli.main(["--json", "demo"]) == 2
    assert "--json does not apply" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(["demo", "--json"])
    assert done.value.code == 2
    assert cli.main(["status", "--state", "bogus"]) == 2
    assert "--state bogus: allowed: queued" in capsys.readouterr().err
    assert cli.main(["status", "some-job", "--state", "running"]) == 2
    assert cli.main(["submit", str(tmp_path / "missing.toml"), "--dry-run"]) == 2
    assert "no such file" in capsys.readouterr().err
    # What is no job file is refused at once, not read forever (a device, a FIFO) or whole (1 MiB+)
    os.mkfifo(tmp_path / "fifo.toml")
    (tmp_path / "big.toml").write_bytes(b"#" * (2 << 20))
    for given, said in (("/dev/zero", "is not a regular file"), (str(tmp_path / "fifo.toml"), "is not a regular file"),
                        (str(tmp_path / "big.toml"), "is larger than 1 MiB"), (str(tmp_path), "is a directory")):
        assert cli.main(["submit", given, "--dry-run"]) == 2
        assert said in capsys.readouterr().err, given
    # A follower waits out a coordinator that answered once, not one that never did: exit 3 at once.
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    for follower in (["watch", "some-job"], ["logs", "some-job", "-f"]):
        started = time.monotonic()
        assert cli.main([*follower, "--coordinator", nowhere, "--timeout", "0.3"]) == 3
        assert time.monotonic() - started < 5 and nowhere in capsys.readouterr().err


def test_a_data_folder_here_that_holds_no_data_is_refused_at_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was queued, and failed on every node ("no node can serve this job"). A path that does not
    exist here is still submitted (a node may hold it), with a note in a dry run."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("not data")
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "valid.jsonl").write_text("{}\n")
    cases = (
        (write_job(tmp_path, "gpt", data={"source": "empty"}), "data.source = 'empty': no .txt or .jsonl files match it in"),
        (write_job(tmp_path, "glob", data={"source": "notes/*.txt"}), "data.source = 'notes/*.txt': no .txt or .jsonl files match it in"),
        (write_job(tmp_path, "lm", base={}, model={"kind": "mlx_lm", "path": "some/model"}, data={"source": "lm"}), "holds no train.jsonl"),
    )
    for job, said in cases:
        assert cli.main(["--coordinator", "tcp://127.0.0.1:9", "--timeout", "0.2", "submit", str(job)]) == 2, job
        err = capsys.readouterr().err
        assert said in err, err
    elsewhere = write_job(tmp_path, "elsewhere", data={"source": "nothere/*.txt"})
    assert cli.main(["--coordinator", "tcp://127.0.0.1:9", "--timeout", "0.2", "submit", str(elsewhere), "--dry-run"]) == 0
    assert "the pool's nodes then look for it at that path" in capsys.readouterr().err


def test_a_gpt_data_path_found_only_under_the_current_folder_is_refused_naming_both(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`source = "data"` in jobs/job.toml, submitted from the folder that holds data/: the path is
    taken from jobs/, where nothing is, so the job was queued and failed on every node."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("some text to train on\n")
    (tmp_path / "jobs").mkdir()
    job = write_job(tmp_path / "jobs", "rel", data={"source": "data"})
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--coordinator", "tcp://127.0.0.1:9", "--timeout", "0.2", "submit", str(job), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"data.source = 'data': no .txt or .jsonl files match it under the job file's folder ({tmp_path / 'jobs' / 'data'})" in err, err
    assert f"{tmp_path / 'data'} under the current folder is not used" in err
    monkeypatch.chdir(tmp_path / "jobs")  # from the job's folder: not here, maybe on a node (submitted, with a note)
    assert cli.main(["--coordinator", "tcp://127.0.0.1:9", "--timeout", "0.2", "submit", str(job), "--dry-run"]) == 0


def test_a_model_folder_or_training_file_here_that_cannot_train_is_refused_at_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model folder without config.json or with a damaged weights file, or a train.jsonl of
    blank lines, that the submitting machine holds: the job was queued and failed on every node
    within a second; now submit exits 2 naming the file, as the trainer would."""
    for name in ("noconfig", "cut", "fine"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    (tmp_path / "cut" / "config.json").write_text("{}")
    (tmp_path / "cut" / "model.safetensors").write_bytes((64).to_bytes(8, "little") + b"{}")
    (tmp_path / "fine" / "config.json").write_text("{}")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "train.jsonl").write_text("\n  \n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "hi"}\n')
    cases = (
        ({"path": "noconfig"}, "data", f"model.path = 'noconfig': {tmp_path / 'noconfig'} has no config.json"),
        ({"path": "cut"}, "data", f"model.path = 'cut': {tmp_path / 'cut' / 'model.safetensors'} is not a safetensors file (its header says 64 bytes, in a file of 10)"),
        ({"path": "fine"}, "blank", f"data.source = 'blank': {tmp_path / 'blank' / 'train.jsonl'} holds no examples"),
    )
    for i, (model, data, said) in enumerate(cases):
        job = write_job(tmp_path, f"lm{i}", base={}, model={"kind": "mlx_lm", **model}, data={"source": data})
        assert cli.main(["--coordinator", "tcp://127.0.0.1:9", "--timeout", "0.2", "submit", str(job)]) == 2, job
        err = capsys.readouterr().err
        assert said in err, err


def test_times_come_from_events_and_the_eta_from_the_running_groups_pace() -> None:
    def event(t: float, kind: str, **fields: Any) -> EventRow:
        return EventRow.from_wire({"t": t, "kind": kind, **fields})

    times = JobTimes().add([
        event(100, "job.submitted"), event(101, "group.starting"), event(104, "group.started"), event(105, "node.joined", node="x"),
        event(110, "checkpoint.saved", step=10), event(120, "checkpoint.saved", step=20),
    ])
    running = JobStatus(id="j-1", name="j", state="running", step=25, steps=100, generation=1, world_size=1, workers=[], checkpoint_step=20, loss=None, val_loss=None, error=None)
    assert (times.submitted, times.started, times.finished) == (100, 101, None)
    assert times.elapsed_s(130) == 29
    assert times.eta_s(running, 130) == pytest.approx(100.0)  # 15 steps in 20 s since step 10; 75 to go
    assert times.eta_s(running, 135) == pytest.approx(75 * 25 / 15)  # the same step 5 s later: a slower pace
    times.add([event(140, "group.started")])  # a restart: the new group's own pace, not yet known
    assert times.eta_s(running, 141) is None
    times.add([event(150, "job.succeeded")])
    assert times.finished == 150 and times.elapsed_s(999) == 49 and times.eta_s(running, 151) is None


@pytest.mark.parametrize("no_color", [False, True])
def test_the_demo_progress_on_a_terminal_is_a_live_bar_in_colors_unless_no_color(monkeypatch: pytest.MonkeyPatch, no_color: bool) -> None:
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLORTERM", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")  # a terminal with colors (CI may say TERM=dumb)
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    screen = Screen(out, time.time(), tty=True)
    worker = WorkerStatus(rank=0, node="node-0", share=16, tokens_per_s=5000.0)
    status = JobStatus(id="j-1", name="j", state="running", step=20, steps=200, generation=1, world_size=1, workers=[worker], checkpoint_step=20, loss=2.5, val_loss=None, error=None)
    screen.progress(status, 10)
    screen.say("SIGKILL -> trainer of rank 1 on node-1 (pid 4) at step 20")
    screen.progress(status, 10)
    screen.done()
    text = out.getvalue()
    assert "step  20/200  loss 2.500" in text and "5000 tok/s" in text and "━" in text
    assert "SIGKILL -> trainer of rank 1" in text
    assert bool(re.search(r"\x1b\[[\d;]*(3[0-7]|9[0-7]|38;)", text)) is not no_color, repr(text[:400])


@pytest.mark.parametrize(("config", "flags", "said"), [
    ("coordinator = [broken\n", [], "config.toml: not valid TOML"),
    ("coordinator = 5\n", [], "config.toml: coordinator = 5: must be a string"),
    ('timeout = "soon"\n', [], "config.toml: timeout = 'soon': must be a finite number"),
    ("timeout = 0\n", [], "config.toml: timeout = 0: must be seconds in (0, 86400]"),
    ('coordinator = "tcp://pool"\n', [], "config.toml: coordinator = 'tcp://pool': a tcp address is tcp://HOST:PORT"),
    # a key of dpd's, refused by dpctl too (the same file, the same rules), and a value that a flag
    # overrides: the file is wrong all the same
    ('cache_max = "lots"\n', [], "config.toml: cache_max = 'lots': expected a size such as 50GB"),
    ("timeout = -3\n", ["--timeout", "2"], "config.toml: timeout = -3: must be seconds in (0, 86400]"),
    ("", ["--coordinator", "pool:7340"], "--coordinator 'pool:7340': must be a ZeroMQ address"),
    ("", ["--coordinator", ""], "--coordinator '': must be a ZeroMQ address"),
    ("", ["--state", ""], "--state '': names no state"),
    ("", ["--timeout", "nan"], "--timeout nan: must be seconds"),
    ("", ["--timeout", "inf"], "--timeout inf: must be seconds"),
    ("", ["--timeout", "1e7"], "--timeout 1e+07: must be seconds"),
    ("", ["DPOOL_COORDINATOR=tcp://pool"], "$DPOOL_COORDINATOR 'tcp://pool': a tcp address is tcp://HOST:PORT"),
    # a bind's wildcard, copied from a --serve line: libzmq's 'Invalid argument' and a traceback before
    ("", ["--coordinator", "tcp://*:8316"], "--coordinator 'tcp://*:8316': '*' is for binding"),
    ('join = "tcp://*:7340"\n', [], "config.toml: join 'tcp://*:7340': '*' is for binding"),
    # the file read for its keys alone (the coordinator given): said once, as above, not after a "keys in" prefix
    ("bogus = 1\n", ["--coordinator", "tcp://127.0.0.1:9"], "dpctl: /"),
])
def test_a_bad_config_file_flag_or_address_is_exit_2_naming_it(tmp_path: Path, config: str, flags: list[str], said: str) -> None:
    """Not a traceback, not a silent fall back to the defaults (and then exit 3 for a pool that is
    not there): the file, the key or flag, the value and what is allowed, on stderr alone."""
    (tmp_path / ".config" / "dpool").mkdir(parents=True)
    (tmp_path / ".config" / "dpool" / "config.toml").write_text(config)
    env = dict(f.split("=", 1) for f in flags if "=" in f)
    r = dpctl("status", "--json", *(f for f in flags if "=" not in f), env=env_without_pool(HOME=str(tmp_path), **env), timeout=60)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1 and r.stdout == "", r.stderr
    assert r.stderr.count("config.toml") <= 1 and "keys in" not in r.stderr, r.stderr
    if "--timeout" in flags:  # the dashboard, a command of its own, reads it too
        r = dpctl("dashboard", *flags, env=env_without_pool(HOME=str(tmp_path)), timeout=60)
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_set_reaches_keys_tables_deep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "deep-set.toml"
    job.write_text('name = "deep-set"\n[train]\nsteps = 60\n')
    sets = ["train.optimizer=sgd", "train.optimizer_config.momentum=0.9", "train.lr_schedule.name=cosine_decay",
            "train.lr_schedule.arguments=[1e-3, 50]"]
    code = cli.main(["submit", str(job), *(x for s in sets for x in ("--set", s)), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    train = tomllib.loads(out)["train"]
    assert train["optimizer_config"]["momentum"] == 0.9 and train["lr_schedule"]["arguments"] == [1e-3, 50, 0.0]  # (its default end)


# -- against the pool ----------------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_prints_the_resolved_job_and_submits_nothing(pool: LocalPool, ctl: Ctl) -> None:
    job = tiny(pool, "dry")
    code, out, err = ctl("submit", str(job), "--set", "train.steps=7", "--set", "train.lr=1e-4", "--set", "name=dry-renamed", "--set", "model.positions=learned", "--dry-run")
    assert code == 0, err
    resolved = tomllib.loads(out)
    assert resolved["name"] == "dry-renamed" and resolved["train"]["steps"] == 7 and resolved["model"]["positions"] == "learned"
    assert resolved["train"]["lr"] == 1e-4 and isinstance(resolved["train"]["lr"], float)
    assert resolved["base_dir"] == str(pool.root) and "nothing submitted" in err
    # --json: the job as data; a data source this machine lacks is said (every worker needs it).
    code, out, err = ctl("submit", str(job), "--dry-run", "--json", "--set", "data.source=no-such-corpus/*.txt")
    assert code == 0 and json.loads(out)["job"]["data"]["source"] == "no-such-corpus/*.txt"
    assert "data.source" in err and "the pool's nodes then look for it at that path" in err
    assert not [j for j in ctl_json(ctl, "status") if j["name"].startswith("dry")]


def test_an_empty_listing_of_an_ended_job_does_not_say_yet(pool: LocalPool, ctl: Ctl) -> None:
    job = write_job(pool.root, "never", workers={"min": 5, "max": 5})  # more than the pool's one slot: it waits
    code, out, _ = ctl("submit", str(job))
    job_id = out.strip()
    assert code == 0 and ctl("metrics", job_id)[1].strip() == "no metrics yet"
    assert ctl("cancel", job_id)[0] == 0
    assert ctl("metrics", job_id)[1].strip() == f"no metrics: job {job_id} cancelled without any"
    assert ctl("samples", job_id)[1].strip() == f"no samples: job {job_id} cancelled without any"


@pytest.mark.slow
def test_global_flags_go_anywhere_on_the_line(pool: LocalPool, tmp_path: Path) -> None:
    # After the subcommand and its own flags, as its own process; the flag beats $DPOOL_COORDINATOR.
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    r = dpctl("nodes", "--json", "--coordinator", pool.addr, "--timeout", "10", env=env_without_pool(DPOOL_COORDINATOR=nowhere))
    assert r.returncode == 0 and [n["name"] for n in json.loads(r.stdout)] == ["n0"], r.stderr
    # The last one given wins, wherever it stands: here a coordinator that does not answer.
    r = dpctl("--coordinator", pool.addr, "--json", "status", "--coordinator", nowhere, "--timeout", "0.5")
    assert r.returncode == 3 and nowhere in r.stderr and r.stdout == ""
    # The config file dpctl shares with dpd: its `coordinator` and `timeout`, below $DPOOL_COORDINATOR.
    home = tmp_path / "home"
    (home / ".config" / "dpool").mkdir(parents=True)
    (home / ".config" / "dpool" / "config.toml").write_text(f'coordinator = "{pool.addr}"\ntimeout = 10\nworkers = 1\n')
    r = dpctl("nodes", "--json", env=env_without_pool(HOME=str(home)))
    assert r.returncode == 0 and [n["name"] for n in json.loads(r.stdout)] == ["n0"], r.stderr
    r = dpctl("nodes", "--timeout", "0.5", env=env_without_pool(HOME=str(home), DPOOL_COORDINATOR=nowhere))  # not the file's 10 s
    assert r.returncode == 3 and nowhere in r.stderr
    (home / ".config" / "dpool" / "config.toml").write_text(f'coordinator = "{nowhere}"\ntimeout = 0.5\n')
    r = dpctl("nodes", env=env_without_pool(HOME=str(home)))
    assert r.returncode == 3 and nowhere in r.stderr and "0.5" in r.stderr, r.stderr  # the config's timeout, not 5 s
    # Completion, as the shell asks for it: flags after a subcommand.
    assert "--set" in complete("dpctl submit x.toml --se", tmp_path)
    assert "--coordinator" in complete("dpctl watch --coo", tmp_path)


@pytest.mark.slow
def test_json_on_every_command_with_times_and_state_filters(pool: LocalPool, ctl: Ctl, tmp_path: Path) -> None:
    job = tiny(pool, "every", train={"steps": 10}, eval={"every_steps": 5, "sample_every_steps": 10, "sample_tokens": 16})
    r = dpctl("submit", str(job), "--set", "train.steps=12", "--json", "--coordinator", pool.addr)
    assert r.returncode == 0 and r.stdout.count("\n") == 1, r.stderr
    job_id = json.loads(r.stdout)["id"]
    assert job_id.startswith("every-")
    assert job_id in complete(f"dpctl watch --coordinator {pool.addr} ev", tmp_path)  # the pool's job ids

    r = dpctl("watch", job_id, "--json", "--coordinator", pool.addr)
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 0 and lines and lines[-1]["state"] == "succeeded", r.stderr
    assert lines[-1]["step"] == 12 == lines[-1]["steps"]  # --set reached the pool
    assert [row["step"] for row in lines] == sorted(row["step"] for row in lines)

    s = ctl_json(ctl, "status", job_id)
    assert s["id"] == job_id and s["state"] == "succeeded" and s["steps"] == 12
    assert s["submitted"] <= s["started"] <= s["finished"] and s["eta_s"] is None
    assert s["elapsed_s"] == pytest.approx(s["finished"] - s["started"], abs=0.01) and s["elapsed_s"] > 0
    assert s["priority"] == 0 and "comm" in s and s["waiting"] is None  # every key, whatever the job
    listed = {j["id"]: j for j in ctl_json(ctl, "status")}
    assert listed[job_id] == s
    assert job_id in [j["id"] for j in ctl_json(ctl, "status", "--state", "succeeded")]
    assert job_id in [j["id"] for j in ctl_json(ctl, "status", "--state", "ended")]
    assert job_id not in [j["id"] for j in ctl_json(ctl, "status", "--state", "running,queued", "--state", "failed")]
    code, table, _ = ctl("status")
    assert code == 0 and all(h in table for h in ("SUBMITTED", "STARTED", "FINISHED", "ELAPSED", "ETA"))
    code, detail, _ = ctl("status", job_id)
    assert re.search(r"elapsed \d+s", detail) and "submitted " in detail

    assert ctl_json(ctl, "nodes")[0]["name"] == "n0"
    code, out, _ = ctl("logs", job_id, "--json")
    logs = [json.loads(line) for line in out.splitlines()]
    assert logs and all({"seq", "t", "rank", "generation", "text"} <= row.keys() for row in logs)
    code, out, _ = ctl("logs", job_id, "--json", "-f")
    assert code == 0 and [json.loads(line) for line in out.splitlines()] == logs  # a finished job: all of it
    code, out, err = ctl("logs", job_id, "--rank", "3")  # it printed nothing, exit 0
    assert code == 2 and not out and f"--rank 3: job {job_id} has no such rank (its last group had ranks 0-0)" in err, err
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "logs", job_id, "--rank", "-1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "-1 is no rank: an integer from 0 to 16383" in r.stderr and "null" not in r.stderr, r.stderr
    metrics = ctl_json(ctl, "metrics", job_id)
    assert [r["step"] for r in metrics if r["kind"] == "train"] == list(range(1, 13))
    assert "job.succeeded" in [e["kind"] for e in ctl_json(ctl, "events", job_id)]
    assert [r["step"] for r in ctl_json(ctl, "samples", job_id)][:1] == [10]
    evals = [r for r in metrics if r["kind"] == "eval"]
    plotted = ctl_json(ctl, "plot", job_id, "-o", str(tmp_path / "every.png"))
    assert plotted == {"file": str(tmp_path / "every.png"), "job": job_id, "state": "succeeded", "steps": 12, "evaluations": len(evals), "restarts": 0}
    exported = ctl_json(ctl, "export", job_id, str(tmp_path / "export"))
    assert exported["job"] == job_id and exported["step"] == 12 and exported["files"]
    assert ctl_json(ctl, "cancel", job_id) == {"id": job_id, "state": "succeeded"}
    drained = ctl_json(ctl, "drain", "n0")
    assert drained["node"] == "n0" and drained.keys() == {"node", "state", "reason"}
    assert ctl_json(ctl, "undrain", "n0")["state"] == "idle"


def test_status_lists_every_job_newest_first_beyond_what_the_coordinator_keeps_in_memory(processes: Processes, tmp_path: Path) -> None:
    """An old job still waiting stays in the coordinator's memory while newer finished ones leave
    it for the database (past RECENT_FINISHED): the list is still whole and newest first."""
    from dpool.client.rpc import Client, all_jobs
    from dpool.daemon.pool import RECENT_FINISHED
    from dpool.protocol import messages as m
    from dpool.protocol.jobspec import parse_job

    pool = LocalPool(processes, tmp_path).start(1)
    waits = pool.submit(write_job(tmp_path, "waits", workers={"min": 2, "max": 2}))  # never runs on one slot
    never = parse_job({"name": "never", "workers": {"min": 2, "max": 2}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()
    with Client(pool.addr, 10) as c:
        for _ in range(RECENT_FINISHED + 6):
            c.call(m.Cancel(job=c.call(m.Submit(job=never, source="test"), m.Submitted).job_id), m.CancelReply)
        paged = [j.id for j in all_jobs(c, page=7)]
    listed = pool.dpctl_json("status")
    assert len(listed) == RECENT_FINISHED + 7 == len({j["id"] for j in listed})
    assert [j["id"] for j in listed] == paged and listed[-1]["id"] == waits and listed[-1]["state"] == "queued"
    assert [j["submitted"] for j in listed] == sorted((j["submitted"] for j in listed), reverse=True)


@pytest.mark.slow
def test_a_failed_job_ends_logs_f_and_watch_with_exit_1(pool: LocalPool, ctl: Ctl) -> None:
    job = tiny(pool, "fails")
    code, out, _ = ctl("submit", str(job), "--set", "data.source=no-such-corpus/*.txt")
    job_id = out.strip()
    r = dpctl("logs", job_id, "-f", "--coordinator", pool.addr)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"job {job_id} failed" in r.stderr and "data.source" in r.stderr
    assert ctl("watch", job_id)[0] == 1
    code, _, err = ctl("submit", str(job), "--set", "data.source=no-such-corpus/*.txt", "--follow")
    assert code == 1 and "failed" in err


def tmux_text(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "view"], capture_output=True, text=True, timeout=10).stdout


@pytest.mark.slow
def test_watch_in_a_terminal_shows_the_job_step_loss_workers_and_eta(pool: LocalPool, ctl: Ctl, tmp_path: Path) -> None:
    """`dpctl watch` in a real terminal (a tmux pane), read the way a person reads it. The job is
    long; it is cancelled once the view has been read, and watch ends with exit 1."""
    found = shutil.which("tmux")
    if found is None:
        pytest.skip("tmux is not installed (.ci/run installs it)")
    steps = 100_000
    job_id = pool.submit(tiny(pool, "live", train={"steps": steps}, checkpoint={"every_steps": 50}))
    tmux = [found, "-S", str(tmp_path / "tmux.sock"), "-f", "/dev/null"]
    watch = f"{sys.executable} -m dpool.client.cli watch {job_id} --coordinator {pool.addr}; echo dpctl-exit-$?; exec cat"
    subprocess.run([*tmux, "new-session", "-d", "-s", "view", "-x", "110", "-y", "32", "sh", "-c", watch], check=True, env=env_without_pool(TERM="xterm-256color"), timeout=30)
    server = int(subprocess.run([*tmux, "display-message", "-p", "-t", "view", "#{pid}"], capture_output=True, text=True, check=True).stdout)
    try:
        def mid_run() -> str | None:
            text = tmux_text(tmux)
            step = re.search(rf"step (\d+)/{steps}", text)
            ok = step and int(step.group(1)) > 0 and "RUNNING" in text and re.search(r"ETA \d+(s|m\d\ds|h\d\dm)", text)
            return text if ok else None

        text = wait_for("the live view of a running job with an ETA", mid_run, JOB_TIMEOUT, every=0.3)
        assert f"job {job_id}  live" in text, text
        assert re.search(r"loss \d+\.\d{4} ", text), text
        assert re.search(r"RANK +NODE +SHARE +TOKENS/S", text) and re.search(r"^ *0 +n0 +6 +\d+ *$", text, re.M), text
        assert re.search(r"workers 1 ", text) and re.search(r"elapsed \d+", text) and "group.started" in text, text

        # Narrower: the next redraw fits the new width (the progress row keeps its ETA).
        subprocess.run([*tmux, "resize-window", "-t", "view", "-x", "72"], check=True, timeout=10)
        wait_for("a redraw at 72 columns", lambda: re.search(rf"^step \d+/{steps} .* ETA \S+ *$", tmux_text(tmux), re.M), 20, every=0.3)

        assert ctl("cancel", job_id)[0] == 0
        text = wait_for("watch to end", lambda: "dpctl-exit-" in (t := tmux_text(tmux)) and t, JOB_TIMEOUT, every=0.3)
        assert "dpctl-exit-1" in text and "CANCELLED" in text, text
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
        wait_for("the tmux server gone", lambda: not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE, 10)


@pytest.mark.slow
def test_watch_rides_out_a_coordinator_killed_and_restarted(pool: LocalPool, ctl: Ctl, tmp_path: Path) -> None:
    """The serving dpd is SIGKILLed mid-run and started again on the same state dir and port:
    `watch` waits for it, sees the job go on, and ends with the job's exit code (1: cancelled)."""
    job_id = pool.submit(tiny(pool, "restart", train={"steps": 100_000}, checkpoint={"every_steps": 20}))
    pool.wait_status(job_id, "a checkpoint", lambda s: s.state == "running" and (s.checkpoint_step or 0) >= 20, JOB_TIMEOUT)
    log = tmp_path / "watch.log"
    watcher = pool.procs.start([sys.executable, "-m", "dpool.client.cli", "watch", job_id, "--coordinator", pool.addr, "--timeout", "2"], log, env=env_without_pool())
    wait_for("watch to show the job", lambda: f"job {job_id}  running" in log.read_text(), 60)

    served = pool.daemons["n0"]
    os.kill(served.pid, signal.SIGKILL)
    served.proc.wait()
    wait_for("watch to miss the coordinator", lambda: "retrying" in log.read_text(), 30)
    wait_for("n0's trainer gone", lambda: not pool.trainer_pids("n0", job_id), 30)
    pool.start_daemon("n0", serve=True)  # same name, state dir and address: the coordinator reloads its SQLite

    wait_for("watch to hear from it again", lambda: "answers again" in log.read_text(), 60)
    pool.wait_status(job_id, "the job running again", lambda s: s.state == "running" and s.generation >= 2, JOB_TIMEOUT)
    wait_for("watch to show the new generation", lambda: re.search(r"running +step \d+/100000 .* gen [2-9]", log.read_text()), 30)
    assert ctl("cancel", job_id)[0] == 0
    assert watcher.wait(timeout=60) == 1, log.read_text()[-3000:]
    assert re.search(rf"job {job_id} +cancelled", log.read_text().splitlines()[-1]), log.read_text()[-2000:]


def test_dpctl_cache_shows_what_a_node_holds_of_a_tree_it_is_fetching() -> None:
    from dpool.client.tables import held

    assert held(12 << 20, 24 << 20, False) == "12.0MiB of 24.0MiB"
    assert held(0, 24 << 20, False) == "0B of 24.0MiB"  # a manifest alone
    assert held(24 << 20, 24 << 20, True) == "24.0MiB"
    assert held(None, 24 << 20, False) == "24.0MiB"  # a node that did not say


def test_event_details_read_lists_as_their_items_never_a_python_repr() -> None:
    from dpool.client.tables import event_details
    from dpool.protocol.payloads import EventRow

    e = EventRow(t=1.0, kind="group.starting", fields={"nodes": ["n1", "n2"], "ranks": ["n1"], "by": [], "cause": None, "warm": True, "reason": "a b"})
    assert event_details(e) == "nodes=n1,n2 ranks=n1 by=- cause=- warm=true reason=a b"
