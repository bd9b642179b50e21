"""The dpd's side of its zygote (trainer/zygote.py): trainers forked from a pre-imported process.

`ForkServer.spawn` gives a `ForkedProcess`, which the agent treats as it treats an
`asyncio.subprocess.Process`: a pid (the leader of its own process group), the trainer's merged
stdout and stderr as a StreamReader, `returncode` and `wait()`. The exit code comes from the zygote,
the child's parent. `DPOOL_ZYGOTE=0` turns this off; so does any failure of the zygote, after which
trainers are exec'd as before until a new zygote is ready.

If the zygote dies while its children run, their exit codes are lost with it: on Linux they are
SIGKILLed (their parent-death signal), elsewhere they stop at their next step (the parent watch).
Each then counts as killed (-9) once its pid is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from dpool.daemon.childenv import StartedZygote, start_zygote, zygote_wanted
from dpool.daemon.children import is_alive
from dpool.protocol.logs import get_logger
from dpool.trainer.zygote import HEADER

START_TIMEOUT_S = 60.0  # for the zygote's imports, on a slow or busy machine
READY_WAIT_S = 10.0  # a start waits this long for a zygote still importing, then execs
REPLY_TIMEOUT_S = 60.0  # for a fork's pid: the zygote may be importing mlx-lm for the next ones
SEND_TIMEOUT_S = 1.0
REAP_WAIT_S = 1.0  # for a zygote whose output ended to exit
RESTART_AFTER_S = 10.0  # a zygote that died is replaced no sooner than this
GONE_POLL_S = 0.1  # how often the pids of a lost zygote's children are looked at
LINE_LIMIT = 1 << 20  # a trainer's output line, as for an exec'd one
LM_MODULES = ("mlx_lm.utils", "mlx_lm.tuner.trainer", "mlx_lm.tuner.utils", "mlx_lm.generate", "mlx_lm.sample_utils")
KILLED = -int(signal.SIGKILL)


def ahead_of_forks(modules: tuple[str, ...]) -> tuple[str, ...]:
    """What a zygote may import for its later forks: nothing on macOS, where a process that has
    imported MLX (and so Metal) must not fork; there the zygote holds pure-Python parts only
    (trainer/zygote.py) and each trainer imports mlx-lm itself."""
    return () if sys.platform == "darwin" else modules


def modules_for(kind: object) -> tuple[str, ...]:
    """What the trainers of a job of this model kind import beyond the zygote's own preload."""
    return LM_MODULES if kind == "mlx_lm" else ()


class ForkServerError(Exception):
    """No fork this time: the caller starts the trainer as a new process."""


class ForkedProcess:
    def __init__(self, pid: int, stdout: asyncio.StreamReader) -> None:
        self.pid, self.stdout = pid, stdout
        self.returncode: int | None = None
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def _exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._done.set_result(code)


class ZygoteProcess:
    """A started zygote as the daemon's loop sees it, as an `asyncio.subprocess.Process` would be:
    its stdout a StreamReader, its exit awaited in a thread (it may have been started before the
    loop was, by daemon/boot.py)."""

    def __init__(self, proc: subprocess.Popen[bytes], stdout: asyncio.StreamReader) -> None:
        self.proc, self.pid, self.stdout = proc, proc.pid, stdout

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    async def wait(self) -> int:
        return await asyncio.to_thread(self.proc.wait)


