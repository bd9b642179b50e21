"""The W&B writer of a job's rank 0: `python -m dpool.trainer.wandb_writer`, started by
trainer/report.py with its output in the run dir's report.log (not the trainer's output: its dpd
reads that to its end before it takes the trainer's exit, and neither this process nor its
wandb-core may hold it open), which writes to its stdin one JSON object a line: first the opening (`job`,
`run_dir`, `generation`, `resume_step`, `backlog_bytes`: metrics.jsonl's size as the resume left
it), then the metrics rows, then `{"end": CODE}` when the trainer ends or stops (none when it fails
or is killed: the pipe just closes).

One job is one W&B run, whatever restarts it. Its id is the job's pool id and training hash
(DPOOL_JOB_ID, set by the dpd that started the trainer: the same in every generation, on every
machine); for a trainer run by hand, an id made at its first start and kept in its run dir
(`report.json`), so that starting it again with the same DIR continues the same run. Every
generation's writer opens the run with `resume="allow"`.

A restarted generation recomputes the steps after its checkpoint, and W&B refuses a step lower than
one it holds: steps the run already holds are not logged again. What it holds is read where it is
written, the run's transaction logs under the wandb folder (`*run-*-ID/run-ID.wandb`, the records
that wandb-core wrote), and online also the step the W&B server resumes the run at. The previous
writer on this machine, and its wandb-core (which outlives a killed client by seconds, writing what
it was handed), are waited for before the logs are read: their pids are kept beside the logs. Rows
the run lacks up to the resume step (handed to a writer killed before they were written) are logged
from metrics.jsonl as the resume left it, and in a pool from the job's other slots' metrics.jsonl on
this machine (rank 0 may come back in another slot). So a job killed and resumed leaves each step
once when its rank 0 comes back on the same machine (WANDB_DIR shared by its slots, or the run
dir's own wandb folder in the same slot), or the run is online; a rank 0 that moves to another
machine offline continues the same run id from its resume step, and `wandb sync` keeps each step
once (W&B drops the lower steps of the later file).

Keys are mlx-lm's (`mlx_lm/tuner/trainer.py`, `WandBCallback`), so dashboards made for
`mlx_lm lora --report-to wandb` work: `iteration`, `train_loss`, `learning_rate`,
`iterations_per_second`, `tokens_per_second`, `trained_tokens`, `peak_memory` (GB), `val_loss`,
`val_time`, and `test_loss`; plus `generation` and `world_size`, so restarts and membership changes
show. The W&B step is the training step.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from dpool.protocol.jobspec import JobSpec, parse_job
from dpool.protocol.logs import configure_logging, get_logger

ENV_JOB_ID = "DPOOL_JOB_ID"  # the job's id in the pool (daemon/agent.py sets it for every trainer)
QUEUE_MAX = 20_000  # rows read from the trainer and not yet logged (W&B still opening the run)
WRITER_WAIT_S = 30.0  # the previous writer and its wandb-core finish writing (~2.5 s here after a kill)
INIT_GRACE_S = 2.0  # the trainer has ended and the run is still not open (W&B unreachable): give up
EXIT_CAP_S = 30.0  # the trainer has ended: the most this writer takes to log and finish
FINISH_TIMEOUT_S = 10.0  # wandb's bound on uploading at finish (the rest stays on disk for `wandb sync`)
RUN_ID_MAX = 64
EXIT_UNREPORTED = 3  # the run could not be opened or written (the trainer says so; report.log says why)


def run_id(spec: JobSpec, run_dir: Path) -> str:
    """The id of the job's W&B run (the module's docstring says whence)."""
    job = os.environ.get(ENV_JOB_ID)
    if job:
        rid = f"{job}-{spec.training_hash()[:8]}"
    else:
        kept = run_dir / "report.json"
        try:
            rid = str(json.loads(kept.read_text())["wandb_run_id"])
        except (OSError, ValueError, KeyError, TypeError):
            rid = f"{spec.name}-{spec.training_hash()[:8]}-{secrets.token_hex(3)}"
            tmp = kept.with_suffix(".tmp")
            tmp.write_text(json.dumps({"wandb_run_id": rid}) + "\n")
            os.replace(tmp, kept)
    if len(rid) > RUN_ID_MAX:
        rid = rid[: RUN_ID_MAX - 16] + rid[-16:]  # the name cut short; the job's tag and hash kept
    return rid


# -- what the run holds ----------------------------------------------------------------------------

BLOCK, HEADER = 32768, 7  # a .wandb file is a LevelDB log: 32 KiB blocks, 7-byte record headers
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def transaction_records(path: Path) -> Iterator[bytes]:
    """The records of a `.wandb` transaction log in order, up to the first torn one (a writer
    killed mid-record leaves one at the end)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        return
    i, pending = 7, b""  # ":W&B", a 2-byte magic and a version byte; blocks count from the file's start
    while True:
        if BLOCK - i % BLOCK < HEADER:
            i += BLOCK - i % BLOCK  # a block's tail too short for a header is padding
        if i + HEADER > len(data):
            return
        _crc, n, kind = struct.unpack_from("<IHB", data, i)
        if kind not in (FULL, FIRST, MIDDLE, LAST) or i + HEADER + n > len(data):
            return
        chunk = data[i + HEADER : i + HEADER + n]
        i += HEADER + n
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        else:
            yield pending + chunk
            pending = b""


