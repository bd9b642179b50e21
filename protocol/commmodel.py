"""What an all_sum costs on a ring, from each link's bandwidth and latency. Pure, no MLX.

MLX's ring all_sum is a reduce-scatter then an all-gather: each rank sends and receives
2(n-1)/n of the buffer, in 2(n-1) hops. Measured on shaped links (DESIGN.md: 3 ranks in network
namespaces), links carry about 90% of nominal, and

    seconds = 2(n-1)/n x bytes / (0.9 x bandwidth) + 2(n-1) x latency

predicts the measured all_sum within about 10%. The ring goes as fast as its slowest link. A
buffer cut into buckets pays the latency term once per bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LINK_EFFICIENCY = 0.9  # the share of a link's nominal bandwidth a ring all_sum reaches
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_bps: float  # bits per second, as measured or as nominal
    latency_s: float  # one way


def ring_seconds(nbytes: float, ranks: int, link: Link, bucket_bytes: float | None = None) -> float:
    """Seconds one all_sum of `nbytes` takes on a ring of `ranks` whose slowest link is `link`."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(nbytes / bucket_bytes)) if bucket_bytes else 1
    moved = 2 * (ranks - 1) / ranks * nbytes * 8
    return moved / (LINK_EFFICIENCY * link.bandwidth_bps) + buckets * 2 * (ranks - 1) * link.latency_s


def slowest(links: list[Link]) -> Link:
    """The ring's pace: the lowest bandwidth, with the highest latency among the links."""
    return Link(min(x.bandwidth_bps for x in links), max(x.latency_s for x in links))


def comm_share(comm_s: float, compute_s: float) -> float:
    """The share of a step spent in all_sum (a blocking all_sum adds to the compute)."""
    total = comm_s + compute_s
    return comm_s / total if total > 0 else 0.0
