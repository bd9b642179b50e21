"""`--advertise` by interface name, the interface each node reports, and the Thunderbolt bridge.

`--advertise lo` and an unknown interface run a real `dpd`; a Mac's bridge is found from
networksetup's and ifconfig's own output, given to `thunderbolt_bridge` through its runner (macOS
cannot run here).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import structlog
from conftest import LocalPool, Processes

from dpool.daemon import cli, netif

IFACES = {"lo0": ["127.0.0.1"], "en0": ["192.168.1.20"], "bridge0": ["169.254.10.2"], "awdl0": []}

# `networksetup -listallhardwareports` on a Mac Studio with two Thunderbolt ports, as it prints it
HARDWARE_PORTS = """
Hardware Port: Ethernet
Device: en0
Ethernet Address: 3c:a6:f6:00:00:01

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: N/A

Hardware Port: Thunderbolt 1
Device: en1
Ethernet Address: 36:5f:4b:00:00:02

Hardware Port: Thunderbolt 2
Device: en2
Ethernet Address: 36:5f:4b:00:00:03

VLAN Configurations
===================
"""

# `ifconfig bridge0` (trimmed to the lines read)
IFCONFIG_BRIDGE = """bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\toptions=63<RXCSUM,TXCSUM,TSO4,TSO6>
\tether 36:5f:4b:00:00:00
\tConfiguration:
\t\tid 0:0:0:0:0:0 priority 0 hellotime 0 fwddelay 0
\tmember: en1 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 8 priority 0 path cost 0
\tmember: en2 flags=3<LEARNING,DISCOVER>
\t        ifmaxaddr 0 port 9 priority 0 path cost 0
\tstatus: active
"""


def runner(replies: dict[str, tuple[int, str]]):  # type: ignore[no-untyped-def]
    """A recording runner: the reply of the first key that is one of the command's arguments, else
    exit 1 (the command failed)."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        code, out = next((r for word, r in replies.items() if word in argv), (1, ""))  # a reply per argument
        return subprocess.CompletedProcess(list(argv), code, out, "")

    run.calls = calls  # type: ignore[attr-defined]
    return run


# -- resolving --advertise ------------------------------------------------------------------------


def test_an_interface_name_resolves_to_its_ipv4_address() -> None:
    assert netif.resolve("lo") == "127.0.0.1" or "lo" not in psutil.net_if_addrs()
    assert netif.resolve("bridge0", IFACES) == "169.254.10.2"
    assert netif.resolve("10.0.0.6", IFACES) == "10.0.0.6"  # an IP is taken as given
    assert netif.resolve("fd00::2", IFACES) == "fd00::2"


def test_a_routable_address_comes_before_a_link_local_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def addr(family: int, address: str) -> SimpleNamespace:
        return SimpleNamespace(family=family, address=address)  # the fields psutil's snicaddr has that are read

    fake = {"en5": [addr(socket.AF_INET, "169.254.3.4"), addr(socket.AF_INET6, "fe80::1"), addr(socket.AF_INET, "10.1.2.3")], "gif0": []}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: fake)
    assert netif.ipv4_addresses() == {"en5": ["10.1.2.3", "169.254.3.4"], "gif0": []}
    assert netif.resolve("en5") == "10.1.2.3"


def test_an_interface_without_ipv4_or_an_unknown_one_is_refused_naming_the_ones_that_work() -> None:
    with pytest.raises(netif.AdvertiseError) as e:
        netif.resolve("awdl0", IFACES)
    assert str(e.value) == (
        "--advertise awdl0: interface awdl0 has no IPv4 address; "
        "interfaces with one: bridge0 (169.254.10.2), en0 (192.168.1.20), lo0 (127.0.0.1)"
    )
    with pytest.raises(netif.AdvertiseError, match=r"'bridge9': neither an IP address nor an interface of this machine; .*en0 \(192\.168\.1\.20\)"):
        netif.resolve("bridge9", IFACES)


