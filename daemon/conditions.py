"""What a machine says about its owner: the conditions `dpd run --yield-when` watches.

    active[:MINUTES]  the owner used the keyboard or mouse within MINUTES (default 5)
                      macOS: `ioreg -c IOHIDSystem` HIDIdleTime (ns since the last input event);
                      Linux: logind's IdleHint/IdleSinceHint (`loginctl show-session`, no
                      argument: the manager's, idle only when every session is)
    battery           running on battery
                      macOS: `pmset -g batt` ("Now drawing from 'Battery Power'");
                      Linux: /sys/class/power_supply (a battery discharging, or mains offline)
    thermal           the machine is throttled for heat
                      macOS: `pmset -g therm` (a CPU speed or scheduler limit under 100, or a
                      thermal or performance warning level recorded);
                      Linux: /sys/class/thermal (a zone at or above a passive, hot or critical trip)
    memory            the system is short of memory
                      macOS: `sysctl kern.memorystatus_vm_pressure_level` (2 warn, 4 critical);
                      Linux: PSI /proc/pressure/memory ("some" avg10 at or above 10%), else
                      MemAvailable under 5% of MemTotal in /proc/meminfo

One class per condition, each with its macOS and its Linux reading; the parsers are pure
functions of the command's output (tested on recorded outputs) and the Linux readers take the
file system's root (tested on fake trees). A reading is `holds` True (yield), False (clear) or None
(unknown: the command failed, timed out, or printed what the parser does not know). Unknown never
means yield: a broken probe must not take a machine out of the pool.

Commands go through a `Runner` with a timeout (`run_command`); `files_runner(DIR)` answers from
files instead (`DIR/KEY` holds what the command would print), the seam `DPOOL_YIELD_PROBE_DIR` uses
so that tests drive a real dpd's conditions (daemon/owner.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

CONDITIONS = ("active", "battery", "thermal", "memory")
ACTIVE_MINUTES = 5.0  # `active` alone: the owner used the machine within the last 5 minutes
ACTIVE_MINUTES_MAX = 24 * 60.0
COMMAND_TIMEOUT_S = 5.0  # a probe command that takes longer reads as unknown
PSI_SOME_AVG10 = 10.0  # % of the last 10 s in which some task waited for memory
MEM_AVAILABLE_FRACTION = 0.05  # without PSI: MemAvailable under this share of MemTotal
MACOS_PRESSURE_WARN = 2  # kern.memorystatus_vm_pressure_level: 1 normal, 2 warn, 4 critical
TRIP_TYPES = ("passive", "hot", "critical")  # trip points where the kernel throttles (not "active": a fan)

# What `dpctl nodes` says a yielding node yields for.
LABELS = {"active": "owner active", "battery": "on battery", "thermal": "thermal pressure", "memory": "memory pressure"}


class ProbeError(Exception):
    """A probe could not be read (the command failed or timed out, a file is missing)."""


@dataclass(frozen=True, slots=True)
class Condition:
    name: str  # one of CONDITIONS
    minutes: float | None = None  # `active` only: how recent an input event counts as the owner at the machine

    def __str__(self) -> str:
        return self.name if self.minutes is None else f"{self.name}:{self.minutes:g}"


def parse_yield_when(text: str) -> tuple[Condition, ...]:
    """`active[:MINUTES],battery,thermal,memory` (any subset, any order, each at most once).
    Raises ValueError saying what was wrong and what is allowed."""
    out: list[Condition] = []
    for part in (p.strip() for p in text.split(",")):
        name, colon, arg = part.partition(":")
        name = name.strip().lower()
        if not name:
            raise ValueError(f"an empty condition in {text!r}; allowed: active[:MINUTES], battery, thermal, memory")
        if name not in CONDITIONS:
            raise ValueError(f"unknown condition {name!r}; allowed: active[:MINUTES], battery, thermal, memory")
        if any(c.name == name for c in out):
            raise ValueError(f"{name!r} is given twice")
        if name != "active":
            if colon:
                raise ValueError(f"{part!r}: only active takes minutes (active:MINUTES)")
            out.append(Condition(name))
            continue
        minutes = ACTIVE_MINUTES
        if colon:
            try:
                minutes = float(arg)
            except ValueError:
                minutes = float("nan")
            if not 0 < minutes <= ACTIVE_MINUTES_MAX:  # nan fails both
                raise ValueError(f"{part!r}: MINUTES must be a number of minutes above 0 and at most {ACTIVE_MINUTES_MAX:g}")
        out.append(Condition(name, minutes))
    return tuple(out)


# -- running commands ----------------------------------------------------------------------------

# (key, argv): `key` names the command's output in a probe dir.
Runner = Callable[[str, Sequence[str]], str]


def run_command(key: str, argv: Sequence[str]) -> str:
    """The command's stdout; ProbeError when it is missing, fails or takes over COMMAND_TIMEOUT_S."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, env={**os.environ, "LC_ALL": "C"})
    except FileNotFoundError:
        raise ProbeError(f"{argv[0]}: not found on this machine") from None
    except subprocess.TimeoutExpired:
        raise ProbeError(f"{' '.join(argv)}: no answer within {COMMAND_TIMEOUT_S:g} s") from None
    except OSError as e:
        raise ProbeError(f"{argv[0]}: {e.strerror or e}") from None
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip().splitlines()
        raise ProbeError(f"{' '.join(argv)} exited {r.returncode}: {said[0][:200] if said else 'no output'}")
    return r.stdout


