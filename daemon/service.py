"""`dpd install`, `uninstall`, `status`, `logs` and `restart`: dpd as an OS service, a LaunchAgent
on macOS, a systemd unit on Linux, managed as `brew services` manages its own.

Rendering is pure (inputs -> text; the templates are `launchd/` and `systemd/`, shipped as package
data), and every command goes through an injectable runner (`logs`, which streams, through an
injectable `execute`), so tests check the files, the command lines and how their output is read
without touching launchd, systemd or the user's home.

- macOS: `~/Library/LaunchAgents/org.dpool.dpd.plist`, logs in `~/Library/Logs/dpool/dpd.log`;
  loaded with `launchctl bootout gui/$UID/org.dpool.dpd` (a "not loaded" failure is fine), then
  `launchctl bootstrap gui/$UID PLIST`. A LaunchAgent runs while its user is logged in, which is
  what MLX on a Mac needs (the GPU belongs to the login session).
- Linux, as root: a system unit `/etc/systemd/system/dpd.service` (state in /var/lib/dpool through
  StateDirectory=, the full hardening); as anyone else: a user unit
  `~/.config/systemd/user/dpd.service` under `systemctl --user` (state in ~/.local/state/dpool; it
  runs while the user is logged in, or always after `loginctl enable-linger USER`).

`status` reads the service's own command line back from its file (so it asks the coordinator that
service joins, with its keys), asks the manager whether it is loaded and running (`launchctl print`,
`systemctl show`), and asks the coordinator for the node's row (`nodes`, the request `dpctl nodes`
makes). `logs` shows the service's log where it is: the file its `--log-file` names, else
~/Library/Logs/dpool/dpd.log under launchd, the journal under systemd. `restart` stops dpd with
SIGTERM (its trainers checkpoint and stop, as at any stop) and starts it again: `systemctl restart`;
under launchd `launchctl kill SIGTERM`, a wait for the exit (its plist's ExitTimeOut at most), then
`launchctl kickstart` (`kickstart -k` would SIGKILL it), or `bootstrap` when it is not loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import plistlib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit
from xml.sax.saxutils import escape

if TYPE_CHECKING:
    from dpool.daemon.cli import Settings
    from dpool.protocol.payloads import NodeRow
    from dpool.protocol.security import ClientKeys

LABEL = "org.dpool.dpd"
UNIT = "dpd.service"
ENTRY = "dpool.daemon.boot"  # the module a service runs: `dpd run` with the zygote started first
SYSTEM_STATE_DIR = Path("/var/lib/dpool")  # StateDirectory=dpool
PATH_FLAGS = ("config", "state_dir", "keys", "log_file")  # made absolute: a service does not start in the user's cwd

STATUS_TIMEOUT_S = 3.0  # `dpd status`: how long the coordinator has to answer
LOG_LINES = 100  # `dpd logs`: the last lines shown (and followed from, with -f)
STOP_POLL_S = 0.2  # `dpd restart` under launchd: how often it looks whether dpd has exited

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]
Execute = Callable[[Sequence[str]], int]  # a command whose output goes to the terminal (logs -f)


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except OSError as e:  # launchctl/systemctl not on this machine
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: {e.strerror or e}")


def execute_command(argv: Sequence[str]) -> int:
    """Run a command on this terminal; its exit code (0 when the user ends a follow with Ctrl-C)."""
    sys.stdout.flush()
    try:
        return subprocess.call(list(argv))
    except FileNotFoundError:
        print(f"dpd: {argv[0]}: not found on this machine", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


@dataclass(frozen=True, slots=True)
class Host:
    """Where a service goes: everything `install` would otherwise read from the machine."""

    platform: str  # "darwin" or "linux"
    home: Path
    uid: int
    python: str  # the absolute interpreter that runs `-m dpool.daemon.boot`
    env: dict[str, str] = field(default_factory=dict)
    system_units: Path = Path("/etc/systemd/system")

    @staticmethod
    def current() -> Host:
        return Host(platform=sys.platform, home=Path.home(), uid=os.getuid(), python=sys.executable, env=dict(os.environ))

    @property
    def system_unit(self) -> bool:
        return self.platform != "darwin" and self.uid == 0


@dataclass(frozen=True, slots=True)
class Plan:
    """What install writes and runs (and uninstall undoes)."""

    path: Path
    text: str
    install: list[list[str]]
    uninstall: list[list[str]]  # before the file is removed
    after_remove: list[list[str]] = field(default_factory=list)
    ignore_failure: frozenset[int] = frozenset()  # indexes in `install` whose failure is expected
    notes: tuple[str, ...] = ()


# -- the command line ----------------------------------------------------------------------------


def flags_from(args: argparse.Namespace, actions: Sequence[argparse.Action], host: Host, env_join: str | None = None) -> list[str]:
    """`dpd run` flags that reproduce what `install` was given, paths made absolute, and the
    coordinator and keys taken from the environment written out, since a service does not inherit
    the installing shell's environment: `env_join`, the coordinator `dpd run` would take from
    $DPOOL_COORDINATOR (only where neither a flag nor the config file names one), and $DPOOL_KEYS."""
    out: list[str] = []
    for action in actions:
        if not action.option_strings or action.dest in ("help", "print", "target"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == "":  # an empty value is no value, as `dpd run` reads it ('--keys "$UNSET"')
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
            continue
        if action.dest in PATH_FLAGS:
            value = str(_path(value))
        out += [flag, str(value)]
    if env_join is not None:
        out += ["--join", env_join]
    if args.keys is None and host.env.get("DPOOL_KEYS"):
        out += ["--keys", str(Path(host.env["DPOOL_KEYS"]).expanduser().absolute())]
    return out


def service_argv(host: Host, flags: list[str], state_dir: Path) -> list[str]:
    if "--state-dir" not in flags:
        flags = [*flags, "--state-dir", str(state_dir)]
    return [host.python, "-m", ENTRY, "run", *flags]


def state_dir_for(host: Host, args: argparse.Namespace) -> Path:
    if args.state_dir:
        return Path(args.state_dir).expanduser().absolute()
    if host.system_unit:
        return SYSTEM_STATE_DIR
    if host.platform == "darwin":
        return host.home / "Library" / "Application Support" / "dpool"
    return Path(host.env.get("XDG_STATE_HOME") or host.home / ".local" / "state") / "dpool"


PRIVATE_TMPS = (Path("/tmp"), Path("/var/tmp"))  # what PrivateTmp=yes gives the system unit a folder of its own for


def private_tmp_problem(host: Host, paths: Sequence[tuple[str, Path | None]]) -> str | None:
    """The system unit runs with PrivateTmp=yes: under /tmp or /var/tmp it sees a folder of its
    own, empty at each start. A state dir there would lose its checkpoints and cache at every
    restart; a key directory or config file there would not be found, a log not be where the
    user looks. `paths`: (flag, path) of each given."""
    if host.platform == "darwin" or not host.system_unit:
        return None
    for flag, given in paths:
        if given is None:
            continue
        path = given.resolve()  # a link into /tmp is /tmp
        for tmp in PRIVATE_TMPS:
            if path == tmp or tmp in path.parents:
                what = {
                    "--state-dir": "own private folder, emptied at each restart (checkpoints and the cache with it)",
                    "--log-file": "own private folder, where no one else sees the log",
                }.get(flag, "own private folder, empty: the service would not find it")
                return (f"{flag} {path}: the system service runs with PrivateTmp=yes, so under {tmp} it would be the service's {what}; "
                        "choose one outside /tmp and /var/tmp")
    return None


# -- rendering (pure) ----------------------------------------------------------------------------


def template(folder: str, name: str) -> Template:
    try:
        text = resources.files(f"dpool.{folder}").joinpath(name).read_text()
    except ModuleNotFoundError:  # an editable install made before the templates were packaged
        text = (Path(__file__).resolve().parent.parent / folder / name).read_text()
    return Template(text)


def render_plist(argv: Sequence[str], *, log_file: Path, working_directory: Path, env: dict[str, str], exit_timeout: int) -> str:
    def string(s: str, indent: str) -> str:
        return f"{indent}<string>{escape(s)}</string>"

    return template("launchd", f"{LABEL}.plist").substitute(
        label=LABEL,
        program_arguments="\n".join(string(a, "\t\t") for a in argv),
        environment="\n".join(f"\t\t<key>{escape(k)}</key>\n{string(v, chr(9) * 2)}" for k, v in sorted(env.items())),
        working_directory=escape(str(working_directory)),
        log_file=escape(str(log_file)),
        exit_timeout=str(exit_timeout),
    )


SAFE = re.compile(r"[A-Za-z0-9_@%$+=:,./-]+")  # after % and $ are doubled


def systemd_quote(arg: str) -> str:
    """One ExecStart= word: specifiers (%) and variables ($) escaped, quoted unless plain."""
    return _unit_text(arg, dollars=True, quote=True)


def systemd_path(path: Path, *, word: bool) -> str:
    """A path in a unit's path setting: specifiers (%) escaped, `$` as it is (only ExecStart=
    expands variables). WorkingDirectory= takes the rest of its line as the path, quotes
    included (`word` False); ReadWritePaths= a list of words, each quoted unless plain."""
    return _unit_text(str(path), dollars=False, quote=word)


def _unit_text(text: str, *, dollars: bool, quote: bool) -> str:
    if any(ord(c) < 32 for c in text):
        raise ValueError(f"{text!r}: control characters cannot go into a unit file")
    text = text.replace("%", "%%")
    if dollars:
        text = text.replace("$", "$$")
    if not quote or SAFE.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(argv: Sequence[str], *, system: bool, state_dir: Path, working_directory: Path, timeout_stop_s: int, log_dir: Path | None = None) -> str:
    """`log_dir`: the folder of --log-file, written like the state dir (ProtectSystem=strict
    leaves every other folder read-only)."""
    writable = [d for d in (state_dir, log_dir) if d is not None and d != SYSTEM_STATE_DIR and SYSTEM_STATE_DIR not in d.parents]
    writable = [d for d in writable if not any(o in d.parents for o in writable)]
    extra = f"ReadWritePaths={' '.join(systemd_path(d, word=True) for d in dict.fromkeys(writable))}\n" if writable else ""
    values = {
        "exec_start": " ".join(systemd_quote(a) for a in argv),
        "working_directory": systemd_path(working_directory, word=False),
        "timeout_stop": f"{timeout_stop_s}s",
        "read_write_paths": extra,
    }
    return template("systemd", "dpd.service" if system else "dpd.user.service").substitute(values)


def stop_timeout(stop_grace_s: float) -> int:
    """Long enough for dpd to stop its trainers (each gets --stop-grace after SIGTERM, a last
    checkpoint included) and to say goodbye to its coordinator."""
    return int(stop_grace_s) + 60


# -- the installed service: where it is, what it runs, what its manager says -------------------


@dataclass(frozen=True, slots=True)
class Installed:
    """The service of this host: its file, and how its manager names and reaches it."""

    host: Host

    @property
    def launchd(self) -> bool:
        return self.host.platform == "darwin"

    @property
    def path(self) -> Path:
        if self.launchd:
            return self.host.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        return self.host.system_units / UNIT if self.host.system_unit else self.host.home / ".config" / "systemd" / "user" / UNIT

    @property
    def kind(self) -> str:
        return "LaunchAgent" if self.launchd else "systemd system unit" if self.host.system_unit else "systemd user unit"

    @property
    def domain(self) -> str:
        return f"gui/{self.host.uid}"

    @property
    def target(self) -> str:
        return f"{self.domain}/{LABEL}"

    @property
    def systemctl(self) -> list[str]:
        return ["systemctl"] if self.host.system_unit else ["systemctl", "--user"]

    @property
    def journalctl(self) -> list[str]:
        return ["journalctl"] if self.host.system_unit else ["journalctl", "--user"]

    @property
    def log_file(self) -> Path:
        """Where launchd writes the LaunchAgent's stdout and stderr."""
        return self.host.home / "Library" / "Logs" / "dpool" / "dpd.log"

    def argv(self) -> list[str]:
        """The command line the service runs, read back from its file ([] when it cannot be read)."""
        try:
            if self.launchd:
                args = plistlib.loads(self.path.read_bytes()).get("ProgramArguments", [])
                return [str(a) for a in args] if isinstance(args, list) else []
            for line in self.path.read_text().splitlines():
                if line.startswith("ExecStart="):
                    return [unquote_systemd(word) for word in shlex.split(line[len("ExecStart="):])]
        except (OSError, ValueError, plistlib.InvalidFileException):
            pass
        return []

    def exit_timeout(self) -> float:
        """How long launchd waits after SIGTERM (the plist's ExitTimeOut) before SIGKILL."""
        try:
            return float(plistlib.loads(self.path.read_bytes()).get("ExitTimeOut", 20))
        except (OSError, ValueError, plistlib.InvalidFileException):
            return 20.0


