"""The coordinator's SQLite database (`<state>/coordinator.sqlite3`): nodes, jobs, metrics, events,
samples and worker logs, so a restarted coordinator carries on and finished jobs stay queryable.
`dpctl rm` deletes a finished job's rows and leaves one row per node in `removals` (job, node):
the node still has to delete its folder of the job; the row goes when the node says it did.

Writes are batched: the coordinator's loop handles every message that is waiting, then commits once
(WAL, synchronous=NORMAL: a crash loses at most the last batch, never corrupts the file).

A database that cannot be written (a full disk, another process holding its lock) never stops the
coordinator: each write is kept as a statement until a commit succeeds. It is executed in the
batch's transaction at the commit (or before a read, so reads see it); when the commit fails,
SQLite may have rolled the whole transaction back (a full disk does), so the statements are kept
and the commit is tried again, whole, with a growing pause (RETRY_S .. RETRY_MAX_S) between tries.
At most PENDING_ROWS_MAX rows wait: past that the oldest log lines go first, then the oldest of
anything. A lock held elsewhere is waited for BUSY_TIMEOUT_S at most, not SQLite's default 5 s.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from dpool.daemon.jobstate import JobMachine, JobState, Saved
from dpool.daemon.plan import GroupPlan, Slot
from dpool.daemon.records import Hold, Job, JobRef
from dpool.protocol.jobspec import JobFileError, parse_job
from dpool.protocol.logs import get_logger
from dpool.protocol.payloads import (
    EventRow,
    JobStatus,
    LogLine,
    MetricRow,
    NodeRow,
    RemovedRows,
    SampleRow,
)
from dpool.protocol.schema import Invalid, compile_type

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, incarnation TEXT NOT NULL, info TEXT NOT NULL,
    joined_at REAL NOT NULL, last_seen REAL NOT NULL, state TEXT NOT NULL, reason TEXT
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, submitted_at REAL NOT NULL, state TEXT NOT NULL,
    spec TEXT NOT NULL, generation INTEGER NOT NULL, error TEXT, started_at REAL, finished_at REAL,
    plan TEXT, step INTEGER NOT NULL, loss REAL, val_loss REAL, checkpoint_step INTEGER
);
CREATE TABLE IF NOT EXISTS metrics (
    job TEXT NOT NULL, kind TEXT NOT NULL, step INTEGER NOT NULL, generation INTEGER NOT NULL,
    row TEXT NOT NULL, PRIMARY KEY (job, kind, step)
);
CREATE TABLE IF NOT EXISTS samples (
    job TEXT NOT NULL, step INTEGER NOT NULL, generation INTEGER NOT NULL, row TEXT NOT NULL,
    PRIMARY KEY (job, step)
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT, t REAL NOT NULL, kind TEXT NOT NULL,
    fields TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events (job, seq);
CREATE INDEX IF NOT EXISTS jobs_name ON jobs (name, submitted_at);
CREATE INDEX IF NOT EXISTS jobs_submitted ON jobs (submitted_at, id);
CREATE INDEX IF NOT EXISTS metrics_order ON metrics (job, step, kind DESC);
CREATE TABLE IF NOT EXISTS logs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, t REAL NOT NULL, rank INTEGER NOT NULL,
    generation INTEGER NOT NULL, text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS logs_job ON logs (job, seq);
CREATE TABLE IF NOT EXISTS removals (
    job TEXT NOT NULL, node TEXT NOT NULL, t REAL NOT NULL, PRIMARY KEY (node, job)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value REAL NOT NULL);
"""
JOB_TABLES = ("metrics", "samples", "events", "logs")  # a job's rows besides its own, each with a `job` column


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


_metric_row = compile_type(MetricRow, "metrics row")
BUSY_TIMEOUT_S = 0.2
RETRY_S, RETRY_MAX_S = 0.5, 10.0
PENDING_ROWS_MAX = 200_000
LOGS_INSERT = "INSERT INTO logs "
REPLY_BYTES = 2 << 20  # rows of one paged reply, by their stored size: half the message cap (MAX_BODY_BYTES)


