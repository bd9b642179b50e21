"""Shared test helpers: the local-pool harness (`dpool.client.localpool`) with a fixture that
cleans up after each test, and dpctl run against a pool as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from dpool.client import localpool
from dpool.client.localpool import Processes, free_port, pids_with, wait_for
from dpool.protocol.payloads import JobStatus

__all__ = ["LocalPool", "Processes", "alive", "free_port", "pids_with", "shaped_links_missing", "share_mlx_kernels", "train_losses", "trained_alone", "wait_for"]
TERMINAL = ("succeeded", "failed", "cancelled")
ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's bytecode once. The tests start thousands of Python processes (dpds,
    trainers, dpctl), each importing the project from source; where PYTHONDONTWRITEBYTECODE is set
    (as in many CI images) none of them writes its bytecode, so each compiled every module again:
    about 0.3 s of CPU a process here, ~4% of the suite's time. Existing bytecode is still read."""
    import compileall
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in [*packages.values(), "tests"]:
        compileall.compile_dir(str(ROOT / folder), quiet=2, force=False)


def share_mlx_kernels(tmpdir: Path) -> None:
    """Give a TMPDIR of a test's own the machine's MLX kernel cache: MLX's CPU backend keeps the
    kernels it compiles under TMPDIR (TMPDIR/mlx), and a fresh folder cost each run ~15-25 s of g++
    before its first step."""
    import tempfile

    shared = Path(tempfile.gettempdir()) / "mlx"
    shared.mkdir(exist_ok=True)
    (tmpdir / "mlx").symlink_to(shared, target_is_directory=True)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """The phase a test failed in kept on its item (`item.stash[FAILED]`), for fixtures that show
    more when it failed."""
    report = yield
    if report.failed:
        item.stash[FAILED] = report.when
    return report


FAILED = pytest.StashKey[str]()
LOG_TAIL = 60  # lines of each process's log shown when a test fails


@pytest.fixture
def processes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Processes]:
    """Processes the test starts, all ended after it. When the test fails, the last lines of each
    one's log are printed (pytest shows them under the failure), so a failure in CI, where the
    files are gone, can be read. One that had to be killed (it ignored SIGTERM for
    STOP_TIMEOUT_S: a daemon that hangs on its way out) is a warning in the run's summary, with
    the end of its log, whether the test passed or not."""
    procs = Processes(str(tmp_path))
    try:
        yield procs
    finally:
        said: list[str] = []
        killed = procs.stop_all(report=said.append)
        if said:
            warnings.warn("\n".join([request.node.nodeid, *said, *procs.log_tails(150, killed)]), pytest.PytestWarning, stacklevel=1)
        if request.node.stash.get(FAILED, None) is not None:
            for line in procs.log_tails(LOG_TAIL):
                print(line)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Any]:
    """A real Coordinator on loopback, its loop in a thread of this process (`peers.Running`),
    stopped after the test."""
    from peers import Running  # peers imports this module

    c = Running(tmp_path)
    try:
        yield c
    finally:
        c.stop()


class LocalPool(localpool.LocalPool):
    """A local pool whose processes the test's `processes` fixture ends, with dpctl run as a user
    runs it and waits on a job's status. Its daemons keep warm trainers only with `warm` (the
    recovery scenarios): each costs about a CPU-second per slot and generation, which the tests
    that are about something else need not pay on a 2-core machine."""

    def __init__(self, procs: Processes, root: Path, *, warm: bool = False, env: dict[str, str] | None = None, **kw: Any) -> None:
        super().__init__(root, procs=procs, env={"DPOOL_WARM": "1" if warm else "0", **(env or {})}, **kw)

    def wait_status(self, job: str, what: str, check: Callable[[JobStatus], Any], timeout: float = 120, every: float = 0.1) -> JobStatus:
        """The job's status once `check` holds for it; fail naming `what` after `timeout` seconds."""
        return wait_for(what, lambda: (s := self.status(job)) is not None and check(s) and s, timeout, every)

    def wait_end(self, job: str, timeout: float = 120, every: float = 0.1) -> JobStatus:
        """The job's status once it has ended (succeeded, failed or cancelled)."""
        return self.wait_status(job, f"job {job} to end", lambda s: s.state in TERMINAL, timeout, every)

    def dpctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "dpool.client.cli", "--coordinator", self.addr, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)

    def dpctl_json(self, *args: str) -> Any:
        r = self.dpctl(*args, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def submit(self, path: Path) -> str:
        r = self.dpctl("submit", str(path))
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def cancelled_on_curve(self, job: str, alone: Callable[[int], dict[int, float]], tol: float, timeout: float = 120) -> list[dict[str, Any]]:
        """Cancel an endless job (at a constant learning rate, its curve does not depend on its
        length) and assert that its N steps are `alone(N)`, one process's run of N steps, within
        `tol`; the job's events."""
        assert self.dpctl("cancel", job).returncode == 0
        final = self.wait_end(job, timeout, every=0.05)
        assert final.state == "cancelled", final
        rows = [r for r in self.dpctl_json("metrics", job) if r["kind"] == "train"]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        curve = alone(len(rows))
        worst = max(abs(r["loss"] - curve[r["step"]]) for r in rows)
        assert worst < tol, (worst, [(r["step"], r["loss"], curve[r["step"]], r["generation"]) for r in rows])
        return self.dpctl_json("events", job)


def train_losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss, from a run dir's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def trained_alone(job: Path, run_dir: Path, timeout: float) -> dict[int, float]:
    """The curve of `job` trained by one trainer process alone in `run_dir`: step -> loss."""
    done = subprocess.run([sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return train_losses(run_dir)


class HomesPool(LocalPool):
    """Each daemon (and so each of its trainers) has its own HOME, ROOT/home-NAME: `~` in a job
    names a different folder on each node, as it would on separate machines."""

    def home(self, name: str) -> Path:
        return self.root / f"home-{name}"

    def prefix(self, name: str, serve: bool) -> list[str]:
        self.home(name).mkdir(parents=True, exist_ok=True)
        return ["env", f"HOME={self.home(name)}"]


def shaped_links_missing(prefix: str) -> str | None:
    """Why this machine cannot build network namespaces and shape links (Linux, root, iproute2, tc,
    and the right to create a bridge: what the namespace benches need), or None where it can."""
    import shutil

    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces and shaped links need Linux, root, iproute2 and tc"
    probe = f"{prefix}{os.getpid() % 1000}"
    if subprocess.run(["ip", "link", "add", probe, "type", "bridge"], capture_output=True).returncode != 0:
        return "cannot create a bridge here (no CAP_NET_ADMIN?)"
    subprocess.run(["ip", "link", "delete", probe], capture_output=True)
    return None


def require_shaped_links(prefix: str) -> None:
    """Skip unless this machine can build network namespaces and shape links."""
    if (why := shaped_links_missing(prefix)) is not None:
        pytest.skip(why)
