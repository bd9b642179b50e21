"""bench/chaos.py's pure parts: the seeded fault draws, the fallback, the curves, the goodput and
which fault each recovery is put down to. No pool runs here (the bench itself does that)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

from dpool.protocol.payloads import EventRow

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def chaos():
    spec = importlib.util.spec_from_file_location("bench_chaos", BENCH / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_chaos"] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_chaos", None)


def test_a_seed_draws_the_same_faults_every_time_and_another_seed_others(chaos) -> None:
    first = list(itertools.islice(chaos.draws(7, 20.0), 50))
    assert first == list(itertools.islice(chaos.draws(7, 20.0), 50))
    assert first != list(itertools.islice(chaos.draws(8, 20.0), 50))
    assert all(10.0 <= d.gap_s <= 30.0 and d.kind in chaos.KINDS and 0 <= d.pick < 1 for d in first)
    assert {d.kind for d in first} == set(chaos.KINDS)  # 50 draws of 5 kinds: every kind comes up


def test_the_bench_leaves_no_module_that_shadows_mlx_lm_on_the_path(chaos) -> None:
    assert str(BENCH) not in sys.path


def test_a_fault_that_cannot_be_injected_falls_back_to_the_next_kind_in_order(chaos) -> None:
    assert chaos.fallback("join", chaos.KINDS) == "join"
    assert chaos.fallback("join", ["kill", "freeze", "lost_node"]) == "kill"  # no spare left: wraps round
    assert chaos.fallback("lost_node", ["kill", "freeze", "join"]) == "join"  # a group of one: no node lost
    assert chaos.fallback("kill", []) is None
    assert chaos.pick(["a", "b", "c"], 0.0) == "a" and chaos.pick(["a", "b", "c"], 0.999) == "c"


def test_the_final_curve_keeps_each_steps_last_row_and_counts_its_tokens_once(chaos) -> None:
    rows = [
        {"kind": "train", "step": 1, "loss": 5.0, "tokens": 768},
        {"kind": "train", "step": 2, "loss": 4.9, "tokens": 768},
        {"kind": "eval", "step": 2, "val_loss": 4.8},
        {"kind": "train", "step": 2, "loss": 4.8, "tokens": 768},  # recomputed after a restart
        {"kind": "train", "step": 3, "loss": 4.7, "tokens": 768},
    ]
    curve = chaos.final_curve(rows)
    assert {s: r["loss"] for s, r in curve.items()} == {1: 5.0, 2: 4.8, 3: 4.7}
    assert chaos.useful_tokens(curve) == 3 * 768


def test_the_loss_difference_is_the_largest_per_step_and_names_missing_steps(chaos) -> None:
    a = {1: {"loss": 5.0}, 2: {"loss": 4.0}, 3: {"loss": 3.0}}
    b = {1: {"loss": 5.0002}, 2: {"loss": 3.999}, 4: {"loss": 2.0}}
    worst, at, missing = chaos.loss_difference(a, b)
    assert at == 2 and worst == pytest.approx(1e-3)
    assert missing == [3, 4]
    assert chaos.loss_difference(a, {1: {"loss": None}})[0] == float("inf")  # a diverged step is never close


def test_goodput_is_chaos_tokens_per_second_over_the_fault_free_twins(chaos) -> None:
    assert chaos.goodput(1000, 110.0, 1000, 100.0) == pytest.approx(100 / 110)
    assert chaos.goodput(1000, 100.0, 1000, 100.0) == pytest.approx(1.0)


def event(t: float, kind: str, **fields) -> EventRow:
    return EventRow(t=t, kind=kind, fields=fields)


def test_each_recovery_is_put_down_to_the_last_action_before_its_interruption(chaos) -> None:
    kill = chaos.Action(10.0, "kill", "n1")
    lost = chaos.Action(30.0, "lost_node", "n2")
    restart = chaos.Action(38.0, "restart", "n2")
    events = [
        event(1.0, "group.starting"), event(2.0, "group.started"),  # the first group: no group.resumed ends it
        event(10.2, "worker.failed", rank=1), event(10.3, "group.starting"), event(11.0, "group.resumed", steps_recomputed=1, cause="failure"),
        event(20.0, "checkpoint.saved", step=40),
        event(33.0, "worker.failed", rank=2), event(34.5, "group.resumed", steps_recomputed=0, cause="failure"),
        # the node's dpd back: the group grows; an interruption that began before the restart was asked
        # for would still be the lost node's
        event(38.5, "node.joined", node="n2"), event(38.6, "group.growing"), event(40.0, "group.resumed", steps_recomputed=0, cause="membership"),
    ]
    orphans = chaos.attribute([restart, kill, lost], events, since=3.0)
    assert orphans == []
    assert [r["t"] for r in kill.resumed] == [11.0] and kill.resumed[0]["steps_recomputed"] == 1
    assert [r["t"] for r in lost.resumed] == [34.5]
    assert [r["cause"] for r in restart.resumed] == ["membership"]
    # paused: a fault stops training when it strikes, a node given back only when the group stops
    assert kill.resumed[0]["paused_s"] == pytest.approx(1.0) and restart.resumed[0]["paused_s"] == pytest.approx(1.4)
    assert kill.fault and not restart.fault


def test_a_recovery_before_any_action_is_reported_not_put_down_to_one(chaos) -> None:
    later = chaos.Action(50.0, "kill", "n1")
    orphans = chaos.attribute([later], [event(5.0, "worker.failed"), event(6.0, "group.resumed", steps_recomputed=2)], since=3.0)
    assert [e.t for e in orphans] == [6.0] and later.resumed == []
