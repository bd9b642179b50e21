"""`dpd install` / `dpd uninstall` and dpd's sd_notify.

The LaunchAgent and the systemd units are rendered through the real `dpd` CLI into a fake home
(launchctl and systemctl are an injected recorder: nothing on this machine is loaded), parsed with
plistlib and checked with `systemd-analyze verify`. sd_notify is checked against a real datagram
socket and a real `dpd run`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import plistlib
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import LocalPool, Processes, free_port, wait_for

from dpool.client.keys import init_keys
from dpool.daemon import cli, sdnotify, service


class Recorder:
    """Stands in for launchctl/systemctl: records each command, fails the ones asked to, and
    answers the ones given `replies` (a word of the command -> (exit code, stdout or stderr) in
    turn, the last one again once the others are used)."""

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail or {}
        self.replies: dict[str, list[tuple[int, str]]] = {}

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        for word, replies in self.replies.items():
            if word in argv:
                code, text = replies.pop(0) if len(replies) > 1 else replies[0]
                return subprocess.CompletedProcess(list(argv), code, text if code == 0 else "", "" if code == 0 else text)
        code = next((c for word, c in self.fail.items() if word in argv), 0)
        return subprocess.CompletedProcess(list(argv), code, "", "Boot-out failed: 3: No such process" if code else "")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A fake home and host; returns a function making the Host for a platform and uid."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("DPOOL_COORDINATOR", "DPOOL_KEYS", "NOTIFY_SOCKET", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    config = tmp_path / "config.toml"
    config.write_text("")
    recorder = Recorder()
    monkeypatch.setattr(service, "run_command", recorder)

    def make(platform: str, uid: int = 501) -> service.Host:
        host = service.Host(platform=platform, home=home, uid=uid, python=sys.executable, env=dict(os.environ), system_units=tmp_path / "etc-systemd-system")
        monkeypatch.setattr(service.Host, "current", staticmethod(lambda: host))
        return host

    make.home, make.config, make.recorder = home, config, recorder  # type: ignore[attr-defined]
    return make


def verify_unit(path: Path, *, user: bool, tmp: Path) -> None:
    """`systemd-analyze verify` accepts the unit without a single warning (it exits 0 on parse
    warnings, so stderr must be empty too)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")
    runtime = tmp / "xdg-runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    cmd = [tool, *(["--user"] if user else []), "verify", str(path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    if r.returncode != 0 and "Failed to initialize manager" in r.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {r.stderr.strip()}")
    assert r.returncode == 0 and r.stderr.strip() == "", f"{' '.join(cmd)}:\n{r.stdout}{r.stderr}"


# -- macOS: the LaunchAgent ---------------------------------------------------------------------


