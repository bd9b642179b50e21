"""`python -m dpool.trainer.zygote FD`: the trainer, imported once, forked for every start.

A trainer's start costs an interpreter, the imports of MLX, numpy, structlog and dpool (about 0.5 s
and a CPU-second on a small machine), and mlx-lm with transformers for a language model (1.5 s
more), before it builds anything. A dpd pays that for every rank of every generation and for every
warm spare, on cores its running ranks need. So each dpd keeps one zygote: a process that has done
those imports and forks a trainer on request. The child runs `dpool.trainer.__main__.main` with its
own arguments, environment, working directory, session and output pipe, exactly as an exec'd
trainer would; the zygote reports its pid and, later, its exit code.

Fork safety. The zygote imports modules and runs nothing: no MLX operation (the CPU stream's thread
and the ring are made in the child), no thread of its own, no ZeroMQ context. OpenBLAS's worker
threads are rebuilt in the child by its own fork handler. On macOS, where a process that has
touched Metal or other system frameworks must not fork, it imports only pure-Python parts.

The channel (the dpd's side is daemon/forkserver.py):
- requests on the socket FD, each a 4-byte big-endian length and a JSON object; a `spawn` carries
  the child's output pipe as SCM_RIGHTS:
  `{"op": "spawn", "id": N, "argv": [...], "env": {...}, "cwd": "...", "then": ["module", ...]}`
  (`then`: modules to import after this fork, for the next ones: mlx-lm once a job needs it);
  `{"op": "import", "id": N, "modules": ["module", ...]}`: import them now, ahead of the forks
  that will need them (mlx-lm while a language-model job's files are staged), answered
  `{"id": N, "imported": [...]}` once done;
- replies as JSON lines on its stdout: `{"ready": PID}` once imported, `{"id": N, "pid": PID}` or
  `{"id": N, "error": "..."}` per request, `{"exit": PID, "code": C}` per child reaped (C as
  asyncio gives it: -N for signal N).

It exits when the socket closes (its dpd stopped) or its parent changes (its dpd died; on Linux
PR_SET_PDEATHSIG kills it first). Its children notice the same way: their parent is the zygote.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
from typing import Any

import setproctitle

from dpool.daemon.childenv import die_with_parent
from dpool.trainer.colocate import recv_exactly

HEADER = struct.Struct(">I")
REQUEST_MAX = 1 << 20  # bytes of one request (an environment and arguments)
ORPHAN_CHECK_S = 0.5
SETUP_TIMEOUT_S = 5.0  # for a child to lead its own process group
ERROR_MAX = 400  # characters of an error reply
ENV_PARENT = "DPOOL_DAEMON_PID"  # the trainer's WorkerLink watches this pid (protocol/worker_link.py)

# What every trainer imports before it builds anything (`python -X importtime -m dpool.trainer`).
PRELOAD = (
    "mlx.core",
    "mlx.nn",
    "mlx.optimizers",
    "numpy",
    "numpy.random",
    "dpool.trainer.__main__",
    "dpool.trainer.loop",
    "dpool.trainer.gpt_task",
    "dpool.trainer.model",
    "dpool.trainer.tinylm",
    "dpool.trainer.lm",
    "dpool.trainer.colocate",
    "dpool.trainer.listening",
    "dpool.trainer.priority",
    "dpool.protocol.worker_link",
)
# macOS: nothing that may touch Metal, Accelerate or other frameworks before the fork.
PRELOAD_DARWIN = ("structlog", "zmq", "orjson", "dpool.protocol.jobspec", "dpool.protocol.logs", "dpool.protocol.worker_link")


def preload_modules() -> tuple[str, ...]:
    return PRELOAD_DARWIN if sys.platform == "darwin" else PRELOAD


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m dpool.trainer.zygote FD (started by dpd)", file=sys.stderr)
        return 2
    # setproctitle takes over the argv and environment memory on its first call: made here, while
    # that memory is still the process's own (a child's os.environ.clear() would leave it none).
    setproctitle.setproctitle(setproctitle.getproctitle())
    sock = socket.socket(fileno=int(argv[0]))
    sock.setblocking(True)
    # Replies go on a private copy of stdout; fd 1 itself points at /dev/null, so nothing printed
    # by an import (or inherited by a child before its own dup2) can corrupt the channel.
    reply = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    for name in preload_modules():
        _import(name)
    try:
        _send(reply, {"ready": os.getpid()})
    except BrokenPipeError:
        return 0  # the dpd that started this one has gone (a refused flag, Ctrl-C): nothing to serve
    return Zygote(sock, reply).serve()


class Zygote:
    def __init__(self, sock: socket.socket, reply: int) -> None:
        self.sock, self.reply = sock, reply
        self.parent = os.getppid()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.children: set[int] = set()

    def serve(self) -> int:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the dpd decides when this process ends
        while os.getppid() == self.parent:
            ready, _, _ = select.select([self.sock, self.wake_r], [], [], ORPHAN_CHECK_S)
            if self.wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.wake_r, 512):
                        pass
            self._reap()
            if self.sock in ready:
                try:
                    req, fds = self._receive()
                except EOFError:
                    return 0
                self._handle(req, fds)
        return 0

    def _receive(self) -> tuple[Any, list[int]]:
        data, fds, _, _ = socket.recv_fds(self.sock, HEADER.size, 4)
        if not data:
            for fd in fds:
                os.close(fd)
            raise EOFError
        data += recv_exactly(self.sock, HEADER.size - len(data))
        (size,) = HEADER.unpack(data)
        if size > REQUEST_MAX:
            for fd in fds:
                os.close(fd)
            raise EOFError  # not our dpd's framing: nothing after it can be trusted
        body = recv_exactly(self.sock, size)
        try:
            return json.loads(body), fds
        except ValueError:
            return None, fds

    def _handle(self, req: Any, fds: list[int]) -> None:
        rid = req.get("id") if isinstance(req, dict) else None
        if isinstance(req, dict) and req.get("op") == "import":
            self._import_now(rid, req.get("modules"), fds)
            return
        problem = _check_spawn(req, fds)
        if problem is not None:
            for fd in fds:
                os.close(fd)
            _send(self.reply, {"id": rid, "error": problem})
            return
        (out,) = fds
        set_r, set_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in (out, set_r, set_w):
                os.close(fd)
            _send(self.reply, {"id": rid, "error": f"fork: {e}"})
            return
        if pid == 0:
            code = 127
            try:
                os.close(set_r)
                code = self._child(req, out, set_w)
            except SystemExit as e:  # argparse's refusal, sys.exit in the trainer
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, int | None):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(out)
        os.close(set_w)
        # The pid goes out once the child leads its own process group under a trainer's name (or
        # has died): a signal the dpd sends its group at once must not miss it.
        select.select([set_r], [], [], SETUP_TIMEOUT_S)
        os.close(set_r)
        self.children.add(pid)
        _send(self.reply, {"id": rid, "pid": pid})
        for name in req.get("then", []):
            _import(name)

    def _import_now(self, rid: Any, modules: Any, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if fds or not (isinstance(modules, list) and all(isinstance(name, str) for name in modules)):
            _send(self.reply, {"id": rid, "error": "an import carries a list of module names and no fds"})
            return
        for name in modules:
            _import(name)
        _send(self.reply, {"id": rid, "imported": modules})

    def _child(self, req: dict[str, Any], out: int, set_up: int) -> int:
        """In the forked child: become the trainer the request describes; returns its exit code."""
        # `ps` and the tools that look for trainers see what an exec'd trainer shows, not the zygote.
        setproctitle.setproctitle(" ".join([sys.executable, "-P", "-m", "dpool.trainer", *req["argv"]]))
        os.setsid()  # its own process group: the dpd signals the group, as for an exec'd trainer
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGCHLD else signal.default_int_handler)
        for fd in (self.sock.fileno(), self.reply, self.wake_r, self.wake_w):
            os.close(fd)
        dies = die_with_parent(os.getppid())  # Linux: SIGKILL when the zygote (so its dpd) dies
        if dies is not None:
            dies()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in (null, out):
            if fd > 2:
                os.close(fd)
        os.chdir(req["cwd"])
        env = dict(req["env"])
        env[ENV_PARENT] = str(os.getppid())  # the zygote: it exits when the dpd goes
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["-m dpool.trainer", *req["argv"]]
        os.close(set_up)  # set up as asked: the zygote may say this pid now
        from dpool.trainer.__main__ import main as trainer_main

        return trainer_main(req["argv"])

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            _send(self.reply, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _check_spawn(req: Any, fds: list[int]) -> str | None:
    if not isinstance(req, dict) or req.get("op") != "spawn":
        return "not a spawn request"
    if len(fds) != 1:
        return f"a spawn carries one output pipe, not {len(fds)}"
    if not (isinstance(req.get("argv"), list) and all(isinstance(a, str) for a in req["argv"])):
        return "argv: a list of strings"
    env = req.get("env")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        return "env: an object of strings"
    if not isinstance(req.get("cwd"), str) or not os.path.isdir(req["cwd"]):
        return f"cwd: not a folder: {req.get('cwd')!r}"
    then = req.get("then", [])
    if not (isinstance(then, list) and all(isinstance(t, str) for t in then)):
        return "then: a list of module names"
    return None


def _send(fd: int, obj: dict[str, Any]) -> None:
    """One reply line: short enough (< PIPE_BUF) to be written whole."""
    if isinstance(obj.get("error"), str):
        obj["error"] = obj["error"][:ERROR_MAX]
    os.write(fd, json.dumps(obj).encode() + b"\n")


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as e:  # a missing optional package: its trainers import it (and fail) themselves
        print(f"dpool zygote: cannot preload {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
