"""This machine's network interfaces, as `--advertise` and the ring see them.

- `--advertise` takes an IP address or an interface name (`--advertise bridge0`); a name becomes the
  interface's IPv4 address (a routable one before a link-local 169.254/16 one, which is what a
  Thunderbolt bridge self-assigns). A name with no IPv4 address, or no such interface, is refused
  with the interfaces that have one.
- A node tells the pool which interface its advertised address belongs to (`NodeInfo.interface`),
  so `dpctl nodes` shows which link the ring uses: ring traffic over Wi-Fi rather than Thunderbolt
  is the most common speed complaint about MLX on Macs (mlx#1210: 274 s against 11 s).
- `thunderbolt_bridge` finds a Mac's Thunderbolt bridge: the device networksetup names "Thunderbolt
  Bridge", or a `bridge*` whose members are all Thunderbolt ports (Internet Sharing's and VMs'
  bridges are not); where networksetup cannot answer, `bridge0`. On Linux, a `thunderbolt*`
  interface (the thunderbolt-net driver's). dpd says at start-up which one it found (`advice`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

import psutil

Addresses = Mapping[str, Sequence[str]]  # interface -> its IPv4 addresses, preferred first
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]
NETWORKSETUP = "/usr/sbin/networksetup"
IFCONFIG = "/sbin/ifconfig"


class AdvertiseError(ValueError):
    """`--advertise` names no IP address and no interface with an IPv4 address."""


class NoAddressYet(AdvertiseError):
    """The interface exists but holds no IPv4 address (yet: a link still coming up at boot)."""


def ipv4_addresses() -> dict[str, list[str]]:
    """Every interface of this machine, with its IPv4 addresses (routable first, then link-local);
    an interface without one maps to []."""
    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        found = [a.address for a in addrs if a.family == socket.AF_INET]
        out[name] = sorted(found, key=lambda ip: ipaddress.ip_address(ip).is_link_local)
    return out


def describe(ifaces: Addresses) -> str:
    """`lo (127.0.0.1), eth0 (192.0.2.2)`: the interfaces that have an IPv4 address."""
    with_ip = [f"{name} ({', '.join(ips)})" for name, ips in sorted(ifaces.items()) if ips]
    return ", ".join(with_ip) or "none"


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def resolve(value: str, ifaces: Addresses | None = None) -> str:
    """`--advertise VALUE` as the IP the ring binds: an IP address as given, an interface name as
    its (preferred) IPv4 address. Raises AdvertiseError naming the interfaces that have one."""
    if is_ip(value):
        return value
    ifaces = ipv4_addresses() if ifaces is None else ifaces
    if value not in ifaces:
        raise AdvertiseError(
            f"--advertise {value!r}: neither an IP address nor an interface of this machine; "
            f"interfaces with an IPv4 address: {describe(ifaces)}"
        )
    if not ifaces[value]:
        raise NoAddressYet(
            f"--advertise {value}: interface {value} has no IPv4 address; "
            f"interfaces with one: {describe(ifaces)}"
        )
    return ifaces[value][0]


def foreign_address(ip: str, ifaces: Addresses | None = None) -> str | None:
    """Why this machine cannot be reached at `ip` (the resolved --advertise): an IPv4 address it
    does not have, where its ring and data channel cannot listen (the daemon ended in a
    traceback). None for loopback, the wildcard, IPv6 and an address it has."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    ifaces = ipv4_addresses() if ifaces is None else ifaces
    if addr.version == 4 and not addr.is_loopback and not addr.is_unspecified and interface_of(ip, ifaces) is None:
        return f"--advertise {ip}: not an address of this machine (its ring and data channel listen there); its addresses: {describe(ifaces)}"
    return None


def loopback_for_remote(ip: str, remote_host: str | None, ifaces: Addresses | None = None) -> str | None:
    """Why peers could not reach this node at a loopback `ip` when its coordinator, `remote_host`
    (a non-loopback --join's host), is another machine: every group with it broke at its start,
    with another node blamed."""
    try:
        loopback = ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return None
    if not loopback or remote_host is None:
        return None
    try:
        coordinator = socket.gethostbyname(remote_host)
    except OSError:
        return None  # it cannot be reached either: the daemon says so as it joins
    ifaces = ipv4_addresses() if ifaces is None else ifaces
    if interface_of(coordinator, ifaces) is not None or ipaddress.ip_address(coordinator).is_loopback:
        return None
    return (f"--advertise {ip}: the pool's other machines cannot reach this one there (its coordinator, {remote_host}, is "
            "another machine); give this machine's address on their network, or leave --advertise out to take the one that "
            "routes to the coordinator")


def interface_of(ip: str, ifaces: Addresses | None = None) -> str | None:
    """The interface that holds `ip`, or None (an address of another machine, a wildcard)."""
    ifaces = ipv4_addresses() if ifaces is None else ifaces
    return next((name for name, ips in sorted(ifaces.items()) if ip in ips), None)


# -- the Thunderbolt bridge ----------------------------------------------------------------------


def run_quietly(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(list(argv), 127, "", str(e))


def hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` as device -> port name (`en1` -> `Thunderbolt 1`)."""
    ports: dict[str, str] = {}
    port = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Hardware Port":
            port = value.strip()
        elif key.strip() == "Device" and port is not None:
            ports[value.strip()] = port
            port = None
    return ports


def bridge_members(text: str) -> list[str]:
    """The `member: en1 flags=...` lines of `ifconfig bridgeN`."""
    return re.findall(r"^\s*member:\s*(\S+)", text, re.MULTILINE)


def thunderbolt_bridge(names: Sequence[str], platform: str = sys.platform, run: Runner = run_quietly) -> str | None:
    """The Thunderbolt bridge among this machine's interfaces `names`, or None."""
    if platform != "darwin":
        return next((n for n in sorted(names) if re.fullmatch(r"thunderbolt\d+", n)), None)
    bridges = sorted(n for n in names if re.fullmatch(r"bridge\d+", n))
    if not bridges:
        return None
    listed = run([NETWORKSETUP, "-listallhardwareports"])
    if listed.returncode != 0:
        return "bridge0" if "bridge0" in bridges else None
    ports = hardware_ports(listed.stdout)
    for bridge in bridges:
        if ports.get(bridge) == "Thunderbolt Bridge":
            return bridge
    for bridge in bridges:
        shown = run([IFCONFIG, bridge])
        members = bridge_members(shown.stdout) if shown.returncode == 0 else []
        if members and all(ports.get(m, "").startswith("Thunderbolt") for m in members):
            return bridge
    return None


def advice(advertise: str, ifaces: Addresses, bridge: str | None) -> tuple[str, dict[str, str]] | None:
    """What dpd logs at start-up about the link its ring traffic takes: an event name and its
    fields, or None when there is nothing to say (no bridge, or a pool on loopback)."""
    if bridge is None or ipaddress.ip_address(advertise).is_loopback:
        return None
    ips = list(ifaces.get(bridge, []))
    if advertise in ips:
        return "ring.thunderbolt", {"interface": bridge, "advertise": advertise}
    on = interface_of(advertise, ifaces) or "?"
    if not ips:
        hint = f"give {bridge} an IPv4 address (System Settings > Network > Thunderbolt Bridge) and restart dpd with --advertise {bridge}"
    else:
        hint = f"restart dpd with --advertise {bridge} ({ips[0]}) to train over Thunderbolt"
    return "ring.not_thunderbolt", {"interface": on, "advertise": advertise, "thunderbolt_bridge": bridge, "hint": hint}
