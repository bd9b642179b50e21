"""`dpd run --serve ... --dashboard [ADDR]`: the serving daemon runs the dashboard as a child
process of its own, a client of its coordinator like any dpctl. It never runs on the coordinator's
loop or thread (a page, however many, costs the coordinator one client's polls), and its memory is
its own. Imports nothing heavy: the daemon imports this module.

The child runs in a session of its own (a Ctrl-C in dpd's terminal reaches dpd, which then stops
it) and ends by itself when dpd is gone (`--parent-pid`). When it exits on its own it is started
again after a pause that doubles from RESTART_MIN_S to RESTART_MAX_S (a port taken by another
program is tried again, not in a loop); the pool never stops for its dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

RESTART_MIN_S, RESTART_MAX_S = 1.0, 60.0
STOP_S = 3.0  # SIGTERM -> SIGKILL
STEADY_S = 30.0  # a child that ran this long has its pause reset


def local_address(endpoint: str) -> str:
    """The coordinator's bound endpoint as a client on this machine reaches it: a wildcard host
    (0.0.0.0, *, ::) becomes loopback."""
    parts = urlsplit(endpoint)
    host, _, port = parts.netloc.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        return urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, "", ""))
    return endpoint


def command(listen: str, coordinator: str, keys: Path | None, *, insecure: bool, tokens: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "dpool.dashboard", "--coordinator", local_address(coordinator), "--listen", listen, "--parent-pid", str(os.getpid())]
    if keys is not None:
        cmd += ["--keys", str(keys)]
    if tokens is not None:
        cmd += ["--tokens", str(tokens)]
    if insecure:
        cmd.append("--insecure")
    return cmd


async def supervise(cmd: list[str], stopping: asyncio.Event, log: Any) -> None:
    """Run `cmd` until `stopping` is set; start it again when it exits on its own."""
    pause = RESTART_MIN_S
    loop = asyncio.get_running_loop()
    while not stopping.is_set():
        started = loop.time()
        try:
            proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            log.error("dashboard.failed", error=str(e))
            return
        log.info("dashboard.started", pid=proc.pid, listen=cmd[cmd.index("--listen") + 1])
        wait = asyncio.ensure_future(proc.wait())
        stop = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({wait, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not wait.done():
            await _stop(proc, wait)
            return
        if loop.time() - started > STEADY_S:
            pause = RESTART_MIN_S
        log.warning("dashboard.exited", pid=proc.pid, code=proc.returncode, restart_in_s=pause)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), pause)
        pause = min(pause * 2, RESTART_MAX_S)


async def _stop(proc: asyncio.subprocess.Process, wait: asyncio.Future[int]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(wait), STOP_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await wait