def files_runner(folder: Path) -> Runner:
    """A runner whose commands print `folder/KEY` (missing: the command failed)."""

    def run(key: str, argv: Sequence[str]) -> str:
        try:
            return (folder / key).read_text()
        except OSError as e:
            raise ProbeError(f"{' '.join(argv)} (from {folder / key}): {e.strerror or e}") from None

    return run


# -- readings ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reading:
    holds: bool | None  # True: yield; False: clear; None: unknown, never a reason to yield
    detail: str  # what was read, for the log


def unknown(detail: str) -> Reading:
    return Reading(None, detail)


class Source:
    """One condition, read on this platform. `read(now)` never raises: a failure is unknown."""

    name = ""

    def __init__(self, platform: str, run: Runner = run_command, root: Path = Path("/")) -> None:
        self.platform, self.run, self.root = platform, run, root

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def read(self, now: float) -> Reading:
        try:
            if self.platform == "darwin":
                return self.darwin(now)
            if self.platform.startswith("linux"):
                return self.linux(now)
        except ProbeError as e:
            return unknown(str(e))
        except OSError as e:
            return unknown(f"{self.name}: {e}")
        return unknown(f"{self.name}: not available on {self.platform}")

    def darwin(self, now: float) -> Reading:
        raise NotImplementedError

    def linux(self, now: float) -> Reading:
        raise NotImplementedError


class Active(Source):
    """The owner at the keyboard: an input event within `minutes`."""

    name = "active"

    def __init__(self, platform: str, run: Runner = run_command, root: Path = Path("/"), *, minutes: float = ACTIVE_MINUTES) -> None:
        super().__init__(platform, run, root)
        self.minutes = minutes

    def _verdict(self, idle_s: float | None, what: str) -> Reading:
        if idle_s is None:
            return unknown(f"{what}: no idle time in its output")
        return Reading(idle_s < self.minutes * 60, f"idle {idle_s:.0f} s (active within {self.minutes:g} min counts)")

    def darwin(self, now: float) -> Reading:
        return self._verdict(parse_hid_idle(self.run("ioreg", ["ioreg", "-c", "IOHIDSystem"])), "ioreg -c IOHIDSystem")

    def linux(self, now: float) -> Reading:
        out = self.run("loginctl", ["loginctl", "show-session", "-p", "IdleHint", "-p", "IdleSinceHint"])
        return self._verdict(parse_logind_idle(out, now), "loginctl show-session")