# -- plans ---------------------------------------------------------------------------------------


def plan(host: Host, argv: list[str], *, state_dir: Path, stop_grace_s: float, log_dir: Path | None = None) -> Plan:
    where = Installed(host)
    if where.launchd:
        env = {
            "PATH": f"{Path(host.python).parent}:/usr/bin:/bin:/usr/sbin:/sbin",
            "PYTHONUNBUFFERED": "1",
        }
        text = render_plist(argv, log_file=where.log_file, working_directory=state_dir, env=env, exit_timeout=stop_timeout(stop_grace_s))
        return Plan(
            path=where.path,
            text=text,
            install=[["launchctl", "bootout", where.target], ["launchctl", "bootstrap", where.domain, str(where.path)]],
            uninstall=[["launchctl", "bootout", where.target]],
            ignore_failure=frozenset({0}),  # not loaded yet
            notes=("status: dpd status", f"logs: dpd logs -f ({where.log_file})"),
        )
    system = host.system_unit
    systemctl = where.systemctl
    text = render_unit(
        argv, system=system, state_dir=state_dir, working_directory=Path("/") if system else host.home,
        timeout_stop_s=stop_timeout(stop_grace_s), log_dir=log_dir,
    )
    notes = ["status: dpd status", f"logs: dpd logs -f (journalctl {'' if system else '--user '}-u dpd)"]
    if not system:
        notes.append("to keep it running after logout and start it at boot: loginctl enable-linger $USER")
    return Plan(
        path=where.path,
        text=text,
        # restart, not start: a second `dpd install` with other flags must take effect
        install=[[*systemctl, "daemon-reload"], [*systemctl, "enable", UNIT], [*systemctl, "restart", UNIT]],
        uninstall=[[*systemctl, "disable", "--now", UNIT]],
        after_remove=[[*systemctl, "daemon-reload"]],
        notes=tuple(notes),
    )


