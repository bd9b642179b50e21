"""Hand-offs between a dpd and its trainers, and between a dpd and the coordinator, complete
whatever order their messages arrive in.

The dpd is the real node agent (daemon/agent.py) in this process, with its real worker socket; the
coordinator is a ROUTER socket on loopback that each test drives by hand; each trainer is a real
process that speaks through the trainer's own link (protocol/worker_link.py) and does nothing else.
One seam: with `first_report_first`, a trainer's start returns to the agent only once the agent has
read that trainer's first report, the order a loaded machine produces now and then (a forked
trainer's pid comes back from the zygote on another pipe than the one its reports use).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import structlog
import zmq
import zmq.asyncio
from jobs import job
from test_pool_state import join, records, running_pool, sends

from dpool.daemon import agent as agent_mod
from dpool.daemon.forkserver import ForkedProcess
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import RankSlot

JOB = "handoff-1a2b3c"
SPEC = parse_job(job("handoff")).to_dict()
WAIT_S = 30.0  # for any one report: far above what each takes (well under a second)
T = TypeVar("T", bound=m.Message)

# A trainer as its dpd sees it, and no more: `--warm` says worker.ready and waits for worker.go; then
# (or at once, started cold) worker.hello and one step's progress (whose all_sum announced a new
# split), then it waits to be stopped.
# HOLD_READY=1: the warm one says ready only once sent SIGUSR1 (blocked from its start, so a signal
# sent early waits); IGNORE_TERM=1: SIGTERM does not end it.
TRAINER = r"""
import os, signal, sys
from dpool.protocol.worker_link import WorkerLink

if os.environ.get("IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
link = WorkerLink.from_env()
if "--warm" in sys.argv:
    if os.environ.get("HOLD_READY") == "1":
        signal.sigwait({signal.SIGUSR1})
    go = link.wait_go()
    if go is None:
        sys.exit(75)
    rank, world, generation = go.rank, len(go.shares), go.generation
else:
    rank, world, generation = 0, 1, int(sys.argv[sys.argv.index("--generation") + 1])
link.hello(rank=rank, world_size=world, generation=generation, pid=os.getpid(), resume_step=0)
link.progress(step=1, loss=2.5, tokens=6, seconds=0.01, resplit=True, gather=True)
while True:
    signal.pause()
"""


async def until(what: str, check: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)
    return got


class Coordinator:
    """The coordinator's side of one dpd's link, played by hand."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.peer = b""
        self.seen: list[m.Message] = []
        self.answer_registrations = True

    async def next(self, kind: type[T], where: Callable[[T], bool] = lambda msg: True, timeout: float = WAIT_S) -> T:
        """The next message of `kind` (for which `where` holds) from the dpd; a registration is
        answered on the way unless `answer_registrations` is off."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not await self.sock.poll(int(left * 1000) + 1):
                continue
            peer, *frames = await self.sock.recv_multipart()
            msg, _ = m.decode(frames, m.COORDINATOR_ACCEPTS)
            self.seen.append(msg)
            if isinstance(msg, m.NodeRegister):
                self.peer = peer  # each registration comes on a new connection
                if self.answer_registrations:
                    await self.send(m.NodeRegistered(heartbeat_s=0.1, liveness=600))
            if isinstance(msg, kind) and where(msg):
                return msg
        said = [str(x.TYPE) for x in self.seen if not isinstance(x, m.NodeHeartbeat)]
        raise AssertionError(f"no {kind.TYPE} from the dpd within {timeout:.0f}s; it said {said}")

    async def send(self, msg: m.Message) -> None:
        await self.sock.send_multipart([self.peer, *msg.to_frames()])


class HandOffAgent(agent_mod.Agent):
    """The node agent, its trainers the stand-ins above (with `env` added)."""

    def __init__(self, ctx: zmq.asyncio.Context, join: str, state_dir: Path, logs: list[dict[str, Any]], *, first_report_first: bool, env: dict[str, str], **kw: Any) -> None:
        super().__init__(ctx, name="n1", join=join, state_dir=state_dir, slots=1, advertise="127.0.0.1", **kw)
        self.logs, self.first_report_first, self.env = logs, first_report_first, env
        self.started: list[int] = []
        self.hold_launch: asyncio.Event | None = None  # set: each start waits for it, as a fork waits for a busy zygote
        self.launch_held = False

    async def _launch(self, job: str, slot: int, run_dir: Path, args: list[str], extra: dict[str, str]) -> asyncio.subprocess.Process | ForkedProcess:
        env = os.environ | self.env | {"DPOOL_WORKER_ADDR": self.worker_addr}
        if self.hold_launch is not None:
            self.launch_held = True
            await self.hold_launch.wait()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TRAINER, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, cwd=str(run_dir), env=env, start_new_session=True, preexec_fn=_block_sigusr1,
        )
        self.started.append(proc.pid)
        if self.first_report_first:
            await until(f"trainer {proc.pid}'s first report read by the agent", lambda: self.said("worker.early", "worker.unknown", pid=proc.pid))
        return proc

    def said(self, *events: str, **fields: Any) -> list[dict[str, Any]]:
        """The agent's log lines of these events with these fields."""
        return [e for e in self.logs if e["event"] in events and all(e.get(k) == v for k, v in fields.items())]


def _block_sigusr1() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, play: Callable[[Coordinator, HandOffAgent], Awaitable[None]], *, first_report_first: bool = False, env: dict[str, str] | None = None, **kw: Any) -> HandOffAgent:
    """Run the agent against the hand-played coordinator through `play`, then stop it."""
    monkeypatch.setenv("DPOOL_ZYGOTE", "0")  # the stand-ins are started by `_launch` above
    monkeypatch.setenv("DPOOL_WARM", "1")
    made: list[HandOffAgent] = []

    async def main(logs: list[dict[str, Any]]) -> None:
        ctx = zmq.asyncio.Context()
        coord = Coordinator(ctx)
        agent = HandOffAgent(ctx, coord.addr, tmp_path / "state", logs, first_report_first=first_report_first, env=env or {}, **kw)
        made.append(agent)
        stopping = asyncio.Event()
        run = asyncio.create_task(agent.run(stopping))
        try:
            await coord.next(m.NodeRegister)
            await play(coord, agent)
        finally:
            stopping.set()
            try:
                await asyncio.wait_for(run, WAIT_S)  # stops every trainer it runs
            finally:
                for pid in agent.started:  # one it could not stop (a failed test) is not left behind
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                shutil.rmtree(agent.memory.root, ignore_errors=True)
                ctx.destroy(linger=0)

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main(logs))
    return made[0]


