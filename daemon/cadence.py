"""How often each node heartbeats: a period that grows with the pool, so that the coordinator's
total heartbeat rate stays bounded whatever the pool's size. Pure: no socket, no clock (the time
is passed in); the pool (daemon/pool.py) holds one `Cadence` and the coordinator sends what
`due` says.

Heartbeats cost the coordinator one message in and one out per node and period. At the default
0.25 s, 1,000 nodes are 4,000 a second each way, and 2,000 nodes never settle: registrations time
out behind heartbeats, and nodes are lost for heartbeats that wait in the queue. So the period is
the configured one (`--heartbeat-interval`, 0.25 s) up to `rate` x period nodes
(`--heartbeat-rate`, 1,000 a second: 250 nodes), and doubles as the pool doubles: 0.5 s to 500
nodes, 1 s to 1,000, 2 s to 2,000. Doubling rather than N / rate exactly: one more node does not
change every node's period. And it comes back down only once the pool is a quarter below the
smaller period's limit, so a node that comes and goes at a limit doesn't either.

A longer period delays one thing: noticing that a node that runs nothing went silent (a node is
lost after liveness x its period). A running group's failures don't wait for heartbeats: a killed
trainer is reported by its dpd at once; a killed dpd or a cut link breaks its peers' ring, whose
trainers exit and are reported at once; the group is then stopped, and each of its nodes must
answer the stop within `answer_s`: 2 x the configured period (0.5 s) for a dpd that answers a
stop at once (`prompt`), whatever the pool's period.

How a node learns its period (protocol/README.md, "Heartbeats"):
- `node.registered` carries the pool's period, which every dpd adopts.
- A change reaches registered nodes on `coord.heartbeat` (`heartbeat_s`, `liveness`), once per
  change; a dpd that adopts it says so on the `node.heartbeat` it sends at once (`heartbeat_s`).
  The first `coord.heartbeat` after each registration carries the period too: a dpd that answers
  it is `prompt` (it also answers a `group.stop` at once).
- A dpd older than this refuses a `coord.heartbeat` with fields it does not know (one frame, which
  it logs) and keeps the period it registered with; it is never `prompt`, and the coordinator
  heartbeats it, and expects it, at that period.
Until a node acknowledges what it was told, the coordinator heartbeats it at the shortest period
it may be using and expects it at the longest.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

HEARTBEAT_RATE = 1000.0  # heartbeats a second the coordinator takes from all nodes together (default)
SHRINK_BELOW = 0.75  # the period halves once the pool is this far under the smaller period's limit
ANSWER_HEARTBEATS = 2  # configured periods a prompt node of a group stopped at once has to answer in


def pool_period(nodes: int, current_s: float, base_s: float, rate: float) -> float:
    """The period for a pool of `nodes` (not lost), now at `current_s`: `base_s` doubled as often
    as it takes for `nodes / period <= rate`; shorter than `current_s` only once the pool is
    `SHRINK_BELOW` of the shorter period's limit."""
    want = _doubled(nodes, base_s, rate)
    if want >= current_s:
        return want
    return min(current_s, _doubled(math.ceil(nodes / SHRINK_BELOW), base_s, rate))


def _doubled(nodes: int, base_s: float, rate: float) -> float:
    period = base_s
    while nodes > rate * period:
        period *= 2
    return period


@dataclass(slots=True)
class Beat:
    """The coordinator's view of one registered node's heartbeats."""

    period_s: float  # the period the node is known to use (registered with, or acknowledged)
    told_s: float | None  # told on coord.heartbeat and not acknowledged yet
    longest_s: float  # the longest period it may be using until it acknowledges (its expiry's)
    tell: bool  # the next coord.heartbeat to it carries told_s
    due: float  # when the coordinator heartbeats it next
    prompt: bool = False  # its dpd acknowledges what it is told: it answers a group.stop at once

    def sending_s(self) -> float:
        """How often the coordinator heartbeats it: the shortest period it may be using."""
        return self.period_s if self.told_s is None else min(self.period_s, self.told_s)


