"""Whether a folder is a model directory as mlx-lm loads it, from its files alone (no MLX): the
trainer asks before it loads one, and dpctl asks at submit of a folder it holds, so a folder
without a config or with a damaged weights file is refused there (exit 2) rather than by every
node's trainer once the job was queued."""

from __future__ import annotations

import json
from pathlib import Path

from dpool.protocol.joberrors import one_line


def model_dir_problem(folder: Path) -> str | None:
    """What makes `folder` no model directory, or None."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file; expected a model directory as mlx-lm loads it"
    if not folder.is_dir():
        return f"no such directory on this machine ({folder})"
    if not (folder / "config.json").is_file():
        return f"{folder} has no config.json; expected a model directory as mlx-lm loads it"
    try:
        config = json.loads((folder / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        return f"{folder / 'config.json'} is not readable JSON ({one_line(e)})"
    if not isinstance(config, dict):
        return f"{folder / 'config.json'} holds a {type(config).__name__}; expected a JSON object (the model's settings)"
    if not any(folder.glob("*.safetensors")):
        return f"{folder} has no *.safetensors weights"
    return bad_weights(folder)


def bad_weights(folder: Path) -> str | None:
    """The first *.safetensors file of `folder` that is not whole, and how, read from the headers
    alone (MLX's own error names a tensor, never the file: one of a sharded model's many)."""
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                head = fh.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                size = f.stat().st_size
                if n < 2 or 8 + n > size:
                    return f"{f} is not a safetensors file (its header says {n} bytes, in a file of {size})"
                header = json.loads(fh.read(n))
            ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            return f"{f} is not a safetensors file ({type(e).__name__}: {one_line(e)})"
        if 8 + n + max(ends, default=0) > size:
            return f"{f} is cut short: its tensors end at byte {8 + n + max(ends)}, the file has {size}"
    return None
