"""Trainers forked from a dpd's zygote (trainer/zygote.py, daemon/forkserver.py): the same training
as an exec'd trainer, the same process contract (own process group, exit codes, output, death with
the daemon), requests the zygote refuses without dying, and the agent's use of it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import LocalPool, Processes, wait_for
from jobs import write_job

from dpool.daemon.childenv import start_zygote, trainer_command, trainer_env
from dpool.daemon.forkserver import KILLED, LM_MODULES, ForkedProcess, ForkServer, ForkServerError


def run(coro_fn: Callable[[ForkServer], Awaitable[Any]]) -> Any:
    """`coro_fn(server)` with a started zygote, stopped afterwards."""

    async def main() -> Any:
        fs = ForkServer()
        fs.start()
        assert fs.ready is not None and await fs.ready, "the zygote did not get ready"
        try:
            return await coro_fn(fs)
        finally:
            for child in list(fs.children.values()):
                os.killpg(child.pid, signal.SIGKILL)
                await child.wait()
            await fs.close()

    return asyncio.run(main())


def losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if r.get("kind", "train") == "train" and "loss" in r]


def test_a_forked_trainer_trains_exactly_the_curve_of_an_exec_d_one(tmp_path: Path) -> None:
    job = write_job(tmp_path, "same", train={"steps": 8})
    execd, forked = tmp_path / "exec", tmp_path / "fork"
    done = subprocess.run(trainer_command(str(job), "--run-dir", str(execd)), env=trainer_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    async def fork(fs: ForkServer) -> tuple[int, bytes]:
        forked.mkdir()
        child = await fs.spawn([str(job), "--run-dir", str(forked)], trainer_env(), str(forked))
        return await child.wait(), await child.stdout.read()

    code, out = run(fork)
    assert code == 0, out[-2000:]
    assert b'"trainer.started"' in out  # its output (stdout and stderr) came through the pipe
    assert losses(forked) == losses(execd) and len(losses(execd)) == 8


def test_a_forked_trainer_is_a_process_group_of_its_own_named_as_a_trainer_and_reports_its_death(tmp_path: Path) -> None:
    job = write_job(tmp_path, "long", train={"steps": 100_000})

    async def check(fs: ForkServer) -> None:
        memory = tmp_path / "kept"  # where its environment says to keep its state in memory
        child = await fs.spawn([str(job), "--run-dir", str(tmp_path / "run")], trainer_env(DPOOL_MEMORY_DIR=str(memory)), str(tmp_path))
        assert isinstance(child, ForkedProcess) and child.returncode is None
        proc = psutil.Process(child.pid)
        assert os.getpgid(child.pid) == child.pid and os.getsid(child.pid) == child.pid
        assert fs.proc is not None and proc.ppid() == fs.proc.pid
        assert str(job) in " ".join(proc.cmdline()) and "dpool.trainer " in " ".join(proc.cmdline())
        assert proc.cwd() == str(tmp_path)
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line, "the trainer's first output line"
        for _ in range(600):  # its environment is the one asked for: it keeps its steps there
            if any(memory.glob("checkpoints/step-*/manifest.json")):
                break
            await asyncio.sleep(0.1)
        assert any(memory.glob("checkpoints/step-*/manifest.json")), sorted(memory.rglob("*"))
        os.killpg(child.pid, signal.SIGKILL)
        assert await asyncio.wait_for(child.wait(), 10) == KILLED == child.returncode

    run(check)


def test_a_bad_job_exits_2_with_its_error_line(tmp_path: Path) -> None:
    async def check(fs: ForkServer) -> tuple[int, bytes]:
        child = await fs.spawn([str(tmp_path / "missing.toml"), "--run-dir", str(tmp_path)], trainer_env(), str(tmp_path))
        return await child.wait(), await child.stdout.read()

    code, out = run(check)
    assert code == 2 and b"error: " in out and b"missing.toml" in out, out


def test_the_zygote_refuses_bad_requests_and_goes_on_forking(tmp_path: Path) -> None:
    async def check(fs: ForkServer) -> None:
        r, w = os.pipe()
        try:
            refused = [
                await fs.request({"op": "spawn", "argv": "not a list", "env": {}, "cwd": str(tmp_path)}, [w]),
                await fs.request({"op": "spawn", "argv": [], "env": {"A": 1}, "cwd": str(tmp_path)}, [w]),
                await fs.request({"op": "spawn", "argv": [], "env": {}, "cwd": str(tmp_path / "nowhere")}, [w]),
                await fs.request({"op": "spawn", "argv": [], "env": {}, "cwd": str(tmp_path)}, []),
                await fs.request({"op": "spawn", "argv": [], "env": {}, "cwd": str(tmp_path)}, [w, w]),
                await fs.request({"op": "explode"}, []),
            ]
        finally:
            os.close(r)
            os.close(w)
        errors = [reply.get("error", "") for reply in refused]
        assert all(errors) and not any("pid" in reply for reply in refused), refused
        assert "argv" in errors[0] and "env" in errors[1] and "nowhere" in errors[2] and "one output pipe" in errors[3]
        child = await fs.spawn(["--help"], trainer_env(), str(tmp_path))  # still serving
        assert await child.wait() == 0 and b"usage:" in await child.stdout.read()

    run(check)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; on macOS the zygote imports no mlx-lm ahead of forks")
def test_modules_preloaded_ahead_of_a_fork_are_in_the_zygote_and_a_bad_import_request_is_refused(tmp_path: Path) -> None:
    """What a dpd asks while a language-model job's files stage: mlx-lm imported in the zygote once,
    before any of its trainers is forked (each fork then has it, where a first fork imported it
    itself and the zygote again after it)."""

    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    async def check(fs: ForkServer) -> None:
        assert fs.proc is not None
        zygote = fs.proc.pid
        marker = "/regex/_regex"  # a native library of transformers, which mlx-lm imports: not loaded yet
        assert marker not in maps(zygote)
        refused = await fs.request({"op": "import", "modules": "mlx_lm"}, [])
        assert "list of module names" in refused.get("error", ""), refused
        asked = fs.preload(LM_MODULES)
        assert asked is not None
        await asked
        assert fs.preload(LM_MODULES) is None  # nothing left to ask
        assert set(LM_MODULES) <= fs.preloaded and marker in maps(zygote)
        child = await fs.spawn(["--help"], trainer_env(), str(tmp_path), LM_MODULES)  # nothing left to import after it
        assert await child.wait() == 0 and b"usage:" in await child.stdout.read()

    run(check)


def test_on_macos_no_mlx_lm_is_imported_ahead_of_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has imported MLX (Metal) must not fork on macOS: there the zygote imports
    nothing for later forks, neither preloaded nor after a fork."""
    from dpool.daemon import forkserver

    assert forkserver.ahead_of_forks(LM_MODULES) == (() if sys.platform == "darwin" else LM_MODULES)
    monkeypatch.setattr(forkserver.sys, "platform", "darwin")
    assert forkserver.ahead_of_forks(LM_MODULES) == ()
    assert ForkServer().preload(LM_MODULES) is None  # nothing asked (and no zygote started for it)


