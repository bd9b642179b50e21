"""A dpd's trainer processes as the daemon watches them (training, agent.py; exports, exporter.py):
whether one is alive or stopped, and the one line it leaves when it refuses its input. How they
are started (command line, environment, death with the daemon) is daemon/childenv.py.

The trainer's contract for bad input (a job file, a data path, a checkpoint that cannot be used) is
exit code 2 after one line `error: <message>` on stderr. The daemon merges the child's stderr into
its output and keeps the last such line, so the coordinator can say which node refused the job and
why, rather than only "exit code 2".
"""

from __future__ import annotations

import psutil

from dpool.protocol.messages import ERROR_LINE_MAX

ERROR_PREFIX = "error: "


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