def start(generation: int) -> m.GroupStart:
    return m.GroupStart(job=JOB, generation=generation, spec=SPEC, ranks=[RankSlot(slot=0, rank=0)], shares=[6], hostfile=[["127.0.0.1:1"]])


def test_heartbeats_go_on_while_a_trainers_start_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that waits (a fork waits for a zygote still importing, seconds for mlx-lm): the
    node's heartbeats go on meanwhile. They were sent by the loop that handles the coordinator's
    messages, and a group start that waited 1.6 s had every node of an mlx-lm job declared lost."""

    async def play(coord: Coordinator, agent: HandOffAgent) -> None:
        agent.hold_launch = asyncio.Event()
        await coord.send(start(1))
        await until("the start to wait", lambda: agent.launch_held)
        for _ in range(3):  # heartbeat_s = 0.1
            await coord.next(m.NodeHeartbeat, timeout=5)
        agent.hold_launch.set()
        started = await coord.next(m.NodeWorkerStarted)
        assert started.pid == agent.started[0]

    scenario(tmp_path, monkeypatch, play)


def test_a_spare_that_says_ready_before_it_is_recorded_is_ready_and_takes_the_next_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order the join that never completed had: the spare's worker.ready read before the agent
    recorded the spare. It used to be dropped (`worker.unknown`), so job.warm was never answered
    and worker.go would have waited for a ready already gone."""

    async def play(coord: Coordinator, agent: HandOffAgent) -> None:
        await coord.send(m.JobWarm(job=JOB, spec=SPEC, slots=[0]))
        warmed = await coord.next(m.NodeWarmed)
        assert (warmed.slots, warmed.error) == ([0], None)
        (spare,) = agent.started
        assert agent.said("worker.early", pid=spare) and not agent.said("worker.unknown"), "the ready came before the record"
        await coord.send(start(1))
        started = await coord.next(m.NodeWorkerStarted)
        hello = await coord.next(m.NodeWorkerHello)
        assert started.pid == hello.pid == spare and (hello.generation, hello.rank) == (1, 0)
        assert (await coord.next(m.NodeProgress)).step == 1
        assert agent.started == [spare], "the spare took the rank: nothing was started cold"

    scenario(tmp_path, monkeypatch, play, first_report_first=True)


