"""Macs that yield to their owners (`dpd run --yield-when`).

- The condition parsers on recorded outputs of macOS's own commands (`ioreg -c IOHIDSystem`,
  `pmset -g batt`, `pmset -g therm`, `sysctl kern.memorystatus_vm_pressure_level`) and of
  `loginctl`; the Linux readers on fake /sys and /proc trees.
- The policy (daemon/yieldpolicy.py) with injected readings and times: yield at once, come back
  only once nothing has held for the clearing time.
- The coordinator's side as pure functions (daemon/pool.py with an injected clock): a yielding
  node's work moves off as a drain's does, it takes none, it comes back, and a user's drain
  outlasts a yield.
- The flag: validated loudly, carried into the LaunchAgent and the systemd unit.
- End to end on real dpds: a node whose owner becomes active (logind's idle hint, through the
  DPOOL_YIELD_PROBE_DIR seam) yields, the job goes on without it with 0 steps recomputed, and
  takes it back when the owner has left.
"""

from __future__ import annotations

import argparse
import json
import plistlib
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import LocalPool, Processes, wait_for
from jobs import write_job
from test_pool_state import Driven, join, records, restart, running_pool, sends
from test_service import fake  # noqa: F401  (the fixture: a fake home and host)

from dpool.daemon import cli
from dpool.daemon.conditions import (
    Active,
    Battery,
    Condition,
    Memory,
    ProbeError,
    Thermal,
    files_runner,
    linux_on_battery,
    linux_throttled,
    parse_hid_idle,
    parse_logind_idle,
    parse_meminfo_available,
    parse_pmset_batt,
    parse_pmset_therm,
    parse_psi_some_avg10,
    parse_vm_pressure_level,
    parse_yield_when,
)
from dpool.daemon.jobstate import JobState
from dpool.daemon.owner import OwnerWatch
from dpool.daemon.pool import Hold
from dpool.daemon.records import Record
from dpool.daemon.yieldpolicy import Change, YieldPolicy
from dpool.protocol import messages as m
from dpool.protocol.owner_messages import NodeYield

# -- recorded outputs (macOS 14, an M2 MacBook Air; and an Intel MacBook Pro for the CPU limits) --

IOREG = """\
+-o Root  <class IORegistryEntry, id 0x100000100, retain 31>
  +-o J413AP  <class IOPlatformExpertDevice, id 0x100000212, registered, matched, active, busy 0 (34361 ms), retain 42>
    +-o IOResources  <class IOResources, id 0x100000103, registered, matched, active, busy 0 (18 ms), retain 134>
      +-o IOHIDSystem  <class IOHIDSystem, id 0x100000567, registered, matched, active, busy 0 (0 ms), retain 21>
        | {
        |   "IOClass" = "IOHIDSystem"
        |   "CFBundleIdentifier" = "com.apple.iokit.IOHIDFamily"
        |   "IOProviderClass" = "IOResources"
        |   "IOGeneralInterest" = "IOCommand is not serializable"
        |   "HIDScrollCountReset" = 0
        |   "HIDParameters" = {"HIDClickTime"=500000000,"HIDKeyRepeat"=83333333,"HIDInitialKeyRepeat"=250000000}
        |   "HIDIdleTime" = 74815262541
        |   "IOMatchCategory" = "IOHIDSystem"
        |   "CFBundleIdentifierKernel" = "com.apple.iokit.IOHIDFamily"
        |   "HIDScrollAcceleration" = 20480
        | }
        |
        +-o IOHIDUserClient  <class IOHIDUserClient, id 0x1000005cd, !registered, !matched, active, busy 0, retain 6>
"""

BATT_BATTERY = """\
Now drawing from 'Battery Power'
 -InternalBattery-0 (id=12124259)\t84%; discharging; 5:41 remaining present: true
"""
BATT_AC = """\
Now drawing from 'AC Power'
 -InternalBattery-0 (id=12124259)\t100%; charged; 0:00 remaining present: true
"""
BATT_DESKTOP = "Now drawing from 'AC Power'\n"  # a Mac mini: no battery line
BATT_UPS = """\
Now drawing from 'UPS Power'
 -CP1500PFCLCD (id=4980736)\t91%; discharging; 41:00 remaining present: true
"""

