"""`dpd run`: the node daemon in the foreground (launchd/systemd supervise it).

Exit codes: 0 stopped cleanly (SIGTERM/SIGINT); 1 it could not run (address in use, name refused by
the pool, a state dir it cannot use); 2 bad input (flags or config file), or the state dir is held
by another running dpd (named by its pid).

One dpd per state dir: it holds an exclusive flock on `STATE/dpd.lock` (which holds its pid) for its
whole life, so a second one never shares the first one's database or removes its worker socket. The
daemon runs under umask 077: the state dir is 0700, and what it and its trainers write there (the
database, logs, the worker socket, checkpoints) is its user's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import fcntl
import importlib.metadata
import ipaddress
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from dpool.daemon import cachecmd, netif
from dpool.daemon.cadence import HEARTBEAT_RATE
from dpool.daemon.childenv import UMASK, StartedZygote
from dpool.daemon.conditions import Condition, parse_yield_when
from dpool.daemon.fitness import TRAINING_RATE_BPS
from dpool.daemon.owner import OwnerWatch
from dpool.protocol.config import (
    DAEMON_KEYS,
    DEFAULT_CONFIG,
    ConfigError,
    parse_size,
    value_problem,
)
from dpool.protocol.config import load_config as shared_config
from dpool.protocol.endpoints import endpoint_problem
from dpool.protocol.logs import Quiet, RotatingFile, configure_logging, get_logger
from dpool.protocol.payloads import name_from_host
from dpool.protocol.security import (
    ClientKeys,
    KeysError,
    ServerKeys,
    client_keys,
    keys_dir,
    server_keys,
)

DEFAULT_SERVE = "tcp://127.0.0.1:7340"
DEFAULT_DASHBOARD = "127.0.0.1:7341"
CONFIG_KEYS = DAEMON_KEYS  # the flags' keys in the config file (protocol/config.py)
LOCK_FILE = "dpd.lock"


class UsageError(Exception):
    """Bad flags or config (exit 2); the message names the flag or key and what is allowed."""


class StateDirBusy(Exception):
    """Another dpd holds the state dir's lock (exit 2); the message names its pid."""


@dataclass(frozen=True, slots=True)
class Settings:
    join: str | None
    serve: str | None
    name: str
    advertise: str
    workers: int
    state_dir: Path
    insecure: bool
    heartbeat_interval: float
    liveness: int
    stop_grace: float
    log_level: str
    log_file: Path | None = None  # dpd's own log, rotated by size (default: stderr)
    keys: ClientKeys | None = None  # this node's CURVE pair and the coordinator's public key
    server_keys: ServerKeys | None = None  # the coordinator's pair and allow-list (with --serve)
    cache_max: int | None = None  # bytes the staging cache may hold (None: as the disk allows)
    stage_rate: float = TRAINING_RATE_BPS  # with --serve: bytes/s a fetch is paced to while its sources train (0: never)
    yield_when: tuple[Condition, ...] = ()  # what makes this node yield to its owner (daemon/conditions.py)
    dashboard: str | None = None  # with --serve: where the dashboard's child process listens (dashboard/child.py)
    heartbeat_rate: float = HEARTBEAT_RATE  # with --serve: heartbeats a second from all nodes together (daemon/cadence.py)
    keys_dir: Path | None = None  # the key directory (the dashboard's keys come from there)
    state_dir_given: bool = False  # by --state-dir or the config file (else the default: `install` picks the service's)


def _lines(text: str) -> int:
    """`dpd logs -n`: a count of lines, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of lines, 0 or more") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n}: expected a number of lines, 0 or more")
    return n


def default_state_dir() -> Path:
    if sys.platform == "darwin":
        return Path("~/Library/Application Support/dpool").expanduser()
    return Path(os.environ.get("XDG_STATE_HOME", "~/.local/state")).expanduser() / "dpool"


def tcp_host(addr: str) -> str | None:
    """The host of a tcp:// address (None for ipc://, inproc://)."""
    parts = urlsplit(addr)
    if parts.scheme != "tcp":
        return None
    host = parts.netloc.rsplit(":", 1)[0]
    return host.strip("[]")