def test_a_trainers_hello_read_before_it_is_recorded_counts_and_its_steps_are_relayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer started cold whose worker.hello (and first step) the agent reads before its start
    returned: the coordinator hears the hello, so the group counts as started, and the step."""

    async def play(coord: Coordinator, agent: HandOffAgent) -> None:
        await coord.send(start(1))
        started = await coord.next(m.NodeWorkerStarted)
        hello = await coord.next(m.NodeWorkerHello)
        progress = await coord.next(m.NodeProgress)
        assert started.pid == hello.pid == agent.started[0] and (hello.generation, progress.step) == (1, 1)
        assert progress.resplit and progress.gather, "the step's flags are relayed with it"
        # The hello was kept until the record (the step too, when it came before the record).
        assert agent.said("worker.early_handled", pid=hello.pid), "the hello came before the record"

    scenario(tmp_path, monkeypatch, play, first_report_first=True)


def test_a_spare_ready_while_the_dpd_registers_again_is_said_once_it_is_registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """node.warmed made while the link is being made again (the coordinator forgot this node) is
    kept and sent once registered, not dropped: the growth waiting for it would wait in vain."""

    async def play(coord: Coordinator, agent: HandOffAgent) -> None:
        await coord.send(m.JobWarm(job=JOB, spec=SPEC, slots=[0]))
        (spare,) = await until("the spare started", lambda: agent.said("spare.started"))
        coord.answer_registrations = False
        await coord.send(m.Error(code=str(m.ErrorCode.NOT_REGISTERED), message="who are you"))
        await coord.next(m.NodeRegister)  # not answered yet
        os.kill(spare["pid"], signal.SIGUSR1)  # now it says ready
        await until("the spare's worker.ready read", lambda: agent.said("spare.ready", pid=spare["pid"]))
        assert not agent.registered
        await coord.send(m.NodeRegistered(heartbeat_s=0.1, liveness=600))
        warmed = await coord.next(m.NodeWarmed)
        assert (warmed.job, warmed.slots, warmed.error) == (JOB, [0], None)

    scenario(tmp_path, monkeypatch, play, env={"HOLD_READY": "1"})


def test_a_warm_request_for_a_slot_that_is_busy_or_missing_is_answered_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def play(coord: Coordinator, agent: HandOffAgent) -> None:
        await coord.send(m.JobWarm(job=JOB, spec=SPEC, slots=[3]))
        warmed = await coord.next(m.NodeWarmed)
        assert warmed.slots == [] and warmed.error == "slots [3] of node n1 are busy or do not exist"
        await coord.send(start(1))
        await coord.next(m.NodeWorkerHello)
        await coord.send(m.JobWarm(job="other-1a2b3c", spec=SPEC, slots=[0]))  # its worker runs there
        warmed = await coord.next(m.NodeWarmed)
        assert warmed.job == "other-1a2b3c" and warmed.slots == [] and "busy" in (warmed.error or "")

    scenario(tmp_path, monkeypatch, play)


def test_a_trainer_stopped_by_sigstop_while_its_group_is_being_stopped_is_killed_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """group.stop sends SIGTERM and SIGCONT; a SIGSTOP that lands after them (or a trainer slow to
    act on SIGTERM, then stopped) used to hold the trainer, its slot and the next generation until
    the grace's SIGKILL (10 s by default). It is killed once seen stopped, and its exit is ours."""
    grace = 120.0

    async def play(coord: Coordinator, agent: HandOffAgent) -> None:
        await coord.send(start(1))
        hello = await coord.next(m.NodeWorkerHello)
        await coord.send(m.GroupStop(job=JOB, generation=1, mode="now"))
        await until("the stop's SIGTERM sent", lambda: agent.said("worker.stopping", pid=hello.pid))
        os.kill(hello.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        exited = await coord.next(m.NodeWorkerExited)
        assert time.monotonic() - t0 < grace / 4, "killed well before the grace"
        assert (exited.stopped, exited.code) == (True, -signal.SIGKILL)
        assert agent.said("worker.stopped_process", pid=hello.pid, stopping=True)

    scenario(tmp_path, monkeypatch, play, env={"IGNORE_TERM": "1"}, stop_grace_s=grace)


def test_a_growth_whose_warm_request_is_never_answered_gives_up_with_an_event_at_the_deadline() -> None:
    pool = running_pool(("a", "b"), hi=3, start_timeout=1.0)
    join(pool, "c", 1, now=2.0)  # job.warm to c, which never answers
    for n in "abc":
        pool.seen(3.0, n)
    out = pool.tick(3.0)
    assert records(out, "group.warmed") == [{"node": "c", "slots": [0], "error": "no node.warmed within 1 s"}]
    assert sorted(s.node for s in sends(out, m.GroupStop)) == ["a", "b"]  # it grows, c started cold