class Battery(Source):
    name = "battery"

    def darwin(self, now: float) -> Reading:
        on = parse_pmset_batt(self.run("pmset-batt", ["pmset", "-g", "batt"]))
        return unknown("pmset -g batt: no power source in its output") if on is None else Reading(on, "on battery" if on else "on AC power")

    def linux(self, now: float) -> Reading:
        on = linux_on_battery(self.root)
        return Reading(on, "on battery" if on else "on mains power")


class Thermal(Source):
    name = "thermal"

    def darwin(self, now: float) -> Reading:
        hot = parse_pmset_therm(self.run("pmset-therm", ["pmset", "-g", "therm"]))
        return unknown("pmset -g therm: output not understood") if hot is None else Reading(hot, "throttled" if hot else "no thermal limit")

    def linux(self, now: float) -> Reading:
        hot = linux_throttled(self.root)
        if hot is None:
            return unknown("thermal: not available here (no thermal zone with a passive, hot or critical trip point)")
        return Reading(hot, "a thermal zone at its trip point" if hot else "every thermal zone below its trip points")


class Memory(Source):
    name = "memory"

    def darwin(self, now: float) -> Reading:
        level = parse_vm_pressure_level(self.run("sysctl", ["sysctl", "kern.memorystatus_vm_pressure_level"]))
        if level is None:
            return unknown("sysctl kern.memorystatus_vm_pressure_level: output not understood")
        return Reading(level >= MACOS_PRESSURE_WARN, f"memory pressure level {level}")

    def linux(self, now: float) -> Reading:
        psi = self.root / "proc" / "pressure" / "memory"
        if psi.exists():
            some = parse_psi_some_avg10(psi.read_text())
            if some is None:
                return unknown(f"{psi}: output not understood")
            return Reading(some >= PSI_SOME_AVG10, f"memory PSI some avg10={some:g}%")
        share = parse_meminfo_available(((self.root / "proc" / "meminfo")).read_text())
        if share is None:
            return unknown("/proc/meminfo: no MemTotal/MemAvailable")
        return Reading(share < MEM_AVAILABLE_FRACTION, f"{share:.0%} of memory available")


SOURCES: dict[str, type[Source]] = {"active": Active, "battery": Battery, "thermal": Thermal, "memory": Memory}


def sources(conditions: Sequence[Condition], platform: str, run: Runner = run_command, root: Path = Path("/")) -> list[Source]:
    out: list[Source] = []
    for c in conditions:
        if c.name == "active":
            out.append(Active(platform, run, root, minutes=c.minutes or ACTIVE_MINUTES))
        else:
            out.append(SOURCES[c.name](platform, run, root))
    return out


# -- macOS parsers (pure) ------------------------------------------------------------------------

_HID_IDLE = re.compile(r'"HIDIdleTime"\s*=\s*(\d+)')


def parse_hid_idle(text: str) -> float | None:
    """Seconds since the last input event, from `ioreg -c IOHIDSystem` (HIDIdleTime, in ns: the
    first IOHIDSystem's, as IOKit's own idle-time code reads it)."""
    m = _HID_IDLE.search(text)
    return int(m.group(1)) / 1e9 if m else None


_DRAWING = re.compile(r"Now drawing from '([^']+)'")


def parse_pmset_batt(text: str) -> bool | None:
    """On battery, from `pmset -g batt`: "Now drawing from 'Battery Power'" (or a UPS's battery)
    vs 'AC Power'; None when it names no source."""
    m = _DRAWING.search(text)
    if m is None:
        return None
    return m.group(1) != "AC Power"


_LIMIT = re.compile(r"^\s*CPU_(?:Speed|Scheduler)_Limit\s*=\s*(\d+)", re.M)
_LEVEL = re.compile(r"^(?!\s*Note:).*?(?:thermal|performance) warning level\D*(\d+)", re.M | re.I)


