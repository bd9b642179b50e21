"""The ring's pace, measured once per group, right after it forms: a few timed all_sums.

What it measures is the ring, not each link: a ring all_sum goes as fast as its slowest link
(protocol/commmodel.py). MLX's ring backend also has `send`/`recv`, but only between direct
neighbours, each one blocking its rank's stream until the bytes are written (mlx ring.cpp: "Send
only supported to direct neighbors"), so timing each link alone needs the ranks to take turns, one
link per round; not done here. The coordinator gives the ring's figures to each pair of
neighbouring nodes, marked `source: "ring"` (daemon/links.py).

How, on every rank alike (every decision comes from rank 0, so all ranks run the same collectives):

1. one tiny all_sum to wake the ring's socket threads (not counted);
2. LATENCY_SAMPLES tiny all_sums: a tiny all_sum is 2(n-1) hops of latency, so the latency is
   their median over 2(n-1);
3. one SMALL_BYTES all_sum for a first guess of the bandwidth;
4. rank 0 sizes the bandwidth samples from that guess so each takes about SAMPLE_S, between
   SMALL_BYTES and BIG_BYTES, and only while the probe stays within BUDGET_S (on a slow link it
   shrinks them, or skips them and keeps the first guess); MLX sums a buffer of at least
   n x 512 KiB both ways round the ring at once, as a step's large all_sums go, so a sample is
   made at least that large when the budget allows (a smaller one goes one way: on a full-duplex
   link it reads up to twice too slow);
5. the faster of two samples gives the bandwidth, with the latency taken out, in the ring model's
   terms (90% link efficiency), so that `ring_seconds` gives back what was timed.

Measured on loopback (2 cores, 2 and 3 ranks): about 10-20 ms in all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from dpool.protocol.commmodel import LINK_EFFICIENCY

LATENCY_SAMPLES = 5
SMALL_BYTES = 64 << 10
BIG_BYTES = 4 << 20
BOTH_WAYS_BYTES = 512 << 10  # per rank: MLX's ring sums a buffer of n x this both ways round
SAMPLE_S = 0.04  # a bandwidth sample aims at this long
BUDGET_S = 0.3  # the probe never plans past this
MAX_BPS, MIN_BPS = 1e13, 1.0  # the protocol's bounds of a bandwidth


@dataclass(frozen=True, slots=True)
class Probe:
    bandwidth_bps: float
    latency_s: float
    bytes: int  # the largest all_sum timed
    seconds: float  # the whole probe


def probe(all_sum: Callable[[mx.array], mx.array], rank: int, ranks: int, clock: Callable[[], float] = time.perf_counter) -> Probe:
    """Time the ring of `ranks` ranks through `all_sum` (the group's own, as a step calls it)."""
    t0 = clock()

    def timed(nbytes: int) -> float:
        x = mx.ones((max(ranks, nbytes // 4),), dtype=mx.float32)
        mx.eval(x)
        start = clock()
        mx.eval(all_sum(x))
        return clock() - start

    def from_rank0(value: int) -> int:
        """Rank 0's integer on every rank, exactly (an all_sum where the others give 0)."""
        x = mx.array([value if rank == 0 else 0] + [0] * (ranks - 1), dtype=mx.int64)
        return int(all_sum(x)[0].item())

    hops = 2 * (ranks - 1)
    timed(4 * ranks)  # wakes the socket threads
    latency = statistics.median(timed(4 * ranks) for _ in range(LATENCY_SAMPLES)) / hops
    small = timed(SMALL_BYTES)
    bps = _bandwidth(SMALL_BYTES, small, ranks, latency)
    best, biggest = bps, SMALL_BYTES
    # Rank 0 decides how large the samples are (and whether to take them), from its own figures.
    size = _sample_bytes(bps, ranks, latency, BUDGET_S - (clock() - t0)) if rank == 0 else 0
    size = from_rank0(size)
    if size:
        times = [timed(size) for _ in range(2)]
        best, biggest = _bandwidth(size, min(times), ranks, latency), size
    return Probe(bandwidth_bps=best, latency_s=latency, bytes=biggest, seconds=clock() - t0)


def _bandwidth(nbytes: int, seconds: float, ranks: int, latency: float) -> float:
    """The link bandwidth (bits/s) under which the ring model gives `seconds` for this all_sum: the
    latency term taken out (at most half of what was timed: a sample is never all latency)."""
    moved = 2 * (ranks - 1) / ranks * nbytes * 8
    transfer = max(seconds - 2 * (ranks - 1) * latency, seconds / 2, 1e-9)
    return min(MAX_BPS, max(MIN_BPS, moved / (LINK_EFFICIENCY * transfer)))


def _sample_bytes(bps: float, ranks: int, latency: float, budget_s: float) -> int:
    """Bytes of each of the two bandwidth samples (0: none; the first guess stands): about SAMPLE_S
    each at the guessed pace, at least both ways round the ring, within BIG_BYTES, and both within
    `budget_s`."""
    per_byte = 2 * (ranks - 1) / ranks * 8 / (LINK_EFFICIENCY * bps)
    size = max(int(SAMPLE_S / per_byte), BOTH_WAYS_BYTES * ranks)
    size = min(size, BIG_BYTES)
    while size > SMALL_BYTES and 2 * (size * per_byte + 2 * (ranks - 1) * latency) > budget_s:
        size //= 2
    return size if size > SMALL_BYTES else 0