def test_a_zygote_started_before_the_loop_is_adopted_and_forks(tmp_path: Path) -> None:
    early = start_zygote()

    async def main() -> None:
        fs = ForkServer(early)
        fs.start()
        assert fs.ready is not None and await asyncio.wait_for(asyncio.shield(fs.ready), 60)
        assert fs.proc is not None and fs.proc.pid == early.proc.pid
        child = await fs.spawn(["--help"], trainer_env(), str(tmp_path))
        assert await asyncio.wait_for(child.wait(), 60) == 0
        await fs.close()
        assert fs.proc.returncode is not None, "it leaves when the daemon closes it"

    asyncio.run(main())


def test_children_of_a_killed_zygote_die_with_it_and_count_as_killed(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the children's parent-death signal is Linux's")
    job = write_job(tmp_path, "orphan", train={"steps": 100_000})

    async def check(fs: ForkServer) -> None:
        child = await fs.spawn([str(job), "--run-dir", str(tmp_path / "run")], trainer_env(), str(tmp_path))
        assert fs.proc is not None
        fs.proc.kill()
        assert await asyncio.wait_for(child.wait(), 20) == KILLED
        assert not psutil.pid_exists(child.pid) or psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        with pytest.raises(ForkServerError):  # no new zygote at once: the agent execs meanwhile
            await fs.spawn(["--help"], trainer_env(), str(tmp_path))

    run(check)


@pytest.mark.parametrize("zygote", ["1", "0"])
def test_a_dpd_forks_its_trainers_unless_told_not_to(processes: Processes, tmp_path: Path, zygote: str) -> None:
    pool = LocalPool(processes, tmp_path, env={"DPOOL_ZYGOTE": zygote})
    pool.start(1)
    job = pool.submit(write_job(tmp_path, "forked"))
    assert pool.wait_end(job).state == "succeeded"
    log = pool.daemons["n0"].log
    started = [json.loads(line) for line in log.read_text().splitlines() if '"worker.started"' in line]
    assert started and all(s["forked"] is (zygote == "1") for s in started), started
    zygotes = [json.loads(line)["pid"] for line in log.read_text().splitlines() if '"zygote.ready"' in line]
    assert len(zygotes) == (1 if zygote == "1" else 0), zygotes
    if zygotes:  # started by `dpd run`'s entry point before the daemon's own imports, not after them
        starting = next(json.loads(line) for line in log.read_text().splitlines() if '"dpd.starting"' in line)
        assert psutil.Process(zygotes[0]).create_time() < datetime.fromisoformat(starting["timestamp"]).timestamp()
    pool.stop()
    for pid in zygotes:  # it leaves with its dpd
        wait_for(f"zygote {pid} gone", lambda pid=pid: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10)
