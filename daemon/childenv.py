"""What a dpd's children start with: their command line and environment, and their death with the
daemon; and the zygote (trainer/zygote.py), started as early as the daemon can.

Light on purpose: dpd's entry point (daemon/boot.py) imports this, and starts the zygote, before
its own imports, so that the zygote's imports of MLX and the trainer (~0.6 CPU-s) run alongside the
daemon's rather than after them: a node that joins can start its first trainer that much sooner.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dpool.trainer.blas import preload_env

ENV_ZYGOTE = "DPOOL_ZYGOTE"  # "0": every trainer is a new interpreter
# dpd run's umask, set before it creates anything (its state dir, database, logs, sockets) and
# before it starts its zygote, whose forked trainers write checkpoints: this user's alone.
UMASK = 0o077


def trainer_command(*args: str) -> list[str]:
    """`python -P -m dpool.trainer ARGS`: -P keeps the working directory (the trainer runs in its
    run dir) off `sys.path`, so no file in a run dir is ever imported."""
    return [sys.executable, "-P", "-m", "dpool.trainer", *args]


def zygote_command() -> list[str]:
    return [sys.executable, "-P", "-m", "dpool.trainer.zygote"]


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


def zygote_wanted() -> bool:
    return os.environ.get(ENV_ZYGOTE, "1") != "0"


@dataclass
class StartedZygote:
    """A zygote process and the daemon's end of its socket; its stdout is a pipe of JSON lines."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    started_at: float = field(default_factory=time.monotonic)


def start_zygote() -> StartedZygote:
    """Start a zygote: its own session, SIGKILLed with this daemon (Linux), told its end of a socket
    pair by fd. Raises OSError when it cannot be started."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen(
            [*zygote_command(), str(theirs.fileno())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None,
            pass_fds=(theirs.fileno(),), env=trainer_env(), start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
        )
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    return StartedZygote(proc, ours)
