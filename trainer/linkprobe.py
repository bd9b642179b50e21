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
3. bandwidth samples from FIRST_BYTES up, four times larger each, until one moves its bytes for
   SAMPLE_S (and at least as long as the ring's latency costs the all_sum, so that the latency's
   own noise cannot swamp it) and is at least n x 512 KiB (MLX sums a buffer that large both ways
   round the ring at once, as a step's large all_sums go; a smaller one goes one way, which on a
   full-duplex link reads up to twice too slow), or BIG_BYTES; then once more at that size. A
   sample is taken only when its transfer, guessed from the one before as that one's time less
   the latency, scaled by its size, fits what is left of BUDGET_S: a first guess from a small
   buffer is no guide (a shaper's burst, the socket buffers let it through fast; on a 100 Mbit/s
   link shaped with a 128 KB burst, sizing from a 64 KiB sample took 0.95 s), a grown one is.
   The budget counts the time spent moving bytes, not the latency each all_sum pays whatever its
   size: on a ring with 5-10 ms between hosts (Wi-Fi, a VPN between two homes) every sample of 3
   ranks costs 20-40 ms of latency, and counting it stopped the probe at 16 KiB, where a sample
   is all latency (it read a 300 Mbit/s link with 8 ms as 12 Mbit/s). No sample starts that
   would end past MAX_S. A sample far slower per byte than the size before (a lost segment's
   retransmission timeout) is taken again before it counts, and only the faster of the two is
   charged to the budget;
4. the faster sample of the largest size gives the bandwidth, with the latency taken out, in the
   ring model's terms (90% link efficiency), so that `ring_seconds` gives back what was timed.

Measured (2 cores): 10-40 ms on loopback with 2 and 3 ranks; 0.25-0.3 s on a 100 Mbit/s link (tbf);
for 3 ranks in network namespaces on one bridge, where the ring is CPU-bound (1-9 ms a hop),
0.3-0.7 s unshaped and at 1 Gbit/s, 0.3-1.1 s at 300 Mbit/s (tbf: samples taken again). On the
ring model, with 3 ranks: 0.4 s at 300 Mbit/s with 3 ms, 0.7-0.8 s with 8-10 ms.
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
SAMPLE_S = 0.04  # a bandwidth sample that moves its bytes this long is a measurement
BUDGET_S = 0.25  # seconds of moving bytes: no sample whose transfer would end past this (one runs over its guess: ~0.3 s)
MAX_S = 2.0  # the whole probe, latency included: no sample is taken that would end past this
STALL = 2.0  # a sample this many times slower per byte than the size before is taken again ...
STALL_MIN_S = 0.005  # ... when it moved its bytes this long at least (a shorter one is cheap to trust)
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
    fixed = hops * latency  # what every all_sum pays, whatever its size
    size, times = FIRST_BYTES, [timed(FIRST_BYTES)]
    moved = 0.0  # the budget spent by the sizes done: each size's faster sample (a stall is not charged)
    pace: float | None = None  # seconds per byte moved of the size before (None: none, or all latency)
    while True:
        # Rank 0 says what comes next (0: done), from its own figures; every rank follows.
        left = BUDGET_S - moved - _transfer(min(times), fixed)
        nxt = _next_bytes(size, times, ranks, fixed, left, MAX_S - (clock() - t0), pace) if rank == 0 else 0
        nxt = from_rank0(nxt)
        if not nxt:
            break
        if nxt != size:
            best = _transfer(min(times), fixed)
            moved, pace, times = moved + best, (best / size if best > 0 else None), []
        times.append(timed(nxt))
        size = nxt
    bps = _bandwidth(size, min(times), ranks, latency)
    return Probe(bandwidth_bps=bps, latency_s=latency, bytes=size, seconds=clock() - t0)


def _transfer(seconds: float, fixed: float) -> float:
    """The part of a sample spent moving bytes: its time less the latency every all_sum pays."""
    return max(seconds - fixed, 0.0)


def _bandwidth(nbytes: int, seconds: float, ranks: int, latency: float) -> float:
    """The link bandwidth (bits/s) under which the ring model gives `seconds` for this all_sum: the
    latency term taken out (at most three quarters of what was timed: the latency is a median of
    tiny all_sums, and a sample is never all latency)."""
    moved = 2 * (ranks - 1) / ranks * nbytes * 8
    transfer = max(seconds - 2 * (ranks - 1) * latency, seconds / 4, 1e-9)
    return min(MAX_BPS, max(MIN_BPS, moved / (LINK_EFFICIENCY * transfer)))


def _next_bytes(
    size: int, times: list[float], ranks: int, fixed: float, budget_s: float, time_left_s: float, pace: float | None = None,
) -> int:
    """The next sample's bytes (0: none). GROWTH times larger until a sample moves its bytes for
    SAMPLE_S (and for at least the `fixed` latency of an all_sum) going both ways round the ring,
    or reaches BIG_BYTES; then the same size once more. Each only when its transfer (the best at
    this size, scaled) fits `budget_s` and its whole time `time_left_s`. A sample that moved its
    bytes for STALL_MIN_S and STALL times slower per byte than the size before (`pace`; or with
    no size before to compare) is looked at again whatever the budget, within `time_left_s`: one
    lost segment waits out TCP's retransmission timeout (200 ms at least), and read alone it made
    a 300 Mbit/s link 25 Mbit/s."""
    last = _transfer(min(times), fixed)

    def fits(nbytes: int) -> bool:
        guess = last * nbytes / size
        return guess <= budget_s and fixed + guess <= time_left_s

    if len(times) == 1 and last >= STALL_MIN_S and (pace is None or last > STALL * pace * size):
        return size if fixed + last <= time_left_s else 0

    grown = size >= BIG_BYTES or (size >= BOTH_WAYS_BYTES * ranks and last >= max(SAMPLE_S, fixed))
    again = size if len(times) < 2 and fits(size) else 0
    if grown:
        return again
    nxt = min(size * GROWTH, BIG_BYTES)
    return nxt if fits(nxt) else again