def is_loopback(addr: str) -> bool:
    host = tcp_host(addr)
    if host is None:
        return urlsplit(addr).scheme in ("ipc", "inproc")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface ('*', 'eth0'): not provably loopback


def _check_addr(flag: str, addr: str) -> None:
    problem = endpoint_problem(addr, connect=flag == "--join")
    if problem is not None:
        raise UsageError(f"{flag} {addr!r}: {problem}")


def load_config(path: Path, required: bool) -> dict[str, Any]:
    """The config file, checked (protocol/config.py: dpctl reads it with the same rules)."""
    try:
        return shared_config(path, required)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _advertise_for(join: str) -> str:
    """The local address peers should use: loopback for a loopback pool, else the interface that
    routes to the coordinator."""
    host = tcp_host(join)
    if host is None or is_loopback(join):
        return "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only asks the kernel for a route
        return str(s.getsockname()[0])
    return socket.gethostbyname(socket.gethostname())


def settings(args: argparse.Namespace) -> Settings:
    path = Path(args.config).expanduser() if args.config else DEFAULT_CONFIG
    cfg = load_config(path, required=bool(args.config))

    def pick(flag: str, default: Any) -> Any:
        v = getattr(args, flag)
        return v if v is not None else cfg.get(flag, default)

    def where(flag: str) -> str:
        """Where `pick(flag)` came from, for a message: the flag, or the config file's key."""
        return f"{path}: {flag} =" if getattr(args, flag) is None and flag in cfg else "--" + flag.replace("_", "-")

    serve = pick("serve", None)
    serve = DEFAULT_SERVE if serve is True else None if serve is False else serve  # config: `serve = true`, as a bare --serve
    join = args.join or (None if serve else cfg.get("join")) or (None if serve else os.environ.get("DPOOL_COORDINATOR"))
    if serve is None and join is None:
        raise UsageError("no coordinator: pass --join ADDR (or set join in the config file or $DPOOL_COORDINATOR), or --serve to host it")
    for flag, addr in (("--serve", serve), ("--join", join)):
        if addr is not None:
            _check_addr(flag, addr)
    insecure = bool(pick("insecure", False))
    kdir = keys_dir(args.keys, cfg.get("keys"))
    for flag, addr in (("--serve", serve), ("--join", join)):
        if addr is not None and not is_loopback(addr) and not insecure and kdir is None:
            raise UsageError(
                f"{flag} {addr}: refusing a non-loopback control plane without CURVE keys; "
                "pass --keys DIR (made by `dpctl keys init DIR`), keep the pool on 127.0.0.1, "
                "or pass --insecure on a network you trust"
            )
    def checked(flag: str, value: Any) -> Any:
        """`value` as the flag or the file gave it, by the rule both share (protocol/config.py)."""
        problem = value_problem(flag, value)
        if problem:
            raise UsageError(f"{where(flag)} {f'{value:g}' if isinstance(value, float) else repr(value)}: {problem}")
        return value

    workers = checked("workers", int(pick("workers", 1)))
    hb, liveness = checked("heartbeat_interval", float(pick("heartbeat_interval", 0.25))), checked("liveness", int(pick("liveness", 6)))
    stop_grace = checked("stop_grace", float(pick("stop_grace", 10.0)))
    rate = checked("heartbeat_rate", float(pick("heartbeat_rate", HEARTBEAT_RATE)))
    name = checked("name", pick("name", None) or name_from_host(socket.gethostname()))
    try:
        node_keys = client_keys(kdir, "node", name) if kdir else None
        coord_keys = server_keys(kdir) if kdir and serve else None
    except KeysError as e:
        raise UsageError(f"--keys: {e}") from None
    dashboard = pick("dashboard", None)
    dashboard = DEFAULT_DASHBOARD if dashboard is True else None if dashboard is False else dashboard  # config: `dashboard = true`
    if dashboard is not None:
        _check_dashboard(dashboard, serve, kdir, insecure)
    log_file = pick("log_file", None)
    level = checked("log_level", str(pick("log_level", "info")))
    advertise = pick("advertise", None)
    if advertise:
        try:
            advertise = netif.resolve(advertise)  # an interface name (bridge0) becomes its IPv4 address
        except netif.NoAddressYet:
            pass  # kept as the name: `install` writes it so, and `run` waits for its address (exit 1)
        except netif.AdvertiseError as e:
            raise UsageError(str(e)) from None
    return Settings(
        join=join,
        serve=serve,
        name=name,
        advertise=advertise or _advertise_for(join or serve),
        workers=workers,
        state_dir=Path(pick("state_dir", None) or default_state_dir()).expanduser().absolute(),
        state_dir_given=bool(pick("state_dir", None)),
        insecure=insecure,
        heartbeat_interval=hb,
        liveness=liveness,
        stop_grace=stop_grace,
        log_level=level,
        log_file=Path(log_file).expanduser().absolute() if log_file else None,
        keys=node_keys,
        server_keys=coord_keys,
        cache_max=_cache_max(pick("cache_max", None), where("cache_max")),
        stage_rate=_stage_rate(pick("stage_rate", None), where("stage_rate")),
        heartbeat_rate=rate,
        yield_when=_yield_when(pick("yield_when", None), where("yield_when")),
        dashboard=dashboard,
        keys_dir=kdir,
    )


