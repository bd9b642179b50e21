"""Shared test helpers: processes that are always cleaned up, free ports, polling with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
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