def install(p: Plan, run: Runner = run_command, *, make_dirs: Sequence[Path] = (), out: Callable[[str], None] = print) -> int:
    """Write the file and load it; 0 on success, 1 with the failing command's output."""
    for d in (p.path.parent, *make_dirs):
        d.mkdir(parents=True, exist_ok=True)
    tmp = p.path.with_suffix(p.path.suffix + ".tmp")
    tmp.write_text(p.text)
    tmp.replace(p.path)  # never a half-written unit
    out(f"wrote {p.path}")
    for i, cmd in enumerate(p.install):
        r = run(cmd)
        if r.returncode != 0 and i not in p.ignore_failure:
            out(f"dpd: `{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
            return 1
    for note in p.notes:
        out(note)
    return 0


def uninstall(p: Plan, run: Runner = run_command, *, out: Callable[[str], None] = print) -> int:
    if not p.path.exists():
        out(f"dpd: not installed ({p.path} does not exist)")
        return 0
    for cmd in p.uninstall:
        run(cmd)  # stopping what is not running is fine: the file goes either way
    p.path.unlink()
    out(f"removed {p.path}")
    for cmd in p.after_remove:
        r = run(cmd)
        if r.returncode != 0:
            out(f"dpd: `{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
            return 1
    return 0


def print_plan(p: Plan, out: Callable[[str], None] = print) -> None:
    out(f"# {p.path}")
    out(p.text.rstrip("\n"))
    out("")
    out("# dpd install would then run:")
    for cmd in p.install:
        out("#   " + " ".join(cmd))


# -- what the installed service runs, and what its manager says ---------------------------------


def unquote_systemd(word: str) -> str:
    """One ExecStart= word as `systemd_quote` wrote it, after shlex took the quotes off."""
    return word.replace("%%", "%").replace("$$", "$")


def run_flags(argv: Sequence[str]) -> list[str] | None:
    """The `dpd run` flags of a service's command line (`PYTHON -m dpool.daemon.boot run FLAGS`;
    services installed before boot.py run `dpool.daemon.cli`, which works as well)."""
    for i in range(len(argv) - 1):
        if argv[i] in (ENTRY, "dpool.daemon.cli") and argv[i + 1] == "run":
            return list(argv[i + 2:])
    return None


def flag_value(flags: Sequence[str], name: str) -> str | None:
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag[len(name) + 1:]
    return None


@dataclass(frozen=True, slots=True)
class ServiceState:
    """What the service manager says about the service."""

    loaded: bool
    running: bool
    pid: int | None
    state: str  # the manager's own words: "running", "active (running)", "inactive (dead)", ...
    enabled: str | None = None  # systemd's UnitFileState: enabled, disabled, ...
    last_exit: str | None = None
    error: str | None = None  # the manager could not be asked


def launchctl_fields(text: str) -> dict[str, str]:
    """The top-level `key = value` lines of `launchctl print SERVICE` (nested blocks skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"\t([a-z][a-z ]*?) = (.*)", line)
        if m and not m.group(2).endswith("{"):
            out.setdefault(m.group(1), m.group(2).strip())
    return out


def systemctl_fields(text: str) -> dict[str, str]:
    """`systemctl show -p A -p B UNIT`'s `Key=Value` lines."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


SYSTEMCTL_PROPERTIES = ("LoadState", "ActiveState", "SubState", "MainPID", "UnitFileState", "ExecMainStatus")


def query(where: Installed, run: Runner) -> ServiceState:
    if where.launchd:
        r = run(["launchctl", "print", where.target])
        if r.returncode != 0:
            said = (r.stderr or r.stdout).strip()
            if "could not find" in said.lower() or r.returncode == 113:
                return ServiceState(loaded=False, running=False, pid=None, state="not loaded")
            return ServiceState(loaded=False, running=False, pid=None, state="unknown", error=f"`launchctl print {where.target}` failed (exit {r.returncode}): {said}")
        f = launchctl_fields(r.stdout)
        pid = int(f["pid"]) if f.get("pid", "").isdigit() else None
        state = f.get("state", "unknown")
        return ServiceState(loaded=True, running=state == "running" and pid is not None, pid=pid, state=state, last_exit=f.get("last exit code") or f.get("last terminating signal"))
    cmd = [*where.systemctl, "show", *(f"--property={p}" for p in SYSTEMCTL_PROPERTIES), UNIT]
    r = run(cmd)
    if r.returncode != 0:
        return ServiceState(loaded=False, running=False, pid=None, state="unknown", error=f"`{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}")
    f = systemctl_fields(r.stdout)
    pid = int(f["MainPID"]) if f.get("MainPID", "0").isdigit() and f.get("MainPID", "0") != "0" else None
    active, sub = f.get("ActiveState", "unknown"), f.get("SubState", "")
    return ServiceState(
        loaded=f.get("LoadState") == "loaded",
        running=active in ("active", "reloading", "deactivating") and pid is not None,
        pid=pid,
        state=f"{active} ({sub})" if sub else active,
        enabled=f.get("UnitFileState") or None,
        last_exit=f.get("ExecMainStatus") or None,
    )


# -- the node as its coordinator sees it -----------------------------------------------------------


def connect_address(addr: str) -> str:
    """Where to reach a coordinator bound at `addr`: a wildcard bind (`tcp://*:7340`,
    `tcp://0.0.0.0:7340`, `tcp://[::]:7340`) is reached on loopback."""
    parts = urlsplit(addr)
    if parts.scheme != "tcp":
        return addr
    host, _, port = parts.netloc.rpartition(":")
    wildcard = {"*": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]", "::": "[::1]"}
    return urlunsplit(parts._replace(netloc=f"{wildcard.get(host, host)}:{port}")) if host in wildcard else addr


def status_keys(keys_flag: str | None, s: Settings) -> ClientKeys | None:
    """The client pair `dpd status` asks with: `--keys DIR`'s, else the one in the service's key
    directory (the serving machine holds the pool's full directory), else dpctl's ($DPOOL_KEYS,
    `keys` in the config file). A node's own pair may not send `nodes` (protocol/README.md, Roles).
    None for a pool without keys; raises KeysError when it has keys and none of these is a client
    pair."""
    from dpool.client.keys import load_client_keys
    from dpool.daemon.cli import DEFAULT_CONFIG
    from dpool.protocol.security import KeysError, client_keys, secret_file

    if keys_flag:
        return client_keys(Path(keys_flag).expanduser().absolute(), "client")
    if s.keys is None:
        return None
    service_dir = Path(s.keys.source).parent  # the node's pair lies in the key directory itself
    if secret_file(service_dir, "client").exists():
        return client_keys(service_dir, "client")
    theirs = load_client_keys(None, DEFAULT_CONFIG)
    if theirs is None:
        raise KeysError(f"the service's keys ({service_dir}) hold no client pair, and a node's own pair may not ask for the pool's nodes; pass --keys DIR with dpctl's pair")
    return theirs


def ask_coordinator(s: Settings, keys_flag: str | None, timeout_s: float) -> tuple[str, NodeRow | None, str | None, int]:
    """(the coordinator's address, the node's row or None, why not, the exit code that goes with it)."""
    from dpool.client.rpc import Client, RemoteError, Unreachable
    from dpool.protocol import messages as m
    from dpool.protocol.security import KeysError

    addr = s.join or connect_address(s.serve or "")
    try:
        keys = status_keys(keys_flag, s)
    except KeysError as e:
        return addr, None, f"--keys: {e}", 2
    try:
        with Client(addr, timeout_s, keys) as c:
            nodes = c.call(m.Nodes(), m.NodesReply).nodes
    except Unreachable as e:
        return addr, None, str(e), 3
    except RemoteError as e:
        return addr, None, f"the coordinator refused `nodes`: {e.message}", 1
    row = next((n for n in nodes if n.name == s.name), None)
    if row is None:
        return addr, None, f"the coordinator does not know node {s.name!r} (not registered yet, or refused: see `dpd logs`)", 1
    return addr, row, None, 0 if row.state != "lost" else 1


def node_line(row: NodeRow) -> str:
    where = f"{row.address} ({row.interface})" if row.interface else row.address
    job = f", job {row.job}" + (f" ranks {','.join(map(str, row.ranks))}" if row.ranks else "") if row.job else ""
    reason = f" ({row.reason})" if row.reason else ""
    return f"{row.name}: {row.state}{reason}, slots {row.busy_slots}/{row.slots}{job}, ring address {where}, heartbeat {row.heartbeat_age_s:.1f}s ago"


def status(where: Installed, run: Runner, parse: Callable[[list[str]], Settings], *, keys_flag: str | None = None, timeout_s: float = STATUS_TIMEOUT_S, json: bool = False, out: Callable[[str], None] = print) -> int:
    """Exit 0 when the service runs and its node is in the pool (not lost); 1 when it is not
    installed, not running, or not (or no longer) in the pool; 2 when its flags or keys are
    refused; 3 when its coordinator does not answer."""
    from dpool.daemon.cli import UsageError

    doc: dict[str, Any] = {"manager": "launchd" if where.launchd else "systemd", "kind": where.kind, "path": str(where.path), "installed": where.path.exists()}
    lines = [("service", f"{where.kind} {where.path}" + ("" if doc["installed"] else " (not installed: `dpd install ...` writes it)"))]
    code = 1
    if doc["installed"]:
        st = query(where, run)
        doc |= {"loaded": st.loaded, "running": st.running, "pid": st.pid, "state": st.state, "enabled": st.enabled, "last_exit": st.last_exit}
        if st.error:
            lines.append(("loaded", f"unknown: {st.error}"))
        else:
            lines.append(("loaded", ("yes" if st.loaded else "no") + (f" ({st.enabled})" if st.enabled else "")))
        lines.append(("running", (f"yes, pid {st.pid}" if st.running else "no") + f" ({st.state}" + (f", last exit {st.last_exit}" if st.last_exit and not st.running else "") + ")"))
        flags = run_flags(where.argv())
        doc |= {"coordinator": None, "node": None, "error": None}
        if flags is None:
            doc["error"] = f"{where.path}: no `dpd run` command line in it"
            lines.append(("coordinator", f"unknown: {doc['error']}"))
            code = 2
        else:
            try:
                s = parse(flags)
            except UsageError as e:
                s, doc["error"], code = None, f"the service's flags are refused: {e}", 2
                lines.append(("coordinator", f"unknown: {doc['error']}"))
            if s is not None:
                addr, row, why, asked = ask_coordinator(s, keys_flag, timeout_s)
                doc |= {"coordinator": addr, "node": row.to_wire() if row else None, "error": why}
                lines.append(("coordinator", addr))
                lines.append(("node", node_line(row) if row else f"{s.name}: {why}"))
                code = asked if st.running or asked == 2 else 1  # not running: 1, whatever the pool says
    if json:
        import orjson

        out(orjson.dumps(doc).decode())
    else:
        width = max(len(k) for k, _ in lines) + 2
        for key, value in lines:
            out(f"{key.ljust(width)}{value}")
    return code


# -- dpd logs / dpd restart ------------------------------------------------------------------------


def logs_command(where: Installed, *, lines: int, follow: bool) -> list[str]:
    """What shows the service's log: its `--log-file` when it has one (dpd writes there, rotated,
    and the manager's capture of stderr holds almost nothing), else the LaunchAgent's log file or
    the unit's journal."""
    log_file = flag_value(run_flags(where.argv()) or [], "--log-file")
    if log_file is None and where.launchd:
        log_file = str(where.log_file)
    if log_file is not None:
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), log_file]  # -F: across rotations
    return [*where.journalctl, "--unit", UNIT, "--lines", str(lines), "--no-pager", *(["--follow"] if follow else [])]


