"""How a dpd runs the trainer as a child process, for training (agent.py) and for exports
(exporter.py): its environment, its death with the daemon, and the one line it leaves when it
refuses its input.

The trainer's contract for bad input (a job file, a data path, a checkpoint that cannot be used) is
exit code 2 after one line `error: <message>` on stderr. The daemon merges the child's stderr into
its output and keeps the last such line, so the coordinator can say which node refused the job and
why, rather than only "exit code 2".
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

import psutil

from dpool.protocol.messages import ERROR_LINE_MAX
from dpool.trainer.blas import preload_env

ERROR_PREFIX = "error: "


def trainer_command(*args: str) -> list[str]:
    """`python -P -m dpool.trainer ARGS`: -P keeps the working directory (the trainer runs in its
    run dir) off `sys.path`, so no file in a run dir is ever imported."""
    return [sys.executable, "-P", "-m", "dpool.trainer", *args]


def trainer_env(**extra: str) -> dict[str, str]:
    """The daemon's environment, without any MLX group settings it may have inherited."""
    env = dict(os.environ)
    for key in ("MLX_RANK", "MLX_HOSTFILE", "MLX_WORLD_SIZE", "DPOOL_WORKER_ADDR"):
        env.pop(key, None)
    env["DPOOL_DAEMON_PID"] = str(os.getpid())  # the trainer exits when its daemon is gone
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONSAFEPATH"] = "1"  # -P, kept when the trainer re-executes itself (trainer/blas.py)
    env.update(extra)
    # The optimized BLAS preloaded from the start: the trainer then has no reason to re-execute
    # itself (trainer/blas.py), which would cost a second interpreter start (~0.2 s) every time.
    return preload_env(env) or env


def error_message(line: str, job_file: str | None = None) -> str | None:
    """The message of a trainer's `error: ...` line, made safe to carry and show: printable
    characters only (others become spaces), one line, at most ERROR_LINE_MAX characters. A leading
    `<job_file>: ` goes: that is the copy the daemon wrote, which means nothing to the user."""
    if not line.startswith(ERROR_PREFIX):
        return None
    text = line[len(ERROR_PREFIX):]
    if job_file and text.startswith(f"{job_file}: "):
        text = text[len(job_file) + 2:]
    return clean(text)


def clean(text: str, limit: int = ERROR_LINE_MAX) -> str | None:
    """`text` as one printable line of at most `limit` characters (None when nothing is left)."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 4]).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text or None


def last_error_in(data: bytes, job_file: str | None = None) -> str | None:
    """The last `error: ...` line in a child's output."""
    found = None
    for raw in data.splitlines():
        msg = error_message(raw.decode("utf-8", "replace"), job_file)
        if msg is not None:
            found = msg
    return found


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A preexec_fn: on Linux the trainer gets SIGKILL when this daemon dies (PR_SET_PDEATHSIG), so
    a SIGKILLed dpd leaves no orphan training on. (macOS has no such call: the trainer's WorkerLink
    watches its parent pid instead.)"""
    if not sys.platform.startswith("linux"):
        return None

    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the daemon died before prctl took effect
            os._exit(1)

    return preexec


def is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU): it runs no code until continued."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def is_alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie, dead but not yet reaped, has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
