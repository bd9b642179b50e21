"""CURVE on the control plane: `dpctl keys init`, a pool that trains with keys, and the peers it refuses.

Real `dpd` and `dpctl` processes on loopback; the coordinator binds 0.0.0.0 in the end-to-end test,
which only keys (or --insecure) allow.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth
from conftest import LocalPool, Processes, free_port, wait_for
from jobs import write_job


def dpctl(*args: str, keys: Path | None = None, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DPOOL_KEYS", "DPOOL_COORDINATOR")}
    cmd = [sys.executable, "-m", "dpool.client.cli", "--timeout", str(timeout)]
    cmd += ["--keys", str(keys)] if keys else []
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60, env=env)


def keys_init(dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return dpctl("keys", "init", str(dir), *extra)


def nodes(addr: str, keys: Path) -> list[dict[str, object]]:
    r = dpctl("--coordinator", addr, "nodes", "--json", keys=keys)
    return json.loads(r.stdout) if r.returncode == 0 else []


# -- keys init ---------------------------------------------------------------------------------


def test_keys_init_writes_private_secrets_and_an_allow_list(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    r = keys_init(d)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("coordinator", "node", "client"):
        assert stat.S_IMODE((d / f"{name}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((d / f"{name}.key").stat().st_mode) == 0o644
        public, secret = zmq.auth.load_certificate(d / f"{name}.key_secret")
        assert secret is not None and len(public) == 40
    # the allow-list admits nodes and clients, never the coordinator's own key
    assert sorted(p.name for p in (d / "allowed").iterdir()) == ["client.key", "node.key"]
    assert zmq.auth.load_certificate(d / "allowed" / "node.key")[0] == zmq.auth.load_certificate(d / "node.key")[0]


def test_keys_init_refuses_to_overwrite_without_force_and_adds_missing_pairs(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert keys_init(d).returncode == 0
    before = (d / "coordinator.key_secret").read_bytes()
    r = keys_init(d)
    assert r.returncode == 1 and "exist already" in r.stderr and "--force" in r.stderr
    assert (d / "coordinator.key_secret").read_bytes() == before

    r = keys_init(d, "--node", "mac3")  # one more node: only its pair is made
    assert r.returncode == 0, r.stderr
    assert (d / "coordinator.key_secret").read_bytes() == before
    assert (d / "allowed" / "node-mac3.key").exists()

    old_client = zmq.auth.load_certificate(d / "client.key")[0]
    assert keys_init(d, "--force").returncode == 0
    assert (d / "coordinator.key_secret").read_bytes() != before
    new_client = zmq.auth.load_certificate(d / "allowed" / "client.key")[0]
    assert new_client != old_client  # the replaced key is no longer admitted

    assert keys_init(d, "--node", "Bad Name").returncode == 2


def test_a_secret_readable_by_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert keys_init(d).returncode == 0
    (d / "client.key_secret").chmod(0o644)
    r = dpctl("--coordinator", f"tcp://127.0.0.1:{free_port()}", "status", keys=d, timeout=1)
    assert r.returncode == 2
    assert "chmod 600" in r.stderr and "client.key_secret" in r.stderr


# -- dpd's rule: no keys, no network -----------------------------------------------------------


def test_non_loopback_without_keys_is_refused_unless_insecure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpool.daemon import cli

    ran: list[cli.Settings] = []

    async def fake_run(s: cli.Settings) -> int:
        ran.append(s)
        return 0

    monkeypatch.setattr(cli, "serve_and_run", fake_run)
    monkeypatch.delenv("DPOOL_KEYS", raising=False)
    state = str(tmp_path / "state")
    base = ["run", "--state-dir", state, "--advertise", "10.0.0.1"]
    assert cli.main([*base, "--serve", "tcp://0.0.0.0:7399"]) == 2
    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340"]) == 2
    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340", "--keys", str(tmp_path / "missing")]) == 2  # a bad key dir is bad input too
    assert ran == []

    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340", "--insecure"]) == 0
    assert ran[-1].keys is None
    keys = tmp_path / "keys"
    assert keys_init(keys).returncode == 0
    assert cli.main([*base, "--serve", "tcp://0.0.0.0:7399", "--keys", str(keys)]) == 0
    assert ran[-1].keys is not None and ran[-1].server_keys is not None
    assert ran[-1].keys.source == str(keys / "node.key_secret")


def test_non_loopback_message_names_keys(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "dpool.daemon.cli", "run", "--join", "tcp://10.1.2.3:7340", "--state-dir", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=30, env={k: v for k, v in os.environ.items() if k != "DPOOL_KEYS"},
    )
    assert r.returncode == 2
    assert "--keys DIR" in r.stderr and "--insecure" in r.stderr


# -- end to end --------------------------------------------------------------------------------


def test_a_pool_with_keys_trains_and_refuses_peers_without_them(processes: Processes, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert keys_init(keys, "--node", "rogue").returncode == 0
    (keys / "allowed" / "node-rogue.key").unlink()  # rogue has a pair, but not admitted
    port = free_port()
    pool = LocalPool(processes, tmp_path, addr=f"tcp://127.0.0.1:{port}")
    addr, with_keys = pool.addr, ("--advertise", "127.0.0.1", "--keys", str(keys))
    coord_log = pool.start_daemon("n0", serve=f"tcp://0.0.0.0:{port}", args=with_keys).log  # non-loopback: allowed with keys
    pool.start_daemon("n1", args=with_keys)
    wait_for("two nodes registered over CURVE", lambda: len(nodes(addr, keys)) == 2, 30)

    job = write_job(tmp_path, "curve", workers={"min": 2, "max": 2}, train={"steps": 10})
    r = dpctl("--coordinator", addr, "submit", str(job), keys=keys)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()

    # refused peers, while the job runs: a dpctl without keys, one with another pool's keys, a
    # node whose key is not in the allow-list
    r = dpctl("--coordinator", addr, "status", timeout=1)
    assert r.returncode == 3 and "--keys" in r.stderr
    other = tmp_path / "other-pool"
    assert keys_init(other).returncode == 0
    assert dpctl("--coordinator", addr, "status", keys=other, timeout=1).returncode == 3
    pool.start_daemon("rogue", args=with_keys)

    def done() -> dict[str, object] | None:
        r = dpctl("--coordinator", addr, "status", job_id, "--json", keys=keys)
        status = json.loads(r.stdout) if r.returncode == 0 else None
        return status if status and status["state"] in ("succeeded", "failed", "cancelled") else None

    status = wait_for("the job to end", done, 120, every=0.5)
    assert status["state"] == "succeeded", status
    assert status["step"] == 10 and status["world_size"] == 2

    assert sorted(str(n["name"]) for n in nodes(addr, keys)) == ["n0", "n1"]  # rogue never joined
    log = [json.loads(line) for line in coord_log.read_text().splitlines() if line.startswith("{")]
    refused = [e for e in log if e.get("event") == "auth.refused"]
    rogue_key = zmq.auth.load_certificate(keys / "node-rogue.key")[0].decode()
    assert any(e["key"] == rogue_key for e in refused), refused
    failed = [e for e in log if e.get("event") == "auth.handshake_failed"]
    reasons = " ".join(str(e["reason"]) for e in failed)
    # a peer without keys: which side notices the mismatch first is a race, so either reason
    assert ("does not use CURVE" in reasons or "without --keys?" in reasons) and "another pool's coordinator.key" in reasons, failed

    # revoking a client: delete its public key from allowed/, and new connections are refused
    shutil.move(keys / "allowed" / "client.key", tmp_path / "client.key.revoked")
    assert dpctl("--coordinator", addr, "status", keys=keys, timeout=1).returncode == 3
