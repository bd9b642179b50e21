"""CURVE on the control plane: `dpctl keys init`, a pool that trains with keys, and the peers it refuses.

Real `dpd` and `dpctl` processes on loopback; the coordinator binds 0.0.0.0 in the end-to-end test,
which only keys (or --insecure) allow.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth
from conftest import LocalPool, Processes, free_port, wait_for
from jobs import write_job

from dpool.client.keys import init_keys
from dpool.protocol.security import KeysError, client_keys


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


def test_keys_init_where_no_folder_can_be_is_exit_2_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    for where, said in ((tmp_path / "afile", "File exists"), (tmp_path / "afile" / "sub", "Not a directory")):
        r = keys_init(where)
        assert r.returncode == 2 and r.stderr.startswith("dpctl: cannot write the keys: ") and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_keys_init_writes_private_secrets_an_allow_list_by_role_and_a_bundle_per_machine(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    r = keys_init(d, "--node", "mac1", "--node", "mac2", "--client", "alice")
    assert r.returncode == 0, r.stderr
    for folder in (d, d / "allowed", d / "allowed" / "nodes", d / "allowed" / "clients", d / "bundles", d / "bundles" / "mac2"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for name in ("coordinator", "client", "node-mac1", "node-mac2", "client-alice"):
        assert stat.S_IMODE((d / f"{name}.key_secret").stat().st_mode) == 0o600
        assert stat.S_IMODE((d / f"{name}.key").stat().st_mode) == 0o644
        public, secret = zmq.auth.load_certificate(d / f"{name}.key_secret")
        assert secret is not None and len(public) == 40
    # the allow-list, by role; never the coordinator's own key
    listed = sorted(str(p.relative_to(d / "allowed")) for p in (d / "allowed").rglob("*.key"))
    assert listed == ["clients/alice.key", "clients/client.key", "nodes/mac1.key", "nodes/mac2.key"]
    assert zmq.auth.load_certificate(d / "allowed" / "nodes" / "mac2.key")[0] == zmq.auth.load_certificate(d / "node-mac2.key")[0]
    # each machine's bundle: coordinator.key and its own pair, never the coordinator's secret
    bundles = {b.name: sorted(p.name for p in b.iterdir()) for b in (d / "bundles").iterdir()}
    assert bundles == {
        "mac1": ["coordinator.key", "node-mac1.key", "node-mac1.key_secret"],
        "mac2": ["coordinator.key", "node-mac2.key", "node-mac2.key_secret"],
        "alice": ["client.key", "client.key_secret", "coordinator.key"],
    }
    assert (d / "bundles" / "alice" / "client.key_secret").read_bytes() == (d / "client-alice.key_secret").read_bytes()
    assert "bundles/mac2" in r.stderr and "coordinator.key_secret" in r.stderr and "Copy" not in r.stderr

    # dpd finds its pair by its name, in the full directory and in its bundle; another name is refused
    assert client_keys(d, "node", "mac1").source == str(d / "node-mac1.key_secret")
    assert client_keys(d / "bundles" / "mac2", "node", "mac2").source == str(d / "bundles" / "mac2" / "node-mac2.key_secret")
    with pytest.raises(KeysError, match=r"holds the pair of node mac2 \(run dpd with --name mac2\).*dpctl keys add-node mac1"):
        client_keys(d / "bundles" / "mac2", "node", "mac1")
    assert client_keys(d / "bundles" / "alice", "client").public == zmq.auth.load_certificate(d / "client-alice.key")[0]


def test_keys_init_refuses_to_overwrite_without_force_and_adds_missing_pairs(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert keys_init(d, "--node", "mac1").returncode == 0
    before = (d / "coordinator.key_secret").read_bytes()
    r = keys_init(d, "--node", "mac1")
    assert r.returncode == 1 and "exist already" in r.stderr and "--force" in r.stderr
    assert (d / "coordinator.key_secret").read_bytes() == before

    r = keys_init(d, "--node", "mac3")  # one more node: only its pair is made
    assert r.returncode == 0, r.stderr
    assert (d / "coordinator.key_secret").read_bytes() == before
    assert (d / "allowed" / "nodes" / "mac3.key").exists() and (d / "bundles" / "mac3" / "node-mac3.key_secret").exists()

    old_client = zmq.auth.load_certificate(d / "client.key")[0]
    assert keys_init(d, "--node", "mac1", "--force").returncode == 0
    assert (d / "coordinator.key_secret").read_bytes() != before
    assert (d / "bundles" / "mac3" / "coordinator.key").read_bytes() == (d / "coordinator.key").read_bytes()  # every bundle follows
    new_client = zmq.auth.load_certificate(d / "allowed" / "clients" / "client.key")[0]
    assert new_client != old_client  # the replaced key is no longer admitted

    assert keys_init(d, "--node", "Bad Name").returncode == 2


def test_keys_init_makes_a_name_given_twice_once(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    r = keys_init(d, "--node", "mac1", "--node", "mac1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f"{d / 'node-mac1.key_secret'}\n") == 1, r.stdout


def test_keys_are_named_by_the_rule_dpd_names_nodes_by(tmp_path: Path) -> None:
    """dpd took `--name mac_1` and told the user to run `dpctl keys add-node mac_1`, which refused
    the name: one rule now, for both (upper case neither: two names, one file on a Mac)."""
    d = tmp_path / "keys"
    r = keys_init(d, "--node", "mac_1", "--node", "m2.local")
    assert r.returncode == 0, r.stderr
    assert (d / "node-mac_1.key_secret").is_file() and (d / "bundles" / "m2.local").is_dir()
    for bad in ("Mac1", "../x", "a b"):
        r = dpctl("keys", "add-node", bad, "--dir", str(d))
        assert r.returncode == 2 and "a name of 1-63 lower-case letters, digits, '.', '_' and '-'" in r.stderr, r.stderr


def test_a_host_name_the_rule_refuses_still_names_a_dpd_given_no_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dpd's default --name is the host name made to fit the rule, not a refusal at start."""
    from dpool.daemon import cli
    from dpool.protocol.payloads import name_from_host

    assert [name_from_host(h) for h in ("Johns-MacBook-Pro.local", "build_box", "My Host", "..", "-x")] == [
        "johns-macbook-pro", "build_box", "my-host", "node", "x"]
    ran: list[cli.Settings] = []

    async def fake_run(s: cli.Settings, zygote: object = None) -> int:
        ran.append(s)
        return 0

    monkeypatch.setattr(cli, "serve_and_run", fake_run)
    monkeypatch.setattr(cli.socket, "gethostname", lambda: "Lab Box #2.example.org")
    assert cli.main(["run", "--serve", "--state-dir", str(tmp_path / "state")]) == 0
    assert ran[-1].name == "lab-box--2"