def logged_step(wandb_dir: Path, rid: str) -> int | None:
    """The newest step of run `rid` in the transaction logs under `wandb_dir` (None: none)."""
    from wandb.proto import wandb_internal_pb2 as pb

    newest = None
    for path in sorted(wandb_dir.glob(f"*run-*-{rid}/run-{rid}.wandb")):
        for raw in transaction_records(path):
            record = pb.Record()
            try:
                record.ParseFromString(raw)
            except Exception:  # protobuf's DecodeError: the rest of this file is not read
                break
            if record.WhichOneof("record_type") == "history":
                step = record.history.step.num
                newest = step if newest is None else max(newest, step)
    return newest


def writers_file(wandb_dir: Path, rid: str) -> Path:
    return wandb_dir / f"dpool-writers-{rid}.json"


def wait_for_writers(wandb_dir: Path, rid: str, timeout: float) -> None:
    """Wait (at most `timeout`) for the earlier writer of the run on this machine and its
    wandb-core to exit: they may still be writing what a killed trainer handed them."""
    import psutil

    try:
        recorded = json.loads(writers_file(wandb_dir, rid).read_text())
    except (OSError, ValueError):
        return
    procs = []
    for w in recorded if isinstance(recorded, list) else []:
        if not isinstance(w, dict) or w.get("host") != socket.gethostname() or w.get("pid") == os.getpid():
            continue
        try:
            p = psutil.Process(int(w["pid"]))
            if abs(p.create_time() - float(w["started"])) < 1.0:  # that process, not a reused pid
                procs.append(p)
        except (psutil.Error, KeyError, TypeError, ValueError):
            continue
    psutil.wait_procs(procs, timeout=timeout)


def own_tmp(wandb_dir: Path, rid: str) -> None:
    """Point this process's (and wandb-core's) temporary files at the run's own folder, emptied
    first: wandb makes two temporary folders when imported and removes them only at a clean
    interpreter exit, so a writer killed with its trainer, or one that gives up (os._exit), would
    leave them in the machine's /tmp, two per generation. The writers of this run before this one
    have exited (`wait_for_writers`): what is there is theirs."""
    tmp = wandb_dir / f"tmp-{rid}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)


def record_writers(wandb_dir: Path, rid: str) -> None:
    """Write down this writer and its wandb-core, for the next writer here to wait for."""
    import psutil

    me = psutil.Process()
    procs = [me]
    for p in me.children(recursive=True):
        try:
            if p.name().startswith("wandb-core"):
                procs.append(p)
        except psutil.Error:
            continue
    writers = [{"host": socket.gethostname(), "pid": p.pid, "started": p.create_time()} for p in procs]
    path = writers_file(wandb_dir, rid)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(writers))
    os.replace(tmp, path)