THERM_APPLE_SILICON = """\
Note: No thermal warning level has been recorded
Note: No performance warning level has been recorded
Note: No CPU power status has been recorded
"""
THERM_INTEL_COOL = """\
Note: No thermal warning level has been recorded
Note: No performance warning level has been recorded
2024-03-02 10:41:07 +0100 CPU Power notify
\tCPU_Scheduler_Limit \t= 100
\tCPU_Available_CPUs \t= 8
\tCPU_Speed_Limit \t= 100
"""
THERM_INTEL_THROTTLED = """\
Note: No thermal warning level has been recorded
Note: No performance warning level has been recorded
2020-11-24 13:10:40 +0100 CPU Power notify
\tCPU_Scheduler_Limit \t= 100
\tCPU_Available_CPUs \t= 8
\tCPU_Speed_Limit \t= 35
"""
THERM_WARNING = """\
2024-03-02 14:02:55 +0100 Thermal Warning Level = 2
Note: No performance warning level has been recorded
Note: No CPU power status has been recorded
"""

SYSCTL_NORMAL = "kern.memorystatus_vm_pressure_level: 1\n"
SYSCTL_WARN = "kern.memorystatus_vm_pressure_level: 2\n"
SYSCTL_CRITICAL = "4\n"  # `sysctl -n`

LOGIND_ACTIVE = "IdleHint=no\nIdleSinceHint=0\n"


def logind_idle_since(t: float) -> str:
    return f"IdleHint=yes\nIdleSinceHint={int(t * 1e6)}\n"


# -- parsers ------------------------------------------------------------------------------------


def test_macos_idle_time_is_the_hid_idle_time_in_seconds() -> None:
    assert parse_hid_idle(IOREG) == pytest.approx(74.815262541)
    assert parse_hid_idle("+-o Root  <class IORegistryEntry>\n") is None


def test_macos_battery_is_the_source_pmset_draws_from() -> None:
    assert parse_pmset_batt(BATT_BATTERY) is True
    assert parse_pmset_batt(BATT_UPS) is True  # a UPS's battery is a battery too
    assert parse_pmset_batt(BATT_AC) is False
    assert parse_pmset_batt(BATT_DESKTOP) is False
    assert parse_pmset_batt("pmset: some error\n") is None


def test_macos_thermal_is_a_speed_limit_or_a_warning_level() -> None:
    assert parse_pmset_therm(THERM_APPLE_SILICON) is False  # nothing recorded: not throttled
    assert parse_pmset_therm(THERM_INTEL_COOL) is False
    assert parse_pmset_therm(THERM_INTEL_THROTTLED) is True
    assert parse_pmset_therm(THERM_WARNING) is True
    assert parse_pmset_therm("Thermal Warning Level = 0\n") is False
    assert parse_pmset_therm("") is None


def test_macos_memory_pressure_is_the_kernels_level() -> None:
    assert parse_vm_pressure_level(SYSCTL_NORMAL) == 1
    assert parse_vm_pressure_level(SYSCTL_WARN) == 2
    assert parse_vm_pressure_level(SYSCTL_CRITICAL) == 4
    assert parse_vm_pressure_level("sysctl: unknown oid 'kern.memorystatus_vm_pressure_level'\n") is None


def test_logind_idle_is_zero_while_a_session_is_active_else_the_time_since_the_hint() -> None:
    now = 1_700_000_000.0
    assert parse_logind_idle(LOGIND_ACTIVE, now) == 0.0
    assert parse_logind_idle(logind_idle_since(now - 90), now) == pytest.approx(90)
    assert parse_logind_idle("IdleHint=yes\nIdleSinceHint=0\n", now) is None  # idle since "never": not known
    assert parse_logind_idle("Failed to connect to bus\n", now) is None