def _page(found: list[Any], limit: int, size: Callable[[Any], int]) -> tuple[list[Any], bool]:
    """The rows of `found` (fetched with one more than `limit`) that one reply carries: at most
    `limit`, and at most REPLY_BYTES of them by `size` (at least one): (rows, whether more follow).
    A page of long log lines or large samples stays under the message size cap."""
    kept: list[Any] = []
    used = 0
    for row in found[:limit]:
        used += size(row)
        if kept and used > REPLY_BYTES:
            return kept, True
        kept.append(row)
    return kept, len(found) > limit


def _read(convert: Callable[[Any], Any], text: str) -> Any:
    """A stored row as its record, or None for one this version cannot read (written by an older
    one): a page leaves it out rather than fail whole."""
    try:
        return convert(orjson.loads(text))
    except (Invalid, orjson.JSONDecodeError):
        return None


class Store:
    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level="DEFERRED")  # SQLite's 5 s wait while it opens
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(jobs)")}
        if "restarts" not in columns:  # a database written before recovery existed
            self.db.execute("ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0")
        if "test_loss" not in columns:  # written before [eval] test existed
            self.db.execute("ALTER TABLE jobs ADD COLUMN test_loss REAL")
        if "interrupted_at" not in columns:  # written before a recovery outlived a coordinator restart
            self.db.execute("ALTER TABLE jobs ADD COLUMN interrupted_at REAL")
            self.db.execute("ALTER TABLE jobs ADD COLUMN cause TEXT")
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(nodes)")}
        if "hold" not in columns:  # written when a hold was only its reason's text
            self.db.execute("ALTER TABLE nodes ADD COLUMN hold TEXT")
            self.db.execute("UPDATE nodes SET hold = ? WHERE reason = 'drained'", (Hold.DRAINED.value,))
            self.db.execute("UPDATE nodes SET hold = ? WHERE reason LIKE 'set aside:%'", (Hold.SET_ASIDE.value,))
        self.db.commit()
        self.db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")  # then never a stalled loop
        self.clock = clock
        self._pending: list[tuple[str, Sequence[Any], bool]] = []  # (sql, parameters, executemany) not yet committed
        self._rows = 0  # rows in _pending
        self._applied = 0  # how many of _pending the open transaction holds
        self._mark = 0  # where the current unit's writes begin in _pending
        self._failures = 0  # commits failed in a row
        self._retry_at = 0.0
        self.dropped = 0  # rows given up while the database could not be written
        self.log = get_logger(component="store")

    def commit(self) -> None:
        """Make every write so far durable; raises sqlite3.Error when it cannot, keeping them all
        to try again at a later commit (none is tried before the back-off has passed)."""
        if not self._pending or self.clock() < self._retry_at:
            return
        try:
            self._apply()
            self.db.commit()
        except sqlite3.Error:
            self._failed()
            raise
        if self._failures:
            self.log.info("store.commit_recovered", failed_commits=self._failures, rows=self._rows, dropped=self.dropped)
        self._pending, self._rows, self._applied, self._mark, self._failures, self._retry_at = [], 0, 0, 0, 0, 0.0

    @property
    def pending_rows(self) -> int:
        """Rows written but not yet committed."""
        return self._rows

    # A unit of work (one request, one tick) is undone whole when it fails: its writes are the
    # statements it added, and the batch commits once.

    def begin_unit(self) -> None:
        self._mark = len(self._pending)

    def end_unit(self) -> None:
        self._mark = len(self._pending)

    def undo_unit(self) -> None:
        if self._applied > self._mark:  # a read executed some of them: start the transaction over
            self._rollback()
        self._rows -= sum(len(p) if many else 1 for _, p, many in self._pending[self._mark:])
        del self._pending[self._mark:]

    def _write(self, sql: str, parameters: Sequence[Any], many: bool = False) -> None:
        """Every write goes through here: kept until a commit succeeds."""
        self._pending.append((sql, parameters, many))
        self._rows += len(parameters) if many else 1

    def _apply(self) -> None:
        """Execute the writes the open transaction does not hold yet."""
        for sql, parameters, many in self._pending[self._applied:]:
            if many:
                self.db.executemany(sql, parameters)
            else:
                self.db.execute(sql, parameters)
            self._applied += 1

    def _see_writes(self) -> None:
        """Before a read: the writes so far, in the open transaction, so the read sees them. A
        database that cannot take them now answers with what it has committed."""
        if self._applied < len(self._pending) and self.clock() >= self._retry_at:
            try:
                self._apply()
            except sqlite3.Error:
                self._failed()

    def _failed(self) -> None:
        """The database took none of it: start over at the next try, after a pause."""
        self._rollback()
        self._failures += 1
        self._retry_at = self.clock() + min(RETRY_MAX_S, RETRY_S * 2 ** (self._failures - 1))
        self._bound()

    def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.rollback()
        self._applied = 0

    def _bound(self) -> None:
        """At most PENDING_ROWS_MAX rows wait for the database: the oldest log lines go first."""
        if self._rows <= PENDING_ROWS_MAX:
            return
        before = self._rows
        kept: list[tuple[str, Sequence[Any], bool]] = []
        over = self._rows - PENDING_ROWS_MAX
        for entry in self._pending:
            sql, parameters, many = entry
            n = len(parameters) if many else 1
            if over > 0 and sql.startswith(LOGS_INSERT):
                over -= n
                self._rows -= n
                continue
            kept.append(entry)
        while self._rows > PENDING_ROWS_MAX and kept:
            _, parameters, many = kept.pop(0)
            self._rows -= len(parameters) if many else 1
        self._pending, self._mark = kept, len(kept)
        self.dropped += before - self._rows
        self.log.error("store.rows_dropped", dropped=before - self._rows, kept=self._rows, failed_commits=self._failures)

    def close(self) -> None:
        """Commit what is pending (once more, whatever the back-off) and close; never raises."""
        self._retry_at = 0.0
        try:
            self.commit()
        except sqlite3.Error as e:
            self.log.error("store.lost_on_close", rows=self._rows, error=str(e))
        with contextlib.suppress(sqlite3.Error):
            self.db.close()

    # -- nodes and jobs ------------------------------------------------------------------------

    def mark_alive(self, wall: float) -> None:
        """The coordinator was alive at `wall`: read back after a crash, it dates what was lost
        while nobody watched (`alive_at`)."""
        self._write("INSERT OR REPLACE INTO meta (key, value) VALUES ('alive_at', ?)", (wall,))

    def alive_at(self) -> float | None:
        """The wall time of the newest `mark_alive` committed (None: a new database, or one
        written before the mark existed)."""
        self._see_writes()
        row = self.db.execute("SELECT value FROM meta WHERE key = 'alive_at'").fetchone()
        return float(row[0]) if row else None

    def save_node(self, row: NodeRow, incarnation: str, joined_at: float, last_seen: float, hold: Hold | None) -> None:
        self._write(
            "INSERT OR REPLACE INTO nodes (name, incarnation, info, joined_at, last_seen, state, reason, hold) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (row.name, incarnation, _json(row.to_wire()), joined_at, last_seen, row.state, row.reason, hold.value if hold else None),
        )

    def forget_node(self, name: str) -> None:
        self._write("DELETE FROM nodes WHERE name = ?", (name,))

    def save_job(self, job: Job) -> None:
        m = job.machine
        plan = None
        if job.plan is not None:
            p = job.plan
            plan = _json(
                {"generation": p.generation, "ranks": [[s.node, s.index] for s in p.ranks], "shares": list(p.shares), "hostfile": [list(h) for h in p.hostfile]}
            )
        self._write(
            "INSERT OR REPLACE INTO jobs (id, name, submitted_at, state, spec, generation, error, started_at, finished_at, plan, step, loss, val_loss, checkpoint_step, restarts, test_loss, "
            "interrupted_at, cause) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job.id, job.name, job.submitted_at, str(m.state), _json(job.doc), m.generation, m.error, m.started_at, m.finished_at, plan, job.step, job.loss, job.val_loss, job.checkpoint_step, m.restarts, job.test_loss,
             m.interrupted_wall, None if m.cause is None else str(m.cause)),
        )

    def load_jobs(self) -> list[tuple[Job, Saved]]:
        """Every stored job with what its machine was, oldest first; one whose stored job file this
        version refuses is left in the database and out of the pool, with a warning."""
        self._see_writes()
        jobs = []
        rows = self.db.execute(
            "SELECT id, name, submitted_at, state, spec, generation, error, started_at, finished_at, plan, step, loss, val_loss, checkpoint_step, restarts, test_loss, "
            "interrupted_at, cause FROM jobs ORDER BY submitted_at"
        )
        for (jid, name, submitted, state, spec, gen, error, started, finished, plan, step, loss, val_loss, ckpt, restarts, test_loss, interrupted, cause) in rows:
            try:
                parsed = parse_job(orjson.loads(spec), source=f"stored job {jid}")
            except (JobFileError, orjson.JSONDecodeError) as e:
                get_logger(component="store").warning("store.job_unreadable", job=jid, error=str(e)[:300])
                continue
            job = Job(id=jid, name=name, spec=parsed, submitted_at=submitted, machine=JobMachine(max_restarts=parsed.recovery.max_restarts),
                      step=step, loss=loss, val_loss=val_loss, test_loss=test_loss, checkpoint_step=ckpt)
            if plan:
                p = orjson.loads(plan)
                job.plan = GroupPlan(
                    job=jid,
                    generation=p["generation"],
                    ranks=tuple(Slot(n, i) for n, i in p["ranks"]),
                    shares=tuple(p["shares"]),
                    hostfile=tuple(tuple(h) for h in p["hostfile"]),
                )
            jobs.append((job, Saved(JobState(state), gen, restarts, step, error, started, finished, interrupted, cause)))
        return jobs

    def find_job(self, ref: str) -> JobRef | None:
        """A stored job by id, by name (its newest), or by a unique id prefix."""
        self._see_writes()
        query = "SELECT id, name, state, submitted_at, finished_at FROM jobs WHERE "
        found = self.db.execute(query + "id = ?", (ref,)).fetchall()
        found = found or self.db.execute(query + "name = ? ORDER BY submitted_at DESC LIMIT 1", (ref,)).fetchall()
        if not found:
            found = self.db.execute(query + "substr(id, 1, ?) = ? LIMIT 2", (len(ref), ref)).fetchall()
            if len(found) != 1:
                return None
        jid, name, state, submitted, finished = found[0]
        return JobRef(id=jid, name=name, state=JobState(state), submitted_at=submitted, finished_at=finished)

    def ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        """At most `limit` job ids that start with `prefix`, newest first."""
        self._see_writes()
        rows = self.db.execute("SELECT id FROM jobs WHERE substr(id, 1, ?) = ? ORDER BY submitted_at DESC LIMIT ?", (len(prefix), prefix, limit))
        return [r[0] for r in rows]

    def job_count(self) -> int:
        """Every job the database holds (live, finished, in memory or not)."""
        self._see_writes()
        return int(self.db.execute("SELECT count(*) FROM jobs").fetchone()[0])

    def has_job(self, job_id: str) -> bool:
        """Whether the id is taken: by a job, or by a removed job some node has still to delete
        (a new job under that id would lose its folder there)."""
        self._see_writes()
        taken = "SELECT 1 FROM jobs WHERE id = ? UNION ALL SELECT 1 FROM removals WHERE job = ? LIMIT 1"
        return self.db.execute(taken, (job_id, job_id)).fetchone() is not None

    def remove_job(self, job_id: str, t: float, nodes: Sequence[str]) -> RemovedRows:
        """Delete the job's rows (the job, its metrics, samples, events and logs; the pool's own
        events stay) and note that each of `nodes` has to delete its folder of the job. Returns
        how many rows of each kind went."""
        self._see_writes()
        counts = {"jobs": self.db.execute("SELECT count(*) FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]}
        for table in JOB_TABLES:
            counts[table] = self.db.execute(f"SELECT count(*) FROM {table} WHERE job = ?", (job_id,)).fetchone()[0]
        self._write("DELETE FROM jobs WHERE id = ?", (job_id,))
        for table in JOB_TABLES:
            self._write(f"DELETE FROM {table} WHERE job = ?", (job_id,))
        if nodes:
            self._write("INSERT OR REPLACE INTO removals (job, node, t) VALUES (?, ?, ?)", [(job_id, n, t) for n in nodes], many=True)
        return RemovedRows(**counts)

    def removals(self, node: str) -> list[str]:
        """The removed jobs whose folder `node` has still to delete, oldest first."""
        self._see_writes()
        return [job for (job,) in self.db.execute("SELECT job FROM removals WHERE node = ? ORDER BY t, job", (node,))]

    def removed_on(self, job_id: str, node: str) -> None:
        """`node` deleted its folder of the removed job."""
        self._write("DELETE FROM removals WHERE job = ? AND node = ?", (job_id, node))

    def node_names(self) -> list[str]:
        """Every node this database has known (a node is never deleted from it)."""
        self._see_writes()
        return [name for (name,) in self.db.execute("SELECT name FROM nodes ORDER BY name")]

    def statuses(self, limit: int, *, skip: frozenset[str] | set[str] = frozenset(), only: str | None = None, before: tuple[float, str] | None = None) -> list[JobStatus]:
        """The newest `limit` stored jobs' status objects (newest first), but those in `skip`; or
        the one job `only`. (A job in the coordinator's memory has a fresher one: `Job.status`.)
        `before` (submitted_at, id): only the jobs that come after that one, newest first (a page)."""
        self._see_writes()
        query = (
            "SELECT id, name, state, step, json_extract(spec, '$.train.steps'), generation, "
            "coalesce(json_array_length(plan, '$.ranks'), 0), checkpoint_step, loss, val_loss, error, submitted_at, started_at, finished_at, test_loss FROM jobs "
        )
        if only is not None:
            rows = self.db.execute(query + "WHERE id = ?", (only,))
        elif before is not None:
            rows = self.db.execute(query + "WHERE (submitted_at, id) < (?, ?) ORDER BY submitted_at DESC, id DESC LIMIT ?", (*before, limit + len(skip)))
        else:
            rows = self.db.execute(query + "ORDER BY submitted_at DESC LIMIT ?", (limit + len(skip),))
        out = []
        for jid, name, state, step, steps, gen, world, ckpt, loss, val_loss, error, submitted, started, finished, test_loss in rows:
            if jid in skip:
                continue
            with contextlib.suppress(Invalid):  # a row an older version wrote in another shape
                out.append(JobStatus.from_wire({
                    "id": jid, "name": name, "state": state, "step": step, "steps": steps, "generation": gen,
                    "world_size": world, "workers": [], "checkpoint_step": ckpt, "loss": loss, "val_loss": val_loss, "test_loss": test_loss, "error": error,
                    "submitted": submitted, "started": started, "finished": finished,
                    "elapsed_s": round(max(0.0, finished - started), 3) if started is not None and finished is not None else None,
                }))
        return out[:limit]

    def held_nodes(self) -> dict[str, tuple[Hold, str]]:
        """Nodes drained or set aside (name -> (hold, reason)): a restarted coordinator keeps them so."""
        self._see_writes()
        rows = self.db.execute("SELECT name, hold, reason FROM nodes WHERE hold IS NOT NULL")
        out = {}
        for name, hold, reason in rows:
            with contextlib.suppress(ValueError):
                out[name] = (Hold(hold), reason or str(hold))
        return out

    # -- metrics, samples, events, logs --------------------------------------------------------

    def add_metric(self, job: str, generation: int, row: MetricRow) -> None:
        """Keep one row per (job, kind, step): the newest generation's, so a resumed run's
        recomputed steps replace the first attempt's and the curve stays clean."""
        self._write(
            "INSERT INTO metrics VALUES (?, ?, ?, ?, ?) ON CONFLICT (job, kind, step) DO UPDATE SET "
            "generation = excluded.generation, row = excluded.row WHERE excluded.generation >= metrics.generation",
            (job, row.kind, row.step, generation, _json(row.to_wire())),
        )

    def logged_steps(self, job: str) -> dict[str, int]:
        """The newest step of each kind of the job's metrics ("train", "eval")."""
        self._see_writes()
        rows = self.db.execute("SELECT kind, MAX(step) FROM metrics WHERE job = ? GROUP BY kind", (job,)).fetchall()
        return {str(kind): int(step) for kind, step in rows}

    def metrics(self, job: str, after: int, limit: int) -> tuple[list[MetricRow], int, bool]:
        """Rows `after`.. of the job's metrics, at most `limit`: (rows, the next page's `after`,
        whether there is one)."""
        self._see_writes()
        found = self.db.execute(
            "SELECT row FROM metrics WHERE job = ? ORDER BY step, kind DESC LIMIT ? OFFSET ?", (job, limit + 1, after)
        ).fetchall()
        kept, more = _page(found, limit, lambda r: len(r[0]))
        rows = [r for (text,) in kept if (r := _read(_metric_row, text)) is not None]
        return rows, after + len(kept), more

    def add_sample(self, job: str, generation: int, row: SampleRow) -> None:
        self._write(
            "INSERT INTO samples VALUES (?, ?, ?, ?) ON CONFLICT (job, step) DO UPDATE SET "
            "generation = excluded.generation, row = excluded.row WHERE excluded.generation >= samples.generation",
            (job, row.step, generation, _json(row.to_wire())),
        )

    def samples(self, job: str, after: int, limit: int) -> tuple[list[SampleRow], int, bool]:
        self._see_writes()
        found = self.db.execute(
            "SELECT row FROM samples WHERE job = ? ORDER BY step LIMIT ? OFFSET ?", (job, limit + 1, after)
        ).fetchall()
        kept, more = _page(found, limit, lambda r: len(r[0]))
        rows = [r for (text,) in kept if (r := _read(SampleRow.from_wire, text)) is not None]
        return rows, after + len(kept), more

    def add_event(self, job: str | None, t: float, kind: str, fields: dict[str, Any]) -> None:
        self._write("INSERT INTO events (job, t, kind, fields) VALUES (?, ?, ?, ?)", (job, t, kind, _json(fields)))

    def events(self, job: JobRef, after: int, limit: int) -> tuple[list[EventRow], int, bool]:
        """The job's events and the pool's events during its life (node.joined, node.lost):
        (events, the next page's `after`, whether there is one)."""
        self._see_writes()
        end = job.finished_at if job.finished_at is not None else float("inf")
        found = self.db.execute(
            "SELECT seq, job, t, kind, fields FROM events WHERE seq > ? AND "
            "(job = ? OR (job IS NULL AND t >= ? AND t <= ?)) ORDER BY seq LIMIT ?",
            (after, job.id, job.submitted_at, end, limit + 1),
        ).fetchall()
        rows, more = _page(found, limit, lambda r: len(r[4]) + 64)
        out, cursor = [], after
        for seq, _job, t, kind, fields in rows:
            with contextlib.suppress(Invalid):  # one an older version wrote in a shape this one cannot carry
                out.append(EventRow.from_wire({"t": round(t, 3), "kind": kind, **orjson.loads(fields)}))
            cursor = seq
        return out, cursor, more

    def add_logs(self, job: str, t: float, rank: int, generation: int, lines: list[str]) -> None:
        self._write(
            LOGS_INSERT + "(job, t, rank, generation, text) VALUES (?, ?, ?, ?, ?)",
            [(job, t, rank, generation, line) for line in lines],
            many=True,
        )

    def logs(self, job: str, after: int, rank: int | None, limit: int) -> tuple[list[LogLine], int, bool]:
        """Output lines `after`.. of the job (of one rank): (lines, the next page's `after`,
        whether there is one)."""
        self._see_writes()
        if rank is None:
            found = self.db.execute(
                "SELECT seq, t, rank, generation, text FROM logs WHERE job = ? AND seq > ? ORDER BY seq LIMIT ?", (job, after, limit + 1)
            ).fetchall()
        else:
            found = self.db.execute(
                "SELECT seq, t, rank, generation, text FROM logs WHERE job = ? AND seq > ? AND rank = ? ORDER BY seq LIMIT ?",
                (job, after, rank, limit + 1),
            ).fetchall()
        rows, more = _page(found, limit, lambda r: len(r[4].encode()) + 48)
        out, cursor = [], after
        for seq, t, r, gen, text in rows:
            out.append(LogLine(seq=seq, t=round(t, 3), rank=r, generation=gen, text=text))
            cursor = seq
        return out, cursor, more
