"""The error of a job file that cannot be used, shared by the TOML job file (jobspec.py) and the
mlx-lm config it may be made from (mlxlm_config.py); reading either, bounded; and `one_line`, for
the libraries' errors that such a message quotes."""

from __future__ import annotations

import os
import stat
from typing import Any

JOB_FILE_MAX_BYTES = 1 << 20  # a job file is a few KB; a device, a pipe or a data file given by mistake is not one


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


class JobFileError(ValueError):
    """A job file that cannot be used; the message is meant for the user as it is."""

    def __init__(self, source: str, key: str, given: Any, allowed: str, *, said: str | None = None) -> None:
        """`said`: the whole message after the file's name, for what is no key's value (a file
        that is not TOML)."""
        self.source, self.key, self.given, self.allowed = source, key, given, allowed
        written = as_written(given)
        shown = "missing" if given is MISSING else f"= {written if len(written) <= 200 else written[:197] + '...'}"
        super().__init__(f"{source}: {said or f'{key} {shown}: {allowed}'}")


def as_written(value: Any, depth: int = 0) -> str:
    """A value as a job file spells it (TOML): true, not True; a table as {b = 1}, not {'b': 1}.
    Strings keep Python's quoting (single quotes, escapes shown), so a control character in one
    stays visible. Long lists and deep tables are cut (the message is one line)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if depth > 3:
        return "..."
    if isinstance(value, dict):
        items = [f"{k} = {as_written(v, depth + 1)}" for k, v in list(value.items())[:8]]
        return "{" + ", ".join(items + (["..."] if len(value) > 8 else [])) + "}"
    if isinstance(value, list | tuple):
        items = [as_written(v, depth + 1) for v in value[:8]]
        return "[" + ", ".join(items + (["..."] if len(value) > 8 else [])) + "]"
    return repr(value)


def one_line(e: BaseException) -> str:
    """An exception's message on one line (a tokenizer's or YAML's error runs over several)."""
    return " ".join(str(e).split())


def read_job_file(path: str) -> bytes:
    """A job file's bytes: a regular file of at most JOB_FILE_MAX_BYTES (JobFileError otherwise, so
    that `/dev/zero` or a FIFO given by mistake is refused instead of read forever)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer must not block the open
    except FileNotFoundError:
        raise JobFileError(path, "file", path, "no such file") from None
    except OSError as e:
        raise JobFileError(path, "file", path, f"cannot be read ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise JobFileError(path, "file", path, "is a directory; give the job file (a .toml, or an mlx_lm .yaml config)")
        if not stat.S_ISREG(mode):
            raise JobFileError(path, "file", path, "is not a regular file; give the job file (a .toml, or an mlx_lm .yaml config)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(JOB_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise JobFileError(path, "file", path, f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > JOB_FILE_MAX_BYTES:
        raise JobFileError(path, "file", path, f"is larger than {JOB_FILE_MAX_BYTES >> 20} MiB; a job file is a few KB")
    return data