# -- rows --------------------------------------------------------------------------------------------


class Tokens:
    """mlx-lm's `trained_tokens`, the tokens trained so far: a row stands for the steps since the
    row before it (exact when every step is logged; otherwise its step's tokens times the steps it
    stands for)."""

    def __init__(self) -> None:
        self.total, self.step = 0, 0

    def add(self, step: int, tokens: int) -> int:
        if step > self.step:
            self.total += tokens * (step - self.step)
            self.step = step
        return self.total


def wandb_row(row: dict[str, Any], tokens: Tokens) -> dict[str, Any] | None:
    """A metrics row as mlx-lm's callback logs it (None: nothing W&B gets)."""
    kind, step = row.get("kind"), row["step"]
    if kind == "train":
        per_step = _int(row.get("tokens"))
        rate = _num(row.get("tokens_per_s"))
        out: dict[str, Any] = {
            "iteration": step,
            "train_loss": _num(row.get("loss"), math.nan),
            "learning_rate": _num(row.get("lr")),
            "iterations_per_second": rate / per_step if per_step else 0.0,
            "tokens_per_second": rate,
            "trained_tokens": tokens.add(step, per_step),
            "generation": _int(row.get("generation"), 1),
            "world_size": _int(row.get("world_size"), 1),
        }
        if "peak_memory" in row:
            out["peak_memory"] = _num(row["peak_memory"])
        return out
    if kind == "eval":
        out = {"iteration": step, "val_loss": _num(row.get("val_loss"), math.nan)}
        if "val_time" in row:
            out["val_time"] = _num(row["val_time"])
        return out
    if kind == "test":
        return {"iteration": step, "test_loss": _num(row.get("test_loss"), math.nan)}
    return None


def _num(v: Any, default: float = 0.0) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else default


def _int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


KIND_ORDER = {"train": 0, "eval": 1, "test": 2}  # a step's rows in the order the loop writes them


def backlog(run_dir: Path, size: int, resume_step: int) -> list[dict[str, Any]]:
    """The rows up to `resume_step`, by step: from this run dir's metrics.jsonl (its first `size`
    bytes: as the resume left it, before this generation's rows) and, where this is a slot of a
    dpd (`jobs/JOB/slot-N`), from the job's other slots here (where rank 0 ran before)."""
    files = [(run_dir / "metrics.jsonl", size)]
    if os.environ.get(ENV_JOB_ID) and run_dir.name.startswith("slot-"):
        files += [(p, None) for p in sorted(run_dir.parent.glob("slot-*/metrics.jsonl")) if p.parent != run_dir]
    rows: dict[tuple[int, str], dict[str, Any]] = {}
    for path, limit in files:
        try:
            with open(path, "rb") as f:
                data = f.read() if limit is None else f.read(limit)
        except OSError:
            continue
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash
            if isinstance(row, dict) and isinstance(step := row.get("step"), int) and step <= resume_step:
                rows.setdefault((step, str(row.get("kind"))), row)
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], KIND_ORDER.get(k[1], 9)))]


# -- the writer ----------------------------------------------------------------------------------------


