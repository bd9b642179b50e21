"""Writing a job back to TOML, for the trainer a daemon starts (`python -m dpool.trainer JOB.toml`).

The job travels on the wire as `JobSpec.to_dict()`; the daemon writes it into its state dir. Paths
stay as the user wrote them, with `base_dir` (the submitted job file's folder) written beside them:
the trainer resolves them on its own machine (`~` is that machine's home), and the written job has
the same `training_hash()` as the submitted one.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from dpool.protocol.jobspec import SECTIONS, JobSpec, parse_job


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v!r} to TOML")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string: JSON's escapes are TOML's
    raise TypeError(f"cannot write {type(v).__name__} to a job file")


def dump_job(spec: JobSpec) -> str:
    """The job as a TOML document that `load_job` reads back to an equal JobSpec (base_dir aside)."""
    data = spec.to_dict()
    lines = [f"name = {_value(data['name'])}", f"base_dir = {_value(os.path.abspath(spec.base_dir))}"]
    for section in SECTIONS:
        lines.append("")
        lines.append(f"[{section}]")
        for key, v in data[section].items():
            if v is not None:  # TOML has no null: an absent optional key is its default, None
                lines.append(f"{key} = {_value(v)}")
    return "\n".join(lines) + "\n"


def job_from_wire(data: dict[str, Any], source: str) -> JobSpec:
    """Validate a job dict that came over the wire (raises JobFileError naming `source`)."""
    return parse_job(data, source=source)