class Cadence:
    def __init__(self, base_s: float, liveness: int, rate: float = HEARTBEAT_RATE) -> None:
        if base_s <= 0 or liveness < 1 or rate <= 0:
            raise ValueError(f"heartbeat {base_s} s, liveness {liveness}, rate {rate}/s: each must be > 0")
        self.base_s, self.liveness, self.rate = base_s, liveness, rate
        self.period_s = base_s  # the pool's period: what a node registering now is told
        self.beats: dict[str, Beat] = {}

    def period_for(self, nodes: int) -> float:
        """The period a pool of `nodes` would have from the start (a restarted coordinator's
        nodes heartbeat at what the previous one told them)."""
        return _doubled(nodes, self.base_s, self.rate)

    def _resize(self) -> None:
        """The pool's period for its nodes now (those registered and not lost); every node not at
        it is told on its next heartbeat."""
        new = pool_period(len(self.beats), self.period_s, self.base_s, self.rate)
        if new == self.period_s:
            return
        self.period_s = new
        for b in self.beats.values():
            if b.period_s != new or b.told_s is not None:
                b.told_s, b.tell, b.longest_s = new, True, max(b.longest_s, new)

    def registered(self, name: str, now: float) -> float:
        """Node `name` (re)registered: the period its node.registered carries. Its first heartbeat
        from the coordinator repeats the period (the probe that makes it `prompt`, so that it is
        soon, within the configured period) at a point of that period given by its name: a
        thousand nodes registered at once are not heartbeated at once."""
        self.beats.pop(name, None)
        self.beats[name] = beat = Beat(period_s=self.period_s, told_s=None, longest_s=self.period_s, tell=True, due=now)
        self._resize()  # counting it (it is told the new period, if any, at once)
        p = self.period_s
        beat.period_s = beat.told_s = beat.longest_s = p
        beat.tell, beat.due = True, now + min(p, self.base_s) * _phase(name)
        return p

    def acknowledged(self, name: str, heartbeat_s: float) -> None:
        """Node `name` heartbeats every `heartbeat_s` (node.heartbeat's field, which only a dpd
        that takes coord.heartbeat's period sends). A value it was not told is ignored."""
        b = self.beats.get(name)
        if b is None:
            return
        if heartbeat_s == b.told_s:
            b.period_s, b.told_s, b.longest_s, b.tell, b.prompt = heartbeat_s, None, heartbeat_s, False, True
        elif b.told_s is None and heartbeat_s == b.period_s:
            b.prompt = True

    def forget(self, name: str) -> None:
        """Node `name` is lost or gone: not heartbeated until it registers again."""
        if self.beats.pop(name, None) is not None:
            self._resize()

    def expiry_s(self, name: str) -> float:
        """Silence after which node `name` is lost."""
        b = self.beats.get(name)
        return self.liveness * (b.longest_s if b is not None else self.period_s)

    def answer_s(self, name: str) -> float:
        """How soon node `name` must be heard from once its group was stopped at once: a prompt
        dpd answers the stop itself, another one with its next heartbeats."""
        b = self.beats.get(name)
        if b is None:
            return self.expiry_s(name)
        return min(self.expiry_s(name), ANSWER_HEARTBEATS * (self.base_s if b.prompt else b.longest_s))

    def due(self, now: float) -> list[tuple[str, float | None]]:
        """The nodes to heartbeat now, each with the period to tell it (None: a plain heartbeat)."""
        out: list[tuple[str, float | None]] = []
        for name, b in self.beats.items():
            if now >= b.due:
                out.append((name, b.told_s if b.tell else None))
                b.tell = False
                b.due = now + b.sending_s()
        return out


def _phase(name: str) -> float:
    """A point in [0, 1) fixed by the name (crc32: the same in every process)."""
    return zlib.crc32(name.encode()) / 2**32
