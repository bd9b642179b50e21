"""Start local MLX ring groups of trainer processes, the way `mlx.launch --backend ring` does.

Each rank gets MLX_RANK and MLX_HOSTFILE (a JSON list of ["127.0.0.1:port"] per rank). Processes
run in their own process group and are ended by PID, never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def trainer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLX_RANK", None)
    env.pop("MLX_HOSTFILE", None)
    env.pop("DPOOL_WORKER_ADDR", None)
    # Two cores here: several ranks with multi-threaded BLAS each would only fight over them.
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra or {})
    return env


class Group:
    """A running group of trainer ranks."""

    def __init__(self, procs: list[subprocess.Popen], logs: list[Path]):
        self.procs, self.logs = procs, logs

    def wait(self, timeout: float = 300) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        return codes

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()


def start(
    job: Path | str,
    run_dir: str,
    world: int,
    tmp: Path,
    shares: list[int] | None = None,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    pin: list[list[str]] | None = None,
) -> Group:
    """Start `world` ranks; `pin` optionally prefixes each rank's command (e.g. taskset)."""
    args = [str(job), "--run-dir", run_dir, *(extra_args or [])]
    if shares:
        args += ["--shares", ",".join(map(str, shares))]
    return start_ranks(tmp, [args] * world, env, pin)


def start_ranks(tmp: Path, per_rank: list[list[str]], env: dict[str, str] | None = None, pin: list[list[str]] | None = None,
                envs: list[dict[str, str]] | None = None) -> Group:
    """One trainer per entry of `per_rank` (its own arguments after `python -m dpool.trainer`), as
    the ranks of one ring group when there are several. `envs`: each rank's own variables too
    (a HOME of its own: `~/corpus` is another folder on each, as on several machines)."""
    tmp.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    hostfile = None
    if len(per_rank) > 1:
        hostfile = tmp / f"hosts-{os.getpid()}-{time.monotonic_ns()}.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(len(per_rank))]))
    for rank, args in enumerate(per_rank):
        extra = {**(env or {}), **(envs[rank] if envs else {})}
        if hostfile:
            extra.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        log = tmp / f"rank{rank}-{time.monotonic_ns()}.log"
        logs.append(log)
        with open(log, "wb") as out:
            cmd = [*(pin[rank] if pin else []), sys.executable, "-m", "dpool.trainer", *args]
            procs.append(subprocess.Popen(cmd, env=trainer_env(extra), stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return Group(procs, logs)


def finish(g: Group, timeout: float = 120) -> list[int]:
    """The ranks' exit codes; whatever happened, none is left running (ended by PID)."""
    try:
        return g.wait(timeout)
    finally:
        g.kill()


def run(job, run_dir, world, tmp, timeout: float = 300, **kw) -> Group:
    g = start(job, run_dir, world, tmp, **kw)
    try:
        codes = g.wait(timeout)
    finally:
        g.kill()
    if any(codes):
        raise AssertionError(f"trainer exit codes {codes}:\n" + "\n".join(g.output(r)[-3000:] for r in range(world)))
    return g


def metrics(run_dir: Path, kind: str = "train") -> dict[int, dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows if r["kind"] == kind}


def kill_at_checkpoint(job, run_dir: Path, step: int, tmp: Path, env: dict[str, str] | None = None, timeout: float = 120) -> None:
    """Run one rank and SIGKILL it the moment its step-`step` checkpoint exists (its manifest is
    the last file written), before it can write the next one."""
    g = start(job, str(run_dir), 1, tmp, env=env)
    manifest = Path(run_dir) / "checkpoints" / f"step-{step}" / "manifest.json"
    try:
        deadline = time.monotonic() + timeout
        while not manifest.exists():
            assert g.procs[0].poll() is None, g.output(0)
            assert time.monotonic() < deadline, f"no step-{step} checkpoint in {timeout} s"
            time.sleep(0.005)
        os.killpg(g.procs[0].pid, signal.SIGKILL)
        assert g.procs[0].wait(timeout=10) == -signal.SIGKILL
    finally:
        g.kill()