class Writer:
    def __init__(self, spec: JobSpec, run_dir: Path, generation: int) -> None:
        self.spec, self.run_dir = spec, run_dir
        self.rid = run_id(spec, run_dir)
        self.dir = Path(os.environ.get("WANDB_DIR") or run_dir)  # wandb writes under DIR/wandb/
        self.wandb_dir = self.dir / "wandb"
        self.tokens, self.last = Tokens(), -1
        self.log = get_logger(job=spec.name, rank=0, generation=generation)

    def open(self) -> Any:
        r = self.spec.report
        self.wandb_dir.mkdir(parents=True, exist_ok=True)
        wait_for_writers(self.wandb_dir, self.rid, WRITER_WAIT_S)
        own_tmp(self.wandb_dir, self.rid)
        import wandb

        run = wandb.init(
            project=r.project or os.environ.get("WANDB_PROJECT") or "dpool", entity=r.entity, name=r.run_name or self.spec.name,
            id=self.rid, resume="allow", dir=str(self.dir),
            config={**self.spec.to_dict(), "training_hash": self.spec.training_hash()},
            settings=wandb.Settings(console="off", quiet=True, finish_timeout=FINISH_TIMEOUT_S),
        )
        record_writers(self.wandb_dir, self.rid)
        here = logged_step(self.wandb_dir, self.rid)
        online = run.starting_step - 1 if run.resumed and run.starting_step else -1
        self.last = max(-1 if here is None else here, online)
        self.log.info("report.opened", to="wandb", run_id=self.rid, project=run.project, holds_steps_to=self.last)
        return run

    def write(self, run: Any, row: dict[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        out = wandb_row(row, self.tokens)  # every row counts its tokens, logged or not
        if out is not None and step > self.last:
            run.log(out, step=step)


def read_rows(rows: queue.Queue[dict[str, Any] | None], ended: dict[str, int], opened: threading.Event, done: threading.Event, log: Any) -> None:
    """The trainer's lines into `rows` until the pipe closes; then bound this process's life."""
    dropped = 0
    for line in sys.stdin.buffer:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        if "end" in row:
            ended["code"] = _int(row["end"], 1)
            continue
        try:
            rows.put_nowait(row)
        except queue.Full:
            dropped += 1
    rows.put(None)
    # The trainer is gone: a run that is not open by now never will be in time (W&B unreachable),
    # and an open one has EXIT_CAP_S to log and finish. Nothing waits on this process after that.
    if not opened.wait(INIT_GRACE_S):
        log.warning("report.abandoned", to="wandb", why=f"the W&B run was not open {INIT_GRACE_S:.0f} s after the trainer ended", dropped=dropped)
        os._exit(EXIT_UNREPORTED)
    if not done.wait(EXIT_CAP_S):
        log.warning("report.abandoned", to="wandb", why=f"W&B took over {EXIT_CAP_S:.0f} s to finish the run", dropped=dropped)
        os._exit(EXIT_UNREPORTED)
    if dropped:
        log.warning("report.dropped", to="wandb", rows=dropped, why="W&B was slower than the training")


def _leave(code: int) -> NoReturn:
    """Exit while the reading thread may sit in stdin: not by a return, whose interpreter shutdown
    would meet that thread inside stdin's lock ("Fatal Python error: _enter_buffered_busy") and die
    on SIGABRT."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> int:
    configure_logging("info")
    opening = json.loads(sys.stdin.buffer.readline() or b"{}")
    spec = parse_job(opening["job"], source="the trainer's job")
    writer = Writer(spec, Path(opening["run_dir"]), int(opening.get("generation", 1)))
    rows: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_MAX)
    ended: dict[str, int] = {}
    opened, done = threading.Event(), threading.Event()
    threading.Thread(target=read_rows, args=(rows, ended, opened, done, writer.log), daemon=True).start()
    try:
        run = writer.open()
    except Exception as e:
        writer.log.warning("report.unavailable", to="wandb", error=str(e)[:500], why="training goes on without W&B")
        _leave(EXIT_UNREPORTED)
    opened.set()
    try:
        for row in backlog(Path(opening["run_dir"]), int(opening.get("backlog_bytes", 0)), int(opening.get("resume_step", 0))):
            writer.write(run, row)
        while (row := rows.get()) is not None:
            writer.write(run, row)
        # The trainer's exit: done (0) or stopped for a new membership (75) finish the run; a
        # trainer that failed or was killed marks it failed, until its next generation resumes it.
        code = ended.get("code", 1)
        run.finish(exit_code=0 if code in (0, 75) else code)
    except Exception as e:
        writer.log.warning("report.failed", to="wandb", error=str(e)[:500], why="training goes on without W&B")
        done.set()
        _leave(EXIT_UNREPORTED)
    done.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
