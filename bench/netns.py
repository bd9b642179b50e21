"""Hosts on one machine: a network namespace each, joined to one bridge by a veth pair whose two
ends are shaped (netem's rate and delay; tbf's rate alone where the kernel has no netem). Needs
Linux, root and iproute2. Shared by the benches that need separate hosts (bench/staging.py,
bench/comm.py); every namespace and link made is removed by `down()`, also after a failure.

Each end of a host's veth pair gets the rate and the delay: a host sends through its own end at
`rate` and receives through the bridge's end at `rate`, so a packet from one host to another
crosses two delays (`delay` is per end, half the one-way latency between two hosts).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path


class NetnsError(RuntimeError):
    """A namespace, link or shaping could not be made: what, and why."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Namespaces:
    """One network namespace per host on a bridge; the root namespace is the bridge's .254.

    `name` prefixes the bridge and the namespaces (`NAME{tag}`, `NAME{tag}-HOST`), `veth` the
    links (`VETH{tag}h{i}` on the bridge, `VETH{tag}c{i}` in the host): the tag is this process's
    PID, so two runs at once never share a name, and each run's hosts get a /24 of their own."""

    def __init__(
        self, hosts: Sequence[str], *, rate: str | None, delay: str | None, name: str = "dpsb", veth: str = "sb", queue: str = "2ms",
    ) -> None:
        self.tag = f"{os.getpid() % 10000}"
        subnet = f"10.{180 + os.getpid() % 70}.{os.getpid() // 70 % 250}"  # a /24 of this run's own (the tests' netns use 10.77-176)
        self.bridge, self.bridge_addr = f"{name}{self.tag}", f"{subnet}.254"
        self.ns = {h: f"{name}{self.tag}-{h}" for h in hosts}
        self.host_end = {h: f"{veth}{self.tag}h{i}" for i, h in enumerate(hosts)}
        self.addrs = {h: f"{subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self.rate, self.delay = rate, delay
        self.queue = queue  # tbf's queue, as the time it takes to drain at the rate
        self.shaping = "none"
        self.delayed = False  # whether the delay was applied (netem); tbf, the fallback, has only the rate
        self.made: list[tuple[str, str]] = []

    def up(self) -> None:
        if ip("link", "add", self.bridge, "type", "bridge", check=False).returncode != 0:
            raise NetnsError(f"cannot create the bridge {self.bridge} (root and CAP_NET_ADMIN are needed)")
        self.made.append(("link", self.bridge))
        ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for h, ns in self.ns.items():
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            outer, inner = self.host_end[h], self.inner(h)
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self.made.append(("link", outer))
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "master", self.bridge)
            ip("link", "set", outer, "up")
            ip("-n", ns, "addr", "add", f"{self.addrs[h]}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        self.shape(self.rate, self.delay)

    def inner(self, host: str) -> str:
        return self.host_end[host].replace("h", "c", 1)

    def shape(self, rate: str | None, delay: str | None) -> str:
        """Every link, both ends, to `rate` (tc's units: 1gbit, 300mbit) and `delay` per end (0.2ms),
        replacing what was there; neither: as fast as veth goes. Returns what was applied."""
        self.rate, self.delay = rate, delay
        if not self.ns:
            return self.shaping
        for h, ns in self.ns.items():
            self.shaping = self._shape(self.host_end[h], None)  # towards the host
            self._shape(self.inner(h), ns)  # from it
        return self.shaping

    def _shape(self, dev: str, ns: str | None) -> str:
        tc = ["tc", *(["-n", ns] if ns else []), "qdisc"]
        if self.rate is None and self.delay is None:
            self.delayed = False
            subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True, text=True, timeout=30)  # none there: fine
            return "none (as fast as veth goes)"
        root = [*tc, "replace", "dev", dev, "root"]
        netem = subprocess.run(
            [*root, "netem", *(["delay", self.delay] if self.delay else []), *(["rate", self.rate] if self.rate else []), "limit", "10000"],
            capture_output=True, text=True, timeout=30,
        )
        self.delayed = netem.returncode == 0 and self.delay is not None
        if netem.returncode == 0:
            return f"{self.rate or 'any rate'} and {self.delay or 'no delay'} at each end (netem)"
        if self.rate is None:
            raise NetnsError(f"cannot delay {dev}: netem: {netem.stderr.strip()}")
        # by default a 250 KB queue (2 ms at 1 Gbit/s), as a switch port has
        tbf = subprocess.run([*root, "tbf", "rate", self.rate, "burst", "64kb", "latency", self.queue], capture_output=True, text=True, timeout=30)
        if tbf.returncode != 0:
            raise NetnsError(f"cannot shape {dev}: netem: {netem.stderr.strip()}; tbf: {tbf.stderr.strip()}")
        return f"{self.rate} at each end (tbf, a {self.queue} queue); no delay: this kernel has no netem ({netem.stderr.strip()})"

    def down(self) -> None:
        for kind, name in reversed(self.made):
            ip(*(("netns", "delete") if kind == "netns" else ("link", "delete")), name, check=False)
        self.made.clear()

    def prefix(self, host: str) -> list[str]:
        """What runs a command inside the host's namespace."""
        return ["ip", "netns", "exec", self.ns[host]]

    def address(self, host: str) -> str:
        return self.addrs[host]

    def counters(self, host: str) -> tuple[int, int]:
        """(bytes into the host, bytes out of it) on its link so far, read on the bridge's end."""
        stats = Path("/sys/class/net") / self.host_end[host] / "statistics"
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
