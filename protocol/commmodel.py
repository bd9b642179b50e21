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


# -- a job's step: what it sends, and how much of the step that is ------------------------------

BUCKET_BYTES = 32 << 20  # the most one all_sum carries (trainer/dist.py buckets a step's gradients)
COMM_BOUND = 0.5  # a predicted share above this: the job spends more time in all_sum than computing
ADVICE = (
    "train LoRA adapters instead of the full model, raise train.global_batch (more compute per "
    "all_sum), put the ring on Thunderbolt (`dpd run --advertise bridge0`), or set "
    '[sync] mode = "diloco" (one all_sum per inner_steps steps)'
)


@dataclass(frozen=True, slots=True)
class StepComm:
    """What one optimizer step spends on the ring, as the model predicts it."""

    nbytes: int  # bytes of one all_sum of the gradients (or, diloco, of the parameter changes)
    seconds: float  # all_sum seconds per step (diloco: one all_sum spread over its inner steps)
    every: int  # steps per all_sum (1: sync)


def step_comm(params: int, ranks: int, link: Link, *, dtype: str = "float32", mode: str = "sync", inner_steps: int = 1) -> StepComm:
    """The all_sum a step of `params` trainable parameters pays on a ring of `ranks` whose slowest
    link is `link`: every step in "sync" mode, once per `inner_steps` steps in "diloco" mode;
    `dtype` is what travels (bfloat16: half the bytes). The step's control vector (a few floats)
    is left out: it costs one latency term, which the bucket count already charges."""
    nbytes = params * DTYPE_BYTES.get(dtype, 4)
    every = max(1, inner_steps) if mode == "diloco" else 1
    return StepComm(nbytes, ring_seconds(nbytes, ranks, link, BUCKET_BYTES) / every, every)


def measured_compute(step_s: float, comm: StepComm) -> float:
    """A step's compute seconds from its measured time (the median of recent steps): in sync mode
    every step includes its all_sum, which the model says costs `comm.seconds`; in diloco mode the
    median step is an inner step, with no all_sum in it."""
    return max(0.0, step_s - comm.seconds) if comm.every == 1 else step_s


def rank_compute_seconds(tokens: int, shares: list[int] | None, rank_tokens_per_s: list[float]) -> list[float]:
    """Each rank's compute seconds in a step, from rank 0's metrics row: its share of the step's
    tokens over its speed (shares that do not fit the speeds: equal ones)."""
    weights = shares if shares and len(shares) == len(rank_tokens_per_s) else [1] * len(rank_tokens_per_s)
    total = sum(weights) or 1
    return [tokens * w / total / max(v, 1e-9) for w, v in zip(weights, rank_tokens_per_s, strict=True)]


def timed_comm(all_sum_s: float, tokens: int, shares: list[int] | None, rank_tokens_per_s: list[float] | None) -> float:
    """What a sync step spent communicating, from rank 0's metrics row: its time in the step's
    all_sum (`all_sum_s`) less its wait there for the slowest rank's compute (rows without the
    ranks' speeds: the whole all_sum_s)."""
    if not rank_tokens_per_s:
        return max(0.0, all_sum_s)
    compute = rank_compute_seconds(tokens, shares, rank_tokens_per_s)
    return max(0.0, all_sum_s - max(0.0, max(compute) - compute[0]))


def gpt_params(layers: int, dim: int, vocab: int, context: int, learned_positions: bool) -> int:
    """Trainable parameters of the built-in GPT (trainer/model.py): token embedding and output head
    (vocab x dim each, untied), per block two LayerNorms (2 x 2 dim), qkv (3 dim^2) and the
    projection (dim^2) without bias, the MLP's two Linear layers with bias (8 dim^2 + 5 dim); the
    final LayerNorm; learned positions add context x dim."""
    block = 12 * dim * dim + 9 * dim
    return 2 * vocab * dim + layers * block + 2 * dim + (context * dim if learned_positions else 0)


def bound_warning(share: float, slow: str, *, measured: bool = False) -> str | None:
    """The warning for a share above COMM_BOUND (None below it): how much of each step goes to
    all_sum (`measured`: as the steps timed it, not as predicted), the link that sets the pace
    (`slow`: its nodes and measured figures), and what to do."""
    if share <= COMM_BOUND:
        return None
    if measured:
        return f"the steps' timed all_sums took about {share:.0%} of each step, on {slow}; to spend less: {ADVICE}"
    return f"about {share:.0%} of each step would be spent in all_sum, paced by {slow}; to spend less: {ADVICE}"


def describe_link(a: str, b: str, link: Link) -> str:
    """`n1 <-> n2 (94 Mbit/s, 1.2 ms)`: a link as the warning names it."""
    return f"{a} <-> {b} ({link.bandwidth_bps / 1e6:.0f} Mbit/s, {link.latency_s * 1e3:.2g} ms)"
