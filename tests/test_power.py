"""dpd keeps a Mac awake while any of its trainers runs (daemon/power.py).

caffeinate cannot run here, so the guard is checked as the LaunchAgent is: the command line it
builds is asserted, and what `spawn` starts is a stand-in with caffeinate's `-w PID` behaviour (it
waits for PID to exit), a real process whose life the tests watch. The last test runs a real agent,
a real coordinator and two real trainers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import zmq.asyncio
from conftest import Processes, alive, free_port
from jobs import job as job_doc

from dpool.client.rpc import Client
from dpool.daemon.agent import Agent
from dpool.daemon.coordinator import Coordinator
from dpool.daemon.coordthread import CoordinatorThread
from dpool.daemon.power import SleepGuard, caffeinate_command
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

STAND_IN = "import psutil, sys; psutil.Process(int(sys.argv[1])).wait()"  # caffeinate -w PID: until PID exits


class Spawner:
    """Records each command line the guard builds and starts the stand-in for it."""

    def __init__(self, processes: Processes, tmp_path: Path) -> None:
        self.processes, self.tmp_path = processes, tmp_path
        self.commands: list[list[str]] = []
        self.started: list[subprocess.Popen[Any]] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.Popen[Any]:
        assert argv[:3] == ["/usr/bin/caffeinate", "-i", "-w"], argv
        self.commands.append(list(argv))
        p = self.processes.start([sys.executable, "-c", STAND_IN, argv[3]], self.tmp_path / f"caffeinate-{len(self.started)}.log", label="caffeinate stand-in")
        self.started.append(p)
        return p


def test_the_command_is_caffeinate_against_idle_sleep_until_dpd_exits() -> None:
    assert caffeinate_command(4242) == ["/usr/bin/caffeinate", "-i", "-w", "4242"]
    assert SleepGuard.for_this_machine("darwin", pid=77).command == ["/usr/bin/caffeinate", "-i", "-w", "77"]
    assert SleepGuard.for_this_machine("darwin").command == caffeinate_command(os.getpid())
    linux = SleepGuard.for_this_machine("linux")
    assert linux.command is None
    linux.update(3)  # nothing to hold, nothing started
    assert not linux.held


def test_held_from_the_first_trainer_to_the_last(processes: Processes, tmp_path: Path) -> None:
    spawn = Spawner(processes, tmp_path)
    guard = SleepGuard(caffeinate_command(os.getpid()), spawn)
    guard.update(0)
    assert spawn.commands == [] and not guard.held
    guard.update(1)  # the first trainer
    (first,) = spawn.started
    assert guard.held and alive(first.pid)
    guard.update(2)
    guard.update(1)  # one of two ended: still held, by the same process
    assert spawn.started == [first] and alive(first.pid)
    guard.update(0)  # the last one ended
    assert not guard.held and first.returncode == -signal.SIGTERM  # ended by the guard, and reaped
    guard.update(1)  # the next job
    assert len(spawn.started) == 2 and guard.held
    guard.close()  # dpd stopping
    assert spawn.started[1].returncode == -signal.SIGTERM
    assert spawn.commands == [caffeinate_command(os.getpid())] * 2


def test_a_caffeinate_that_died_is_started_again_and_a_missing_one_is_said_once(processes: Processes, tmp_path: Path) -> None:
    spawn = Spawner(processes, tmp_path)
    guard = SleepGuard(caffeinate_command(os.getpid()), spawn)
    guard.update(1)
    os.kill(spawn.started[0].pid, signal.SIGKILL)
    spawn.started[0].wait()
    with structlog.testing.capture_logs() as logs:
        guard.update(2)
    assert [e["event"] for e in logs] == ["power.assertion_lost", "power.assertion_held"]
    assert len(spawn.started) == 2 and guard.held
    guard.close()

    def missing(argv: Sequence[str]) -> subprocess.Popen[Any]:
        raise FileNotFoundError(2, "No such file or directory", argv[0])

    guard = SleepGuard(caffeinate_command(os.getpid()), missing)
    with structlog.testing.capture_logs() as logs:
        for n in (1, 2, 0, 1):
            guard.update(n)  # training goes on without the assertion
    assert [e["event"] for e in logs] == ["power.assertion_failed"] and not guard.held


def test_the_agent_holds_it_from_its_first_trainer_to_its_last(processes: Processes, tmp_path: Path) -> None:
    spawn = Spawner(processes, tmp_path)
    guard = SleepGuard(caffeinate_command(os.getpid()), spawn)
    spec = parse_job(job_doc("awake", workers={"min": 2, "max": 2}, train={"steps": 4}, checkpoint={"every_steps": 2}), base_dir=str(tmp_path))
    addr = f"tcp://127.0.0.1:{free_port()}"
    held_while_both_ran: list[bool] = []

    def call(msg: m.Message, expect: type[Any]) -> Any:
        with Client(addr, 10.0) as c:
            return c.call(msg, expect)

    async def scenario() -> str:
        ctx = zmq.asyncio.Context()
        stopping = asyncio.Event()
        coord = CoordinatorThread(lambda: Coordinator(ctx, addr, tmp_path / "state", heartbeat_s=0.2, liveness=20))
        coord.start()
        await asyncio.wrap_future(coord.bound)
        agent = Agent(ctx, name="n0", join=addr, state_dir=tmp_path / "state", slots=2, advertise="127.0.0.1", heartbeat_s=0.2, liveness=20, stop_grace_s=5.0, awake=guard)
        run = asyncio.create_task(agent.run(stopping))
        try:
            job_id = (await asyncio.to_thread(call, m.Submit(job=spec.to_dict(), source="awake.toml"), m.Submitted)).job_id
            while (state := (await asyncio.to_thread(call, m.Status(job=job_id), m.StatusReply)).jobs[0].state) not in ("succeeded", "failed", "cancelled"):
                if len(agent.workers) == 2:
                    held_while_both_ran.append(guard.held)
                await asyncio.sleep(0.05)
            return state
        finally:
            stopping.set()
            await run
            coord.stop()
            await asyncio.to_thread(coord.join, 10)
            ctx.destroy(linger=0)

    with structlog.testing.capture_logs() as logs:
        assert asyncio.run(scenario()) == "succeeded"
    events = [e["event"] for e in logs if e["event"].startswith(("power.", "worker.started", "worker.exited"))]
    assert events.count("power.assertion_held") == 1 and events.count("power.assertion_released") == 1, events
    # held before the first trainer was reported started, released between the two exits
    assert events.index("power.assertion_held") < events.index("worker.started")
    first_exit = events.index("worker.exited")
    assert first_exit < events.index("power.assertion_released") < len(events) - 1 and events[-1] == "worker.exited", events
    assert held_while_both_ran and all(held_while_both_ran)
    assert spawn.commands == [caffeinate_command(os.getpid())]
    assert spawn.started[0].returncode == -signal.SIGTERM and not guard.held
