"""The coordinator's SQLite database (`<state>/coordinator.sqlite3`): nodes, jobs, metrics, events,
samples and worker logs, so a restarted coordinator carries on and finished jobs stay queryable.

Writes are batched: the coordinator's loop handles every message that is waiting, then commits once
(WAL, synchronous=NORMAL: a crash loses at most the last batch, never corrupts the file).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.plan import GroupPlan, Slot
from dpool.daemon.records import Job
from dpool.protocol.payloads import EventRow, LogLine, MetricRow, NodeRow, SampleRow
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
CREATE TABLE IF NOT EXISTS logs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, t REAL NOT NULL, rank INTEGER NOT NULL,
    generation INTEGER NOT NULL, text TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS logs_job ON logs (job, seq);
"""


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


_metric_row = compile_type(MetricRow, "metrics row")


def _read(convert: Callable[[Any], Any], text: str) -> Any:
    """A stored row as its record, or None for one this version cannot read (written by an older
    one): a page leaves it out rather than fail whole."""
    try:
        return convert(orjson.loads(text))
    except (Invalid, orjson.JSONDecodeError):
        return None


class Store:
    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level="DEFERRED")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(jobs)")}
        if "restarts" not in columns:  # a database written before recovery existed
            self.db.execute("ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0")
        self.db.commit()
        self._unit = self._saved = False

    def commit(self) -> None:
        self.db.commit()

    # A unit of work (one request, one tick) is a savepoint inside the batch's transaction, opened
    # at its first write (most units write nothing): one that fails is undone whole, and the batch
    # commits once.

    def begin_unit(self) -> None:
        self._unit, self._saved = True, False

    def end_unit(self) -> None:
        if self._saved:
            self.db.execute("RELEASE unit")
        self._unit = self._saved = False

    def undo_unit(self) -> None:
        saved, self._unit, self._saved = self._saved, False, False
        if saved:
            self.db.execute("ROLLBACK TO unit")
            self.db.execute("RELEASE unit")

    def _write(self) -> None:
        """Called by every method that writes, before it does."""
        if self._unit and not self._saved:
            if not self.db.in_transaction:
                self.db.execute("BEGIN")
            self.db.execute("SAVEPOINT unit")
            self._saved = True

    def close(self) -> None:
        self.db.commit()
        self.db.close()

    # -- nodes and jobs ------------------------------------------------------------------------

    def save_node(self, row: NodeRow, incarnation: str, joined_at: float, last_seen: float) -> None:
        self._write()
        self.db.execute(
            "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?)",
            (row.name, incarnation, _json(row.to_wire()), joined_at, last_seen, row.state, row.reason),
        )

    def save_job(self, job: Job) -> None:
        self._write()
        m = job.machine
        plan = None
        if job.plan is not None:
            p = job.plan
            plan = _json(
                {"generation": p.generation, "ranks": [[s.node, s.index] for s in p.ranks], "shares": list(p.shares), "hostfile": [list(h) for h in p.hostfile]}
            )
        self.db.execute(
            "INSERT OR REPLACE INTO jobs (id, name, submitted_at, state, spec, generation, error, started_at, finished_at, plan, step, loss, val_loss, checkpoint_step, restarts) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job.id, job.name, job.submitted_at, str(m.state), _json(job.spec), m.generation, m.error, m.started_at, m.finished_at, plan, job.step, job.loss, job.val_loss, job.checkpoint_step, m.restarts),
        )

    def load_jobs(self) -> list[Job]:
        jobs = []
        rows = self.db.execute(
            "SELECT id, name, submitted_at, state, spec, generation, error, started_at, finished_at, plan, step, loss, val_loss, checkpoint_step, restarts FROM jobs ORDER BY submitted_at"
        )
        for (jid, name, submitted, state, spec, gen, error, started, finished, plan, step, loss, val_loss, ckpt, restarts) in rows:
            machine = JobMachine(state=JobState(state), generation=gen, error=error, started_at=started, finished_at=finished, restarts=restarts)
            job = Job(id=jid, name=name, spec=orjson.loads(spec), submitted_at=submitted, machine=machine, step=step, loss=loss, val_loss=val_loss, checkpoint_step=ckpt)
            if plan:
                p = orjson.loads(plan)
                job.plan = GroupPlan(
                    job=jid,
                    generation=p["generation"],
                    ranks=tuple(Slot(n, i) for n, i in p["ranks"]),
                    shares=tuple(p["shares"]),
                    hostfile=tuple(tuple(h) for h in p["hostfile"]),
                )
            jobs.append(job)
        return jobs

    def set_aside_nodes(self) -> dict[str, str]:
        """Nodes drained or set aside (name -> reason): a restarted coordinator keeps them so."""
        rows = self.db.execute("SELECT name, reason FROM nodes WHERE reason = 'drained' OR reason LIKE 'set aside:%'")
        return {name: reason for name, reason in rows}

    # -- metrics, samples, events, logs --------------------------------------------------------

    def add_metric(self, job: str, generation: int, row: MetricRow) -> None:
        """Keep one row per (job, kind, step): the newest generation's, so a resumed run's
        recomputed steps replace the first attempt's and the curve stays clean."""
        self._write()
        self.db.execute(
            "INSERT INTO metrics VALUES (?, ?, ?, ?, ?) ON CONFLICT (job, kind, step) DO UPDATE SET "
            "generation = excluded.generation, row = excluded.row WHERE excluded.generation >= metrics.generation",
            (job, row.kind, row.step, generation, _json(row.to_wire())),
        )

    def metrics(self, job: str, after: int, limit: int) -> tuple[list[MetricRow], int, bool]:
        """Rows `after`.. of the job's metrics, at most `limit`: (rows, the next page's `after`,
        whether there is one)."""
        found = self.db.execute(
            "SELECT row FROM metrics WHERE job = ? ORDER BY step, kind DESC LIMIT ? OFFSET ?", (job, limit + 1, after)
        ).fetchall()
        rows = [r for (text,) in found[:limit] if (r := _read(_metric_row, text)) is not None]
        return rows, after + min(limit, len(found)), len(found) > limit

    def add_sample(self, job: str, generation: int, row: SampleRow) -> None:
        self._write()
        self.db.execute(
            "INSERT INTO samples VALUES (?, ?, ?, ?) ON CONFLICT (job, step) DO UPDATE SET "
            "generation = excluded.generation, row = excluded.row WHERE excluded.generation >= samples.generation",
            (job, row.step, generation, _json(row.to_wire())),
        )

    def samples(self, job: str, after: int, limit: int) -> tuple[list[SampleRow], int, bool]:
        found = self.db.execute(
            "SELECT row FROM samples WHERE job = ? ORDER BY step LIMIT ? OFFSET ?", (job, limit + 1, after)
        ).fetchall()
        rows = [r for (text,) in found[:limit] if (r := _read(SampleRow.from_wire, text)) is not None]
        return rows, after + min(limit, len(found)), len(found) > limit

    def add_event(self, job: str | None, t: float, kind: str, fields: dict[str, Any]) -> None:
        self._write()
        self.db.execute("INSERT INTO events (job, t, kind, fields) VALUES (?, ?, ?, ?)", (job, t, kind, _json(fields)))

    def events(self, job: Job, after: int, limit: int) -> tuple[list[EventRow], int]:
        """The job's events and the pool's events during its life (node.joined, node.lost)."""
        end = job.machine.finished_at if job.machine.finished_at is not None else float("inf")
        rows = self.db.execute(
            "SELECT seq, job, t, kind, fields FROM events WHERE seq > ? AND "
            "(job = ? OR (job IS NULL AND t >= ? AND t <= ?)) ORDER BY seq LIMIT ?",
            (after, job.id, job.submitted_at, end, limit),
        )
        out, cursor = [], after
        for seq, _job, t, kind, fields in rows:
            with contextlib.suppress(Invalid):  # one an older version wrote in a shape this one cannot carry
                out.append(EventRow.from_wire({"t": round(t, 3), "kind": kind, **orjson.loads(fields)}))
            cursor = seq
        return out, cursor

    def add_logs(self, job: str, t: float, rank: int, generation: int, lines: list[str]) -> None:
        self._write()
        self.db.executemany(
            "INSERT INTO logs (job, t, rank, generation, text) VALUES (?, ?, ?, ?, ?)",
            [(job, t, rank, generation, line) for line in lines],
        )

    def logs(self, job: str, after: int, rank: int | None, limit: int) -> tuple[list[LogLine], int]:
        if rank is None:
            rows = self.db.execute(
                "SELECT seq, t, rank, generation, text FROM logs WHERE job = ? AND seq > ? ORDER BY seq LIMIT ?", (job, after, limit)
            )
        else:
            rows = self.db.execute(
                "SELECT seq, t, rank, generation, text FROM logs WHERE job = ? AND seq > ? AND rank = ? ORDER BY seq LIMIT ?",
                (job, after, rank, limit),
            )
        out, cursor = [], after
        for seq, t, r, gen, text in rows:
            out.append(LogLine(seq=seq, t=round(t, 3), rank=r, generation=gen, text=text))
            cursor = seq
        return out, cursor
