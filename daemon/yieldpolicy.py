"""When a node yields to its owner, and when it comes back. Pure: readings and the time in,
a change out; no clock, no command, no socket (daemon/owner.py reads the conditions and says the
changes to the coordinator).

    working  --a condition holds-->  yielding(why)
    yielding --none has held for clear_s-->  working

It yields at the first reading that holds, at once: an owner who sits down wants the machine now.
It comes back only once no condition has held for `clear_s` (default 2 minutes): each return and
each yield costs the pool a planned restart, so a machine that flickers (a battery that charges
and drains, a thermal zone at its trip point) must not move a job back and forth. `active` has a
memory of its own on top (MINUTES since the last input event), so the owner's return is counted
from when they stopped, not from when the reading last said so.

An unknown reading (a probe that failed) never holds: it neither starts a yield nor prolongs one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CLEAR_S = 120.0  # a condition must have cleared this long before the node takes work again


@dataclass(frozen=True, slots=True)
class Change:
    """The node's new state: `yielding` the reason (None: it works again); `was` the previous one."""

    yielding: str | None
    was: str | None


class YieldPolicy:
    def __init__(self, clear_s: float = CLEAR_S) -> None:
        if clear_s < 0:
            raise ValueError(f"clear_s must be >= 0, got {clear_s}")
        self.clear_s = clear_s
        self.yielding: str | None = None  # why, while yielding
        self.held_at: float | None = None  # the last reading at which a condition held

    def observe(self, now: float, holding: Sequence[str]) -> Change | None:
        """One round of readings: the labels of the conditions that hold now, in the order they
        were asked for. The change it makes, if any."""
        if holding:
            self.held_at = now
            why = ", ".join(holding)
            if why != self.yielding:
                # working -> yielding: the owner needs the machine (or needs it for another reason now)
                was, self.yielding = self.yielding, why
                return Change(why, was)
            return None
        if self.yielding is not None and self.held_at is not None and now - self.held_at >= self.clear_s:
            # yielding -> working: nothing has held for clear_s
            was, self.yielding = self.yielding, None
            return Change(None, was)
        return None  # working, or yielding while the condition clears: the reason stays the last one that held

    def returns_at(self) -> float | None:
        """When the node comes back if nothing holds again (None: not yielding)."""
        if self.yielding is None or self.held_at is None:
            return None
        return self.held_at + self.clear_s
