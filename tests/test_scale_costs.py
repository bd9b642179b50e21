"""What a big pool costs the coordinator per message, as behaviour (bench/control_plane.py --scale
measures the time): a launch's N group.starts share one job file, split and hostfile, which are
checked against their bounds once, not N times, and never let through when out of bounds."""

from __future__ import annotations

from typing import Any

import pytest

from dpool.protocol import fit as fitmod
from dpool.protocol import messages as m
from dpool.protocol.payloads import RankSlot

N = 300


def launch(hostfile: list[list[str]], shares: list[int]) -> list[m.GroupStart]:
    spec: dict[str, Any] = {"name": "big", "workers": {"min": N, "max": N}}
    return [m.GroupStart(job="big-1", generation=1, spec=spec, ranks=[RankSlot(rank=i, slot=0)], shares=shares, hostfile=hostfile) for i in range(N)]


def test_a_launchs_shared_fields_are_checked_once_for_all_its_group_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    real = fitmod._plain_fits

    def counting(s: Any, value: Any) -> bool:
        checked.append(s.name)
        return bool(real(s, value))

    monkeypatch.setattr(fitmod, "_plain_fits", counting)
    msgs = launch([[f"10.0.0.{i % 250}:{5000 + i}"] for i in range(N)], [1] * N)
    for msg in msgs:
        assert fitmod.fit(msg) == (msg, [])
    assert sorted(checked) == ["hostfile", "shares", "spec"]  # once each, not N times


def test_a_shared_field_out_of_its_bounds_is_fixed_in_every_message() -> None:
    too_long = [["10.0.0.1:5000"]] * (16384 + 1)  # one rank more than a hostfile may hold
    for msg in launch(too_long, [1] * N)[:3]:
        out, fixes = fitmod.fit(msg)
        assert out is not msg and fixes and "hostfile" in fixes[0], fixes
