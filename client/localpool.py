"""A pool of `dpd` processes on this machine: started, awaited, inspected and stopped by PID.

`dpctl demo`, the tests and the benchmarks all run their local pools through this module. Every
daemon is a child process in its own session (a Ctrl-C in the terminal reaches only the caller,
which then stops the pool in order), with its own state dir and log file under the pool's root:

    ROOT/state-NAME/      its --state-dir; a trainer's run dir is state-NAME/jobs/JOB/slot-K
    ROOT/dpd-NAME.log     its output (dpd-NAME.2.log, ... when a daemon of that name starts again)
    ROOT/dpd.toml         an empty config, so that a user's own dpd config is not read

ROOT must belong to this pool alone (a fresh temporary folder): stopping the pool ends its daemons
(SIGTERM, a grace, then SIGKILL to each one's process group), then every process whose command line
names a path under ROOT: trainers that outlived a daemon that was killed. Nothing is ever found or
ended by its process name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Self, TypeVar

import psutil

from dpool.client.rpc import Client
from dpool.protocol import messages as m
from dpool.protocol.checkpoints import memory_root
from dpool.protocol.payloads import JobStatus, NodeRow

STOP_GRACE_S = 5.0  # each daemon's SIGTERM -> SIGKILL grace for its trainers (dpd --stop-grace)
STOP_TIMEOUT_S = STOP_GRACE_S + 10.0  # SIGTERM -> SIGKILL for a daemon: its trainers' grace, then its own exit
REGISTER_TIMEOUT_S = 60.0  # daemons up and registered (Python + MLX import on a slow, busy machine)
POLL_S = 0.2
CLIENT_TIMEOUT_S = 5.0
T = TypeVar("T", bound=m.Message)


class LocalPoolError(Exception):
    """A daemon of the pool exited, or the pool did not come up; the message says which daemon, and
    ends with the end of its log."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy, and return that; raise TimeoutError naming
    `what` (and the last thing `check` returned) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log, indented, for an error message."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line[:300] for line in text[-lines:])


# -- finding processes ---------------------------------------------------------------------------


class ProcessInfo(NamedTuple):
    pid: int
    ppid: int
    args: str  # the command line, its arguments joined by spaces


def processes() -> list[ProcessInfo]:
    """Every process on this machine that can be read (psutil: /proc on Linux, sysctl on macOS)."""
    out: list[ProcessInfo] = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        info = p.info  # a process that is gone or not ours to read has None where it could not be read
        out.append(ProcessInfo(info["pid"], info["ppid"] or 0, " ".join(info["cmdline"] or ())))
    return out


def processes_with(marker: str) -> list[ProcessInfo]:
    """Processes whose command line contains `marker` (a unique path), except this process and its
    ancestors: a wrapper that named the same folder (`timeout 600 bench ... --out DIR`) is never
    one of the pool's processes."""
    table = processes()
    parent = {p.pid: p.ppid for p in table}
    ours, pid = set(), os.getpid()
    while pid > 1 and pid not in ours:
        ours.add(pid)
        pid = parent.get(pid, 0)
    return [p for p in table if marker in p.args and p.pid not in ours]


def pids_with(marker: str) -> list[int]:
    """The PIDs of `processes_with(marker)`."""
    return [p.pid for p in processes_with(marker)]


# -- starting and stopping -----------------------------------------------------------------------


