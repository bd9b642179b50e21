"""Separate hosts on one machine: daemons in network namespaces, each with its own address on a
bridge, the MLX ring between them over those addresses. Cutting one host's link kills nothing: the
coordinator must notice by heartbeat and progress deadlines, restart without that host, and finish
on the reference curve. Needs root and iproute2; skipped cleanly otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import Processes, wait_for
from test_recovery import STEPS, Pool, job_file, kinds, mid_run
from test_recovery import reference as reference  # the fault-free curve fixture, shared

from dpool.client.localpool import Daemon

pytestmark = pytest.mark.slow


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Three namespaces on a bridge: name -> address; the root namespace is 10.77.x.254."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need Linux, root and iproute2")
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{77 + os.getpid() % 100}"
    bridge = f"dpbr{tag}"
    names = {f"n{i}": f"dp{tag}n{i}" for i in range(1, 3)}
    made: list[tuple[str, str]] = []
    try:
        if _ip("link", "add", bridge, "type", "bridge", check=False).returncode != 0:
            pytest.skip("cannot create a bridge here (no CAP_NET_ADMIN?)")
        made.append(("link", bridge))
        _ip("addr", "add", f"{subnet}.0.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        addrs = {"n0": f"{subnet}.0.254"}
        for i, (node, ns) in enumerate(names.items(), start=1):
            _ip("netns", "add", ns)
            made.append(("netns", ns))
            host_end, ns_end = f"dv{tag}h{i}", f"dv{tag}c{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            made.append(("link", host_end))
            _ip("link", "set", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.0.{i}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            addrs[node] = f"{subnet}.0.{i}"
            addrs[f"{node}.ns"], addrs[f"{node}.link"] = ns, host_end
        yield addrs
    finally:
        for kind, name in reversed(made):
            if kind == "netns":
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)


class NetnsPool(Pool):
    """n0 in the root namespace serves on the bridge; n1 and n2 each run in their own namespace."""

    def __init__(self, procs: Processes, root: Path, hosts: dict[str, str]) -> None:
        super().__init__(procs, root, addr=f"tcp://{hosts['n0']}:{7400 + os.getpid() % 500}")
        self.hosts = hosts

    def prefix(self, name: str, serve: bool) -> list[str]:
        return [] if serve else ["ip", "netns", "exec", self.hosts[f"{name}.ns"]]

    def start_daemon(self, name: str, *, args: Sequence[str] = (), **kw: Any) -> Daemon:
        return super().start_daemon(name, args=(*args, "--insecure", "--advertise", self.hosts[name]), **kw)


def test_a_host_whose_link_is_cut_is_left_behind(hosts: dict[str, str], processes: Processes, tmp_path: Path, reference: Any) -> None:
    pool = NetnsPool(processes, tmp_path, hosts).start(3)
    assert {n.name: n.address for n in pool.nodes()} == {n: hosts[n] for n in ("n0", "n1", "n2")}
    job = pool.submit(job_file(tmp_path, "netns"))
    mid_run(pool, job)
    _ip("link", "set", hosts["n2.link"], "down")  # nothing is killed: packets just stop
    events = pool.finish(job, reference)
    failed = kinds(events, "worker.failed")
    assert failed and failed[0]["reason"] in ("heartbeat", "stalled"), failed
    assert any(e["world_size"] == 2 for e in kinds(events, "group.started"))
    final = pool.status(job)
    assert final is not None and final.step == STEPS
    # Every daemon stops on SIGTERM, the cut host's too; its trainer, which nothing reached, is
    # ended as a leftover.
    assert pool.stop(timeout=30) == []


@pytest.mark.long
def test_a_host_cut_off_past_its_heartbeats_and_back_rejoins_without_blame(hosts: dict[str, str], processes: Processes, tmp_path: Path, reference: Any) -> None:
    """n2's link goes down long enough for the coordinator to lose it (1.5 s of silence), then
    comes back: the same dpd, alive all along, registers again. Its loss was a membership change:
    the restart it cost is given back, n2 is not blamed, and it takes work again."""
    pool = NetnsPool(processes, tmp_path, hosts).start(3)
    job = pool.submit(job_file(tmp_path, "netns-back"))
    mid_run(pool, job)
    _ip("link", "set", hosts["n2.link"], "down")
    try:
        wait_for("n2 lost", lambda: any(n.name == "n2" and n.state == "lost" for n in pool.nodes()), 30, every=0.05)
    finally:
        _ip("link", "set", hosts["n2.link"], "up")
    wait_for("n2 back", lambda: any(n.name == "n2" and n.state != "lost" for n in pool.nodes()), 60, every=0.05)
    events = pool.finish(job, reference)
    (returned,) = kinds(events, "node.returned")
    assert (returned["node"], returned["restarts"]) == ("n2", 0), events  # the restart it cost was given back
    n2 = next(n for n in pool.nodes() if n.name == "n2")
    assert n2.reason is None and n2.state in ("idle", "busy"), n2
    assert pool.stop(timeout=30) == []
