"""Planning a group: which slots, which ranks, which shares, which ring addresses. Pure functions.

The blueprint (`GroupPlan`, frozen) is kept apart from what runs (`WorkerGroup` in the pool):
a plan is decided once per generation and never edited; a new membership is a new plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dpool.protocol.shares import MIN_GAIN, apportion


@dataclass(frozen=True, slots=True)
class Slot:
    node: str
    index: int


@dataclass(frozen=True, slots=True)
class FreeSlot:
    """A slot that could take a rank, with the newest checkpoint of the job it holds (or None)."""

    node: str
    index: int
    holds_step: int | None
    kept: bool = False  # it holds the newest checkpoint of another job waiting to resume: taken last


@dataclass(frozen=True, slots=True)
class GroupPlan:
    job: str
    generation: int
    ranks: tuple[Slot, ...]  # rank r runs on ranks[r]
    shares: tuple[int, ...]  # sequences of each global batch computed by rank r
    hostfile: tuple[tuple[str, ...], ...]  # MLX ring hostfile: one ["ip:port"] per rank
    _by_node: dict[str, list[tuple[int, Slot]]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_node: dict[str, list[tuple[int, Slot]]] = {}
        for r, s in enumerate(self.ranks):
            by_node.setdefault(s.node, []).append((r, s))
        object.__setattr__(self, "_by_node", dict(sorted(by_node.items())))

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def nodes(self) -> list[str]:
        return list(self._by_node)

    def ranks_on(self, node: str) -> list[tuple[int, Slot]]:
        return self._by_node.get(node, [])


def choose_slots(free: Sequence[FreeSlot], lo: int, hi: int) -> list[Slot] | None:
    """Up to `hi` slots (None when fewer than `lo` are free), in rank order.

    Which: slots holding the newest checkpoint of the job first (no copy needed to resume), then
    those that hold no other waiting job's newest checkpoint (`kept`: it resumes there), then one
    slot per node before a second on any node (nodes are the unit of compute). Rank order is
    stable: rank 0 on the slot holding the newest checkpoint (it loads and broadcasts it), the
    others by (node name, slot index), so a re-plan of the same membership gives the same ranks.
    """
    if len(free) < lo:
        return None
    newest = max((f.holds_step for f in free if f.holds_step is not None), default=None)

    def preference(f: FreeSlot) -> tuple[int, bool, int, int, str]:
        holds = f.holds_step if f.holds_step is not None else -1
        return (0 if newest is not None and holds == newest else 1, f.kept, -holds, f.index, f.node)

    chosen = sorted(free, key=preference)[:hi]
    first = chosen[0] if newest is not None and chosen[0].holds_step == newest else None
    rest = sorted((f for f in chosen if f is not first), key=lambda f: (f.node, f.index))
    ordered = ([first] if first is not None else []) + rest
    return [Slot(f.node, f.index) for f in ordered]


def equal_shares(global_batch: int, world_size: int) -> list[int]:
    """The global batch in `world_size` contiguous shares that differ by at most one sequence."""
    if world_size < 1 or global_batch < world_size:
        raise ValueError(f"cannot split {global_batch} sequences over {world_size} workers")
    q, r = divmod(global_batch, world_size)
    return [q + 1 if i < r else q for i in range(world_size)]


def speed_shares(global_batch: int, speeds: Sequence[float | None]) -> list[int]:
    """Shares proportional to each rank's measured speed; equal while any rank's is unknown.

    The trainer refines them while it runs (it measures every step); this only gives a new
    generation a head start from what the last one measured.
    """
    equal = equal_shares(global_batch, len(speeds))
    known = [float(v) for v in speeds if v is not None and v > 0]
    if len(known) < len(speeds):
        return equal
    weighted = apportion(known, global_batch)

    def step_time(shares: list[int]) -> float:
        return max(s / v for s, v in zip(shares, known, strict=True))

    # As the trainer does: a split that does not shorten the step by MIN_GAIN is not worth leaving equal.
    return weighted if step_time(weighted) <= (1 - MIN_GAIN) * step_time(equal) else equal


def ring_hostfile(ranks: Sequence[Slot], endpoints: Mapping[Slot, str]) -> list[list[str]]:
    """The hostfile `mlx.launch --backend ring` would write: one ["ip:port"] per rank."""
    return [[endpoints[s]] for s in ranks]
