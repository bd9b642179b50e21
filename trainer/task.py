"""What the loop trains, behind one small interface: a model kind.

The loop, the step, the checkpoints and the collectives never ask which kind they train. A kind
(the built-in GPT in `gpt_task.py`, an mlx-lm model in `lm.py`) gives:

- `model`: the nn.Module, with what it trains unfrozen (`trainable_parameters()` is what the
  optimizer updates, what the collectives carry and what a checkpoint holds);
- `examples(step, start, count)`: examples [start, start + count) of global batch `step`, chosen by
  (seed, step) alone; `val_examples(indices)` the same for the held-out set of `val_count`;
- `fingerprints`: content hashes (data, model) that every rank must share;
- `sample(step)`, `export(out)`, and a few facts for logs and manifests.

An example is a token sequence, the offset where its trained tokens start (the prompt before it is
masked) and its identity (for per-example randomness such as LoRA dropout). `pack` turns a rank's
examples into micro batches: grouped by length to pad less (sums do not depend on order), padded
as mlx-lm pads, with the [offset, length] pairs that mlx-lm's loss masks with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.nn as nn
import numpy as np

from dpool.protocol.jobspec import JobSpec


def source_named(spec: JobSpec, what: str) -> tuple[str, str]:
    """The job's key and value behind fingerprint `what` ("data", "model", "adapters"), for errors."""
    if what == "data" and spec.data.hf_dataset is not None:
        return "data.hf_dataset", ", ".join(d.path for d in spec.data.hf_dataset)
    if what == "data":
        return "data.source", spec.data.source
    if what == "test":
        return "data.source (its test.jsonl)", spec.data.source
    if what == "adapters":
        return "model.adapters", str(spec.model.adapters)
    return "model.path", str(spec.model.path)


@dataclass(frozen=True, slots=True)
class Example:
    tokens: np.ndarray  # int32, 1-D
    offset: int  # trained targets start at this token (0: every token)
    ident: int  # the example's index in its split: seeds its dropout, whatever the split of the batch


@dataclass(frozen=True, slots=True)
class MicroBatch:
    tokens: np.ndarray  # (B, W) int32, zero-padded
    lengths: np.ndarray  # (B, 2) int32: [offset, length] per row, as mlx-lm's default_loss reads them
    idents: np.ndarray  # (B,) int64


class Task(Protocol):
    model: nn.Module
    val_count: int
    fingerprints: dict[str, int]
    pad_to: int  # micro batches are padded to 1 + a multiple of this (bounded compiled shapes)
    width_cap: int  # and never wider than this

    def examples(self, step: int, start: int, count: int) -> list[Example]: ...

    def val_examples(self, indices: list[int]) -> list[Example]: ...

    def sample(self, step: int) -> str: ...

    def export(self, out: Path) -> list[str]: ...

    def describe(self) -> dict[str, Any]: ...

    def data_position(self, step: int) -> dict[str, int]: ...

    def set_dropout_keys(self, keys: Any) -> None: ...


def pack(examples: list[Example], micro: int, pad_to: int, width_cap: int) -> list[MicroBatch]:
    """Micro batches of at most `micro` examples, shortest first, each padded as mlx-lm pads:
    to 1 + a multiple of `pad_to` tokens, at most `width_cap`; longer examples are truncated."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].tokens), i))
    out = []
    for first in range(0, len(order), micro):
        rows = [examples[i] for i in order[first : first + micro]]
        longest = max(len(r.tokens) for r in rows)
        width = min(1 + pad_to * math.ceil(longest / pad_to), width_cap)
        tokens = np.zeros((len(rows), width), dtype=np.int32)
        lengths = np.zeros((len(rows), 2), dtype=np.int32)
        for j, r in enumerate(rows):
            n = min(len(r.tokens), width)
            tokens[j, :n] = r.tokens[:n]
            lengths[j] = (r.offset, n)
        out.append(MicroBatch(tokens, lengths, np.array([r.ident for r in rows], dtype=np.int64)))
    return out


def build_task(spec: JobSpec, cache_dir: Path, *, with_data: bool = True) -> Task:
    """The job's kind. `with_data=False` builds the model only (export, probes)."""
    if spec.model.kind == "mlx_lm":
        from dpool.trainer.lm import LMTask

        return LMTask(spec, cache_dir, with_data=with_data)
    from dpool.trainer.gpt_task import GPTTask

    return GPTTask(spec, cache_dir, with_data=with_data)
