"""Rank 0's metrics.jsonl and samples.jsonl."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson


class MetricsLog:
    """Rank 0's metrics.jsonl and samples.jsonl; rows past the resume step are dropped on resume.
    `report` (trainer/report.py, set by `report.attach`) gets each metrics row as it is written."""

    def __init__(self, run_dir: Path, resume_step: int, enabled: bool):
        self.enabled, self.resume_step = enabled, resume_step
        self.report: Any = None
        self.metrics, self.samples = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
        if enabled:
            for path in (self.metrics, self.samples):
                self._truncate_after(path, resume_step)

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        """Keep the rows of steps 0..`step`: a fresh start (0) keeps none, so its own evaluation at
        step 0 is not written twice; a line that is no row (torn by a crash mid-write, or edited)
        goes too."""
        if not path.exists():
            return
        keep = []
        for line in path.read_bytes().splitlines():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            at = row.get("step") if isinstance(row, dict) else None
            if type(at) is int and 0 <= at <= step and step > 0:
                keep.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in keep))
        os.replace(tmp, path)

    def append(self, path: Path, row: dict[str, Any], **report: Any) -> None:
        """Write `row`; a metrics row goes on to the report too, with `report`'s figures that the
        row does not carry (an evaluation's `val_time`)."""
        if self.enabled:
            with open(path, "ab") as f:
                f.write(orjson.dumps(row) + b"\n")
            if self.report is not None and path == self.metrics:
                self.report.row(row, **report)

    def sample(self, step: int, text: str, link: Any) -> None:
        """Rank 0's generated sample of `step`: to samples.jsonl, and to the daemon (`link`) if any."""
        row = {"step": step, "text": text}
        self.append(self.samples, row)
        if link:
            link.sample(row)

    def catch_up(self, group: Any, spec: Any, start: int, ended: Any, link: Any, evaluate: Any, task: Any) -> None:
        """At a resume from `start` (> 0), by hand: the evaluation and sample due at the step (or
        outer step: the global steps `ended`) that ended there, when the files lack them. Under a
        daemon rank 0's files may be another slot's, and the pool's own record (resume_max) keeps
        a resume from passing what it has not recorded."""
        by_hand, final = link is None, start == spec.train.steps
        due_eval = by_hand and (final or any(s % spec.eval.every_steps == 0 for s in ended))
        due_sample = by_hand and (final or any(s % spec.eval.sample_every_steps == 0 for s in ended))
        redo_eval, redo_sample = self.unwritten(group, start, due_eval, due_sample)
        if redo_eval:
            evaluate(start)
        if redo_sample and group.rank == 0:
            self.sample(start, task.sample(start), link)

    def unwritten(self, group: Any, step: int, eval_due: bool, sample_due: bool) -> tuple[bool, bool]:
        """At a resume from `step`: whether its evaluation and its sample, due at that step, are
        not in the files. A run stopped after it handed that step's checkpoint to its writer and
        before it wrote them (an evaluation takes a while) resumes there, and the rows were lost.
        Rank 0 holds the files; every rank gets its answer (the evaluation is collective)."""
        held: set[str] = set()
        if self.enabled:
            for path, kind in ((self.metrics, "eval"), (self.samples, "sample")):
                if path.exists() and any(_row_is(line, kind, step) for line in path.read_bytes().splitlines()):
                    held.add(kind)
        want = [int(eval_due and "eval" not in held), int(sample_due and "sample" not in held)]
        eval_missing, sample_missing = group.broadcast_ints(want)
        return bool(eval_missing), bool(sample_missing)


def _row_is(line: bytes, kind: str, step: int) -> bool:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return isinstance(row, dict) and row.get("step") == step and (kind == "sample" or row.get("kind") == kind)