class Processes:
    """Child processes, each in its own session with its output in a log file, all ended by
    `stop_all`: SIGTERM to each one's process group, up to `timeout` seconds for all of them to
    exit, SIGKILL to the group of any that did not, then SIGKILL to anything still running whose
    command line names a path under `root` (a trainer whose daemon was killed first)."""

    def __init__(self, root: Path | str) -> None:
        self.marker = f"{Path(root).absolute()}{os.sep}"
        self.started: list[subprocess.Popen[bytes]] = []
        self.labels: dict[int, str] = {}
        self.logs: dict[int, Path] = {}
        self.state_dirs: list[Path] = []  # of the dpds started here: their state in RAM ends with them

    def start(self, cmd: Sequence[str], log: Path, *, env: Mapping[str, str] | None = None, cwd: Path | None = None, label: str = "") -> subprocess.Popen[bytes]:
        """Start `cmd` with stdin closed and stdout and stderr written to `log`; `label` names it
        when `stop_all` has to kill it."""
        with open(log, "wb") as out:
            p = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        self.started.append(p)
        if "--state-dir" in cmd[:-1]:
            self.state_dirs.append(Path(cmd[list(cmd).index("--state-dir") + 1]))
        self.labels[p.pid] = label or Path(cmd[0]).name
        self.logs[p.pid] = Path(log)
        return p

    def log_tails(self, lines: int, among: Sequence[subprocess.Popen[bytes]] | None = None) -> Iterator[str]:
        """The last `lines` lines of each started process's log (or of those `among` them), each
        under a heading naming the process, its pid and how it ended."""
        for p in self.started if among is None else among:
            log = self.logs[p.pid]
            try:
                text = log.read_text(errors="replace").splitlines()
            except OSError as e:
                text = [f"(unreadable: {e})"]
            yield f"----- {self.labels[p.pid]} (pid {p.pid}, exit {p.returncode}): last {min(lines, len(text))} of {len(text)} lines of {log}"
            yield from text[-lines:]

    def _stacks(self, p: subprocess.Popen[bytes]) -> None:
        """Have a stuck dpd write every thread's stack into its log (`dpd run` dumps them on
        SIGUSR1): what it was waiting on. The dump is written in the signal handler; the log's
        growth says it is there (2 s at most)."""
        log = self.logs[p.pid]
        if "dpd" not in self.labels[p.pid]:
            return  # another process has no such handler: SIGUSR1 would only end it
        size = log.stat().st_size if log.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and log.exists() and log.stat().st_size == size:
            time.sleep(0.05)

    def stop_all(self, timeout: float = STOP_TIMEOUT_S, report: Callable[[str], None] | None = None) -> list[subprocess.Popen[bytes]]:
        """End every process started here and every leftover under `root`; the ones that had to be
        killed are returned, each also told to `report` in a line."""
        say = report or (lambda line: None)
        for p in self.started:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)  # its session: a dpd stops its own trainers
        deadline = time.monotonic() + timeout
        killed = []
        for p in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.05, deadline - time.monotonic()))
            if p.poll() is None:
                say(f"{self.labels[p.pid]} (pid {p.pid}) did not stop in time: SIGKILL (its stacks, SIGUSR1, end its log)")
                self._stacks(p)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # it and anything it forked in its session
                p.wait()
                killed.append(p)
        # Trainers whose dpd died first were re-parented: found by the root they run under.
        for leftover in processes_with(self.marker):
            say(f"{'trainer' if 'dpool.trainer' in leftover.args else 'process'} pid {leftover.pid} outlived its parent: SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(leftover.pid) == leftover.pid:
                    os.killpg(leftover.pid, signal.SIGKILL)  # a trainer leads its group: it and its children
                else:
                    os.kill(leftover.pid, signal.SIGKILL)
        for state_dir in self.state_dirs:  # what its dpds kept in RAM (daemon/memstore.py), killed ones' too
            shutil.rmtree(memory_root(state_dir), ignore_errors=True)
        return killed


@dataclass(slots=True)
class Daemon:
    """One `dpd` process of a local pool."""

    name: str
    serving: bool
    state_dir: Path
    log: Path
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid


class LocalPool:
    """Real `dpd` processes on this machine that form one pool, and the real client to talk to it.

    `start(1, 1, 1)` starts a serving daemon `n0` and joining daemons `n1`, `n2` (one slot each)
    and waits until all three are registered; `start_daemon` starts one daemon (again, under a name
    used before: same state dir); `stop` ends everything. Subclasses may run each daemon under a
    command `prefix` (a network namespace, another HOME)."""

    def __init__(self, root: Path, *, addr: str | None = None, env: Mapping[str, str] | None = None, procs: Processes | None = None) -> None:
        """`root`: a folder of this pool alone. `addr`: the control plane (default: a free port on
        loopback). `env`: added to every daemon's environment, which is this process's without
        $DPOOL_COORDINATOR and $DPOOL_KEYS (no keys unless a daemon is given --keys). `procs`: where
        the daemons are recorded, to share a test's clean-up (default: the pool's own)."""
        self.root = Path(root).absolute()
        self.addr = addr or f"tcp://127.0.0.1:{free_port()}"
        self.env = {k: v for k, v in os.environ.items() if k not in ("DPOOL_COORDINATOR", "DPOOL_KEYS")} | dict(env or {})
        self.procs = procs or Processes(self.root)
        self.daemons: dict[str, Daemon] = {}  # the live daemon of each name (a refused duplicate is not it)
        self.started: list[Daemon] = []  # every daemon started, in order
        self.config = self.root / "dpd.toml"

    def prefix(self, name: str, serve: bool) -> list[str]:
        """What a daemon's command runs under: nothing here; a subclass's hook."""
        return []

    def start_daemon(self, name: str, *, serve: bool | str = False, workers: int = 1, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Daemon:
        """Start `dpd run` named `name` with `workers` slots: it joins the pool's address and, with
        `serve`, also hosts the coordinator there (or at the bind address `serve` gives). `args`
        are more `dpd run` flags; `env` is added to the pool's environment for this daemon."""
        if not self.config.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            self.config.write_text("# a local pool: loopback, no keys unless given; the user's own config is not read\n")
        state_dir = self.root / f"state-{name}"
        runs = sum(d.name == name for d in self.started)
        log = self.root / (f"dpd-{name}.log" if runs == 0 else f"dpd-{name}.{runs + 1}.log")
        cmd = [
            sys.executable, "-m", "dpool.daemon.boot", "run", "--config", str(self.config), "--name", name,
            "--workers", str(workers), "--state-dir", str(state_dir), "--stop-grace", str(STOP_GRACE_S), "--join", self.addr,
            *(["--serve", self.addr if serve is True else serve] if serve else []),
            *args,
        ]
        proc = self.procs.start([*self.prefix(name, bool(serve)), *cmd], log, env=self.env | dict(env or {}), label=f"dpd {name}")
        d = Daemon(name, bool(serve), state_dir, log, proc)
        self.started.append(d)
        if name not in self.daemons or self.daemons[name].proc.poll() is not None:
            self.daemons[name] = d
        return d

    def start(self, *slots: int, timeout: float = REGISTER_TIMEOUT_S) -> Self:
        """A serving daemon `n0` and one joining daemon `n1`, `n2`, ... per further entry, with
        these slots; returns once all of them are registered."""
        for i, n in enumerate(slots):
            self.start_daemon(f"n{i}", serve=i == 0, workers=n)
        self.wait_registered(len(slots), timeout)
        return self

    def wait_registered(self, n: int, timeout: float = REGISTER_TIMEOUT_S, *, check: Callable[[], None] | None = None) -> list[NodeRow]:
        """The pool's live nodes once there are `n` of them. Raises LocalPoolError as soon as a
        daemon exits, or after `timeout` seconds; `check` runs at every poll (it may raise too)."""
        deadline = time.monotonic() + timeout
        live: list[NodeRow] = []
        while time.monotonic() < deadline:
            if check is not None:
                check()
            self.check_alive()
            live = [x for x in self.nodes() if x.state != "lost"]
            if len(live) >= n:
                return live
            time.sleep(POLL_S)
        logs = "\n".join(f"  {d.name} ({d.log}):\n{tail(d.log)}" for d in self.daemons.values())
        raise LocalPoolError(f"only {len(live)} of {n} daemons registered within {timeout:.0f}s; the end of each log:\n{logs}")

    def check_alive(self) -> None:
        """Raise LocalPoolError if a daemon of the pool has exited."""
        for d in self.daemons.values():
            code = d.proc.poll()
            if code is not None:
                raise LocalPoolError(f"dpd {d.name} (pid {d.pid}) exited with code {code}; the end of its log ({d.log}):\n{tail(d.log)}")

    def call(self, msg: m.Message, expect: type[T], timeout_s: float = CLIENT_TIMEOUT_S) -> T:
        """One request to the coordinator, the way dpctl makes it."""
        with Client(self.addr, timeout_s) as c:
            return c.call(msg, expect)

    def nodes(self) -> list[NodeRow]:
        """The pool's node rows; [] while the coordinator does not answer (it is starting)."""
        try:
            return self.call(m.Nodes(), m.NodesReply).nodes
        except Exception:
            return []

    def status(self, job: str) -> JobStatus | None:
        """The job's status row, or None while the coordinator does not answer."""
        try:
            return self.call(m.Status(job=job), m.StatusReply).jobs[0]
        except Exception:
            return None

    def trainer_pids(self, node: str, job: str = "", generation: int | None = None) -> list[int]:
        """The training processes the daemon `node` runs (for `job`, of `generation`), found by the
        run dir under its state dir that their command line names, so that a trainer whose daemon
        is gone is found too. A warm trainer (`--warm`: started ahead of need, its rank given later)
        counts once the coordinator lists its pid as a worker of the job (of `generation`), or
        when the coordinator does not answer (then it cannot be told apart from a spare)."""
        found = self._trainers(node, job)
        mark = "" if generation is None else f" --generation {generation} "
        cold = [p.pid for p in found if " --generation " in f"{p.args} " and mark in f"{p.args} "]
        warm = [p.pid for p in found if " --warm" in f"{p.args} "]
        if not warm:
            return cold
        ranked = self._worker_pids(job, generation)
        return cold + [pid for pid in warm if ranked is None or pid in ranked]

    def spare_pids(self, node: str, job: str = "", *, ready: bool = False) -> list[int]:
        """The warm trainers `node` keeps (for `job`) that no generation has taken yet; `ready`:
        only those done building (their dpd logged `spare.ready`)."""
        warm = [p.pid for p in self._trainers(node, job) if " --warm" in f"{p.args} "]
        ranked = self._worker_pids(job, None) or set()
        spares = [pid for pid in warm if pid not in ranked]
        if ready and spares and node in self.daemons:
            said = set()
            with contextlib.suppress(OSError), open(self.daemons[node].log, "rb") as f:
                for line in f:
                    if b'"spare.ready"' in line:
                        with contextlib.suppress(ValueError):
                            said.add(int(json.loads(line).get("pid", 0)))
            spares = [pid for pid in spares if pid in said]
        return spares

    def _trainers(self, node: str, job: str) -> list[ProcessInfo]:
        state_dir = self.daemons[node].state_dir if node in self.daemons else self.root / f"state-{node}"
        found = processes_with(f"{state_dir}{os.sep}jobs{os.sep}{job + os.sep if job else ''}")
        return [p for p in found if "dpool.trainer" in p.args]

    def _worker_pids(self, job: str, generation: int | None) -> set[int] | None:
        """The pids the coordinator lists as the job's (every running job's) workers; None when
        it does not answer."""
        try:
            rows = self.call(m.Status(job=job or None), m.StatusReply).jobs
        except Exception:
            return None
        return {w.pid for s in rows if generation is None or s.generation == generation for w in s.workers if w.pid is not None}

    def stop(self, timeout: float = STOP_TIMEOUT_S, report: Callable[[str], None] | None = None) -> list[Daemon]:
        """SIGTERM every daemon (each stops its trainers), wait up to `timeout` seconds, SIGKILL
        whatever is left, then any trainer that outlived its daemon; returns the daemons that had
        to be killed (each also told to `report`)."""
        killed = self.procs.stop_all(timeout, report)  # and the state its dpds kept in RAM
        return [d for d in self.started if d.proc in killed]

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