def test_install_writes_and_loads_a_launch_agent(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake("darwin", uid=501)
    keys = tmp_path / "keys"
    init_keys(keys, nodes=["mac1"])  # its pair: dpd checks that node mac1 has one
    monkeypatch.chdir(tmp_path)
    code = cli.main(["install", "--config", str(fake.config), "--serve", "tcp://0.0.0.0:7399", "--name", "mac1", "--workers", "2", "--keys", "keys"])
    assert code == 0

    path = fake.home / "Library" / "LaunchAgents" / "org.dpool.dpd.plist"
    plist = plistlib.loads(path.read_bytes())
    assert plist["Label"] == "org.dpool.dpd"
    args = plist["ProgramArguments"]
    assert Path(args[0]).is_absolute() and args[0] == sys.executable
    assert args[1:4] == ["-m", "dpool.daemon.boot", "run"]
    flags = dict(zip(args[4::2], args[5::2], strict=False))
    assert flags["--serve"] == "tcp://0.0.0.0:7399" and flags["--name"] == "mac1" and flags["--workers"] == "2"
    assert flags["--keys"] == str(keys)  # a relative path made absolute: launchd does not start in our cwd
    assert flags["--config"] == str(fake.config)
    assert flags["--state-dir"] == str(fake.home / "Library" / "Application Support" / "dpool")
    assert plist["RunAtLoad"] is True
    assert plist["ProcessType"] == "Interactive"  # unset: launchd throttles the CPU and I/O of dpd's trainers
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert isinstance(plist["ThrottleInterval"], int) and plist["ThrottleInterval"] >= 10
    log_dir = fake.home / "Library" / "Logs" / "dpool"
    assert Path(plist["StandardErrorPath"]).parent == log_dir and log_dir.is_dir()
    assert plist["EnvironmentVariables"]["PATH"].startswith(str(Path(sys.executable).parent))
    assert Path(plist["WorkingDirectory"]).is_dir()

    # bootout first (it fails when nothing is loaded, which install accepts), then bootstrap
    assert fake.recorder.calls == [["launchctl", "bootout", "gui/501/org.dpool.dpd"], ["launchctl", "bootstrap", "gui/501", str(path)]]


def test_install_ignores_not_loaded_but_reports_a_failed_bootstrap(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("darwin")
    fake.recorder.fail = {"bootout": 3}
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    fake.recorder.fail = {"bootstrap": 5}
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 1
    assert "launchctl bootstrap" in capsys.readouterr().out


def test_uninstall_boots_out_and_removes_the_agent(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("darwin", uid=501)
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    path = fake.home / "Library" / "LaunchAgents" / "org.dpool.dpd.plist"
    fake.recorder.calls.clear()
    assert cli.main(["uninstall"]) == 0
    assert not path.exists()
    assert fake.recorder.calls == [["launchctl", "bootout", "gui/501/org.dpool.dpd"]]
    assert cli.main(["uninstall"]) == 0  # again: nothing to do, said so
    assert "not installed" in capsys.readouterr().out


def test_environment_coordinator_and_keys_are_written_into_the_service(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    init_keys(keys)
    monkeypatch.setenv("DPOOL_COORDINATOR", "tcp://10.0.0.5:7340")
    monkeypatch.setenv("DPOOL_KEYS", str(keys))
    fake("darwin")  # the host's env is read after the variables are set
    assert cli.main(["install", "--config", str(fake.config), "--advertise", "10.0.0.6"]) == 0
    args = plistlib.loads((fake.home / "Library" / "LaunchAgents" / "org.dpool.dpd.plist").read_bytes())["ProgramArguments"]
    assert args[args.index("--join") + 1] == "tcp://10.0.0.5:7340"
    assert args[args.index("--keys") + 1] == str(keys)


@pytest.mark.parametrize("config", ['join = "tcp://127.0.0.1:7001"', 'serve = "tcp://127.0.0.1:7003"'])
def test_a_coordinator_in_the_config_file_wins_over_the_environment_as_dpd_run_takes_it(fake, monkeypatch: pytest.MonkeyPatch, config: str) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DPOOL_COORDINATOR", "tcp://127.0.0.1:7002")
    fake.config.write_text(config + "\n")
    fake("darwin")
    assert cli.main(["install", "--config", str(fake.config)]) == 0
    args = plistlib.loads((fake.home / "Library" / "LaunchAgents" / "org.dpool.dpd.plist").read_bytes())["ProgramArguments"]
    # the service reads the file itself, as `dpd run --config` in a shell with that variable would
    assert "--join" not in args and args[args.index("--config") + 1] == str(fake.config)


def test_bad_flags_are_refused_before_anything_is_written(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("darwin")
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--workers", "0"]) == 2
    assert cli.main(["install", "--config", str(fake.config), "--join", "tcp://10.1.2.3:7340"]) == 2  # non-loopback, no keys
    assert "--workers" in capsys.readouterr().err
    assert not (fake.home / "Library").exists() and fake.recorder.calls == []


def test_print_only_prints(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--print"]) == 0
    out = capsys.readouterr().out
    assert "[Service]" in out and "Type=notify" in out
    assert "systemctl --user daemon-reload" in out and "systemctl --user restart dpd.service" in out
    assert fake.recorder.calls == [] and not (fake.home / ".config").exists()


# -- Linux: systemd units -----------------------------------------------------------------------


def test_user_unit_is_installed_enabled_and_verifies(fake, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--name", "box", "--stop-grace", "30"]) == 0
    path = fake.home / ".config" / "systemd" / "user" / "dpd.service"
    text = path.read_text()
    lines = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["Type"] == "notify" and lines["Restart"] == "on-failure" and lines["KillMode"] == "mixed"
    assert lines["TimeoutStopSec"] == "90s"  # --stop-grace 30 and a margin for the goodbye
    exec_start = lines["ExecStart"].split()
    assert exec_start[:4] == [sys.executable, "-m", "dpool.daemon.boot", "run"]
    assert exec_start[exec_start.index("--state-dir") + 1] == str(fake.home / ".local" / "state" / "dpool")
    assert "StateDirectory" not in lines and lines["WantedBy"] == "default.target"
    assert fake.recorder.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "dpd.service"],
        ["systemctl", "--user", "restart", "dpd.service"],
    ]
    verify_unit(path, user=True, tmp=tmp_path)

    fake.recorder.calls.clear()
    assert cli.main(["uninstall"]) == 0
    assert not path.exists()
    assert fake.recorder.calls == [["systemctl", "--user", "disable", "--now", "dpd.service"], ["systemctl", "--user", "daemon-reload"]]


def test_an_empty_flag_value_is_left_out_of_the_service_as_dpd_run_leaves_it(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """'--state-dir "$UNSET"': the unit said '--state-dir None', and the service kept its state in ~/None."""
    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", "", "--keys", "", "--log-file", "", "--print"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and f"--state-dir {fake.home / '.local' / 'state' / 'dpool'}" in out


def test_install_keeps_the_state_dir_the_config_file_names(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """The service's default --state-dir was written over the config file's state_dir (a flag beats
    the file): its checkpoints went elsewhere than the user asked."""
    fake("linux", uid=1000)
    mine = fake.home / "dpool-state"
    fake.config.write_text(f'state_dir = "{mine}"\n')
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--print"]) == 0
    assert f"--state-dir {mine}" in capsys.readouterr().out


def test_unit_paths_with_spaces_letters_and_signs_verify(tmp_path: Path) -> None:
    """A home such as /home/josé or 'my home': WorkingDirectory= takes the path as the rest of its
    line (quoted, systemd refused it: 'path is not absolute'); ReadWritePaths= never expands `$`,
    so a '$' there is written once."""
    home = tmp_path / "jo sé %h $HOME"
    state, logs = tmp_path / "st é $x", tmp_path / "logs"
    text = service.render_unit(
        [sys.executable, "-m", "dpool.daemon.boot", "run", "--state-dir", str(state)], system=True, state_dir=state,
        working_directory=home, timeout_stop_s=90, log_dir=logs,
    )
    lines = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["WorkingDirectory"] == str(home).replace("%", "%%")
    assert lines["ReadWritePaths"] == f'"{state}" {logs}'
    path = tmp_path / "dpd.service"
    path.write_text(text)
    verify_unit(path, user=False, tmp=tmp_path)


def test_system_unit_as_root_is_hardened_and_verifies(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=0)
    monkeypatch.setattr(service, "PRIVATE_TMPS", ())  # this test's folders are under /tmp
    keys = tmp_path / "keys"
    init_keys(keys)
    assert cli.main(["install", "--config", str(fake.config), "--join", "tcp://10.0.0.5:7340", "--keys", str(keys), "--advertise", "10.0.0.6"]) == 0
    path = tmp_path / "etc-systemd-system" / "dpd.service"
    text = path.read_text()
    lines = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert lines["StateDirectory"] == "dpool" and "--state-dir /var/lib/dpool" in lines["ExecStart"]
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "read-only"), ("PrivateTmp", "yes")):
        assert lines[key] == value, key
    assert "ReadWritePaths" not in lines  # StateDirectory= is writable under ProtectSystem=strict
    assert lines["WantedBy"] == "multi-user.target"
    assert fake.recorder.calls[0] == ["systemctl", "daemon-reload"]
    verify_unit(path, user=False, tmp=tmp_path)


def test_a_system_service_refuses_a_state_dir_its_private_tmp_would_hide(fake, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """PrivateTmp=yes: under /tmp the service's state would be a private folder, emptied at each
    restart. Refused before anything is written; a user unit (no PrivateTmp) may use it."""
    fake("linux", uid=0)
    monkeypatch.setattr(service, "PRIVATE_TMPS", (tmp_path.resolve(),))  # this test's /tmp, wherever the machine's is
    state = tmp_path / "state"
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", str(state), "--print"]) == 2
    assert f"--state-dir {state}: the system service runs with PrivateTmp=yes" in capsys.readouterr().err
    assert not (tmp_path / "etc-systemd-system" / "dpd.service").exists() and not state.exists()
    # The same for what it reads (keys, its config) and its log: there the service would not find
    # them, nor the user its log.
    elsewhere = Path("/var/lib/dpool-test-never-made")
    keys = tmp_path / "keys"
    init_keys(keys)
    for flags, said in (
        (["--keys", str(keys), "--join", "tcp://10.0.0.5:7340"], f"--keys {keys.resolve()}: the system service runs with PrivateTmp=yes"),
        (["--log-file", str(tmp_path / "dpd.log")], f"--log-file {(tmp_path / 'dpd.log').resolve()}: the system service runs with PrivateTmp=yes"),
        ([], f"--config {fake.config.resolve()}: the system service runs with PrivateTmp=yes"),
    ):
        assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", str(elsewhere), *flags, "--print"]) == 2
        assert said in capsys.readouterr().err
    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", str(state), "--print"]) == 0


def test_a_state_dir_elsewhere_is_made_writable(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=0)
    monkeypatch.setattr(service, "PRIVATE_TMPS", ())  # this test's folders are under /tmp
    state = tmp_path / "data dir"
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", str(state)]) == 0
    text = (tmp_path / "etc-systemd-system" / "dpd.service").read_text()
    assert f'ReadWritePaths="{state}"' in text and f'--state-dir "{state}"' in text
    assert state.is_dir()  # ReadWritePaths= on a missing path fails the unit
    # ProtectSystem=strict: a log outside the state dir is made writable too (it was not), and a
    # relative --log-file is made absolute (the service starts in /).
    monkeypatch.chdir(tmp_path)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", str(state), "--log-file", "logs/dpd.log"]) == 0
    text = (tmp_path / "etc-systemd-system" / "dpd.service").read_text()
    logs = tmp_path / "logs"
    assert f'ReadWritePaths="{state}" {logs}\n' in text and f"--log-file {logs / 'dpd.log'}" in text and logs.is_dir()
    verify_unit(tmp_path / "etc-systemd-system" / "dpd.service", user=False, tmp=tmp_path)
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--state-dir", str(state), "--log-file", str(state / "dpd.log")]) == 0
    assert f'ReadWritePaths="{state}"\n' in (tmp_path / "etc-systemd-system" / "dpd.service").read_text()  # within it: once


def test_exec_start_words_are_quoted_and_escaped() -> None:
    assert service.systemd_quote("/usr/bin/python3") == "/usr/bin/python3"
    assert service.systemd_quote("/a b/c") == '"/a b/c"'
    assert service.systemd_quote("50%") == "50%%"  # a specifier otherwise
    assert service.systemd_quote("$HOME") == "$$HOME"  # a variable otherwise
    assert service.systemd_quote('say "hi"') == '"say \\"hi\\""'
    with pytest.raises(ValueError):
        service.systemd_quote("a\nb")


def test_quoted_paths_survive_systemd_analyze(fake, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host = fake("linux", uid=1000)
    argv = service.service_argv(host, ["--serve", "tcp://127.0.0.1:7340", "--name", "box", "--log-file", str(tmp_path / "50%$HOME" / "dpd.log")], tmp_path / "state with space")
    p = service.plan(host, argv, state_dir=tmp_path / "state with space", stop_grace_s=10)
    path = tmp_path / "dpd.service"
    path.write_text(p.text)
    verify_unit(path, user=True, tmp=tmp_path)


# -- sd_notify ----------------------------------------------------------------------------------


def receiver(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + address[1:] if address.startswith("@") else address)
    s.settimeout(30)
    return s


def test_notify_reaches_path_and_abstract_sockets(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    abstract = f"@dpool-test-{uuid.uuid4().hex}"
    for address in (path, abstract):
        with receiver(address) as r:
            assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": address})
            assert r.recv(4096) == b"READY=1"
    assert not sdnotify.notify("READY=1", {})  # outside systemd: nothing, no error
    assert not sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})


def test_dpd_says_ready_once_registered_and_stopping_on_sigterm(processes: Processes, tmp_path: Path) -> None:
    address = f"@dpool-test-{uuid.uuid4().hex}"  # abstract: as systemd's own NOTIFY_SOCKET may be
    with receiver(address) as r:
        pool = LocalPool(processes, tmp_path)
        p = pool.start_daemon("n0", serve=True, env={"NOTIFY_SOCKET": address}).proc
        ready = r.recv(4096).decode()
        assert ready.splitlines()[0] == "READY=1"
        assert f"STATUS=registered with {pool.addr}" in ready
        os.kill(p.pid, signal.SIGTERM)
        assert r.recv(4096).decode().splitlines()[0] == "STOPPING=1"
        assert p.wait(timeout=30) == 0


# -- dpd status / logs / restart / --version ------------------------------------------------------

# `launchctl print gui/501/org.dpool.dpd` of a running agent (macOS 14; blocks trimmed)
LAUNCHCTL_RUNNING = """gui/501/org.dpool.dpd = {
\tactive count = 1
\tpath = /Users/me/Library/LaunchAgents/org.dpool.dpd.plist
\ttype = LaunchAgent
\tstate = running

\tprogram = /opt/homebrew/bin/python3
\targuments = {
\t\t/opt/homebrew/bin/python3
\t\t-m
\t\tdpool.daemon.cli
\t\trun
\t}

\tdefault environment = {
\t\tPATH => /usr/bin:/bin:/usr/sbin:/sbin
\t}

\tdomain = gui/501 [100005]
\tminimum runtime = 10
\texit timeout = 70
\truns = 1
\tpid = 4242
\timmediate reason = speculative
\tlast exit code = (never exited)

\tspawn type = interactive (4)
}
"""
LAUNCHCTL_STOPPED = LAUNCHCTL_RUNNING.replace("\tstate = running", "\tstate = not running").replace("\tpid = 4242\n", "").replace("(never exited)", "0")
LAUNCHCTL_NOT_LOADED = (113, 'Could not find service "org.dpool.dpd" in domain for port')
SYSTEMCTL_SHOW = "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=4343\nUnitFileState=enabled\nExecMainStatus=0\n"
SHOW = ["show", *(f"--property={p}" for p in service.SYSTEMCTL_PROPERTIES), "dpd.service"]


def fields(out: str) -> dict[str, str]:
    """`dpd status`'s `key   value` lines."""
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def test_status_of_a_running_agent_asks_launchctl_and_its_coordinator(fake, processes: Processes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("darwin", uid=501)
    pool = LocalPool(processes, tmp_path / "pool")
    assert cli.main(["install", "--config", str(fake.config), "--join", pool.addr, "--name", "n0"]) == 0
    pool.start_daemon("n0", serve=True)  # the dpd that launchd would run, with the service's name and coordinator
    pool.wait_registered(1)
    fake.recorder.calls.clear()
    fake.recorder.replies = {"print": [(0, LAUNCHCTL_RUNNING)]}
    capsys.readouterr()

    assert cli.main(["status"]) == 0
    got = fields(capsys.readouterr().out)
    assert fake.recorder.calls == [["launchctl", "print", "gui/501/org.dpool.dpd"]]
    assert got["service"] == f"LaunchAgent {fake.home}/Library/LaunchAgents/org.dpool.dpd.plist"
    assert got["loaded"] == "yes" and got["running"] == "yes, pid 4242 (running)"
    assert got["coordinator"] == pool.addr  # read back from the plist's --join
    assert got["node"].startswith("n0: idle, slots 0/1, ring address 127.0.0.1 (lo")

    assert cli.main(["status", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["manager"], doc["installed"], doc["loaded"], doc["running"], doc["pid"]) == ("launchd", True, True, True, 4242)
    assert doc["node"]["name"] == "n0" and doc["node"]["state"] == "idle" and doc["error"] is None


def test_status_asks_with_the_services_client_pair_or_says_why_it_cannot(fake, processes: Processes, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake("darwin", uid=501)
    monkeypatch.setattr(cli, "DEFAULT_CONFIG", fake.home / "config.toml")  # not this machine's own dpool config
    keys = tmp_path / "keys"
    init_keys(keys, nodes=["n0"])
    pool = LocalPool(processes, tmp_path / "pool")
    pool.start_daemon("n0", serve=True, args=["--keys", str(keys)])
    fake.recorder.replies = {"print": [(0, LAUNCHCTL_RUNNING)]}
    assert cli.main(["install", "--config", str(fake.config), "--join", pool.addr, "--name", "n0", "--keys", str(keys)]) == 0
    capsys.readouterr()
    # the serving machine's full key directory holds dpctl's pair: the coordinator answers it
    wait_for("n0 registered, as `dpd status` sees it", lambda: pool.check_alive() or cli.main(["status"]) == 0, timeout=60)
    assert fields(capsys.readouterr().out)["node"].startswith("n0: idle")

    # a node's bundle holds its own pair only, which may not ask for the pool's nodes
    assert cli.main(["install", "--config", str(fake.config), "--join", pool.addr, "--name", "n0", "--keys", str(keys / "bundles" / "n0")]) == 0
    capsys.readouterr()
    assert cli.main(["status"]) == 2
    assert "hold no client pair" in fields(capsys.readouterr().out)["node"]
    assert cli.main(["status", "--keys", str(keys)]) == 0  # given one


def test_status_of_a_user_unit_whose_coordinator_is_away(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=1000)
    away = f"tcp://127.0.0.1:{free_port()}"
    assert cli.main(["install", "--config", str(fake.config), "--join", away, "--name", "box"]) == 0
    fake.recorder.calls.clear()
    fake.recorder.replies = {"show": [(0, SYSTEMCTL_SHOW)]}
    capsys.readouterr()
    assert cli.main(["status", "--timeout", "0.3"]) == 3
    got = fields(capsys.readouterr().out)
    assert fake.recorder.calls == [["systemctl", "--user", *SHOW]]
    assert got["service"] == f"systemd user unit {fake.home}/.config/systemd/user/dpd.service"
    assert got["loaded"] == "yes (enabled)" and got["running"] == "yes, pid 4343 (active (running))"
    assert got["coordinator"] == away and got["node"].startswith(f"box: no answer from the coordinator at {away} within 0.3s")


def test_status_of_a_stopped_unloaded_or_missing_service(fake, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=0)
    monkeypatch.setattr(service, "PRIVATE_TMPS", ())  # this test's folders are under /tmp
    assert cli.main(["status"]) == 1  # nothing installed: said, and no systemctl asked
    assert "(not installed: `dpd install ...` writes it)" in capsys.readouterr().out and fake.recorder.calls == []
    assert cli.main(["install", "--config", str(fake.config), "--serve", f"tcp://0.0.0.0:{free_port()}", "--insecure"]) == 0
    fake.recorder.calls.clear()
    fake.recorder.replies = {"show": [(0, "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nUnitFileState=enabled\nExecMainStatus=1\n")]}
    capsys.readouterr()
    assert cli.main(["status", "--timeout", "0.2"]) == 1
    got = fields(capsys.readouterr().out)
    assert fake.recorder.calls == [["systemctl", *SHOW]]  # a system unit: no --user
    assert got["running"] == "no (failed (failed), last exit 1)"
    assert got["coordinator"].startswith("tcp://127.0.0.1:")  # its wildcard bind, reached on loopback

    fake.recorder.replies = {"show": [(1, "Failed to connect to bus: No medium found")]}
    assert cli.main(["status", "--timeout", "0.2"]) == 1
    assert "Failed to connect to bus" in fields(capsys.readouterr().out)["loaded"]

    fake("darwin")
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    fake.recorder.replies = {"print": [LAUNCHCTL_NOT_LOADED]}
    capsys.readouterr()
    assert cli.main(["status", "--timeout", "0.2"]) == 1
    got = fields(capsys.readouterr().out)
    assert got["loaded"] == "no" and got["running"] == "no (not loaded)"


def test_logs_come_from_the_agents_log_file_the_journal_or_the_log_file_flag(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("darwin")
    assert cli.main(["logs"]) == 1  # not installed
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    log = fake.home / "Library" / "Logs" / "dpool" / "dpd.log"
    log.write_text("".join(f'{{"event": "line {i}"}}\n' for i in range(5)))
    capfd.readouterr()
    assert cli.main(["logs", "-n", "2"]) == 0  # a real tail
    assert capfd.readouterr().out == '{"event": "line 3"}\n{"event": "line 4"}\n'

    executed: list[list[str]] = []
    monkeypatch.setattr(service, "execute_command", lambda argv: executed.append(list(argv)) or 0)
    assert cli.main(["logs", "-f"]) == 0
    assert executed[-1] == ["tail", "-n", "100", "-F", str(log)]  # -F: it follows across a rotation
    own = tmp_path / "own.log"
    assert cli.main(["install", "--config", str(fake.config), "--serve", "--log-file", str(own)]) == 0
    assert cli.main(["logs", "-f"]) == 0
    assert executed[-1] == ["tail", "-n", "100", "-F", str(own)]

    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    assert cli.main(["logs", "-f", "-n", "20"]) == 0
    assert executed[-1] == ["journalctl", "--user", "--unit", "dpd.service", "--lines", "20", "--no-pager", "--follow"]
    fake("linux", uid=0)
    monkeypatch.setattr(service, "PRIVATE_TMPS", ())  # this test's folders are under /tmp
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    assert cli.main(["logs"]) == 0
    assert executed[-1] == ["journalctl", "--unit", "dpd.service", "--lines", "100", "--no-pager"]


def test_restart_stops_an_agent_with_sigterm_waits_and_kicks_it_off(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("darwin", uid=501)
    assert cli.main(["restart"]) == 1  # not installed
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    fake.recorder.calls.clear()
    # running; still running after the SIGTERM (its trainers checkpoint); gone; started again
    fake.recorder.replies = {"print": [(0, LAUNCHCTL_RUNNING), (0, LAUNCHCTL_RUNNING), (0, LAUNCHCTL_STOPPED), (0, LAUNCHCTL_RUNNING.replace("4242", "4343"))]}
    capsys.readouterr()
    assert cli.main(["restart"]) == 0
    target = "gui/501/org.dpool.dpd"
    assert fake.recorder.calls == [
        ["launchctl", "print", target],
        ["launchctl", "kill", "SIGTERM", target],  # not `kickstart -k`: that is SIGKILL
        ["launchctl", "print", target],
        ["launchctl", "print", target],
        ["launchctl", "kickstart", target],
        ["launchctl", "print", target],
    ]
    assert capsys.readouterr().out.strip() == "restarted dpd (LaunchAgent): pid 4343"

    fake.recorder.calls.clear()
    fake.recorder.replies = {"print": [LAUNCHCTL_NOT_LOADED]}
    fake.recorder.fail = {"bootstrap": 5}
    assert cli.main(["restart"]) == 1  # not loaded: bootstrapped (RunAtLoad starts it), which failed here
    plist = str(fake.home / "Library" / "LaunchAgents" / "org.dpool.dpd.plist")
    assert fake.recorder.calls == [["launchctl", "print", target], ["launchctl", "bootstrap", "gui/501", plist]]
    assert "launchctl bootstrap gui/501" in capsys.readouterr().err  # a failure goes to stderr


def test_restart_of_a_unit_is_systemctl_restart(fake, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    fake("linux", uid=1000)
    assert cli.main(["install", "--config", str(fake.config), "--serve"]) == 0
    fake.recorder.calls.clear()
    fake.recorder.replies = {"show": [(0, SYSTEMCTL_SHOW)]}
    capsys.readouterr()
    assert cli.main(["restart"]) == 0
    assert fake.recorder.calls == [["systemctl", "--user", "restart", "dpd.service"], ["systemctl", "--user", *SHOW]]
    assert capsys.readouterr().out.strip() == "restarted dpd (systemd user unit): pid 4343"


def test_a_service_file_is_read_back_as_it_was_written(fake, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    host = fake("linux", uid=1000)
    odd = ["--serve", "tcp://127.0.0.1:7340", "--name", "box", "--log-file", str(tmp_path / "log dir 50%$HOME" / "dpd.log")]
    p = service.plan(host, service.service_argv(host, odd, tmp_path / "state with space"), state_dir=tmp_path / "state with space", stop_grace_s=10)
    service.install(p, service.run_command, out=lambda line: None)
    flags = service.run_flags(service.Installed(host).argv())
    assert flags == [*odd, "--state-dir", str(tmp_path / "state with space")]
    assert service.flag_value(flags or [], "--log-file") == str(tmp_path / "log dir 50%$HOME" / "dpd.log")
    assert service.connect_address("tcp://*:7340") == "tcp://127.0.0.1:7340"
    assert service.connect_address("tcp://[::]:7340") == "tcp://[::1]:7340"
    assert service.connect_address("tcp://10.0.0.5:7340") == "tcp://10.0.0.5:7340"


def user_systemd() -> bool:
    if shutil.which("systemctl") is None:
        return False
    r = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0


@pytest.mark.skipif(os.getuid() == 0 or not user_systemd(), reason="needs a systemd user manager (`systemctl --user`) and a user other than root")
def test_status_of_an_installed_user_unit_under_real_systemd(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unit = Path.home() / ".config" / "systemd" / "user" / "dpd.service"
    if unit.exists():
        pytest.skip(f"{unit} exists: this user's own dpd is left alone")
    config = tmp_path / "dpd.toml"
    config.write_text("")
    port = free_port()
    try:
        assert cli.main(["install", "--config", str(config), "--serve", f"tcp://127.0.0.1:{port}", "--name", "unit-test", "--state-dir", str(tmp_path / "state")]) == 0
        capsys.readouterr()
        wait_for("the unit's dpd registered, as `dpd status` sees it", lambda: cli.main(["status"]) == 0, timeout=60)
        got = fields(capsys.readouterr().out.split("\n\n")[-1])
        assert got["running"].startswith("yes, pid ") and got["node"].startswith("unit-test: idle")
        assert cli.main(["restart"]) == 0
        assert "restarted dpd (systemd user unit): pid " in capsys.readouterr().out
    finally:
        cli.main(["uninstall"])


def test_dpd_version() -> None:
    r = subprocess.run([sys.executable, "-m", "dpool.daemon.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"dpd {importlib.metadata.version('dpool')}\n"


def test_the_config_file_dpctl_shares_is_read_by_dpd_too(tmp_path: Path) -> None:
    """One config file for both: dpctl's keys (`coordinator`, `timeout`) are dpd's to accept and
    check, not to refuse as unknown; a key neither knows is still refused, naming both sets."""
    config = tmp_path / "config.toml"
    config.write_text('join = "tcp://127.0.0.1:7340"\ncoordinator = "tcp://127.0.0.1:7340"\ntimeout = 10\nworkers = 2\n')
    assert cli.load_config(config, required=True)["workers"] == 2
    config.write_text('timeout = "soon"\n')
    with pytest.raises(cli.UsageError, match="timeout = 'soon': must be a finite number"):
        cli.load_config(config, required=True)
    config.write_text("coordinatr = 1\n")
    with pytest.raises(cli.UsageError, match=r"unknown key 'coordinatr'; allowed: join, .*coordinator, timeout"):
        cli.load_config(config, required=True)
    config.write_text("heartbeat_interval = inf\n")
    with pytest.raises(cli.UsageError, match="heartbeat_interval = inf: must be a finite number"):
        cli.load_config(config, required=True)
    # A value out of its range names the file and the key, whatever flag would override it
    for text, said in (('cache_max = "lots"', "cache_max = 'lots': expected a size such as 50GB"), ("timeout = -3", r"timeout = -3: must be seconds in \(0, 86400\]"),
                       ("liveness = 1", r"liveness = 1: must be a count of heartbeats in \[2, 1000\]"), ('log_level = "loud"', "log_level = 'loud': must be one of debug")):
        config.write_text(text + "\n")
        with pytest.raises(cli.UsageError, match=f"{config}: {said}"):
            cli.load_config(config, required=True)


def test_a_bad_value_in_the_config_file_is_refused_naming_the_file_and_the_key(tmp_path: Path) -> None:
    """`dpd run --config FILE`: exit 2 and one line that names FILE and the key (not the flag the
    user never passed); a bad --log-file is refused the same way, not a daemon with no log."""
    config = tmp_path / "c.toml"
    config.write_text('yield_when = "sometimes"\n')
    base = [sys.executable, "-m", "dpool.daemon.boot", "run", "--serve", "tcp://127.0.0.1:7398", "--state-dir", str(tmp_path / "sd")]
    r = subprocess.run([*base, "--config", str(config)], capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 2 and f"{config}: yield_when = 'sometimes'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    (tmp_path / "afile").write_text("")
    for bad in (tmp_path, tmp_path / "afile" / "dpd.log"):
        r = subprocess.run([*base, "--log-file", str(bad)], capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)})
        assert r.returncode == 2 and f"--log-file {bad}: cannot write there" in r.stderr, r.stderr


def test_every_flag_has_a_spelling_in_the_config_file(tmp_path: Path) -> None:
    """`serve = true` and `dashboard = true` are a bare --serve and --dashboard; a size may be a
    number of bytes, as its flag's `0` or `25000000`."""
    config = tmp_path / "c.toml"
    config.write_text("serve = true\ndashboard = true\nstage_rate = 0\ncache_max = 50000000000\n")
    s = cli.settings(argparse.Namespace(**(dict.fromkeys(cli.CONFIG_KEYS) | {"config": str(config)})))
    assert (s.serve, s.dashboard, s.stage_rate, s.cache_max) == (cli.DEFAULT_SERVE, cli.DEFAULT_DASHBOARD, 0.0, 50_000_000_000)
    config.write_text("serve = false\njoin = \"tcp://127.0.0.1:7001\"\n")
    s = cli.settings(argparse.Namespace(**(dict.fromkeys(cli.CONFIG_KEYS) | {"config": str(config)})))
    assert (s.serve, s.join) == (None, "tcp://127.0.0.1:7001")


@pytest.mark.parametrize(("flags", "said"), [
    (["--heartbeat-interval", "nan"], "--heartbeat-interval nan"),
    (["--heartbeat-interval", "inf"], "--heartbeat-interval inf"),
    (["--liveness", "1000000000"], "--liveness 1000000000"),
    (["--stop-grace", "-5"], "--stop-grace -5"),
    (["--stop-grace", "nan"], "--stop-grace nan"),
    (["--serve", "tcp://127.0.0.1"], "tcp://HOST:PORT"),
    (["--serve", "tcp://127.0.0.1:99999"], "must be 1-65535"),
    (["--join", "tcp://*:7340"], "--join 'tcp://*:7340': '*' is for binding"),
])
def test_out_of_range_flags_are_refused_with_exit_2_and_one_line(tmp_path: Path, flags: list[str], said: str) -> None:
    """Refused before anything starts, dpd run and dpd install alike (a service with
    TimeoutStopSec=-40s, or a daemon that never declares a peer lost, is no setting)."""
    for command in (["run", "--serve", "tcp://127.0.0.1:7398"], ["install", "--print", "--serve"]):
        r = subprocess.run([sys.executable, "-m", "dpool.daemon.boot", *command, "--state-dir", str(tmp_path / "sd"), *flags],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(tmp_path)})
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, (command, r.stderr)
        assert r.stdout == ""


def test_dpd_logs_takes_a_count_of_lines_not_a_negative_one() -> None:
    from dpool.daemon import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["logs", "-n", "-5"])
    assert e.value.code == 2
