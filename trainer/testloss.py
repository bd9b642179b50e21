"""The test loss: what `mlx_lm lora --test` reports, computed by the pool at the end of training
(`[eval] test = true`) or for a checkpoint (`dpctl test`, the trainer's `--test`).

mlx-lm's `evaluate` sums the per-token losses of its batches and divides by their tokens, each
example truncated to max_seq_length and masked from its offset (mask_prompt) as in training. The
sum does not depend on how the examples are grouped, so each rank scores its share of each global
batch of the chosen examples (`LMTask.test_indices`) and the pool all_sums, as for the validation
loss: the result is the same on any number of ranks.
"""

from __future__ import annotations

import math
from typing import Any

from dpool.protocol.jobspec import JobSpec
from dpool.trainer.data import split_shares
from dpool.trainer.dist import Group
from dpool.trainer.step import held_out_loss
from dpool.trainer.task import pack


def test_loss(spec: JobSpec, task: Any, group: Group, shares: list[int], micro: int) -> tuple[float, int]:
    """(test loss, examples scored) of the task's model as it is now; every rank calls it."""
    chosen = task.test_indices()
    offset, share = split_shares(shares)[group.rank]
    gb = spec.train.global_batch
    mine = [j for p, j in enumerate(chosen) if offset <= p % gb < offset + share]
    batches = pack(task.test_examples(mine), max(1, micro), task.pad_to, task.width_cap)
    return held_out_loss(task.model, batches, group), len(chosen)


def report_test(spec: JobSpec, task: Any, group: Group, shares: list[int], micro: int, step: int, metrics: Any, link: Any, log: Any) -> None:
    """The end of training: the test loss as a metrics row of kind "test" (rank 0 writes and reports it)."""
    loss, count = test_loss(spec, task, group, shares, micro)
    row = {"kind": "test", "step": step, "test_loss": loss}
    metrics.append(metrics.metrics, row)
    if group.rank == 0:
        log.info("test.done", step=step, test_loss=round(loss, 4), test_ppl=round(math.exp(min(loss, 700)), 4), examples=count)
        if link:
            link.metric(row)
