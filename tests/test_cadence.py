"""The heartbeat period that grows with the pool (daemon/cadence.py), as pure functions with the
time passed in, and the pool's expiry and answer windows that follow each node's period."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from dpool.daemon import cli
from dpool.daemon.cadence import HEARTBEAT_RATE, Cadence, pool_period
from dpool.daemon.pool import Pool, Record
from dpool.protocol import messages as m
from dpool.protocol.payloads import NodeInfo

BASE = 0.25


def test_the_default_period_holds_to_250_nodes_then_doubles_as_the_pool_doubles() -> None:
    at = {n: pool_period(n, BASE, BASE, HEARTBEAT_RATE) for n in (1, 250, 251, 500, 501, 1000, 1001, 2000, 4000)}
    assert at == {1: 0.25, 250: 0.25, 251: 0.5, 500: 0.5, 501: 1.0, 1000: 1.0, 1001: 2.0, 2000: 2.0, 4000: 4.0}


def test_the_total_heartbeat_rate_never_passes_the_budget_nor_falls_below_half_of_it_once_reached() -> None:
    for n in range(1, 6000, 7):
        p = pool_period(n, BASE, BASE, HEARTBEAT_RATE)
        assert n / p <= HEARTBEAT_RATE
        assert p == BASE or n / p > HEARTBEAT_RATE / 2


def test_the_period_grows_at_once_but_shrinks_only_a_quarter_below_the_limit() -> None:
    assert pool_period(1001, 1.0, BASE, HEARTBEAT_RATE) == 2.0
    assert pool_period(1000, 2.0, BASE, HEARTBEAT_RATE) == 2.0  # one node left: no change for all
    assert pool_period(751, 2.0, BASE, HEARTBEAT_RATE) == 2.0
    assert pool_period(750, 2.0, BASE, HEARTBEAT_RATE) == 1.0
    assert pool_period(10, 2.0, BASE, HEARTBEAT_RATE) == 0.25  # a pool that emptied: straight back


def registered(c: Cadence, names: list[str], now: float = 0.0) -> list[float]:
    return [c.registered(n, now) for n in names]


def test_a_node_registering_is_told_the_pools_period_and_probed_once_within_its_first_period() -> None:
    c = Cadence(BASE, 6, rate=8)  # 2 nodes at 0.25 s, 4 at 0.5 s
    assert registered(c, ["a", "b", "c"]) == [0.25, 0.25, 0.5]
    assert all(b.due < BASE for b in c.beats.values())
    sent = c.due(0.5)
    assert dict(sent) == {"a": 0.5, "b": 0.5, "c": 0.5}  # a and b: the new period; c: the probe
    assert c.due(0.5) == []
    assert dict(c.due(0.75)) == {"a": None, "b": None}  # still at 0.25 until they acknowledge
    for n in ("a", "b", "c"):
        c.acknowledged(n, 0.5)
    assert [c.beats[n].period_s for n in "abc"] == [0.5] * 3 and all(c.beats[n].prompt for n in "abc")
    assert dict(c.due(1.0)) == {"a": None, "b": None, "c": None}
    assert c.due(1.25) == [] and len(c.due(1.5)) == 3  # every 0.5 s from now on


def test_nodes_registered_together_are_heartbeated_spread_over_the_period() -> None:
    c = Cadence(BASE, 6)
    registered(c, [f"n{i:04d}" for i in range(1000)])
    assert c.period_s == 1.0
    # Each is probed within the configured period (0.25 s), spread over it.
    firsts = sorted(b.due for b in c.beats.values())
    assert firsts[0] >= 0 and firsts[-1] < BASE
    quarters = [sum(q * BASE / 4 <= t < (q + 1) * BASE / 4 for t in firsts) for q in range(4)]
    assert all(200 < k < 300 for k in quarters), quarters
    c.due(BASE)
    # Then every 1 s; the first 500 registered when the period was shorter, and until they
    # acknowledge the longer one they are heartbeated at what they may still use.
    assert {b.due for name, b in c.beats.items() if name >= "n0500"} == {BASE + 1.0}
    assert {b.due for name, b in c.beats.items() if name < "n0250"} == {2 * BASE}


def test_an_older_dpd_that_never_acknowledges_keeps_its_period_and_is_expected_at_it() -> None:
    c = Cadence(BASE, 6, rate=8)
    registered(c, ["old"])
    c.due(0.3)  # the probe: refused by an older dpd, which says nothing
    registered(c, ["b", "c", "d"], 1.0)  # the pool's period doubles to 0.5
    old = c.beats["old"]
    assert old.period_s == 0.25 and old.told_s == 0.5
    assert c.expiry_s("old") == 6 * 0.5  # it may have adopted 0.5: expected at the longer
    assert old.sending_s() == 0.25  # it may not have: heartbeated at the shorter
    assert c.answer_s("old") == 2 * 0.5  # not prompt: its next heartbeats answer a stop


def test_a_period_the_node_was_not_told_is_ignored() -> None:
    c = Cadence(BASE, 6)
    registered(c, ["a"])
    c.acknowledged("a", 3600.0)  # a buggy or hostile dpd cannot make itself unlosable
    assert c.expiry_s("a") == 6 * BASE and not c.beats["a"].prompt
    c.acknowledged("ghost", 1.0)  # not registered: nothing
    assert "ghost" not in c.beats


def test_until_a_shorter_period_is_acknowledged_the_node_is_expected_at_the_longest_it_may_use() -> None:
    c = Cadence(BASE, 6, rate=8)
    registered(c, ["a", "b", "c", "d", "e", "f", "g", "h", "i"])  # 9 nodes at 8/s: 2 s
    for n in "abcdefghi":
        c.acknowledged(n, c.beats[n].told_s or 0.0)
    assert c.period_s == 2.0 and c.expiry_s("a") == 12.0
    for n in "bcdefghi":
        c.forget(n)  # the pool empties: 1 node, 0.25 s
    assert c.period_s == 0.25 and c.beats["a"].told_s == 0.25
    assert c.expiry_s("a") == 12.0  # it heartbeats every 2 s until it has the news
    c.acknowledged("a", 0.25)
    assert c.expiry_s("a") == 6 * 0.25


def test_a_prompt_node_answers_a_stop_within_two_configured_periods_whatever_the_pools_period() -> None:
    c = Cadence(BASE, 6, rate=1)
    registered(c, ["a", "b", "c", "d", "e"])  # 5 nodes at 1/s: 8 s
    assert c.period_s == 8.0
    c.acknowledged("a", 8.0)
    assert c.answer_s("a") == 2 * BASE
    assert c.answer_s("b") == 2 * 8.0  # not acknowledged yet: as an older dpd


# -- the pool follows each node's period --------------------------------------------------------


def join(pool: Pool, name: str, now: float) -> None:
    refusal, _ = pool.register(now, m.NodeRegister(name=name, incarnation=f"inc-{name}", info=NodeInfo(slots=1, advertise="127.0.0.1")))
    assert refusal is None


def lost(actions: list[Any]) -> list[str]:
    return [a.fields["node"] for a in actions if isinstance(a, Record) and a.kind == "node.lost"]


def test_the_pool_loses_a_node_after_liveness_times_its_own_period() -> None:
    pool = Pool(heartbeat_s=BASE, liveness=6, heartbeat_rate=1)
    for n in "abc":
        join(pool, n, 0.0)
    assert pool.cadence.period_s == 4.0  # 3 nodes at 1 heartbeat/s
    for n in "abc":
        pool.from_node(0.1, n, m.NodeHeartbeat(heartbeat_s=4.0))
    assert lost(pool.tick(6 * BASE + 1)) == []  # silent far longer than the configured expiry
    pool.from_node(20.0, "a", m.NodeHeartbeat(heartbeat_s=4.0))
    pool.from_node(20.0, "b", m.NodeHeartbeat(heartbeat_s=4.0))
    assert lost(pool.tick(24.2)) == ["c"]  # 24.1 s of silence: 6 x 4 s
    assert pool.cadence.period_s == 4.0 and "c" not in pool.cadence.beats


def test_a_node_heartbeat_with_its_period_makes_it_prompt_and_a_stop_is_answered_within_half_a_second() -> None:
    pool = Pool(heartbeat_s=BASE, liveness=6, heartbeat_rate=1)
    for n in "ab":
        join(pool, n, 0.0)
        pool.from_node(0.0, n, m.NodeHeartbeat(heartbeat_s=2.0))
    pool.nodes["b"].asked_at = 1.0  # as Pool._stop does for the nodes of a group stopped at once
    assert lost(pool.tick(1.4)) == []
    assert lost(pool.tick(1.5)) == ["b"]


def test_silence_is_judged_up_to_what_the_coordinator_has_read_not_the_clock() -> None:
    """2,000 answers to a stop wait in the coordinator's own input for a second: not silence."""
    pool = Pool(heartbeat_s=BASE, liveness=6)
    for n in "ab":
        join(pool, n, 0.0)
        pool.from_node(0.0, n, m.NodeHeartbeat(heartbeat_s=BASE))
    pool.nodes["b"].asked_at = 1.0
    assert lost(pool.tick(3.0, read_to=1.2)) == []  # "a" is 3 s behind the clock too, yet not lost
    assert lost(pool.tick(3.0, read_to=1.5)) == ["b"]
    assert lost(pool.tick(3.0, read_to=1.6)) == ["a"]  # 1.6 s after it was last heard: past 1.5 s


# -- the flag -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_heartbeat_rate_that_is_not_a_positive_rate_is_refused_naming_the_flag(value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text("")
    assert cli.main(["run", "--config", str(config), "--serve", "--state-dir", str(tmp_path / "s"), "--heartbeat-rate", value]) == 2
    err = capsys.readouterr().err
    assert "--heartbeat-rate" in err and "heartbeats a second" in err, err
    assert not (tmp_path / "s").exists()  # refused before anything is made


def test_the_heartbeat_rate_comes_from_the_flag_or_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("heartbeat_rate = 250.0\n")
    args = argparse.Namespace(**(dict.fromkeys(cli.CONFIG_KEYS) | {"config": str(config), "serve": cli.DEFAULT_SERVE}))
    assert cli.settings(args).heartbeat_rate == 250.0
    config.write_text("")
    assert cli.settings(args).heartbeat_rate == HEARTBEAT_RATE