def logs(where: Installed, execute: Execute, *, lines: int = LOG_LINES, follow: bool = False) -> int:
    if not where.path.exists():
        print(f"dpd: not installed ({where.path} does not exist)", file=sys.stderr)
        return 1
    cmd = logs_command(where, lines=lines, follow=follow)
    if cmd[0] == "tail" and not follow and not Path(cmd[-1]).exists():
        print(f"dpd: no log yet at {cmd[-1]}", file=sys.stderr)
        return 1
    return execute(cmd)


def restart(where: Installed, run: Runner, *, out: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> int:
    if not where.path.exists():
        print(f"dpd: not installed ({where.path} does not exist); `dpd install ...` writes and starts it", file=sys.stderr)
        return 1
    if where.launchd:
        cmds = launchd_restart(where, run, sleep)
    else:
        cmds = [[*where.systemctl, "restart", UNIT]]
    for cmd in cmds:
        r = run(cmd)
        if r.returncode != 0:
            print(f"dpd: `{' '.join(cmd)}` failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()}", file=sys.stderr)
            return 1
    after = query(where, run)
    out(f"restarted dpd ({where.kind})" + (f": pid {after.pid}" if after.running else f": {after.state}"))
    return 0


def launchd_restart(where: Installed, run: Runner, sleep: Callable[[float], None]) -> list[list[str]]:
    """Stop a loaded agent with SIGTERM and wait for its exit; what is left to run to start it."""
    before = query(where, run)
    if not before.loaded:
        return [["launchctl", "bootstrap", where.domain, str(where.path)]]  # RunAtLoad starts it
    if before.running:
        run(["launchctl", "kill", "SIGTERM", where.target])
        deadline = time.monotonic() + where.exit_timeout()
        while query(where, run).running:
            if time.monotonic() > deadline:  # launchd would SIGKILL it now too
                return [["launchctl", "kickstart", "-k", where.target]]
            sleep(STOP_POLL_S)
    return [["launchctl", "kickstart", where.target]]


# -- dpd install / uninstall / status / logs / restart ---------------------------------------------


def main(args: argparse.Namespace, run_parser: argparse.ArgumentParser, host: Host | None = None, run: Runner | None = None, execute: Execute | None = None) -> int:
    from dpool.daemon.cli import UsageError, settings

    host, run, execute = host or Host.current(), run or run_command, execute or execute_command
    if getattr(args, "target", None):
        host = dataclasses.replace(host, platform="darwin" if args.target == "launchd" else "linux")
    where = Installed(host)
    if args.command == "status":
        return status(where, run, lambda flags: settings(parse_run_flags(run_parser, flags)), keys_flag=args.keys, timeout_s=args.timeout, json=args.json)
    if args.command == "logs":
        return logs(where, execute, lines=args.lines, follow=args.follow)
    if args.command == "restart":
        return restart(where, run)
    if args.command == "uninstall":
        return uninstall(plan(host, [], state_dir=state_dir_for(host, argparse.Namespace(state_dir=None)), stop_grace_s=0), run)
    try:
        s = settings(args)  # the same checks as `dpd run`: refuse now, not in a restart loop
    except UsageError as e:
        print(f"dpd: {e}", file=sys.stderr)
        return 2
    state_dir = s.state_dir if s.state_dir_given else state_dir_for(host, args)  # the flag, the config file's, or the service's default
    given = [("--state-dir", state_dir), ("--keys", s.keys_dir), ("--log-file", s.log_file), ("--config", _path(args.config))]
    if (problem := private_tmp_problem(host, given)) is not None:
        print(f"dpd: {problem}", file=sys.stderr)
        return 2
    # The coordinator as `dpd run` resolves it (a flag, else serving, else the config file, else
    # $DPOOL_COORDINATOR): written into the service only where it came from the environment.
    env_join = s.join if args.join is None and s.serve is None and s.join == host.env.get("DPOOL_COORDINATOR") else None
    argv = service_argv(host, flags_from(args, run_parser._actions, host, env_join), state_dir)
    log_dir = s.log_file.parent if s.log_file is not None else None
    p = plan(host, argv, state_dir=state_dir, stop_grace_s=s.stop_grace, log_dir=log_dir)
    if args.print:
        print_plan(p)
        return 0
    dirs = [state_dir] if state_dir != SYSTEM_STATE_DIR else []  # systemd makes its StateDirectory
    if host.platform == "darwin":
        dirs.append(where.log_file.parent)
    if log_dir is not None:
        dirs.append(log_dir)
    return install(p, run, make_dirs=dirs)


def _path(given: str | None) -> Path | None:
    return Path(given).expanduser().absolute() if given else None


def parse_run_flags(run_parser: argparse.ArgumentParser, flags: list[str]) -> argparse.Namespace:
    """The service's `dpd run` flags as `dpd run` reads them (UsageError, not an exit, when not)."""
    from dpool.daemon.cli import UsageError

    try:
        args, rest = run_parser.parse_known_args(flags)
    except SystemExit:
        raise UsageError(f"`dpd run` does not take {' '.join(flags)}") from None
    if rest:
        raise UsageError(f"`dpd run` does not take {' '.join(rest)}")
    return args
