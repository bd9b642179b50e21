"""`dpd cache`: what this node's staging cache holds, and pruning it.

    dpd cache [--state-dir DIR] [--json]        one row per tree: digest, size, files, last use, where from
    dpd cache prune [DIGEST] [--state-dir DIR]  remove one tree, or every tree (and every file no tree links)

A running dpd prunes by itself within `--cache-max`, least recently used first, never a tree a
live job uses; it alone knows which those are, so `prune` refuses while it runs (its state dir is
locked) rather than delete a tree under a job.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from dpool.client.tables import age, held, size, table
from dpool.staging.cache import Cache


def add_parser(sub: argparse._SubParsersAction, default_state_dir: Path) -> None:
    cache = sub.add_parser("cache", help="what this node's staging cache holds (`prune [DIGEST]`: remove trees while dpd is stopped)")
    cache.add_argument("action", nargs="?", choices=["list", "prune"], default="list")
    cache.add_argument("digest", nargs="?", help="prune: only this tree (a digest, or a unique prefix of one)")
    cache.add_argument("--state-dir", dest="state_dir", default=str(default_state_dir), help=f"the dpd's state dir (default {default_state_dir})")
    cache.add_argument("--json", action="store_true", help="list: a JSON array on stdout")


def main(args: argparse.Namespace, lock: Callable[[Path], int]) -> int:
    """`lock(state_dir)` takes the dpd's state-dir lock (raises while a dpd runs there)."""
    state = Path(args.state_dir).expanduser()
    if not state.is_dir():  # a mistyped --state-dir: not "an empty cache"
        print(f"dpd cache: --state-dir {state}: no such folder (give the state dir its dpd runs with)", file=sys.stderr)
        return 2
    if not (state / "cache").is_dir():
        print("[]" if args.json else f"no staging cache at {state / 'cache'} (is --state-dir the dpd's?)")
        return 0
    cache = Cache(state / "cache")
    entries = cache.entries()
    if args.action == "list":
        if args.json:
            sys.stdout.write(orjson.dumps([e.__dict__ for e in entries]).decode() + "\n")
            return 0
        if not entries:
            print(f"the cache at {cache.root} is empty")
            return 0
        now = time.time()
        print(table(
            ["DIGEST", "SIZE", "FILES", "USED", "FROM"],
            [[e.digest[:12], held(e.held, e.bytes, e.complete), e.files, age(now - e.last_used) if e.last_used else "never", e.adopted or ("cache" if e.complete else "partial")] for e in entries],
        ))
        print(f"{size(sum(e.held for e in entries if not e.adopted)) or '0B'} in {cache.root}")
        return 0
    try:
        fd = lock(state)
    except Exception as e:  # StateDirBusy names the running dpd's pid
        print(f"dpd cache prune: {e}; a running dpd prunes its cache itself (--cache-max)", file=sys.stderr)
        return 2
    try:
        digest = None
        if args.digest:
            found = [e.digest for e in entries if e.digest.startswith(args.digest)]
            if len(found) != 1:
                why = "; give a longer prefix" if found else " (`dpd cache` lists them)"
                print(f"dpd cache prune: {args.digest!r} names {len(found)} trees in {cache.root}{why}", file=sys.stderr)
                return 2
            digest = found[0]
        freed = cache.prune(digest)
    finally:
        os.close(fd)
    print(f"freed {freed / 1e6:.1f} MB")
    return 0
