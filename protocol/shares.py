"""Shares: how many sequences of each global batch each rank computes.

Shared by the coordinator (which plans a generation's first split from measured speeds) and the
trainer (which rebalances while it runs), so both split the same way. Pure; no MLX.
"""

from __future__ import annotations

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


def replica_ranges(shares: list[int], replicas: int) -> list[range]:
    """diloco: each rank's replicas, contiguous ranges in proportion to its share, at least one each."""
    out, first = [], 0
    for c in apportion([float(s) for s in shares], replicas):
        out.append(range(first, first + c))
        first += c
    return out


def replica_shares(shares: list[int], replicas: int, global_batch: int) -> list[int]:
    """diloco: the sequences of each global batch each rank computes under `shares`: its whole
    replicas' slices (replica r's is global_batch // replicas, one more for the first
    global_batch % replicas). What status and the metrics rows say, not the speeds' split."""
    base, extra = divmod(global_batch, replicas)
    return [sum(base + (1 if r < extra else 0) for r in rg) for rg in replica_ranges(shares, replicas)]
