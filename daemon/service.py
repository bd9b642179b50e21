"""`dpd install` / `dpd uninstall`: dpd as an OS service, a LaunchAgent on macOS, a systemd unit on Linux.

Rendering is pure (inputs -> text; the templates are `launchd/` and `systemd/`, shipped as package
data), and every command goes through an injectable runner, so tests check the files and the
command lines without touching launchd, systemd or the user's home.

- macOS: `~/Library/LaunchAgents/org.dpool.dpd.plist`, logs in `~/Library/Logs/dpool/dpd.log`;
  loaded with `launchctl bootout gui/$UID/org.dpool.dpd` (a "not loaded" failure is fine), then
  `launchctl bootstrap gui/$UID PLIST`. A LaunchAgent runs while its user is logged in, which is
  what MLX on a Mac needs (the GPU belongs to the login session).
- Linux, as root: a system unit `/etc/systemd/system/dpd.service` (state in /var/lib/dpool through
  StateDirectory=, the full hardening); as anyone else: a user unit
  `~/.config/systemd/user/dpd.service` under `systemctl --user` (state in ~/.local/state/dpool; it
  runs while the user is logged in, or always after `loginctl enable-linger USER`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

LABEL = "org.dpool.dpd"
UNIT = "dpd.service"
SYSTEM_STATE_DIR = Path("/var/lib/dpool")  # StateDirectory=dpool
PATH_FLAGS = ("config", "state_dir", "keys")  # made absolute: a service does not start in the user's cwd

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


@dataclass(frozen=True, slots=True)
class Host:
    """Where a service goes: everything `install` would otherwise read from the machine."""

    platform: str  # "darwin" or "linux"
    home: Path
    uid: int
    python: str  # the absolute interpreter that runs `-m dpool.daemon.cli`
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


def flags_from(args: argparse.Namespace, actions: Sequence[argparse.Action], host: Host) -> list[str]:
    """`dpd run` flags that reproduce what `install` was given, paths made absolute, and the
    coordinator and keys taken from the environment ($DPOOL_COORDINATOR, $DPOOL_KEYS) written out,
    since a service does not inherit the installing shell's environment."""
    out: list[str] = []
    for action in actions:
        if not action.option_strings or action.dest in ("help", "print", "target"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
            continue
        if action.dest in PATH_FLAGS:
            value = str(Path(value).expanduser().absolute())
        out += [flag, str(value)]
    if args.join is None and args.serve is None and host.env.get("DPOOL_COORDINATOR"):
        out += ["--join", host.env["DPOOL_COORDINATOR"]]
    if args.keys is None and host.env.get("DPOOL_KEYS"):
        out += ["--keys", str(Path(host.env["DPOOL_KEYS"]).expanduser().absolute())]
    return out


def service_argv(host: Host, flags: list[str], state_dir: Path) -> list[str]:
    if "--state-dir" not in flags:
        flags = [*flags, "--state-dir", str(state_dir)]
    return [host.python, "-m", "dpool.daemon.cli", "run", *flags]


def state_dir_for(host: Host, args: argparse.Namespace) -> Path:
    if args.state_dir:
        return Path(args.state_dir).expanduser().absolute()
    if host.system_unit:
        return SYSTEM_STATE_DIR
    if host.platform == "darwin":
        return host.home / "Library" / "Application Support" / "dpool"
    return Path(host.env.get("XDG_STATE_HOME") or host.home / ".local" / "state") / "dpool"


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
    if any(ord(c) < 32 for c in arg):
        raise ValueError(f"{arg!r}: control characters cannot go into a unit file")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if SAFE.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(argv: Sequence[str], *, system: bool, state_dir: Path, working_directory: Path, timeout_stop_s: int) -> str:
    extra = "" if state_dir == SYSTEM_STATE_DIR else f"ReadWritePaths={systemd_quote(str(state_dir))}\n"
    values = {
        "exec_start": " ".join(systemd_quote(a) for a in argv),
        "working_directory": systemd_quote(str(working_directory)),
        "timeout_stop": f"{timeout_stop_s}s",
        "read_write_paths": extra,
    }
    return template("systemd", "dpd.service" if system else "dpd.user.service").substitute(values)


def stop_timeout(stop_grace_s: float) -> int:
    """Long enough for dpd to stop its trainers (each gets --stop-grace after SIGTERM, a last
    checkpoint included) and to say goodbye to its coordinator."""
    return int(stop_grace_s) + 60


# -- plans ---------------------------------------------------------------------------------------


def plan(host: Host, argv: list[str], *, state_dir: Path, stop_grace_s: float) -> Plan:
    if host.platform == "darwin":
        path = host.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        log_file = host.home / "Library" / "Logs" / "dpool" / "dpd.log"
        env = {
            "PATH": f"{Path(host.python).parent}:/usr/bin:/bin:/usr/sbin:/sbin",
            "PYTHONUNBUFFERED": "1",
        }
        text = render_plist(argv, log_file=log_file, working_directory=state_dir, env=env, exit_timeout=stop_timeout(stop_grace_s))
        domain = f"gui/{host.uid}"
        return Plan(
            path=path,
            text=text,
            install=[["launchctl", "bootout", f"{domain}/{LABEL}"], ["launchctl", "bootstrap", domain, str(path)]],
            uninstall=[["launchctl", "bootout", f"{domain}/{LABEL}"]],
            ignore_failure=frozenset({0}),  # not loaded yet
            notes=(f"logs: {log_file}", f"status: launchctl print {domain}/{LABEL}"),
        )
    system = host.system_unit
    systemctl = ["systemctl"] if system else ["systemctl", "--user"]
    path = host.system_units / UNIT if system else host.home / ".config" / "systemd" / "user" / UNIT
    text = render_unit(argv, system=system, state_dir=state_dir, working_directory=Path("/") if system else host.home, timeout_stop_s=stop_timeout(stop_grace_s))
    notes = [f"logs: journalctl {'' if system else '--user '}-u dpd -f", f"status: {' '.join(systemctl)} status dpd"]
    if not system:
        notes.append("to keep it running after logout and start it at boot: loginctl enable-linger $USER")
    return Plan(
        path=path,
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


# -- dpd install / uninstall ---------------------------------------------------------------------


def main(args: argparse.Namespace, run_actions: Sequence[argparse.Action], host: Host | None = None, run: Runner | None = None) -> int:
    from dpool.daemon.cli import UsageError, settings

    host, run = host or Host.current(), run or run_command
    if args.target:
        host = dataclasses.replace(host, platform="darwin" if args.target == "launchd" else "linux")
    if args.command == "uninstall":
        return uninstall(plan(host, [], state_dir=state_dir_for(host, argparse.Namespace(state_dir=None)), stop_grace_s=0), run)
    try:
        s = settings(args)  # the same checks as `dpd run`: refuse now, not in a restart loop
    except UsageError as e:
        print(f"dpd: {e}", file=sys.stderr)
        return 2
    state_dir = state_dir_for(host, args)
    argv = service_argv(host, flags_from(args, run_actions, host), state_dir)
    p = plan(host, argv, state_dir=state_dir, stop_grace_s=s.stop_grace)
    if args.print:
        print_plan(p)
        return 0
    dirs = [state_dir] if state_dir != SYSTEM_STATE_DIR else []  # systemd makes its StateDirectory
    if host.platform == "darwin":
        dirs.append(host.home / "Library" / "Logs" / "dpool")
    return install(p, run, make_dirs=dirs)
