"""A warm trainer builds its model and data at a low CPU priority, and trains at the usual one.

A spare (`--warm`) starts while its node trains: its interpreter start, imports and model build
take a core for a second or two, which the running ranks would lose on a machine with few cores.
So it lowers its priority first, and raises it back at `worker.go`. A spare on a node that runs no
worker yet (a node that joins: its dpd sets DPOOL_WARM_LOW=0) builds at the usual priority. Only where raising it back is
allowed, or the whole next generation would train at the low priority:

- macOS: the process's background state (`PRIO_DARWIN_BG`), which a process may set and clear on
  itself.
- Linux: nice +10 for every thread, back to where it was at go, when this process may lower its
  nice value again (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it); otherwise nothing.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

NICE = 10
PRIO_DARWIN_PROCESS = getattr(os, "PRIO_DARWIN_PROCESS", 4)
PRIO_DARWIN_BG = getattr(os, "PRIO_DARWIN_BG", 0x1000)


def lower() -> Callable[[], None] | None:
    """Lower this process's CPU priority; returns what raises it back (None: left as it was)."""
    if sys.platform == "darwin":
        try:
            os.setpriority(PRIO_DARWIN_PROCESS, 0, PRIO_DARWIN_BG)
        except OSError:
            return None
        return lambda: os.setpriority(PRIO_DARWIN_PROCESS, 0, 0)
    if not sys.platform.startswith("linux"):
        return None
    was = os.getpriority(os.PRIO_PROCESS, 0)
    if not _may_lower_nice_to(was):
        return None
    _renice_all(was + NICE)
    return lambda: _renice_all(was)


def _may_lower_nice_to(nice: int) -> bool:
    """Whether this process may set its nice value back down to `nice` (setpriority(2))."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - nice <= soft


def thread_ids() -> list[int]:
    """This process's threads (Linux: /proc/self/task); [0], the calling thread, where not listed."""
    tasks = Path("/proc/self/task")
    return [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]


def _renice_all(nice: int) -> None:
    """Every thread's nice value (on Linux it is per thread; new threads inherit the creator's)."""
    for tid in thread_ids():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, nice)
