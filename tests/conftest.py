"""Shared test helpers: processes that are always cleaned up, free ports, polling with a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def pids_with(marker: str) -> list[int]:
    """PIDs of this user's processes whose command line contains `marker` (a unique tmp path)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            out.append(int(entry.name))
    return out


class Processes:
    """Processes a test starts, each in its own process group; `stop_all` ends every one of them,
    and then anything still running whose command line names the test's tmp dir (trainers whose
    daemon was killed)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], log: Path, **kw: Any) -> subprocess.Popen[bytes]:
        f = open(log, "wb")  # noqa: SIM115 -- closed with the process in stop_all
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        p._log = f  # type: ignore[attr-defined]
        self.started.append(p)
        return p

    def stop_all(self, grace: float = 15.0) -> None:
        for p in self.started:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p._log.close()  # type: ignore[attr-defined]
        for pid in pids_with(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(str(tmp_path))
    try:
        yield procs
    finally:
        procs.stop_all()


class LocalPool:
    """A pool of real `dpd` processes on loopback: `n0` serves, the others join; each daemon has its
    own state dir under `root`. Talks to the coordinator the way dpctl does (the real client)."""

    def __init__(self, procs: Processes, root: Path) -> None:
        self.procs, self.root = procs, root
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Path] = []

    def dpd(self, name: str, *, serve: bool = False, workers: int = 1, extra: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
        state = self.root / f"state-{name}"
        cmd = [sys.executable, "-m", "dpool.daemon.cli", "run", "--name", name, "--workers", str(workers), "--state-dir", str(state), "--stop-grace", "5"]
        cmd += ["--serve", self.addr] if serve else ["--join", self.addr]
        log = self.root / f"dpd-{len(self.logs)}-{name}.log"
        self.logs.append(log)
        p = self.procs.start([*self.prefix(name, serve), *cmd, *extra], log)
        if name not in self.daemons or self.daemons[name].poll() is not None:
            self.daemons[name] = p  # the live daemon of that name (a refused duplicate is not it)
        return p

    def prefix(self, name: str, serve: bool) -> list[str]:
        """What a daemon's command runs under (nothing here; a network namespace for netns tests)."""
        return []

    def start(self, *slots: int) -> LocalPool:
        """A serving daemon `n0` and one joining daemon per further entry, with these slots."""
        for i, n in enumerate(slots):
            self.dpd(f"n{i}", serve=i == 0, workers=n)
        self.wait_nodes(len(slots))
        return self

    def wait_nodes(self, n: int, timeout: float = 60) -> None:
        wait_for(f"{n} live nodes", lambda: len([x for x in self.nodes() if x["state"] != "lost"]) == n, timeout)

    def call(self, msg: Any, expect: type[Any]) -> Any:
        from dpool.client.rpc import Client

        with Client(self.addr, 5.0) as c:
            return c.call(msg, expect)

    def nodes(self) -> list[dict[str, Any]]:
        from dpool.protocol import messages as m

        try:
            return self.call(m.Nodes(), m.NodesReply).nodes
        except Exception:
            return []  # the coordinator is (re)starting

    def status(self, job: str) -> dict[str, Any] | None:
        """The job's status object, or None while the coordinator does not answer."""
        from dpool.protocol import messages as m

        try:
            return self.call(m.Status(job=job), m.StatusReply).jobs[0]
        except Exception:
            return None

    def dpctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dpool.client.cli", "--coordinator", self.addr, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def dpctl_json(self, *args: str) -> Any:
        r = self.dpctl(*args, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def submit(self, path: Path) -> str:
        r = self.dpctl("submit", str(path))
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def trainer_pids(self, node: str, job: str) -> list[int]:
        return pids_with(f"state-{node}/jobs/{job}/")