def test_an_interface_whose_address_has_not_come_up_is_exit_1_and_installs_as_its_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link still coming up at boot: the interface is there, its address not yet. Exit 2 told
    systemd (RestartPreventExitStatus=2) never to try again; exit 1 is retried. And a service may
    be installed for it meanwhile, with the name (resolved as dpd starts)."""
    from dpool.daemon import cli, service

    monkeypatch.setattr(netif, "ipv4_addresses", lambda: IFACES)
    monkeypatch.setattr(service, "PRIVATE_TMPS", ())  # this test's folders are under /tmp (a system unit, as root, refuses them)
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "dpd.toml"
    config.write_text("")
    state = tmp_path / "state"
    assert cli.main(["run", "--config", str(config), "--serve", "--advertise", "awdl0", "--state-dir", str(state)]) == 1
    assert "--advertise awdl0: interface awdl0 has no IPv4 address" in capsys.readouterr().err and not state.exists()
    assert cli.main(["install", "--print", "--config", str(config), "--serve", "--advertise", "awdl0", "--state-dir", str(state)]) == 0
    assert "--advertise awdl0" in capsys.readouterr().out


def test_the_interface_of_an_address() -> None:
    assert netif.interface_of("169.254.10.2", IFACES) == "bridge0"
    assert netif.interface_of("10.9.9.9", IFACES) is None
    assert netif.interface_of("127.0.0.1") in (name for name, ips in netif.ipv4_addresses().items() if "127.0.0.1" in ips)


def dpd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "dpd.toml"
    config.write_text("")
    cmd = [sys.executable, "-m", "dpool.daemon.cli", "run", "--config", str(config), "--state-dir", str(tmp_path / "state"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_dpd_refuses_an_unknown_interface_with_exit_2(tmp_path: Path) -> None:
    r = dpd(tmp_path, "--serve", "--advertise", "nosuch0")
    assert r.returncode == 2, r.stderr
    assert "--advertise 'nosuch0': neither an IP address nor an interface of this machine" in r.stderr
    assert "lo (127.0.0.1)" in r.stderr or "lo0 (127.0.0.1)" in r.stderr  # the ones it could use
    assert "Traceback" not in r.stderr and not (tmp_path / "state").exists()


def test_dpd_refuses_an_address_it_does_not_have_or_loopback_for_a_pool_elsewhere(tmp_path: Path) -> None:
    """An address of another machine (the host's line copied): the data channel could not listen
    there and dpd ended in a traceback. Loopback while the coordinator is another machine: the
    node joined, and every group with it broke at its start, another node blamed."""
    r = dpd(tmp_path, "--serve", "--advertise", "198.51.100.77")  # exit 1: an address may come up later (a service retries)
    assert r.returncode == 1 and "--advertise 198.51.100.77: not an address of this machine" in r.stderr, r.stderr
    assert "127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    r = dpd(tmp_path, "--join", "tcp://198.51.100.7:7340", "--insecure", "--advertise", "127.0.0.1")
    assert r.returncode == 2, r.stderr
    assert "--advertise 127.0.0.1: the pool's other machines cannot reach this one there (its coordinator, 198.51.100.7, is another machine)" in r.stderr
    assert not (tmp_path / "state").exists()
    assert dpd(tmp_path, "--join", "tcp://198.51.100.7:7340", "--insecure", "--advertise", "198.51.100.8").returncode == 1


@pytest.mark.skipif("lo" not in psutil.net_if_addrs(), reason="no interface named lo (macOS calls it lo0)")
def test_advertise_lo_rings_on_127_0_0_1_and_dpctl_nodes_shows_the_interface(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path)
    d = pool.start_daemon("n0", serve=True, args=["--advertise", "lo"])
    (row,) = pool.wait_registered(1)
    assert (row.address, row.interface) == ("127.0.0.1", "lo")
    started = next(json.loads(line) for line in d.log.read_text().splitlines() if '"dpd.starting"' in line)
    assert (started["advertise"], started["interface"]) == ("127.0.0.1", "lo")

    (node,) = pool.dpctl_json("nodes")
    assert (node["address"], node["interface"]) == ("127.0.0.1", "lo")
    r = pool.dpctl("nodes")
    assert r.returncode == 0, r.stderr
    header, line = r.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "ADDRESS", "INTERFACE", "STATE"]
    assert line.split()[:4] == ["n0", "127.0.0.1", "lo", "idle"]


# -- the Thunderbolt bridge -----------------------------------------------------------------------


def test_a_macs_thunderbolt_bridge_is_found_by_its_hardware_port() -> None:
    run = runner({"-listallhardwareports": (0, HARDWARE_PORTS)})
    assert netif.thunderbolt_bridge(["lo0", "en0", "bridge0"], "darwin", run) == "bridge0"
    assert run.calls == [[netif.NETWORKSETUP, "-listallhardwareports"]]  # type: ignore[attr-defined]


def test_a_bridge_of_thunderbolt_ports_counts_and_internet_sharings_does_not() -> None:
    ports = HARDWARE_PORTS.replace("Thunderbolt Bridge", "Bridge").replace("bridge0", "bridge1")
    run = runner({"-listallhardwareports": (0, ports), "bridge1": (0, IFCONFIG_BRIDGE), "bridge100": (0, IFCONFIG_BRIDGE.replace("en1", "en0").replace("en2", "vmenet0"))})
    assert netif.bridge_members(IFCONFIG_BRIDGE) == ["en1", "en2"]
    assert netif.thunderbolt_bridge(["en0", "bridge1", "bridge100"], "darwin", run) == "bridge1"
    assert netif.thunderbolt_bridge(["en0", "bridge100"], "darwin", run) is None  # a VM's bridge: en0 and vmenet0


def test_bridge0_counts_where_networksetup_cannot_say_and_linux_has_thunderbolt_net() -> None:
    run = runner({})
    assert netif.thunderbolt_bridge(["en0", "bridge0"], "darwin", run) == "bridge0"
    assert netif.thunderbolt_bridge(["en0"], "darwin", run) is None
    assert netif.thunderbolt_bridge(["eth0", "thunderbolt0"], "linux") == "thunderbolt0"
    assert netif.thunderbolt_bridge(["eth0", "br0"], "linux") is None


def test_start_up_says_which_link_the_ring_uses_and_suggests_the_bridge() -> None:
    assert netif.advice("169.254.10.2", IFACES, "bridge0") == ("ring.thunderbolt", {"interface": "bridge0", "advertise": "169.254.10.2"})
    event, fields = netif.advice("192.168.1.20", IFACES, "bridge0") or ("", {})
    assert event == "ring.not_thunderbolt" and fields["interface"] == "en0" and fields["thunderbolt_bridge"] == "bridge0"
    assert "--advertise bridge0 (169.254.10.2)" in fields["hint"]
    _, fields = netif.advice("192.168.1.20", {**IFACES, "bridge0": []}, "bridge0") or ("", {})
    assert "give bridge0 an IPv4 address" in fields["hint"] and "--advertise bridge0" in fields["hint"]
    assert netif.advice("192.168.1.20", IFACES, None) is None  # no bridge: nothing to say
    assert netif.advice("127.0.0.1", IFACES, "bridge0") is None  # a pool on one machine


def test_dpd_says_it_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `dpd run` logs after `dpd.starting`, on a Mac whose bridge0 is not the ring's link."""
    monkeypatch.setattr(netif, "ipv4_addresses", lambda: IFACES)
    monkeypatch.setattr(netif, "thunderbolt_bridge", lambda names: "bridge0" if "bridge0" in names else None)
    with structlog.testing.capture_logs() as logs:
        cli.say_ring_link(structlog.get_logger(), "192.168.1.20")
        cli.say_ring_link(structlog.get_logger(), "169.254.10.2")
    assert [(e["event"], e["log_level"], e["interface"]) for e in logs] == [("ring.not_thunderbolt", "warning", "en0"), ("ring.thunderbolt", "info", "bridge0")]
    assert logs[0]["hint"] == "restart dpd with --advertise bridge0 (169.254.10.2) to train over Thunderbolt"
