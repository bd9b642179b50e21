"""`dpctl dashboard [--listen ADDR]` and `python -m dpool.dashboard` (what `dpd run --dashboard`
starts): the read-only web dashboard of a pool, a client of its coordinator.

    dpctl dashboard                                  http://127.0.0.1:7341/, the pool of --coordinator
    dpctl dashboard --listen 0.0.0.0:7341 --keys DIR viewers' tokens required (DIR/allowed/viewers/)
    dpctl dashboard --listen 0.0.0.0:7341 --insecure anyone who reaches the port sees the pool

Its keys (where the pool has keys): with the pool's full key directory, the dashboard's own viewer
pair, `viewer-dashboard` (made there on first use, as `dpctl keys add-client dashboard --read-only`
would): the coordinator then refuses it anything but reading. With a bundle, the bundle's pair (a
viewer's bundle is read-only too). Exit codes: 0 stopped (Ctrl-C, SIGTERM); 1 it could not listen;
2 bad input (the message names the flag).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from dpool.dashboard.options import DEFAULT_LISTEN, DEFAULT_POLL_S, Options, OptionsError, check
from dpool.protocol.security import BUNDLES, ClientKeys, KeysError, client_keys

DASHBOARD_VIEWER = "dashboard"
PARENT_CHECK_S = 1.0


def add_arguments(p: argparse.ArgumentParser, *, standalone: bool) -> None:
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDR", help=f"HOST:PORT to serve on (default {DEFAULT_LISTEN}; anything but loopback needs viewer tokens or --insecure)")
    p.add_argument("--tokens", metavar="DIR", help="the folder of viewers' token hashes (default: the key directory's allowed/viewers/ off loopback); given, every request needs a token")
    p.add_argument("--insecure", action="store_true", help="serve beyond loopback without viewer tokens (a network you trust)")
    p.add_argument("--poll", type=float, default=DEFAULT_POLL_S, metavar="SECONDS", help=f"how often the coordinator is read while someone looks (default {DEFAULT_POLL_S:g})")
    if standalone:
        p.add_argument("--coordinator", required=True, metavar="ADDR")
        p.add_argument("--keys", metavar="DIR", help="the pool's key directory or a bundle")
        p.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS")
        p.add_argument("--parent-pid", dest="parent_pid", type=int, help="end when this process (the dpd that started it) is gone")


def viewer_keys(directory: Path) -> ClientKeys:
    """The dashboard's pair: its own viewer pair in a full key directory (made on first use), or
    the bundle's."""
    if not (directory / "coordinator.key_secret").exists():
        return client_keys(directory, "client")  # a bundle: its pair
    bundle = directory / BUNDLES / DASHBOARD_VIEWER
    if not (bundle / "client.key_secret").exists():
        from dpool.client.keys import Pair, add_key

        try:
            add_key(directory, Pair("viewer", DASHBOARD_VIEWER), force=(directory / f"viewer-{DASHBOARD_VIEWER}.key_secret").exists())
        except ValueError as e:
            raise KeysError(f"{directory}: cannot make the dashboard's viewer pair: {e}") from None
        print(f"dashboard: made its read-only key pair viewer-{DASHBOARD_VIEWER} in {directory}", file=sys.stderr)
    return client_keys(bundle, "client")


def run(opts: Options, keys: ClientKeys | None) -> int:
    from dpool.dashboard import server
    from dpool.dashboard.auth import Tokens
    from dpool.dashboard.poller import Poller

    poller = Poller(opts.coordinator, keys, lambda view, rendered: None, poll_s=opts.poll_s, timeout_s=opts.timeout_s)
    application = server.app(poller, Tokens(opts.tokens) if opts.tokens is not None else None)

    def ready(url: str) -> None:
        who = "viewer tokens required" if opts.tokens is not None else ("open to anyone who reaches it (--insecure)" if not opts.listen.loopback else "this machine only")
        print(f"dashboard: {url} (pool at {opts.coordinator}; {who}); Ctrl-C stops it", file=sys.stderr, flush=True)

    async def main() -> None:
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        watch = asyncio.create_task(_watch_parent(opts.parent_pid, stopping)) if opts.parent_pid else None
        try:
            await server.serve(application, opts.listen.host, opts.listen.port, ready=ready, stopping=stopping)
        finally:
            if watch is not None:
                watch.cancel()

    try:
        asyncio.run(main())
    except OSError as e:
        print(f"dashboard: cannot listen on {opts.listen.host}:{opts.listen.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


async def _watch_parent(pid: int | None, stopping: asyncio.Event) -> None:
    """Set `stopping` once `pid`, the parent, is gone (a dpd killed without its SIGTERM handler):
    this process is then another's child."""
    while pid and os.getppid() == pid:
        await asyncio.sleep(PARENT_CHECK_S)
    stopping.set()


def start(a: Any, coordinator: str, keys_directory: Path | None) -> int:
    """Check the flags, load the keys, serve: the exit code."""
    try:
        opts = check(
            a.listen, coordinator, keys=keys_directory, tokens=Path(a.tokens).expanduser().absolute() if a.tokens else None,
            insecure=a.insecure, poll_s=a.poll, timeout_s=getattr(a, "timeout", 3.0), parent_pid=getattr(a, "parent_pid", None),
        )
        keys = viewer_keys(keys_directory) if keys_directory is not None else None
    except OptionsError as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 2
    except KeysError as e:
        print(f"dashboard: --keys: {e}", file=sys.stderr)
        return 2
    return run(opts, keys)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpool.dashboard", description="the read-only web dashboard of a pool")
    add_arguments(p, standalone=True)
    a = p.parse_args(argv)
    return start(a, a.coordinator, Path(a.keys).expanduser().absolute() if a.keys else None)
