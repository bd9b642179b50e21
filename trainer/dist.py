"""Collectives: the group, a step's all_sum in buckets, and broadcast from rank 0.

MLX has no broadcast; `all_sum(x if rank == 0 else zeros)` gives bit-identical copies. Small
all_sums are latency-bound (DESIGN.md: ~0.07 GB/s at 4 KB, ~0.95 GB/s at 16 MB), so everything a
step exchanges travels in as few buffers as possible: one per dtype, cut into buckets of at most
BUCKET_BYTES so a large model needs no second full copy of its gradients. Ranks that share a machine
get their share of its cores, wait for each other asleep, and, when the whole group is on one
machine, sum in pieces that go one way round the ring (trainer/colocate.py).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Sequence

import mlx.core as mx

from dpool.protocol.commmodel import BUCKET_BYTES
from dpool.protocol.logs import get_logger
from dpool.trainer.colocate import (
    BARRIER_ENV,
    QUIET_ENV,
    LocalBarrier,
    RingSetupError,
    barrier_address,
    colocated,
    one_way_bytes,
    quiet_ring,
    read_hostfile,
    split_address,
    split_blas_threads,
    usable_cores,
)
from dpool.trainer.linkprobe import Probe, probe
from dpool.trainer.listening import last_rank_apart, wait_for_listeners

# The last rank calls the ring's init this long after the others (Group.__init__ says why).
LAST_RANK_DELAY_S = 0.020
LISTEN_WAIT_S = 1.0  # the most the last rank waits for the ports of the ranks on its machine
# The most one all_sum carries (Group.all_sum_fused) is BUCKET_BYTES (protocol/commmodel.py, 32
# MiB, as mlx-lm's `average_gradients`): the ring model's prediction charges latency per bucket.
PROBE_ENV = "DPOOL_LINK_PROBE"  # "0": no start-up probe of the ring (every rank must agree)


class Group:
    """The MLX group, or a one-rank stand-in when the process runs alone.

    Built when the process learns its place: from MLX_RANK and MLX_HOSTFILE in os.environ at
    construction (a warm trainer sets them after importing MLX), not at import.

    Start-up order. MLX's ring connects rank r to r + 1 (mlx/distributed/ring/ring.cpp): ranks
    0..n-2 listen first, the last rank connects to rank 0 first, and a refused connect is retried
    only after 1 s. Ranks that call init at the same moment (warm trainers, assigned at once) hit
    that retry most of the time, because the last rank connects before rank 0 listens. So the last
    rank calls init LAST_RANK_DELAY_S later. Measured on 2 cores (bench/ringstart.py, BENCHMARKS.md
    "Ring start-up"; median / worst of 9 starts, from the moment the ranks were told to start):

        3 ranks, all at once            1.04 / 1.09 s   (6 of 9 retried)
        3 ranks, the last 5 ms later    0.05 / 0.06 s   (none)
        3 ranks, the last 20 ms later   0.06 / 0.07 s   (none)
        2 and 4 ranks, the last 20 ms later   0.04 / 0.05 s and 0.08 / 0.11 s   (none)

    5 ms is enough on an idle machine, not on a busy one (two busy loops on the 2 cores): there
    the last rank still came first in 3 of 9 starts at 5 ms, none at 20 ms (the retries left there
    come from rank n-2 connecting before the last rank listens, which no delay can order). Rank 0
    first and every other rank later is no faster and makes every rank wait. A rank alone never
    waits.

    In a pool the ranks are told to go by their daemons, and under load they reach init tens of
    milliseconds apart: the recovery bench (3 ranks and their spares on 2 cores) retried in 9 of
    21 generations with the fixed 20 ms, mostly rank 0 connecting to a rank 1 not yet in init.
    So where the other ranks share its machine, the last rank calls init once their ports are
    listening (trainer/listening.py, Linux); where any is elsewhere, it also waits the 20 ms. The
    race left is rank n-2 connecting to the last rank in the moment between the last rank's own
    connect and its listen. No delay orders it; on a machine with fewer free cores than ranks it
    was lost mostly because rank n-2, woken, took the last rank's core. So during init the last
    rank runs on a core of its own (`last_rank_apart`, Linux): 0 of 17 generations retried in a
    pool where 8 of 21 had."""

    def __init__(self) -> None:
        self.barrier: LocalBarrier | None = None
        self.one_way: int | None = None  # all_sums at most this many bytes each (trainer/colocate.py)
        self.ranks_here = 1  # ranks of this group on this machine, this one included
        self.link: Probe | None = None  # the ring's pace, timed right after it formed (trainer/linkprobe.py)
        hostfile, rank = os.environ.get("MLX_HOSTFILE"), os.environ.get("MLX_RANK")
        if not hostfile or rank is None:
            self.group: mx.distributed.Group | None = None
            self.rank, self.size = 0, 1
            return
        hosts = read_hostfile(hostfile)
        if not rank.isdigit() or int(rank) >= len(hosts):
            raise RingSetupError(f"MLX_RANK={rank!r}: expected a rank from 0 to {len(hosts) - 1}, one per entry of MLX_HOSTFILE {hostfile}")
        here = colocated(hosts, int(rank))
        self.ranks_here = len(here)
        chosen = split_blas_threads(len(here))
        delay = self._start_order(hosts, int(rank), here)
        # Blocks until every peer has connected (the daemon's start-up deadline covers a peer
        # that never comes).
        with last_rank_apart(int(rank) == len(hosts) - 1, len(here)):
            self.group = mx.distributed.init(backend="ring", strict=True)
        self.rank, self.size = self.group.rank(), self.group.size()
        # Every rank must agree on both: the barrier's members wait for each other, and one-way
        # all_sums must be cut alike everywhere. So one rank started with DPOOL_QUIET_RING=0 or
        # DPOOL_LOCAL_BARRIER=0 turns it off for all (every rank calls this all_sum); so does
        # DPOOL_LINK_PROBE=0 for the probe below.
        wants = [int(os.environ.get(env, "1") != "0") for env in (QUIET_ENV, BARRIER_ENV, PROBE_ENV)]
        quiet, barrier, probed = (n == self.size for n in self.sum_ints(wants))
        quieted = 0
        if quiet and len(here) == self.size:
            # The whole group on this machine (the same hostfile tells every rank so). The sockets
            # are each rank's own business: one whose sockets stay as MLX made them only spins.
            self.one_way = one_way_bytes(self.size)
            quieted = quiet_ring(hosts, self.rank)
        if barrier and len(here) > 1:
            self.barrier = LocalBarrier.join(barrier_address(hosts), self.rank, here)
            weakref.finalize(self, self.barrier.close)
        if probed:
            # Timed as a step's all_sums go (one-way pieces, sockets quieted): before any other
            # collective of the trainer, so every rank is here at once.
            self.link = probe(self._ring_sum, self.rank, self.size)
        link = self.link
        get_logger(rank=self.rank).info(
            "group.joined", world_size=self.size, colocated_ranks=here, local_barrier=self.barrier is not None,
            quiet_ring_sockets=quieted, one_way_bytes=self.one_way, start_delay_ms=round(delay * 1000, 1), **chosen,
            **({} if link is None else {
                "ring_mbit_s": round(link.bandwidth_bps / 1e6, 1), "ring_latency_ms": round(link.latency_s * 1e3, 3),
                "probe_ms": round(link.seconds * 1e3, 1), "probe_bytes": link.bytes,
            }),
        )

    @staticmethod
    def _start_order(hosts: list[list[str]], rank: int, here: list[int]) -> float:
        """The last rank waits until the others listen (see above); the seconds it waited. Ranks
        on this machine are looked at (Linux); for any other, it waits LAST_RANK_DELAY_S."""
        if len(hosts) < 2 or rank != len(hosts) - 1:
            return 0.0
        t0 = time.monotonic()
        peers = [split_address(a) for r in here if r != rank for a in hosts[r]]
        seen = wait_for_listeners(peers, LISTEN_WAIT_S) if peers else None
        if seen is not True or len(here) < len(hosts):
            time.sleep(max(0.0, LAST_RANK_DELAY_S - (time.monotonic() - t0)))
        return time.monotonic() - t0

    def crowding(self) -> float:
        """How many times over this machine's cores pay for work that every rank here does at
        once (a checkpoint's write): its ranks per core, at least 1."""
        return max(1.0, self.ranks_here / usable_cores())

    def wait_for_colocated(self) -> None:
        """Before the step's all_sum: wait, asleep, until every rank on this machine is done
        computing, so none spins in the ring's all_sum while a neighbour still needs the core
        (trainer/colocate.py). Nothing to do for a rank alone on its machine."""
        if self.barrier is not None:
            self.barrier.wait()

    def all_sum(self, x: mx.array) -> mx.array:
        if self.group is None or self.size == 1:
            return x
        return self._ring_sum(x)

    def _ring_sum(self, x: mx.array) -> mx.array:
        """One all_sum, or, in a group on one machine, one per piece of at most `one_way` bytes:
        each goes one way round the ring, so no socket thread both sends and receives and the
        blocking sockets never hold a send up behind a receive (trainer/colocate.py).

        Each piece is evaluated before the next is sent: when a peer dies, MLX fails the pending
        all_sum and its socket threads end, and a second all_sum in the same evaluation would wait
        for them forever; this way the first failure raises."""
        if self.one_way is None or x.nbytes <= self.one_way:
            return mx.distributed.all_sum(x, group=self.group)
        flat, n = x.reshape(-1), self.one_way // x.itemsize
        parts = []
        for i in range(0, flat.size, n):
            parts.append(mx.distributed.all_sum(flat[i : i + n], group=self.group))
            mx.eval(parts[-1])
        return mx.concatenate(parts).reshape(x.shape)

    def all_sum_fused(self, arrays: Sequence[mx.array], bucket_bytes: int | None = None) -> list[mx.array]:
        """all_sum many arrays, returned in the same shapes and order: those of one dtype travel
        together, in buckets of at most `bucket_bytes` (default BUCKET_BYTES; a larger array is cut
        across buckets). Each bucket is one collective, summed before the next is built, so a large
        model never needs a second full copy of its gradients for the send buffer: one bucket at a
        time (mlx-lm's `average_gradients` does the same, 32 MiB)."""
        if self.group is None or self.size == 1:
            return list(arrays)
        limit = bucket_bytes or BUCKET_BYTES
        by_dtype: dict[mx.Dtype, list[int]] = {}
        for i, a in enumerate(arrays):
            by_dtype.setdefault(a.dtype, []).append(i)
        pieces: list[list[mx.array]] = [[] for _ in arrays]  # each array's summed pieces, in order
        for idx in by_dtype.values():
            per = max(1, limit // arrays[idx[0]].itemsize)  # elements per bucket
            bucket: list[tuple[int, mx.array]] = []  # (array index, flat piece)
            room = per

            def flush(per: int = per) -> None:
                nonlocal bucket, room
                if not bucket:
                    return
                flat = bucket[0][1] if len(bucket) == 1 else mx.concatenate([p for _, p in bucket])
                summed = self._ring_sum(flat)
                mx.eval(summed)  # this bucket is summed before the next is built (see above)
                offset = 0
                for i, p in bucket:
                    pieces[i].append(summed[offset : offset + p.size])
                    offset += p.size
                bucket, room = [], per

            for i in idx:
                flat, start = arrays[i].reshape(-1), 0
                while start < flat.size:
                    take = min(room, flat.size - start)
                    bucket.append((i, flat[start : start + take] if take < flat.size else flat))
                    start += take
                    room -= take
                    if room == 0:
                        flush()
            flush()
        out = []
        for a, ps in zip(arrays, pieces, strict=True):
            whole = ps[0] if len(ps) == 1 else mx.concatenate(ps)
            out.append(whole.reshape(a.shape))
        return out

    def broadcast(self, arrays: Sequence[mx.array], root: int = 0) -> list[mx.array]:
        """Rank `root`'s arrays on every rank (others pass arrays of the right shapes and dtypes)."""
        if self.group is None or self.size == 1:
            return list(arrays)
        sent = arrays if self.rank == root else [mx.zeros_like(a) for a in arrays]
        return self.all_sum_fused(sent)

    def broadcast_ints(self, values: Sequence[int]) -> list[int]:
        """A few integers from rank 0 (exact: int64)."""
        x = mx.array(list(values), dtype=mx.int64)
        (y,) = self.broadcast([x])
        return [int(v) for v in y.tolist()]

    def sum_ints(self, values: Sequence[int]) -> list[int]:
        x = self.all_sum(mx.array(list(values), dtype=mx.int64))
        return [int(v) for v in x.tolist()]

    def gather_ints(self, value: int) -> list[int]:
        """Each rank's integer, in rank order (exact: int64, one all_sum)."""
        return self.sum_ints([value if r == self.rank else 0 for r in range(self.size)])
