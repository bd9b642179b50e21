"""The loop that watches a machine's owner for `dpd run --yield-when`: every `period_s` it reads
the conditions (daemon/conditions.py) on a thread of its own, so a slow `pmset` never holds up the
agent's heartbeats, feeds the pure policy (daemon/yieldpolicy.py) and tells the agent each change,
which says it to the coordinator (node.yield, protocol/owner_messages.py).

A source that cannot be read is logged once (`yield.source_unknown`), and again only once it reads
(`yield.source_back`); meanwhile it counts as clear, never as a reason to yield.

For tests (and for trying it by hand), environment variables:
- `DPOOL_YIELD_PROBE_DIR=DIR`: the commands' outputs come from files in DIR (`loginctl`, `ioreg`,
  `pmset-batt`, `pmset-therm`, `sysctl`: what the command would print; a missing file is a failed
  command) and the Linux readers read DIR as the root (`DIR/sys/class/power_supply/...`,
  `DIR/proc/pressure/memory`);
- `DPOOL_YIELD_PERIOD_S` (default 5), `DPOOL_YIELD_CLEAR_S` (default 120): how often it reads,
  and how long every condition must have cleared before the node takes work again.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dpool.daemon.conditions import (
    Condition,
    Reading,
    Runner,
    Source,
    files_runner,
    run_command,
    sources,
)
from dpool.daemon.yieldpolicy import CLEAR_S, Change, YieldPolicy

PERIOD_S = 5.0
ENV_PROBE_DIR = "DPOOL_YIELD_PROBE_DIR"
ENV_PERIOD = "DPOOL_YIELD_PERIOD_S"
ENV_CLEAR = "DPOOL_YIELD_CLEAR_S"


class OwnerWatch:
    def __init__(
        self,
        conditions: Sequence[Condition],
        log: Any,
        *,
        platform: str = sys.platform,
        run: Runner = run_command,
        root: Path = Path("/"),
        period_s: float = PERIOD_S,
        clear_s: float = CLEAR_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.conditions = tuple(conditions)
        self.sources: list[Source] = sources(conditions, platform, run, root)
        self.policy = YieldPolicy(clear_s)
        self.period_s = period_s
        self.log, self.clock, self.wall = log, clock, wall
        self.unknown: set[str] = set()  # sources said unknown, until they read again

    @classmethod
    def from_env(cls, conditions: Sequence[Condition], log: Any, env: dict[str, str] | None = None) -> OwnerWatch:
        env = dict(os.environ) if env is None else env
        probe = env.get(ENV_PROBE_DIR)
        kw: dict[str, Any] = {"period_s": _seconds(env, ENV_PERIOD, PERIOD_S), "clear_s": _seconds(env, ENV_CLEAR, CLEAR_S)}
        if probe:
            kw |= {"run": files_runner(Path(probe)), "root": Path(probe)}
        return cls(conditions, log, **kw)

    @property
    def yielding(self) -> str | None:
        """Why the node yields now (None: it works)."""
        return self.policy.yielding

    def read(self) -> list[tuple[Source, Reading]]:
        """Every source once (blocking: commands with their timeout). Logs a source that turns
        unknown, once, and its return."""
        wall = self.wall()
        out = []
        for s in self.sources:
            try:
                r = s.read(wall)
            except Exception as e:  # a parser's bug on output it never saw: unknown, like any failed probe
                r = Reading(None, f"{s.name}: {type(e).__name__}: {e}")
            if r.holds is None and s.name not in self.unknown:
                self.unknown.add(s.name)
                self.log.warning("yield.source_unknown", condition=s.name, error=r.detail, counts_as="clear")
            elif r.holds is not None and s.name in self.unknown:
                self.unknown.discard(s.name)
                self.log.info("yield.source_back", condition=s.name, reading=r.detail)
            out.append((s, r))
        return out

    def step(self, readings: Sequence[tuple[Source, Reading]]) -> Change | None:
        """Feed one round to the policy; the change it made, if any."""
        change = self.policy.observe(self.clock(), [s.label for s, r in readings if r.holds])
        if change is None:
            return None
        said = {s.name: r.detail for s, r in readings}
        if change.yielding is not None:
            self.log.info("node.yielding", reason=change.yielding, was=change.was, readings=said)
        else:
            self.log.info("node.returned", reason=change.was, cleared_s=self.policy.clear_s, readings=said)
        return change

    async def run(self, on_change: Callable[[str | None], None]) -> None:
        """Read, decide, say, forever (cancelled with the agent)."""
        self.log.info("yield.watching", conditions=[str(c) for c in self.conditions], period_s=self.period_s, clear_s=self.policy.clear_s)
        while True:
            readings = await asyncio.to_thread(self.read)
            change = self.step(readings)
            if change is not None:
                on_change(change.yielding)
            await asyncio.sleep(self.period_s)


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"${name}={raw!r}: must be a number of seconds >= 0")
    return value