def test_psi_and_meminfo() -> None:
    psi = "some avg10=23.51 avg60=8.02 avg300=1.77 total=912364\nfull avg10=11.20 avg60=3.01 avg300=0.61 total=401223\n"
    assert parse_psi_some_avg10(psi) == pytest.approx(23.51)
    assert parse_psi_some_avg10("full avg10=1.00\n") is None
    meminfo = "MemTotal:       16303428 kB\nMemFree:          212148 kB\nMemAvailable:     489102 kB\n"
    assert parse_meminfo_available(meminfo) == pytest.approx(489102 / 16303428)
    assert parse_meminfo_available("MemFree: 1 kB\n") is None


# -- Linux readers on fake trees ------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def test_linux_battery_from_power_supply(tmp_path: Path) -> None:
    ps = "sys/class/power_supply"
    laptop = {f"{ps}/AC/type": "Mains", f"{ps}/AC/online": "1", f"{ps}/BAT0/type": "Battery", f"{ps}/BAT0/present": "1", f"{ps}/BAT0/status": "Charging"}
    assert linux_on_battery(write_tree(tmp_path / "a", laptop)) is False
    unplugged = laptop | {f"{ps}/AC/online": "0", f"{ps}/BAT0/status": "Discharging"}
    assert linux_on_battery(write_tree(tmp_path / "b", unplugged)) is True
    # Some firmware says "Not charging" on battery: mains offline is enough.
    assert linux_on_battery(write_tree(tmp_path / "c", laptop | {f"{ps}/AC/online": "0", f"{ps}/BAT0/status": "Not charging"})) is True
    desktop = {f"{ps}/hidpp_battery_0/type": "Battery", f"{ps}/hidpp_battery_0/status": "Discharging", f"{ps}/hidpp_battery_0/present": "0"}
    assert linux_on_battery(write_tree(tmp_path / "d", desktop)) is False  # an absent battery does not count
    assert linux_on_battery(tmp_path / "none") is False  # no power_supply at all: a server


def test_linux_thermal_zones_against_their_passive_trip_points(tmp_path: Path) -> None:
    tz = "sys/class/thermal/thermal_zone0"
    zone = {f"{tz}/temp": "61000", f"{tz}/trip_point_0_type": "active", f"{tz}/trip_point_0_temp": "55000",
            f"{tz}/trip_point_1_type": "passive", f"{tz}/trip_point_1_temp": "95000", f"{tz}/trip_point_2_type": "critical", f"{tz}/trip_point_2_temp": "105000"}
    assert linux_throttled(write_tree(tmp_path / "cool", zone)) is False  # above the fan's trip, below the passive one
    assert linux_throttled(write_tree(tmp_path / "hot", zone | {f"{tz}/temp": "96000"})) is True
    assert linux_throttled(write_tree(tmp_path / "fan-only", {f"{tz}/temp": "61000", f"{tz}/trip_point_0_type": "active", f"{tz}/trip_point_0_temp": "55000"})) is None
    assert Thermal("linux", root=tmp_path / "empty").read(0.0).holds is None
    assert "not available here" in Thermal("linux", root=tmp_path / "empty").read(0.0).detail


