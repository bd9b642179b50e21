"""Writing a job back to TOML, for the trainer a daemon starts (`python -m dpool.trainer JOB.toml`).

The job travels on the wire as `JobSpec.to_dict()`; the daemon writes it into its state dir. Paths
stay as the user wrote them, with `base_dir` (the submitted job file's folder) written beside them:
the trainer resolves them on its own machine (`~` is that machine's home), and the written job has
the same `training_hash()` as the submitted one.
"""

from __future__ import annotations

import math
import os
from typing import Any

import tomli_w

from dpool.protocol.jobspec import JobSpec, parse_job


def _plain(v: Any, key: str) -> Any:
    """`v` without None (TOML has no null: an absent optional key is its default, None), checked
    writable: a non-finite float has no TOML form that reads back as the same job."""
    if isinstance(v, dict):
        return {k: _plain(x, f"{key}.{k}") for k, x in v.items() if x is not None}
    if isinstance(v, list | tuple):
        return [_plain(x, f"{key}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"cannot write {key} = {v!r} to TOML")
    return v


def dump_job(spec: JobSpec) -> str:
    """The job as a TOML document that `load_job` reads back to an equal JobSpec (base_dir aside).
    Written by tomli_w: nested tables (`[train.lr_schedule]`), lists and arrays of tables
    (`[[data.hf_dataset]]`) come out as TOML writes them."""
    data = {k: v for k, v in _plain(spec.to_dict(), "job").items() if v != {}}  # no empty [content]
    data["base_dir"] = os.path.abspath(spec.base_dir)
    head = {k: data.pop(k) for k in ("name", "priority", "base_dir") if k in data}
    return tomli_w.dumps(head) + "\n" + tomli_w.dumps(data, multiline_strings=False)


def job_from_wire(data: dict[str, Any], source: str) -> JobSpec:
    """Validate a job dict that came over the wire (raises JobFileError naming `source`)."""
    return parse_job(data, source=source)
