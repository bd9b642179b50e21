"""A warm trainer builds its model and data at a low CPU priority, and trains at the usual one.

A spare (`--warm`) starts while its node trains: its interpreter start, imports and model build
take a core for a second or two, which the running ranks would lose on a machine with few cores.
So it lowers its priority first, and raises it back at `worker.go`. A spare on a node that runs no
worker yet (a node that joins: its dpd sets DPOOL_WARM_LOW=0) builds at the usual priority. Only where raising it back is
allowed, or the whole next generation would train at the low priority:

- macOS: the process's background state (`PRIO_DARWIN_BG`), which a process may set and clear on
  itself.
- Linux: nice +10 for every thread, back to where it was at go, when this process may lower its
  nice value again (root, CAP_SYS_NICE, or an RLIMIT_NICE that allows it); and its autogroup's
  nice +10, back at go (any user may).

Why the autogroup. Every trainer leads its own session (its dpd stops it by process group), and
with autogroups on (`/proc/sys/kernel/sched_autogroup_enabled`, the default of most desktop and
server kernels) every session is a scheduling group of its own: a thread's nice value then weighs
only against the threads of its own session, and each session gets an equal share of a busy core.
A spare at nice 10 alone in its session took half the core of the rank beside it: measured in a
pool of two dpds pinned by taskset, two spares building on the core of two ranks made each rank's
compute 80 ms instead of 40 for ~1 s (steps 4 to 16, the balancer's first windows, which then gave
that core's ranks too little work; BENCHMARKS.md, "Unlike machines"). The autogroup's nice weighs against
the other sessions: 0.11 of a contended core at +10 (0.5 with the thread's nice alone). Raising it
back needs no privilege, but the kernel takes one autogroup change per 100 ms from an unprivileged
user (EAGAIN, kernel/sched/autogroup.c): the spares of one machine told to go together take turns,
up to `AUTOGROUP_RETRY_S` each, and then a thread keeps trying.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

NICE = 10
PRIO_DARWIN_PROCESS = getattr(os, "PRIO_DARWIN_PROCESS", 4)
PRIO_DARWIN_BG = getattr(os, "PRIO_DARWIN_BG", 0x1000)
AUTOGROUP = Path("/proc/self/autogroup")  # "/autogroup-123 nice 0": this session's scheduling group
AUTOGROUP_ON = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP_RETRY_S = 0.5  # the most a change waits out the kernel's rate limit (one per 100 ms)
AUTOGROUP_LATE_S = 10.0  # then, at go, a thread keeps trying this long


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
    undo: list[Callable[[], None]] = []
    was = os.getpriority(os.PRIO_PROCESS, 0)
    if _may_lower_nice_to(was):
        _renice_all(was + NICE)
        undo.append(lambda: _renice_all(was))
    group = autogroup_nice()
    if group is not None and set_autogroup_nice(min(19, group + NICE)):
        undo.append(lambda: _set_autogroup_back(group))
    if not undo:
        return None

    def back() -> None:
        for f in undo:
            f()

    return back


def autogroup_nice() -> int | None:
    """The nice value of this process's autogroup, when it has one of its own: autogroups are on
    and this process leads its session (never the group of the shell or daemon that started it)."""
    try:
        if AUTOGROUP_ON.read_text().strip() != "1" or os.getsid(0) != os.getpid():
            return None
        _, sep, value = AUTOGROUP.read_text().partition(" nice ")
        return int(value) if sep else None
    except (OSError, ValueError):
        return None


def _set_autogroup_back(nice: int) -> None:
    if not set_autogroup_nice(nice):
        # Still refused (more spares went at once than the kernel's pace allows): keep trying off
        # the training path rather than train the whole generation at the low priority.
        threading.Thread(target=set_autogroup_nice, args=(nice, AUTOGROUP_LATE_S), daemon=True).start()


def set_autogroup_nice(nice: int, retry_s: float = AUTOGROUP_RETRY_S) -> bool:
    """Set this session's autogroup nice value; False where the kernel refuses it. EAGAIN (another
    autogroup changed less than 100 ms ago) is waited out, up to `retry_s`."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            AUTOGROUP.write_text(str(nice))
            return True
        except OSError as e:
            if e.errno != errno.EAGAIN or time.monotonic() >= deadline:
                return False
        time.sleep(0.01)


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
