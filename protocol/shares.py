"""Shares: how many sequences of each global batch each rank computes.

Shared by the coordinator (which plans a generation's first split from measured speeds) and the
trainer (which rebalances while it runs), so both split the same way. Pure; no MLX.
"""

from __future__ import annotations

import itertools

# A new split must shorten the step by this much to be worth a change (a compile of new shapes, and
# the risk of following noise). Not more: ranks that share cores (two on one core, beside one
# alone) have neighbours of their best split only 7-8% slower, one sequence moved from a rank to
# the rank it shares its core with changes nothing but who waits (trainer/balance.py).
MIN_GAIN = 0.05


def apportion(weights: list[float], total: int) -> list[int]:
    """Split `total` proportionally to `weights`, every part >= 1 (largest remainder)."""
    n = len(weights)
    if total < n:
        raise ValueError(f"cannot give {n} ranks at least one of {total} sequences")
    w = [max(x, 1e-12) for x in weights]
    exact = [total * x / sum(w) for x in w]
    parts = [int(e) for e in exact]
    order = sorted(range(n), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    for i in range(n):  # every rank keeps at least one sequence, taken from the biggest share
        if parts[i] == 0:
            parts[max(range(n), key=parts.__getitem__)] -= 1
            parts[i] = 1
    return parts


def replica_sizes(replicas: int, global_batch: int) -> list[int]:
    """diloco: the sequences of each global batch replica r trains (global_batch // replicas, one
    more for the first global_batch % replicas)."""
    base, extra = divmod(global_batch, replicas)
    return [base + (1 if r < extra else 0) for r in range(replicas)]


def replica_ranges(shares: list[int], replicas: int, global_batch: int) -> list[range]:
    """diloco: each rank's replicas, contiguous, at least one each. Shares that end on replicas'
    edges (what `replica_shares` gives) are those replicas exactly; others are apportioned by
    weight. (Apportioning shares already rounded to replicas again gave another split where the
    replicas differ in size: 32 sequences in 12 replicas, equal nodes, 18 and 14 became 21 and 11.)"""
    sizes = replica_sizes(replicas, global_batch)
    edges, first, out = list(itertools.accumulate(sizes)), 0, []
    ends = list(itertools.accumulate(shares))
    if all(s > 0 for s in shares) and set(ends) <= set(edges) and ends[-1] == edges[-1]:
        for end in ends:
            last = edges.index(end) + 1
            out.append(range(first, last))
            first = last
        return out
    for c in apportion([float(s) for s in shares], replicas):
        out.append(range(first, first + c))
        first += c
    return out


def replica_shares(shares: list[int], replicas: int, global_batch: int) -> list[int]:
    """diloco: the sequences of each global batch each rank computes under `shares`: its whole
    replicas' slices. What status and the metrics rows say, not the speeds' split; given back to
    `replica_ranges`, they are the same replicas."""
    sizes = replica_sizes(replicas, global_batch)
    return [sum(sizes[r] for r in rg) for rg in replica_ranges(shares, replicas, global_batch)]
