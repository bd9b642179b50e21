"""Collectives: the group, one fused all_sum for a step, and broadcast from rank 0.

MLX has no broadcast; `all_sum(x if rank == 0 else zeros)` gives bit-identical copies. Small
all_sums are latency-bound (DESIGN.md: ~0.07 GB/s at 4 KB, ~0.95 GB/s at 16 MB), so everything a
step exchanges travels in as few buffers as possible: one per dtype.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx


class Group:
    """The MLX group, or a one-rank stand-in when the process runs alone."""

    def __init__(self) -> None:
        if os.environ.get("MLX_HOSTFILE") and os.environ.get("MLX_RANK") is not None:
            # Blocks until every peer has connected (the daemon's start-up deadline covers a peer
            # that never comes).
            self.group: mx.distributed.Group | None = mx.distributed.init(backend="ring", strict=True)
            self.rank, self.size = self.group.rank(), self.group.size()
        else:
            self.group, self.rank, self.size = None, 0, 1

    def all_sum(self, x: mx.array) -> mx.array:
        if self.group is None or self.size == 1:
            return x
        return mx.distributed.all_sum(x, group=self.group)

    def all_sum_fused(self, arrays: Sequence[mx.array]) -> list[mx.array]:
        """all_sum many arrays with one collective per dtype; returns them in the same shapes."""
        if self.group is None or self.size == 1:
            return list(arrays)
        by_dtype: dict[mx.Dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        out: list[mx.array | None] = [None] * len(arrays)
        for idx in by_dtype.values():
            flat = mx.concatenate([arrays[i].reshape(-1) for i in idx])
            summed = mx.distributed.all_sum(flat, group=self.group)
            offset = 0
            for i in idx:
                n = arrays[i].size
                out[i] = summed[offset : offset + n].reshape(arrays[i].shape)
                offset += n
        return out  # type: ignore[return-value]

    def broadcast(self, arrays: Sequence[mx.array]) -> list[mx.array]:
        """Rank 0's arrays on every rank (others pass arrays of the right shapes and dtypes)."""
        if self.group is None or self.size == 1:
            return list(arrays)
        sent = arrays if self.rank == 0 else [mx.zeros_like(a) for a in arrays]
        return self.all_sum_fused(sent)

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """A few integers from rank 0 (exact: int64)."""
        x = mx.array(list(values), dtype=mx.int64)
        (y,) = self.broadcast([x])
        return [int(v) for v in y.tolist()]

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        x = self.all_sum(mx.array(list(values), dtype=mx.int64))
        return [int(v) for v in x.tolist()]