def parse_pmset_therm(text: str) -> bool | None:
    """Throttled for heat, from `pmset -g therm`: a CPU speed or scheduler limit under 100, or a
    thermal or performance warning level above 0 recorded. An Apple silicon Mac that is not
    throttled often prints only the "Note: No ... has been recorded" lines: that is clear. None
    when the output is neither."""
    limits = [int(v) for v in _LIMIT.findall(text)]
    levels = [int(v) for v in _LEVEL.findall(text)]
    if any(v < 100 for v in limits) or any(v > 0 for v in levels):
        return True
    if limits or levels or "no thermal warning level has been recorded" in text.lower():
        return False
    return None


_PRESSURE_LEVEL = re.compile(r"^(?:kern\.memorystatus_vm_pressure_level:\s*)?(\d+)\s*$", re.M)


def parse_vm_pressure_level(text: str) -> int | None:
    """`sysctl kern.memorystatus_vm_pressure_level` ("kern.memorystatus_vm_pressure_level: 2",
    or the bare value of `sysctl -n`): 1 normal, 2 warn, 4 critical."""
    m = _PRESSURE_LEVEL.search(text.strip())
    return int(m.group(1)) if m else None


# -- Linux parsers and readers -------------------------------------------------------------------


def parse_logind_idle(text: str, now: float) -> float | None:
    """Seconds the owner has been idle, from `loginctl show-session -p IdleHint -p IdleSinceHint`
    (IdleSinceHint: µs since the epoch when the idle hint was last set). Not idle: 0."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    hint = props.get("IdleHint", "").strip()
    if hint == "no":
        return 0.0
    if hint != "yes":
        return None
    try:
        since = int(props.get("IdleSinceHint", "").strip()) / 1e6
    except ValueError:
        return None
    return max(0.0, now - since) if since > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def linux_on_battery(root: Path) -> bool:
    """/sys/class/power_supply: a battery discharging, or mains present and none online. A machine
    without a battery is never on battery."""
    supplies = root / "sys" / "class" / "power_supply"
    batteries, mains = [], []
    for d in sorted(supplies.iterdir()) if supplies.is_dir() else []:
        kind = _read(d / "type")
        if kind == "Battery" and _read(d / "present") != "0":
            batteries.append(_read(d / "status"))
        elif kind == "Mains":
            mains.append(_read(d / "online"))
    if not batteries:
        return False
    if any(s == "Discharging" for s in batteries):
        return True
    return bool(mains) and all(o == "0" for o in mains)


def linux_throttled(root: Path) -> bool | None:
    """/sys/class/thermal: some zone at or above one of its passive, hot or critical trip points
    (millidegrees). None when no zone has such a trip point (a VM, many desktops)."""
    zones = root / "sys" / "class" / "thermal"
    known = False
    for z in sorted(zones.glob("thermal_zone*")) if zones.is_dir() else []:
        temp = _read(z / "temp")
        if temp is None or not temp.lstrip("-").isdigit():
            continue
        for trip in sorted(z.glob("trip_point_*_type")):
            if _read(trip) not in TRIP_TYPES:
                continue
            limit = _read(trip.with_name(trip.name.replace("_type", "_temp")))
            if limit is None or not limit.lstrip("-").isdigit() or int(limit) <= 0:
                continue
            known = True
            if int(temp) >= int(limit):
                return True
    return False if known else None


_PSI_SOME = re.compile(r"^some\s.*?\bavg10=([0-9.]+)", re.M)


def parse_psi_some_avg10(text: str) -> float | None:
    """/proc/pressure/memory's "some avg10" (% of the last 10 s some task waited for memory)."""
    m = _PSI_SOME.search(text)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


def parse_meminfo_available(text: str) -> float | None:
    """MemAvailable / MemTotal from /proc/meminfo."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0])
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    if not total or available is None:
        return None
    return available / total
