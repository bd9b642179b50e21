"""Job files for tests: a tiny GPT job, with any key of any section overridden.

    write_job(tmp_path, "queued", workers={"min": 2, "max": 2}, train={"steps": 100_000})

writes `tmp_path/queued.toml`: TINY with those keys replaced. TINY trains in seconds on two cores
(one layer of width 32, 20 steps of 6 sequences, a checkpoint every 5 steps, no evaluation or
samples before step 1000); a test states only what its job needs beyond that. The file is written
by the daemon's own writer (`dump_job`) after the job is validated, so a test's bad key fails where
it is written, naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import parse_job

TINY: dict[str, dict[str, Any]] = {
    "model": {"layers": 1, "dim": 32, "heads": 2, "context": 32},
    "train": {"steps": 20, "global_batch": 6, "warmup_steps": 2, "log_every_steps": 1},
    "checkpoint": {"every_steps": 5},
    "eval": {"every_steps": 1000, "batches": 1, "sample_every_steps": 1000},
}

# TINY without its warm-up: the base of a job with a train.lr_schedule (which sets its own warm-up).
# With a constant schedule a job's curve does not depend on its number of steps: an endless job,
# cancelled once a test has seen what it waits for, is compared with a run of as many steps.
NO_WARMUP: dict[str, dict[str, Any]] = {**TINY, "train": {k: v for k, v in TINY["train"].items() if k != "warmup_steps"}}


def constant_lr(lr: float) -> dict[str, Any]:
    """A train.lr_schedule at `lr` throughout."""
    return {"name": "constant", "arguments": [lr]}


# The trainer's own tests (ring groups, no daemon): two layers of width 64, 24 sequences of 64 tokens
# a step, enough that the loss curve tells runs apart.
SMALL: dict[str, dict[str, Any]] = {
    "model": {"layers": 2, "dim": 64, "heads": 4, "context": 64},
    "train": {"global_batch": 24, "lr": 1e-3, "warmup_steps": 3, "log_every_steps": 1},
}


def job(name: str, base: dict[str, dict[str, Any]] = TINY, **sections: dict[str, Any]) -> dict[str, Any]:
    """The job `name`: `base` with the keys of each given section replaced. A `model` of another
    kind than the base's starts from nothing (the GPT's keys do not apply to it)."""
    out: dict[str, Any] = {"name": name}
    for section in base.keys() | sections.keys():
        start = base.get(section, {})
        kind = sections.get(section, {}).get("kind")
        if section == "model" and kind is not None and kind != start.get("kind", "gpt"):
            start = {}
        out[section] = {**start, **sections.get(section, {})}
    return out


def write_job(folder: Path, name: str, *, file: str | None = None, base: dict[str, dict[str, Any]] = TINY, **sections: dict[str, Any]) -> Path:
    """`job(name, base, **sections)` written to `folder/file` (default: `folder/NAME.toml`)."""
    path = folder / (file or f"{name}.toml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_job(parse_job(job(name, base, **sections), source=str(path), base_dir=str(folder))))
    return path