def test_linux_memory_reads_psi_else_meminfo(tmp_path: Path) -> None:
    calm = write_tree(tmp_path / "calm", {"proc/pressure/memory": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0"})
    assert Memory("linux", root=calm).read(0.0).holds is False
    squeezed = write_tree(tmp_path / "squeezed", {"proc/pressure/memory": "some avg10=42.10 avg60=20.00 avg300=5.00 total=9\nfull avg10=9.00 avg60=1.00 avg300=0.10 total=3"})
    assert Memory("linux", root=squeezed).read(0.0).holds is True
    old_kernel = write_tree(tmp_path / "old", {"proc/meminfo": "MemTotal: 1000000 kB\nMemAvailable: 20000 kB"})
    assert Memory("linux", root=old_kernel).read(0.0).holds is True
    assert Memory("linux", root=tmp_path / "nothing").read(0.0).holds is None


def test_sources_run_the_platforms_commands_and_a_failure_is_unknown(tmp_path: Path) -> None:
    outputs = write_tree(tmp_path / "out", {"ioreg": IOREG, "pmset-batt": BATT_BATTERY, "pmset-therm": THERM_APPLE_SILICON, "sysctl": SYSCTL_WARN})
    run = files_runner(outputs)
    assert Active("darwin", run, minutes=1).read(0.0).holds is False  # idle 75 s > 1 min
    assert Active("darwin", run, minutes=2).read(0.0).holds is True
    assert Battery("darwin", run).read(0.0).holds is True
    assert Thermal("darwin", run).read(0.0).holds is False
    assert Memory("darwin", run).read(0.0).holds is True
    missing = files_runner(tmp_path / "none")
    with pytest.raises(ProbeError):
        missing("ioreg", ["ioreg"])
    r = Active("darwin", missing).read(0.0)
    assert r.holds is None and "ioreg" in r.detail
    assert Battery("win32", run).read(0.0).holds is None


def test_a_command_that_does_not_exist_or_hangs_is_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import shutil

    from dpool.daemon import conditions

    sleep = shutil.which("sleep")
    monkeypatch.setenv("PATH", str(tmp_path))
    r = Active("linux", conditions.run_command).read(time.time())
    assert r.holds is None and "not found" in r.detail
    hang = tmp_path / "loginctl"
    hang.write_text(f"#!/bin/sh\nexec {sleep} 30\n")
    hang.chmod(0o755)
    monkeypatch.setattr(conditions, "COMMAND_TIMEOUT_S", 0.2)
    t0 = time.monotonic()
    r = Active("linux", conditions.run_command).read(time.time())
    assert r.holds is None and "no answer" in r.detail and time.monotonic() - t0 < 10


# -- the flag ------------------------------------------------------------------------------------


def test_yield_when_takes_the_conditions_in_any_order() -> None:
    assert parse_yield_when("active") == (Condition("active", 5.0),)
    assert parse_yield_when("battery, active:10,thermal,memory") == (
        Condition("battery"), Condition("active", 10.0), Condition("thermal"), Condition("memory"))
    assert parse_yield_when("active:0.5") == (Condition("active", 0.5),)


@pytest.mark.parametrize(("value", "said"), [
    ("sleepy", "unknown condition 'sleepy'"),
    ("active:soon", "MINUTES must be a number"),
    ("active:-3", "MINUTES must be a number"),
    ("active:nan", "MINUTES must be a number"),
    ("battery:5", "only active takes minutes"),
    ("battery,battery", "given twice"),
    ("active,", "an empty condition"),
])
def test_a_bad_yield_when_is_refused_naming_the_flag(value: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text("")
    assert cli.main(["run", "--config", str(config), "--serve", "--state-dir", str(tmp_path / "s"), "--yield-when", value]) == 2
    err = capsys.readouterr().err
    assert "--yield-when" in err and said in err, err
    assert not (tmp_path / "s").exists()  # refused before anything is made


def test_yield_when_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('yield_when = "active:3,battery"\n')
    args = argparse.Namespace(**(dict.fromkeys(cli.CONFIG_KEYS) | {"config": str(config), "serve": cli.DEFAULT_SERVE}))
    assert cli.settings(args).yield_when == (Condition("active", 3.0), Condition("battery"))
    config.write_text('yield_when = "warm"\n')
    with pytest.raises(cli.UsageError, match=f"{config}: yield_when = 'warm': unknown condition"):  # the file and key, not a flag never passed
        cli.settings(args)


def test_the_flag_is_carried_into_the_launch_agent_and_the_unit(fake, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    fake("darwin", uid=501)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--yield-when", "active:10,battery"]) == 0
    args = plistlib.loads((fake.home / "Library" / "LaunchAgents" / "org.dpool.dpd.plist").read_bytes())["ProgramArguments"]
    assert args[args.index("--yield-when") + 1] == "active:10,battery"
    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--yield-when", "thermal,memory"]) == 0
    unit = (fake.home / ".config" / "systemd" / "user" / "dpd.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart=")).split()
    assert exec_start[exec_start.index("--yield-when") + 1] == "thermal,memory"
    fake.recorder.calls.clear()
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--yield-when", "active:x"]) == 2
    assert fake.recorder.calls == []  # refused before anything is written or loaded


# -- the policy ----------------------------------------------------------------------------------


def test_the_node_yields_at_the_first_reading_that_holds() -> None:
    p = YieldPolicy(clear_s=120)
    assert p.observe(0.0, []) is None and p.yielding is None
    assert p.observe(5.0, ["owner active"]) == Change("owner active", None)
    assert p.observe(10.0, ["owner active"]) is None  # no news


def test_it_comes_back_only_once_nothing_has_held_for_the_clearing_time() -> None:
    p = YieldPolicy(clear_s=120)
    p.observe(0.0, ["on battery"])
    assert p.observe(60.0, []) is None and p.yielding == "on battery"  # cleared, not for long enough
    assert p.returns_at() == 120.0
    assert p.observe(100.0, ["on battery"]) is None  # back on battery: the wait starts again
    assert p.observe(219.0, []) is None
    assert p.observe(220.0, []) == Change(None, "on battery") and p.yielding is None and p.returns_at() is None


def test_a_flickering_condition_does_not_move_the_job_back_and_forth() -> None:
    p = YieldPolicy(clear_s=120)
    changes = [c for t in range(0, 600, 5) if (c := p.observe(float(t), ["thermal pressure"] if t % 60 == 0 else [])) is not None]
    assert changes == [Change("thermal pressure", None)]  # one yield, no return while it keeps coming back


def test_the_reason_follows_what_holds() -> None:
    p = YieldPolicy(clear_s=10)
    p.observe(0.0, ["owner active"])
    assert p.observe(1.0, ["owner active", "on battery"]) == Change("owner active, on battery", "owner active")
    assert p.observe(2.0, []) is None and p.yielding == "owner active, on battery"  # clearing: the last reason stays


def test_unknown_readings_never_make_a_node_yield(tmp_path: Path) -> None:
    """Every probe failing (no loginctl, no pmset): the watch reads unknown, logs it once, and the
    node works on."""
    lines: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            lines.append((event, kw))

        info = warning

    watch = OwnerWatch(parse_yield_when("active,battery,thermal,memory"), Log(), platform="darwin", run=files_runner(tmp_path / "none"))
    for t in range(3):
        watch.clock = lambda t=t: float(t)
        assert watch.step(watch.read()) is None
    assert watch.yielding is None
    assert sorted(kw["condition"] for e, kw in lines if e == "yield.source_unknown") == ["active", "battery", "memory", "thermal"]  # once each
    write_tree(tmp_path / "none", {"pmset-batt": BATT_BATTERY})
    change = watch.step(watch.read())
    assert change == Change("on battery", None)
    assert [kw["condition"] for e, kw in lines if e == "yield.source_back"] == ["battery"]


def test_a_source_that_raises_reads_unknown_and_the_watch_goes_on(tmp_path: Path) -> None:
    events: list[str] = []

    class Log:
        def warning(self, event: str, **kw: Any) -> None:
            events.append(event)

        info = warning

    watch = OwnerWatch(parse_yield_when("thermal"), Log(), platform="darwin", run=files_runner(tmp_path))

    def broken(now: float) -> Any:
        raise IndexError("a parser's bug")

    watch.sources[0].read = broken  # type: ignore[method-assign]
    ((_, reading),) = watch.read()
    assert reading.holds is None and "IndexError" in reading.detail and events == ["yield.source_unknown"]


def test_the_probe_dir_seam_and_its_settings_come_from_the_environment(tmp_path: Path) -> None:
    write_tree(tmp_path, {"loginctl": LOGIND_ACTIVE})
    watch = OwnerWatch.from_env(parse_yield_when("active"), None, {"DPOOL_YIELD_PROBE_DIR": str(tmp_path), "DPOOL_YIELD_PERIOD_S": "0.1", "DPOOL_YIELD_CLEAR_S": "2"})
    assert (watch.period_s, watch.policy.clear_s) == (0.1, 2.0)
    if watch.sources[0].platform.startswith("linux"):
        assert watch.sources[0].read(time.time()).holds is True
    with pytest.raises(ValueError, match="DPOOL_YIELD_PERIOD_S"):
        OwnerWatch.from_env(parse_yield_when("active"), None, {"DPOOL_YIELD_PERIOD_S": "-1"})


# -- the coordinator's side (pure) ---------------------------------------------------------------


def say(pool: Driven, now: float, name: str, why: str | None) -> list[Any]:
    return pool._then_schedule(now, pool.from_node(now, name, NodeYield(reason=why)))


def test_a_yielding_node_drains_with_no_step_lost_takes_no_work_and_comes_back() -> None:
    pool = running_pool()
    out = say(pool, 2.0, "c", "owner active")
    assert records(out, "node.yielding") == [{"node": "c", "reason": "owner active"}]
    assert sends(out, m.GroupStop) and all(s.msg.mode == "checkpoint" for s in sends(out, m.GroupStop))  # type: ignore[attr-defined]
    row = pool.node_rows(2.0)[2]
    assert (row.state, row.reason) == ("yielding", "owner active")
    for r, n in enumerate("abc"):
        out = pool.worker_exited(2.2, n, "j", 1, r, 0, 75, False)
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"]  # the job goes on without c
    out = restart(pool, out, 3.0, resume=8)
    assert records(out, "group.resumed")[0]["steps_recomputed"] == 0
    assert pool.node_rows(5.0)[2].state == "yielding" and pool.nodes["c"].free() == []
    assert records(say(pool, 5.0, "c", "owner active"), "node.yielding") == []  # no news
    out = say(pool, 6.0, "c", None)
    assert records(out, "node.returned") == [{"node": "c", "reason": "owner active"}]
    assert (pool.node_rows(6.0)[2].state, pool.node_rows(6.0)[2].reason) == ("idle", None)
    # The job grows back onto c (it answers its warm-up at once here).
    assert [s.node for s in sends(out, m.JobWarm)] == ["c"]
    out = pool.from_node(6.5, "c", m.NodeWarmed(job="j", slots=[0])) + pool.schedule(6.5)
    assert sorted(s.node for s in sends(out, m.GroupStop)) == ["a", "b"]
    assert pool.jobs["j"].machine.restarts == 0  # a yield is a membership change, never a failure


def test_a_job_a_yield_leaves_below_its_minimum_is_preempted_naming_the_yield() -> None:
    """The job needs both nodes; b's owner needs b back: the job stops at a checkpoint and waits in
    the queue, and says so as a preemption by no job, its cause the yield (as job.shrunk says a
    shrink's)."""
    pool = running_pool(("a", "b"), lo=2)
    out = say(pool, 2.0, "b", "memory pressure")
    assert sends(out, m.GroupStop)
    pool.progress(2.1, "j", 1, 0, 8, 192, 0.05)  # the step the stop was fused into
    for r, n in enumerate("ab"):
        pool.checkpoint(2.15, n, "j", 1, r, 0, 8, 0.01)
    out = []
    for r, n in enumerate("ab"):
        out += pool.worker_exited(2.25, n, "j", 1, r, 0, 75, False)
    assert pool.jobs["j"].state is JobState.QUEUED
    assert [a.kind for a in out if isinstance(a, Record) and a.kind.startswith("job.")] == ["job.preempted", "job.queued"]
    (pre,) = records(out, "job.preempted")
    assert pre == {"by": [], "from": 2, "cause": "node b yields to its owner (memory pressure)", "step": 8, "steps_lost": 0, "stop_s": 0.25}


def test_a_users_drain_outlasts_the_yield_and_an_undrain_while_yielding_keeps_it_yielding() -> None:
    pool = running_pool(("a", "b"))
    say(pool, 2.0, "b", "on battery")
    out = pool.drain(2.1, "b")
    assert records(out, "node.draining") == [{"node": "b"}] and sends(out, m.GroupStop) == []  # its work is leaving already
    pool.worker_exited(2.2, "a", "j", 1, 0, 0, 75, False)
    out = pool.worker_exited(2.2, "b", "j", 1, 1, 0, 75, False)
    assert records(out, "node.drained") == [{"node": "b"}]
    out = say(pool, 3.0, "b", None)
    assert records(out, "node.returned") == []
    assert (pool.nodes["b"].hold, pool.node_rows(3.0)[1].reason) == (Hold.DRAINED, "drained")  # the owner's condition ended; the user's drain did not
    say(pool, 4.0, "b", "owner active")
    assert pool.nodes["b"].hold is Hold.DRAINED
    out = pool.undrain(5.0, "b")
    row = pool.node_rows(5.0)[1]
    assert (row.state, row.reason) == ("yielding", "owner active")  # undrained, but its owner still needs it
    say(pool, 6.0, "b", None)
    assert pool.node_rows(6.0)[1].state == "idle"


def test_a_node_yielding_while_a_group_is_prepared_there_is_left_out_of_it() -> None:
    pool = Driven(heartbeat_s=0.5, liveness=6)
    for n in "ab":
        join(pool, n, 1)
    out = pool.submit(0.0, "j", _spec(hi=2))
    assert sorted(s.node for s in sends(out, m.GroupPrepare)) == ["a", "b"]
    out = say(pool, 0.5, "b", "thermal pressure")
    assert [s.node for s in sends(out, m.GroupPrepare)] == ["a"]  # prepared again, without b


def _spec(**kw: Any) -> Any:
    from test_pool_state import spec

    return spec(**kw)


def test_a_yield_is_the_dpds_to_say_after_a_restart() -> None:
    """A hold of drain or set-aside outlives a dpd restart; a yield does not (the new process says
    its own state once registered), so a dpd restarted without --yield-when is not stuck."""
    pool = Driven(heartbeat_s=0.5, liveness=6)
    join(pool, "a", 1)
    say(pool, 1.0, "a", "owner active")
    pool.bye(2.0, "a")
    refusal, _ = pool.register(3.0, m.NodeRegister(name="a", incarnation="new", info=pool.nodes["a"].info))
    assert refusal is None and pool.nodes["a"].hold is None
    pool.remembered = {"a": (Hold.YIELDING, "owner active")}  # a restarted coordinator's store
    pool.bye(4.0, "a")
    pool.register(5.0, m.NodeRegister(name="a", incarnation="newer", info=pool.nodes["a"].info))
    assert pool.nodes["a"].hold is None and pool.node_rows(5.0)[0].state == "idle"


# -- end to end: real dpds -------------------------------------------------------------------------


def table_row(text: str, name: str) -> dict[str, str]:
    """`dpctl nodes`' row for node `name`, by column (the header's words start each column)."""
    header, *rows = text.splitlines()
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]

    def cells(line: str) -> list[str]:
        return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]

    return next(dict(zip(cells(header), cells(r), strict=True)) for r in rows if r.startswith(name + " "))


def test_dpctl_nodes_says_why_a_node_yields_in_its_reason_column(processes: Processes, tmp_path: Path) -> None:
    """A real dpd on battery (its /sys through DPOOL_YIELD_PROBE_DIR) yields as it registers: the
    table's STATE says yielding and REASON why, as `nodes --json`'s "reason" does (REASON showed
    "-" and the reason sat in STATE)."""
    ps = "sys/class/power_supply"
    probe = write_tree(tmp_path / "probe", {f"{ps}/AC/type": "Mains", f"{ps}/AC/online": "0", f"{ps}/BAT0/type": "Battery", f"{ps}/BAT0/present": "1", f"{ps}/BAT0/status": "Discharging"})
    pool = LocalPool(processes, tmp_path)
    pool.start_daemon("n0", serve=True, args=["--yield-when", "battery"], env={"DPOOL_YIELD_PROBE_DIR": str(probe), "DPOOL_YIELD_PERIOD_S": "0.1"})
    pool.wait_registered(1)
    wait_for("n0 yielding", lambda: any(n.name == "n0" and n.state == "yielding" for n in pool.nodes()), 30, every=0.05)
    assert [(n["state"], n["reason"]) for n in pool.dpctl_json("nodes")] == [("yielding", "on battery")]
    table = pool.dpctl("nodes")
    assert table.returncode == 0, table.stderr
    row = table_row(table.stdout, "n0")
    assert (row["STATE"], row["REASON"]) == ("yielding", "on battery"), table.stdout


@pytest.mark.slow
def test_a_node_whose_owner_becomes_active_drains_and_returns(processes: Processes, tmp_path: Path) -> None:
    """(e): n2's owner sits down (logind says a session is active): n2 yields, its work moves to
    n0 and n1 with 0 steps recomputed, `dpctl nodes` says why; the owner leaves (idle since an hour
    ago): after the clearing time n2 takes work again and the job grows back onto it."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "loginctl").write_text(logind_idle_since(time.time() - 3600))
    pool = LocalPool(processes, tmp_path)
    pool.start_daemon("n0", serve=True)
    pool.start_daemon("n1")
    pool.start_daemon("n2", args=["--yield-when", "active:1"], env={"DPOOL_YIELD_PROBE_DIR": str(probe), "DPOOL_YIELD_PERIOD_S": "0.1", "DPOOL_YIELD_CLEAR_S": "1"})
    pool.wait_registered(3)
    job = pool.submit(write_job(tmp_path, "owner", workers={"min": 1, "max": 3}, train={"steps": 100_000, "global_batch": 6}, checkpoint={"every_steps": 1000}))
    pool.wait_status(job, "3 workers mid-run", lambda s: s.state == "running" and s.world_size == 3 and s.step >= 3, timeout=120, every=0.05)

    (probe / "loginctl").write_text(LOGIND_ACTIVE)  # the owner touches the keyboard
    n2 = wait_for("n2 yielding", lambda: next((n for n in pool.nodes() if n.name == "n2" and n.state == "yielding"), None), 30, every=0.05)
    assert n2.reason == "owner active"
    shrunk = pool.wait_status(job, "the job on n0 and n1 alone", lambda s: s.state == "running" and s.world_size == 2 and s.generation >= 2, timeout=60, every=0.05)
    assert {w.node for w in shrunk.workers} == {"n0", "n1"}
    table = pool.dpctl("nodes")
    assert table.returncode == 0 and (table_row(table.stdout, "n2")["STATE"], table_row(table.stdout, "n2")["REASON"]) == ("yielding", "owner active"), table.stdout
    undrain = pool.dpctl("undrain", "n2")  # a user's undrain does not overrule the owner
    assert undrain.returncode == 0 and "yields to its owner (owner active)" in undrain.stdout, undrain.stdout
    step = pool.wait_status(job, "steps without n2", lambda s: s.step >= shrunk.step + 3, timeout=60, every=0.05).step
    assert all(n.job is None for n in pool.nodes() if n.name == "n2")  # it takes no work while yielding

    (probe / "loginctl").write_text(logind_idle_since(time.time() - 3600))  # the owner leaves
    wait_for("n2 back", lambda: any(n.name == "n2" and n.state != "yielding" for n in pool.nodes()), 30, every=0.05)
    grown = pool.wait_status(job, "the job back on 3 nodes", lambda s: s.state == "running" and s.world_size == 3 and s.generation > shrunk.generation and s.step > step, timeout=60, every=0.05)
    assert "n2" in {w.node for w in grown.workers}

    assert pool.dpctl("cancel", job).returncode == 0
    pool.wait_end(job, 60)
    events = pool.dpctl_json("events", job)
    kinds = [e["kind"] for e in events]
    assert [(e["node"], e["reason"]) for e in events if e["kind"] == "node.yielding"] == [("n2", "owner active")]
    assert next(e for e in events if e["kind"] == "node.returned")["node"] == "n2"
    resumed = [e for e in events if e["kind"] == "group.resumed"]
    assert len(resumed) >= 2 and all(e["steps_recomputed"] == 0 and e["cause"] == "membership" for e in resumed), resumed
    assert "worker.failed" not in kinds, events
    steps = [r["step"] for r in pool.dpctl_json("metrics", job) if r["kind"] == "train"]
    assert steps == list(range(1, len(steps) + 1))
    log = (tmp_path / "dpd-n2.log").read_text()
    assert '"node.yielding"' in log and '"node.returned"' in log
    json.loads(next(line for line in log.splitlines() if '"node.yielding"' in line))  # one JSON line, as logs are
