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
3. bandwidth samples from FIRST_BYTES up, four times larger each, until one takes SAMPLE_S and
   is at least n x 512 KiB (MLX sums a buffer that large both ways round the ring at once, as a
   step's large all_sums go; a smaller one goes one way, which on a full-duplex link reads up to
   twice too slow), or BIG_BYTES; then once more at that size. A sample is taken only when the
   one before, four times over, still fits the probe's BUDGET_S: a first guess from a small
   buffer is no guide (a shaper's burst, the socket buffers let it through fast; on a 100 Mbit/s
   link shaped with a 128 KB burst, sizing from a 64 KiB sample took 0.95 s), a grown one is;
4. the faster sample of the largest size gives the bandwidth, with the latency taken out, in the
   ring model's terms (90% link efficiency), so that `ring_seconds` gives back what was timed.

Measured (2 cores): 10-40 ms on loopback with 2 and 3 ranks; 0.25-0.3 s on a 100 Mbit/s link (tbf).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from dpool.protocol.commmodel import LINK_EFFICIENCY

LATENCY_SAMPLES = 5
FIRST_BYTES = 16 << 10  # the first bandwidth sample: 0.15 s at 1 Mbit/s
GROWTH = 4
BIG_BYTES = 4 << 20
BOTH_WAYS_BYTES = 512 << 10  # per rank: MLX's ring sums a buffer of n x this both ways round
SAMPLE_S = 0.04  # a bandwidth sample this long is a measurement
BUDGET_S = 0.25  # the probe takes no sample that would end past this (a sample runs over its guess: it ends by ~0.3 s)
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
    size, times = FIRST_BYTES, [timed(FIRST_BYTES)]
    while True:
        # Rank 0 says what comes next (0: done), from its own figures; every rank follows.
        nxt = _next_bytes(size, times, ranks, BUDGET_S - (clock() - t0)) if rank == 0 else 0
        nxt = from_rank0(nxt)
        if not nxt:
            break
        times = (times if nxt == size else []) + [timed(nxt)]
        size = nxt
    bps = _bandwidth(size, min(times), ranks, latency)
    return Probe(bandwidth_bps=bps, latency_s=latency, bytes=size, seconds=clock() - t0)


def _bandwidth(nbytes: int, seconds: float, ranks: int, latency: float) -> float:
    """The link bandwidth (bits/s) under which the ring model gives `seconds` for this all_sum: the
    latency term taken out (at most half of what was timed: a sample is never all latency)."""
    moved = 2 * (ranks - 1) / ranks * nbytes * 8
    transfer = max(seconds - 2 * (ranks - 1) * latency, seconds / 2, 1e-9)
    return min(MAX_BPS, max(MIN_BPS, moved / (LINK_EFFICIENCY * transfer)))


def _next_bytes(size: int, times: list[float], ranks: int, budget_s: float) -> int:
    """The next sample's bytes (0: none): GROWTH times larger until a sample takes SAMPLE_S and
    goes both ways round the ring, or BIG_BYTES; then the same size once more; each only when it
    would end within `budget_s` (its time taken as the last one's, scaled by its size)."""
    last = times[-1]
    grown = size >= BIG_BYTES or (last >= SAMPLE_S and size >= BOTH_WAYS_BYTES * ranks)
    if grown:
        return size if len(times) < 2 and last <= budget_s else 0
    nxt = min(size * GROWTH, BIG_BYTES)
    return nxt if last * nxt / size <= budget_s else (size if len(times) < 2 and last <= budget_s else 0)