def test_a_client_named_client_is_refused_it_would_replace_the_default_clients_key(tmp_path: Path) -> None:
    """Its key took allowed/clients/client.key, and the serving machine's dpctl was locked out."""
    r = keys_init(tmp_path / "new", "--node", "mac1", "--client", "client")
    assert r.returncode == 2 and "--client 'client': that name is the default client's" in r.stderr, r.stderr
    assert not (tmp_path / "new").exists()
    d = tmp_path / "keys"
    assert keys_init(d, "--node", "mac1").returncode == 0
    before = (d / "allowed" / "clients" / "client.key").read_bytes()
    r = dpctl("keys", "add-client", "client", "--dir", str(d))
    assert r.returncode == 2 and "that name is the default client's" in r.stderr, r.stderr
    assert (d / "allowed" / "clients" / "client.key").read_bytes() == before


def test_keys_add_node_and_add_client_issue_one_more_key(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert keys_init(d, "--node", "mac1").returncode == 0
    r = dpctl("keys", "add-node", "mac4", "--dir", str(d))
    assert r.returncode == 0, r.stderr
    assert (d / "allowed" / "nodes" / "mac4.key").exists() and "bundles/mac4" in r.stderr
    r = dpctl("keys", "add-client", "dash", "--read-only", keys=d)  # the directory from --keys
    assert r.returncode == 0, r.stderr
    assert (d / "allowed" / "viewers" / "dash.key").exists() and (d / "bundles" / "dash" / "client.key_secret").exists()
    assert dpctl("keys", "add-node", "mac4", "--dir", str(d)).returncode == 1  # exists: --force to replace
    r = dpctl("keys", "add-client", "dash", "--dir", str(d))
    assert r.returncode == 2 and "a viewer already" in r.stderr
    r = dpctl("keys", "add-node", "mac5", "--dir", str(d / "bundles" / "mac1"))  # a bundle cannot issue keys
    assert r.returncode == 2 and "coordinator.key_secret: missing" in r.stderr


def test_a_secret_readable_by_others_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert keys_init(d).returncode == 0
    (d / "client.key_secret").chmod(0o644)
    r = dpctl("--coordinator", f"tcp://127.0.0.1:{free_port()}", "status", keys=d, timeout=1)
    assert r.returncode == 2
    assert "chmod 600" in r.stderr and "client.key_secret" in r.stderr


@pytest.mark.parametrize("garbage", [b"public-key", b"\x00\xff\xfe binary", b'public-key = "short"\nsecret-key = "short"\n', b""])
def test_a_malformed_key_file_is_a_keys_error_naming_it(tmp_path: Path, garbage: bytes) -> None:
    d = tmp_path / "keys"
    init_keys(d, nodes=["n1"])
    (d / "bundles" / "n1" / "coordinator.key").write_bytes(garbage)
    with pytest.raises(KeysError, match=f"^{d / 'bundles' / 'n1' / 'coordinator.key'}: not a CURVE key file"):
        client_keys(d / "bundles" / "n1", "node", "n1")
    (d / "node-n1.key_secret").write_bytes(garbage)
    with pytest.raises(KeysError, match=f"^{d / 'node-n1.key_secret'}: not a CURVE key file"):
        client_keys(d, "node", "n1")


def test_a_malformed_secret_exits_2_naming_the_file(tmp_path: Path) -> None:
    d = tmp_path / "keys"
    assert keys_init(d, "--node", "n1").returncode == 0
    for secret in (d / "client.key_secret", d / "node-n1.key_secret"):
        secret.write_bytes(b"public-key")  # zmq.auth.load_certificate raises IndexError on it
    r = dpctl("--coordinator", f"tcp://127.0.0.1:{free_port()}", "status", keys=d, timeout=1)
    assert r.returncode == 2 and f"{d / 'client.key_secret'}: not a CURVE key file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "dpool.daemon.cli", "run", "--join", f"tcp://127.0.0.1:{free_port()}", "--name", "n1", "--keys", str(d), "--state-dir", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 2 and f"{d / 'node-n1.key_secret'}: not a CURVE key file" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- dpd's rule: no keys, no network -----------------------------------------------------------


def test_non_loopback_without_keys_is_refused_unless_insecure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dpool.daemon import cli

    ran: list[cli.Settings] = []

    async def fake_run(s: cli.Settings, zygote: object = None) -> int:
        ran.append(s)
        return 0

    monkeypatch.setattr(cli, "serve_and_run", fake_run)
    monkeypatch.delenv("DPOOL_KEYS", raising=False)
    monkeypatch.setattr(cli.netif, "ipv4_addresses", lambda: {"lo": ["127.0.0.1"], "eth9": ["10.0.0.1"]})  # the address it advertises is its own
    state = str(tmp_path / "state")
    base = ["run", "--state-dir", state, "--advertise", "10.0.0.1"]
    assert cli.main([*base, "--serve", "tcp://0.0.0.0:7399"]) == 2
    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340"]) == 2
    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340", "--keys", str(tmp_path / "missing")]) == 2  # a bad key dir is bad input too
    assert ran == []

    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340", "--insecure"]) == 0
    assert ran[-1].keys is None
    keys = tmp_path / "keys"
    assert keys_init(keys, "--node", "mac1").returncode == 0
    assert cli.main([*base, "--serve", "tcp://0.0.0.0:7399", "--keys", str(keys), "--name", "mac1"]) == 0
    assert ran[-1].keys is not None and ran[-1].server_keys is not None
    assert ran[-1].keys.source == str(keys / "node-mac1.key_secret")
    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340", "--keys", str(keys / "bundles" / "mac1"), "--name", "mac1"]) == 0
    assert cli.main([*base, "--join", "tcp://10.1.2.3:7340", "--keys", str(keys / "bundles" / "mac1"), "--name", "mac2"]) == 2  # not its key
    assert cli.main([*base, "--serve", "tcp://0.0.0.0:7399", "--keys", str(keys / "bundles" / "mac1"), "--name", "mac1"]) == 2  # no coordinator secret


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
    assert keys_init(keys, "--node", "n0", "--node", "n1", "--node", "rogue").returncode == 0
    (keys / "allowed" / "nodes" / "rogue.key").unlink()  # rogue has a pair, but not admitted
    port = free_port()
    pool = LocalPool(processes, tmp_path, addr=f"tcp://127.0.0.1:{port}")
    addr, with_keys = pool.addr, ("--advertise", "127.0.0.1", "--keys", str(keys))
    coord_log = pool.start_daemon("n0", serve=f"tcp://0.0.0.0:{port}", args=with_keys).log  # non-loopback: allowed with keys
    pool.start_daemon("n1", args=("--advertise", "127.0.0.1", "--keys", str(keys / "bundles" / "n1")))  # its bundle only
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
    log = json_lines(coord_log)
    refused = [e for e in log if e.get("event") == "auth.refused"]
    rogue_key = zmq.auth.load_certificate(keys / "node-rogue.key")[0].decode()
    assert any(e["key"] == rogue_key for e in refused), refused
    failed = [e for e in log if e.get("event") == "auth.handshake_failed"]
    reasons = " ".join(str(e["reason"]) for e in failed)
    # a peer without keys: which side notices the mismatch first is a race, so either reason
    assert ("does not use CURVE" in reasons or "without --keys?" in reasons) and "another pool's coordinator.key" in reasons, failed

    # a dpd killed and started again under its own key replaces its old process once that has
    # been silent two heartbeat periods, asking again meanwhile (node_busy); it was refused as a
    # duplicate until the old one was lost (under systemd, a restart loop)
    n1 = pool.daemons["n1"]
    before = len(json_lines(coord_log))
    os.killpg(n1.pid, signal.SIGKILL)
    n1.proc.wait()
    again = pool.start_daemon("n1", args=("--advertise", "127.0.0.1", "--keys", str(keys / "bundles" / "n1")))
    wait_for("the new n1 registered", lambda: '"node.registered"' in again.log.read_text(), 30)
    assert again.proc.poll() is None
    # the coordinator's own log line may reach its file after the dpd's: wait for it, bounded.
    # Replaced, unless the old process was declared lost first (the new one took longer than the
    # heartbeats' expiry to start, on a busy machine): then it simply joins again.
    def taken_back() -> str | None:
        seen = [str(e.get("event")) for e in json_lines(coord_log)[before:] if e.get("node") == "n1" and e.get("component") == "coordinator"]
        if "node.replaced" in seen:
            return "replaced"
        lost = [i for i, e in enumerate(seen) if e == "node.lost"]
        return "lost, then joined again" if lost and "node.joined" in seen[lost[-1] :] else None

    wait_for("node.replaced in the coordinator's log", taken_back, 10)

    # revoking a client: delete its public key from allowed/, and new connections are refused
    shutil.move(keys / "allowed" / "clients" / "client.key", tmp_path / "client.key.revoked")
    assert dpctl("--coordinator", addr, "status", keys=keys, timeout=1).returncode == 3


def json_lines(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
