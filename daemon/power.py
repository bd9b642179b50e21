"""A Mac that idle-sleeps mid-job is a lost node: while any of its trainers runs, dpd keeps it awake.

macOS: `caffeinate -i -w DPD_PID`, started when the first trainer starts and ended (SIGTERM) when
the last one ends. `-i` is the power assertion against idle system sleep (PreventUserIdleSystemSleep:
the display may still sleep, and closing the lid still sleeps a laptop: that is the user's call);
`-w DPD_PID` ends caffeinate, and so the assertion, when dpd itself is gone, even by SIGKILL, so an
assertion never outlives its daemon. A caffeinate that died on its own is started again at the next
change in the count of trainers. Elsewhere (Linux: a server does not idle-sleep under load, and a
desktop's inhibitors belong to its session) there is no command and the guard does nothing.

The command line is pure (`caffeinate_command`) and the process is started through an injectable
`spawn`, so the tests check both on a machine without caffeinate, as the LaunchAgent is checked.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dpool.protocol.logs import get_logger

CAFFEINATE = "/usr/bin/caffeinate"
STOP_WAIT_S = 5.0  # caffeinate exits at once on SIGTERM; SIGKILL after this

Spawn = Callable[[Sequence[str]], "subprocess.Popen[Any]"]


def caffeinate_command(pid: int) -> list[str]:
    """The assertion against idle sleep, held until it is ended or dpd (`pid`) exits."""
    return [CAFFEINATE, "-i", "-w", str(pid)]


def spawn_quietly(argv: Sequence[str]) -> subprocess.Popen[Any]:
    return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)


class SleepGuard:
    """Runs `command` while `update` is told that trainers run, ends it when none do."""

    def __init__(self, command: Sequence[str] | None, spawn: Spawn = spawn_quietly) -> None:
        self.command = list(command) if command is not None else None
        self.spawn = spawn
        self.proc: subprocess.Popen[Any] | None = None
        self.failed = False  # said once: a machine without caffeinate trains on, only not kept awake
        self.log = get_logger()

    @staticmethod
    def for_this_machine(platform: str = sys.platform, pid: int | None = None) -> SleepGuard:
        return SleepGuard(caffeinate_command(os.getpid() if pid is None else pid) if platform == "darwin" else None)

    @property
    def held(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def update(self, trainers: int) -> None:
        """Told the number of trainers running now: holds the assertion while it is above 0."""
        if self.command is None:
            return
        if trainers > 0 and not self.held:
            if self.proc is not None:  # it died on its own while trainers ran
                self.log.warning("power.assertion_lost", pid=self.proc.pid, code=self.proc.returncode)
            self._start(trainers)
        elif trainers == 0 and self.proc is not None:
            self._stop()

    def close(self) -> None:
        if self.proc is not None:
            self._stop()

    def _start(self, trainers: int) -> None:
        try:
            self.proc = self.spawn(self.command or [])
        except OSError as e:
            self.proc = None
            if not self.failed:
                self.log.warning("power.assertion_failed", command=" ".join(self.command or []), error=str(e))
            self.failed = True
            return
        self.log.info("power.assertion_held", pid=self.proc.pid, trainers=trainers)

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        assert proc is not None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.log.info("power.assertion_released", pid=proc.pid)