class ForkServer:
    def __init__(self, early: StartedZygote | None = None) -> None:
        """`early`: a zygote already started (daemon/boot.py), adopted by the first `start`."""
        self.early = early
        self.log = get_logger()
        self.enabled = zygote_wanted()
        self.proc: ZygoteProcess | None = None
        self.sock: socket.socket | None = None
        self.ready: asyncio.Future[bool] | None = None  # True once imported; False: it failed
        self.children: dict[int, ForkedProcess] = {}
        self.early_exits: dict[int, int] = {}
        self.replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.preloaded: set[str] = set()  # modules this zygote was asked to import: after a fork ("then") or ahead (preload)
        self.next_id = 1
        self.started_at = -RESTART_AFTER_S
        self.closing = False
        self.tasks: set[asyncio.Task[Any]] = set()

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start a zygote in the background (when enabled, and none runs or has just failed)."""
        if not self.enabled or self.closing or (self.ready is not None and not self.ready.done()):
            return
        if self.ready is not None and self.ready.result() and self.proc is not None and self.proc.returncode is None:
            return
        early, self.early = self.early, None
        if early is None and time.monotonic() - self.started_at < RESTART_AFTER_S:
            return
        self.started_at = early.started_at if early is not None else time.monotonic()
        self.preloaded = set()  # a new zygote has imported none of them
        self.ready = asyncio.get_running_loop().create_future()
        self._task(self._run(early))

    async def _run(self, early: StartedZygote | None) -> None:
        assert self.ready is not None
        try:
            started = early if early is not None else start_zygote()
        except OSError as e:
            self.log.warning("zygote.start_failed", error=str(e))
            self.ready.set_result(False)
            return
        assert started.proc.stdout is not None
        stdout = asyncio.StreamReader(limit=LINE_LIMIT)
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), started.proc.stdout)
        started.sock.settimeout(SEND_TIMEOUT_S)
        self.sock = started.sock
        proc = self.proc = ZygoteProcess(started.proc, stdout)
        watchdog = asyncio.get_running_loop().call_later(max(0.0, START_TIMEOUT_S - (time.monotonic() - self.started_at)), self._slow_start, proc)
        try:
            await self._read(proc)
        finally:
            watchdog.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), REAP_WAIT_S)  # its exit code, for the log
            self._lost(proc)

    def _slow_start(self, proc: ZygoteProcess) -> None:
        if self.ready is not None and not self.ready.done():
            self.log.warning("zygote.slow_start", pid=proc.pid, after_s=START_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    async def _read(self, proc: ZygoteProcess) -> None:
        assert proc.stdout is not None and self.ready is not None
        while True:
            line = await proc.stdout.readline()
            if not line:
                return
            try:
                reply = json.loads(line)
            except ValueError:
                self.log.warning("zygote.bad_reply", line=line[:200].decode("utf-8", "replace"))
                continue
            if not isinstance(reply, dict):
                continue
            if "ready" in reply and not self.ready.done():
                self.ready.set_result(True)
                self.log.info("zygote.ready", pid=proc.pid, after_s=round(time.monotonic() - self.started_at, 3))
            elif "exit" in reply:
                child = self.children.pop(reply["exit"], None)
                if child is not None:
                    child._exited(int(reply.get("code", 1)))
                else:  # its fork's reply is read, but spawn() has not taken the child yet
                    self.early_exits[reply["exit"]] = int(reply.get("code", 1))
            elif "id" in reply:
                fut = self.replies.pop(reply["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)

    def _lost(self, proc: ZygoteProcess) -> None:
        """The zygote is gone (or never got ready): forks stop; its children are followed by pid."""
        if self.ready is not None and not self.ready.done():
            self.ready.set_result(False)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        for fut in self.replies.values():
            if not fut.done():
                fut.set_exception(ForkServerError("the zygote exited"))
        self.replies.clear()
        orphans, self.children = self.children, {}
        if not self.closing:
            self.log.warning("zygote.exited", pid=proc.pid, code=proc.returncode, running=sorted(orphans))
        for child in orphans.values():
            self._task(self._until_gone(child))

    async def _until_gone(self, child: ForkedProcess) -> None:
        while is_alive(child.pid):
            await asyncio.sleep(GONE_POLL_S)  # not our child: no wait() to block on, only its pid
        child._exited(KILLED)

    async def close(self) -> None:
        """Stop the zygote (its children are the agent's to stop first)."""
        self.closing = True
        if self.sock is not None:
            self.sock.close()  # EOF: the zygote leaves
            self.sock = None
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), 2.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _task(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    # -- forks ---------------------------------------------------------------------------------

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, then: tuple[str, ...] = ()) -> ForkedProcess:
        """A trainer forked with these arguments, environment and working directory. Waits for a
        zygote that is still importing: it started earlier than an exec'd trainer would now."""
        if not self.enabled or self.closing:
            raise ForkServerError("forking is off")
        self.start()
        if (why := await self._unready(READY_WAIT_S)) is not None:
            raise ForkServerError(why)
        later = [t for t in ahead_of_forks(then) if t not in self.preloaded]
        r, w = os.pipe()
        try:
            reply = await self.request({"op": "spawn", "argv": argv, "env": env, "cwd": cwd, "then": later}, [w])
        except ForkServerError:
            os.close(r)
            raise
        finally:
            os.close(w)
        if "pid" not in reply:
            os.close(r)
            raise ForkServerError(str(reply.get("error", "refused")))
        self.preloaded.update(later)
        stdout = asyncio.StreamReader(limit=LINE_LIMIT)
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(r, "rb", 0))
        child = ForkedProcess(int(reply["pid"]), stdout)
        if child.pid in self.early_exits:
            child._exited(self.early_exits.pop(child.pid))
        else:
            self.children[child.pid] = child
        return child

    def preload(self, modules: tuple[str, ...]) -> asyncio.Task[None] | None:
        """Have the zygote import these soon, ahead of the trainers that will need them (mlx-lm
        while a language-model job's files are staged): a first fork would otherwise import them in
        the child, and the zygote again after it, on the cores the group is starting on. The task
        that asks, where there is anything to ask."""
        modules = ahead_of_forks(modules)
        if any(name not in self.preloaded for name in modules) and self.enabled and not self.closing:
            self.start()
            return self._task(self._preload(modules))
        return None

    async def _preload(self, modules: tuple[str, ...]) -> None:
        if await self._unready(START_TIMEOUT_S) is not None:  # nothing waits on this: as long as a zygote's start may take
            return
        later = [name for name in modules if name not in self.preloaded]
        if not later:
            return
        # Marked before the answer: the zygote takes requests in order, so a fork asked for
        # meanwhile happens after the import.
        self.preloaded.update(later)
        with contextlib.suppress(ForkServerError):  # a zygote that did not answer is replaced (_broken)
            await self.request({"op": "import", "modules": later}, [])

    async def _unready(self, timeout: float) -> str | None:
        """Why no started zygote can take a request within `timeout` seconds (None: one can)."""
        if self.ready is None:
            return "no zygote"
        try:
            ready = await asyncio.wait_for(asyncio.shield(self.ready), timeout)
        except TimeoutError:
            return f"the zygote is not ready after {timeout:.0f} s"
        return None if ready and self.sock is not None else "no zygote"

    async def request(self, obj: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """One request (given an id here) with these fds, and the zygote's reply to it."""
        if self.sock is None:
            raise ForkServerError("no zygote")
        rid, self.next_id = self.next_id, self.next_id + 1
        body = json.dumps({**obj, "id": rid}).encode()
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.replies[rid] = fut
        try:
            socket.send_fds(self.sock, [HEADER.pack(len(body)) + body], fds)
        except OSError as e:
            self.replies.pop(rid, None)
            self._broken(f"request not sent: {e}")
            raise ForkServerError(f"request not sent: {e}") from e
        try:
            return await asyncio.wait_for(fut, REPLY_TIMEOUT_S)
        except TimeoutError as e:
            self.replies.pop(rid, None)
            self._broken("no reply to a request")
            raise ForkServerError("the zygote did not answer") from e

    def _broken(self, why: str) -> None:
        proc = self.proc
        self.log.warning("zygote.broken", why=why, pid=proc.pid if proc else None)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