def _check_dashboard(listen: str, serve: str | None, kdir: Path | None, insecure: bool) -> None:
    """--dashboard's address, checked as `dpctl dashboard --listen` checks it (dashboard/options.py)."""
    from dpool.dashboard.options import OptionsError, check

    if serve is None:
        raise UsageError(f"--dashboard {listen}: goes with --serve (the dashboard reads the coordinator this daemon hosts); elsewhere run `dpctl dashboard`")
    try:
        check(listen, serve, keys=kdir, tokens=None, insecure=insecure, flag="--dashboard")
    except OptionsError as e:
        raise UsageError(str(e)) from None


def _yield_when(value: object, where: str = "--yield-when") -> tuple[Condition, ...]:
    if value is None:
        return ()
    try:
        conditions = parse_yield_when(str(value))
        OwnerWatch.from_env(conditions, None)  # its test settings ($DPOOL_YIELD_*), checked now
    except ValueError as e:
        raise UsageError(f"{where} {value!r}: {e}") from None
    return conditions


def _stage_rate(value: object, where: str = "--stage-rate") -> float:
    if value is None:
        return TRAINING_RATE_BPS
    if str(value).strip() in ("0", "off"):
        return 0.0
    try:
        return float(parse_size(str(value)) or 0)
    except ValueError:
        raise UsageError(f"{where} {value!r}: expected bytes a second such as 25MB or 100MiB, or 0 (never paced)") from None


def _cache_max(value: object, where: str = "--cache-max") -> int | None:
    try:
        return parse_size(None if value is None else str(value))
    except ValueError as e:
        raise UsageError(f"{where} {value!r}: {e}") from None


COORDINATOR_STOP_S = 10.0  # after the agent has stopped: the coordinator's batch in hand, then its exit


