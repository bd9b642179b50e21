"""`[report] to = ["wandb"]`: rank 0's metrics rows, reported to Weights & Biases as they are written.

Only rank 0 of the running generation reports (the rank that writes metrics.jsonl). It hands each
row to a writer process of its own (`python -m dpool.trainer.wandb_writer`, trainer/wandb_writer.py)
through a pipe it never waits on: a full pipe drops the row (with a warning), a writer that is gone
stops the reporting, and training goes on either way. The writer, not the trainer, imports wandb
and talks to W&B; a W&B that is slow, unreachable or stuck in its own exit hooks can hold neither a
step nor the trainer's exit (a wandb client in the trainer's own process held its exit 90 s when
the service could not be reached).

At the end the trainer gives the writer a bounded time to log what it holds and finish the run
(CLOSE_S); a trainer stopped for a new membership less, and a failing one none: the rows after its
checkpoint are recomputed, and the next writer logs those before it from metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

from dpool.protocol.jobspec import JobSpec
from dpool.protocol.logs import get_logger

INSTALL_HINT = "pip install 'dpool[wandb]'"
CLOSE_S = {0: 20.0, 75: 5.0}  # exit code -> how long the writer may take to finish: the job's end; a stop
END_WRITE_S = 1.0  # how long the last line may wait for room in the pipe
# What the writer needs of a row (a train row also carries shares and each rank's speed, which
# W&B does not get: a line stays within PIPE_BUF, so a write is whole or refused, never torn).
KEYS = ("kind", "step", "loss", "lr", "tokens", "tokens_per_s", "world_size", "generation", "val_loss", "test_loss")

_open: list[Reporter] = []


class ReportError(ValueError):
    """[report] cannot be honoured on this machine (exit 2, as bad input: its node sits the job out)."""


def attach(spec: JobSpec, metrics: Any, generation: int) -> None:
    """Report `metrics`' rows as `spec.report` says, when this rank writes them (rank 0)."""
    if "wandb" not in spec.report.to or not metrics.enabled:
        return
    if not _installed("wandb"):
        raise ReportError(
            f"[report] to = ['wandb']: the wandb package is not installed on this machine, which runs rank 0 (the rank that reports); {INSTALL_HINT}"
        )
    metrics.report = Reporter(spec, metrics.metrics, generation, metrics.resume_step)
    _open.append(metrics.report)


def close(code: int) -> None:
    """The trainer ends with exit `code` (0 done, 75 stopped, else failed)."""
    while _open:
        _open.pop().close(code)


def _installed(name: str) -> bool:
    """Whether `import name` can work, found without importing it (wandb takes a second)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


class Reporter:
    """The trainer's end of the pipe to its W&B writer."""

    def __init__(self, spec: JobSpec, metrics_path: Path, generation: int, resume_step: int) -> None:
        self.log = get_logger(job=spec.name, rank=0, generation=generation)
        run_dir = metrics_path.parent.resolve()  # the writer runs in it
        opening = {
            "job": spec.to_dict(), "run_dir": str(run_dir), "generation": generation, "resume_step": resume_step,
            # metrics.jsonl as the resume left it: rows the W&B run may lack are logged from it
            "backlog_bytes": metrics_path.stat().st_size if metrics_path.exists() else 0,
        }
        # Its output goes to a file of its own: the trainer's output is a pipe its dpd reads to the
        # end before it takes the trainer's exit, which the writer (and its wandb-core) must not hold.
        self.output = run_dir / "report.log"
        with open(self.output, "ab") as out:
            self.output_from = out.tell()  # this writer's lines start here (earlier generations' precede them)
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "dpool.trainer.wandb_writer"], stdin=subprocess.PIPE, stdout=out, stderr=out, cwd=str(run_dir),
            )
        assert self.proc.stdin is not None
        self.fd = self.proc.stdin.fileno()
        self.dropped, self.gone = 0, False
        self._write(orjson.dumps(opening) + b"\n", wait=END_WRITE_S)
        os.set_blocking(self.fd, False)  # from here a write is taken at once or refused

    def row(self, row: dict[str, Any], **extra: Any) -> None:
        """Hand a metrics row on (the training thread: never waits)."""
        if self.gone:
            return
        out = {k: _plain(row[k]) for k in KEYS if k in row}
        if row.get("kind") == "train":
            out["peak_memory"] = _peak_memory_gb()
        out.update((k, _plain(v)) for k, v in extra.items())
        line = orjson.dumps(out) + b"\n"
        if len(line) > select.PIPE_BUF:
            return  # not a row the writer takes (rows of KEYS are a few hundred bytes)
        try:
            os.write(self.fd, line)
        except BlockingIOError:
            self.dropped += 1
            if self.dropped == 1:
                self.log.warning("report.dropped", to="wandb", why="the W&B writer is behind; rows are dropped, training goes on")
        except OSError as e:  # the writer is gone (it could not reach W&B, or it failed)
            self.gone = True
            said = writer_error(self.output, self.output_from)
            self.log.warning("report.stopped", to="wandb", error=said or str(e), why=f"the W&B writer exited (see {self.output}); training goes on without it")

    def close(self, code: int) -> None:
        """Tell the writer the trainer's exit and let it finish the run, within CLOSE_S; a failing
        trainer leaves at once (the writer sees the pipe close and finishes by itself)."""
        if not self.gone and code in CLOSE_S:
            self._write(orjson.dumps({"end": code}) + b"\n", wait=END_WRITE_S)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]  # the writer reads to its end
        if code in CLOSE_S:
            try:
                done = self.proc.wait(CLOSE_S[code])
            except subprocess.TimeoutExpired:
                self.log.warning("report.unfinished", to="wandb", after_s=CLOSE_S[code], why=f"the W&B writer finishes by itself; the trainer does not wait longer (see {self.output})")
                return
            if done != 0 and not self.gone:
                said = writer_error(self.output, self.output_from)
                self.log.warning("report.unfinished", to="wandb", code=done, error=said,
                                 why=f"the W&B run was not written ({said or 'W&B unreachable?'}): see {self.output}")

    def _write(self, data: bytes, wait: float) -> None:
        """Write all of `data`, waiting at most `wait` seconds for room; give up quietly after."""
        view = memoryview(data)
        while view:
            _, ready, _ = select.select([], [self.fd], [], wait)
            if not ready:
                return
            try:
                view = view[os.write(self.fd, view) :]
            except BlockingIOError:
                continue
            except OSError:
                self.gone = True
                return


def _plain(v: Any) -> Any:
    """A value as JSON carries it: a number that is not finite as null (W&B gets NaN for it)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _peak_memory_gb() -> float:
    import mlx.core as mx

    return mx.get_peak_memory() / 1e9  # mlx-lm's unit


WRITER_ERRORS = ("report.unavailable", "report.failed")  # the writer's lines that say why it gave up


def writer_error(log_file: Path, start: int = 0, tail_bytes: int = 64 << 10) -> str | None:
    """The error this writer logged (`report.unavailable`/`report.failed`: no API key, no network,
    a bad entity) in its log from byte `start` (its own lines, not an earlier generation's); None
    when it logged none."""
    try:
        with open(log_file, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            entry = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(entry, dict) and entry.get("event") in WRITER_ERRORS and isinstance(entry.get("error"), str):
            return entry["error"][:300]
    return None
