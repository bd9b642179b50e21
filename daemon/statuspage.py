"""A page of the job list: `status` with a `limit` (the dashboard's /jobs, however long the history).

The coordinator holds the live jobs and the newest finished ones in memory (their status is the
fresh one) and every job in its database. A page is the `limit` jobs that come after a cursor in
one order, newest first: (submitted_at, id) descending, the id breaking a tie of two jobs
submitted in the same instant, so no job is skipped or shown twice from one page to the next. The
cursor is the previous page's last job. A page costs one indexed query of `limit` rows (plus the
jobs in memory, which are skipped there), so the 3,000th job is as cheap to list as the first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dpool.protocol.payloads import JobStatus

Key = tuple[float, str]  # (submitted_at, id): the list's order, newest first
FIRST: Key = (1e300, "")  # before every job: the first page


def key(s: JobStatus) -> Key:
    return (s.submitted if s.submitted is not None else 0.0, s.id)


def page(memory: Sequence[JobStatus], stored: Callable[[Key, int, set[str]], list[JobStatus]], before: Key | None, limit: int, *, skip: set[str] | None = None) -> tuple[list[JobStatus], bool]:
    """The `limit` newest jobs that come after `before` (None: the first page), and whether more
    follow. `memory`: the coordinator's fresh status of jobs it holds in memory (those of the page
    at least); `skip`: the ids of every job it holds in memory (default: those of `memory`);
    `stored(before, n, skip)`: the `n` newest stored jobs after `before`, leaving out `skip`."""
    cursor = before or FIRST
    fresh = sorted((s for s in memory if key(s) < cursor), key=key, reverse=True)
    merged = sorted(fresh[: limit + 1] + stored(cursor, limit + 1, skip if skip is not None else {s.id for s in memory}), key=key, reverse=True)
    return merged[:limit], len(merged) > limit