async def serve_and_run(s: Settings, zygote: StartedZygote | None = None) -> int:
    """The node's agent, and with --serve the coordinator on a thread of its own (its own loop):
    a coordinator busy for seconds never holds up the agent's heartbeats."""
    from dpool.daemon import sdnotify
    from dpool.daemon.agent import Agent
    from dpool.daemon.coordinator import Coordinator
    from dpool.daemon.coordthread import CoordinatorThread

    log = get_logger(node=s.name)
    ctx = zmq.asyncio.Context()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)  # handlers only record; the loops act on it
    coord: CoordinatorThread | None = None
    coord_ended: asyncio.Future[None] | None = None  # the coordinator thread's end, on this loop
    crash_said = False
    notify_task = None
    dashboard_task: asyncio.Task[None] | None = None
    join = s.join
    try:
        if s.serve:
            serve = s.serve
            coord = CoordinatorThread(
                lambda: Coordinator(ctx, serve, s.state_dir, heartbeat_s=s.heartbeat_interval, liveness=s.liveness, keys=s.server_keys, stage_rate_bps=s.stage_rate,
                                    heartbeat_rate=s.heartbeat_rate)
            )
            coord.start()
            try:
                endpoint = await asyncio.wrap_future(coord.bound)
            except zmq.ZMQError as e:
                log.error("coordinator.bind_failed", address=s.serve, error=str(e))
                print(f"dpd: cannot serve on {s.serve}: {e}", file=sys.stderr)
                return 1
            join = join or endpoint
            coord_ended = asyncio.wrap_future(coord.ended)
            if s.dashboard is not None:
                from dpool.dashboard import child as dashboard_child

                dashboard_cmd = dashboard_child.command(s.dashboard, endpoint, s.keys_dir if s.server_keys else None, insecure=s.insecure)
                dashboard_task = asyncio.create_task(dashboard_child.supervise(dashboard_cmd, stopping, log))
        assert join is not None
        agent = Agent(
            ctx,
            name=s.name,
            join=join,
            state_dir=s.state_dir,
            slots=s.workers,
            advertise=s.advertise,
            heartbeat_s=s.heartbeat_interval,
            liveness=s.liveness,
            stop_grace_s=s.stop_grace,
            keys=s.keys,
            zygote=zygote,
            cache_max=s.cache_max,
            owner=OwnerWatch.from_env(s.yield_when, log) if s.yield_when else None,
        )
        agent_task = asyncio.create_task(agent.run(stopping))
        notify_task = asyncio.create_task(sdnotify.announce(agent, stopping))  # systemd Type=notify
        waits: set[asyncio.Future[Any]] = {agent_task} | ({coord_ended} if coord_ended else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if coord_ended in done and not agent_task.done():
            assert coord_ended is not None
            log.error("coordinator.crashed", error=repr(coord_ended.exception()))
            crash_said = True
            stopping.set()
            await agent_task
            return 1
        return agent_task.result()
    finally:
        if notify_task is not None:
            notify_task.cancel()
        if dashboard_task is not None:
            stopping.set()
            with contextlib.suppress(Exception):
                await dashboard_task  # its child stopped (SIGTERM, then SIGKILL)
        stuck = False
        if coord is not None:
            coord.stop()  # after the agent: its node.bye still reaches the coordinator
            stuck = not await asyncio.to_thread(coord.join, COORDINATOR_STOP_S)
            if stuck:
                log.error("coordinator.stuck", waited_s=COORDINATOR_STOP_S)
        if coord_ended is not None:
            if not coord_ended.done():
                coord_ended.cancel()
            elif not coord_ended.cancelled() and coord_ended.exception() is not None and not crash_said:
                log.error("coordinator.crashed", error=repr(coord_ended.exception()))  # while stopping
        if not stuck:  # else its sockets are in use on its thread: they go with the process
            ctx.destroy(linger=0)


def lock_state_dir(state_dir: Path) -> int:
    """Make the state dir (0700) and take its lock for this process's life: the descriptor, kept
    open (and not inherited by children). Raises StateDirBusy naming the pid that holds it."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir, 0o700)  # one made by an older dpd, or by hand under umask 022
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f"pid {holder}" if holder.isdigit() else "a process that has not written its pid yet"
        raise StateDirBusy(f"state dir {state_dir} is in use by another dpd ({who}); stop it, or pass another --state-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def say_ring_link(log: Any, advertise: str) -> None:
    """A Thunderbolt bridge carries the ring's gradients many times faster than Wi-Fi: say at
    start-up whether the ring uses the one this machine has, and how to choose it if not."""
    ifaces = netif.ipv4_addresses()
    said = netif.advice(advertise, ifaces, netif.thunderbolt_bridge(list(ifaces)))
    if said is not None:
        event, fields = said
        (log.info if event == "ring.thunderbolt" else log.warning)(event, **fields)


def main(argv: list[str] | None = None, zygote: StartedZygote | None = None) -> int:
    """`dpd ...`; `zygote`: one daemon/boot.py started for `dpd run` before these imports."""
    parser = argparse.ArgumentParser(prog="dpd", description="dpool node daemon")
    parser.add_argument("--version", action="version", version=f"dpd {importlib.metadata.version('dpool')}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the daemon in the foreground")
    run.add_argument("--config", help=f"TOML file with the same keys as the flags (default {DEFAULT_CONFIG} if it exists)")
    run.add_argument("--join", help="the coordinator to join (default: the one this daemon serves, else config, else $DPOOL_COORDINATOR)")
    run.add_argument("--serve", nargs="?", const=DEFAULT_SERVE, help=f"also host the coordinator (default address {DEFAULT_SERVE})")
    run.add_argument("--name", help="node name, unique in the pool (default: the host name)")
    run.add_argument("--advertise", help="the IP MLX collectives use to reach this node, or an interface whose IPv4 address it is (bridge0: the Thunderbolt bridge)")
    run.add_argument("--workers", type=int, help="worker slots this node offers (default 1)")
    run.add_argument("--state-dir", dest="state_dir", help=f"daemon state: run dirs, checkpoints, the coordinator's database (default {default_state_dir()})")
    run.add_argument("--insecure", action="store_true", default=None, help="allow a non-loopback control plane without CURVE keys")
    run.add_argument("--keys", help="CURVE key directory made by `dpctl keys init` (else $DPOOL_KEYS, else config); with it every control-plane socket uses CURVE")
    run.add_argument("--heartbeat-interval", dest="heartbeat_interval", type=float, help="seconds between heartbeats (default 0.25)")
    run.add_argument("--liveness", type=int, help="heartbeats missed before a peer is lost (default 6)")
    run.add_argument("--heartbeat-rate", dest="heartbeat_rate", type=float, help=f"with --serve: the most heartbeats a second the coordinator takes from all nodes together; past it the period doubles as the pool grows (default {HEARTBEAT_RATE:g}: 0.25 s up to 250 nodes, 1 s at 1,000)")
    run.add_argument("--cache-max", dest="cache_max", help="the most the staging cache keeps, e.g. 50GB (default: as the disk allows); least recently used first, never what a live job uses")
    run.add_argument("--stage-rate", dest="stage_rate", help="with --serve: a node fetching a job's files from nodes that train is paced to this many bytes a second, so their steps barely slow (default 10MB; 0: never paced)")
    run.add_argument("--dashboard", nargs="?", const=DEFAULT_DASHBOARD, metavar="ADDR", help="with --serve: also serve the read-only web dashboard at ADDR (default 127.0.0.1:7341; elsewhere needs viewer tokens or --insecure), a process of its own")
    run.add_argument("--stop-grace", dest="stop_grace", type=float, help="seconds between SIGTERM and SIGKILL when stopping a worker (default 10)")
    run.add_argument("--log-level", dest="log_level", help="debug, info, warning or error")
    run.add_argument(
        "--yield-when", dest="yield_when", metavar="CONDITIONS",
        help="give the machine back to its owner (its work moves off, no step lost) while any of these holds, and take work again 2 minutes after none does: "
        "active[:MINUTES] (keyboard or mouse used within MINUTES, default 5), battery, thermal (throttled), memory (pressure); e.g. active:10,battery",
    )
    run.add_argument("--log-file", dest="log_file", help="write dpd's log (JSON lines) to this file, rotated by size, instead of stderr")
    install = sub.add_parser("install", parents=[run], add_help=False, help="write and load the OS service (LaunchAgent, systemd unit) that runs `dpd run` with these flags")
    install.add_argument("--print", action="store_true", help="only print the file and the commands install would run")
    install.add_argument("--target", choices=["launchd", "systemd"], help="the service manager (default: this machine's)")
    uninstall = sub.add_parser("uninstall", help="stop and remove the OS service")
    uninstall.add_argument("--target", choices=["launchd", "systemd"], help="the service manager (default: this machine's)")
    status = sub.add_parser("status", help="the installed service: loaded, running, its pid, its coordinator, its node as the coordinator sees it")
    status.add_argument("--keys", help="a key directory with a client pair to ask the coordinator with (default: the service's, else dpctl's)")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds the coordinator has to answer (default 3)")
    status.add_argument("--json", action="store_true", help="one JSON object on stdout")
    logs = sub.add_parser("logs", help="the installed service's log (its --log-file, ~/Library/Logs/dpool/dpd.log, or the journal)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("-n", "--lines", type=_lines, default=100, help="the last lines to show (default 100)")
    sub.add_parser("restart", help="stop the installed service (SIGTERM: trainers checkpoint and stop) and start it again")
    cachecmd.add_parser(sub, default_state_dir())
    args = parser.parse_args(argv)
    if args.command == "cache":
        return cachecmd.main(args, lock_state_dir)
    if args.command in ("install", "uninstall", "status", "logs", "restart"):
        from dpool.daemon import service

        return service.main(args, run)
    try:
        s = settings(args)
    except UsageError as e:
        print(f"dpd: {e}", file=sys.stderr)
        return 2
    # Here, not in settings: `install` may prepare another machine's service.
    if not netif.is_ip(s.advertise):
        try:
            s = dataclasses.replace(s, advertise=netif.resolve(s.advertise))  # up since settings() looked
        except netif.AdvertiseError as e:  # an interface whose address has not come up yet
            print(f"dpd: {e}", file=sys.stderr)
            return 1  # not 2: a service manager retries 1, and the link may be up by then
    if (problem := netif.loopback_for_remote(s.advertise, tcp_host(s.join) if s.join and not is_loopback(s.join) else None)) is not None:
        print(f"dpd: {problem}", file=sys.stderr)
        return 2
    if (problem := netif.foreign_address(s.advertise)) is not None:
        print(f"dpd: {problem}", file=sys.stderr)
        return 1  # not 2: the address may come up later (a link still starting at boot), and a service manager retries 1

    os.umask(UMASK)  # before anything is created: the state dir, the database, logs, sockets
    try:
        lock = lock_state_dir(s.state_dir)
    except StateDirBusy as e:
        print(f"dpd: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"dpd: cannot use the state dir {s.state_dir}: {e}", file=sys.stderr)
        return 1
    if s.log_file is not None:
        log_file = RotatingFile(s.log_file, quiet=True)
        try:
            s.log_file.parent.mkdir(parents=True, exist_ok=True)
            log_file.open()  # now, so that a path it cannot write is refused, not a daemon without a log
        except OSError as e:
            print(f"dpd: --log-file {s.log_file}: cannot write there: {e.strerror or e}", file=sys.stderr)
            os.close(lock)
            return 2
        configure_logging(s.log_level, json=True, stream=log_file)
    elif sys.stderr.isatty():
        configure_logging(s.log_level)
    else:
        configure_logging(s.log_level, json=True, stream=Quiet(sys.stderr.buffer))  # a full disk under stderr must not stop dpd
    log = get_logger(node=s.name)
    log.info("dpd.starting", serve=s.serve, join=s.join, slots=s.workers, advertise=s.advertise, interface=netif.interface_of(s.advertise), state_dir=str(s.state_dir))
    say_ring_link(log, s.advertise)
    # `kill -USR1 <pid>`: every thread's Python stack on stderr (the journal, launchd's log), for
    # a dpd that does not stop or answer; it runs on. Dumped from a Python handler, which runs
    # holding the GIL, so the other threads' frames hold still while they are read: faulthandler's
    # own signal handler reads them while they run, and crashed a dpd about once in 25 dumps.
    signal.signal(signal.SIGUSR1, lambda signum, frame: faulthandler.dump_traceback(all_threads=True))
    try:
        return asyncio.run(serve_and_run(s, zygote))
    finally:
        os.close(lock)


if __name__ == "__main__":
    sys.exit(main())
