"""`dpctl keys init DIR`: the pool's CURVE key pairs, laid out as protocol/security.py reads them.

    DIR/coordinator.key[_secret]   the coordinator's pair
    DIR/node.key[_secret]          the daemons' pair (plus node-NAME pairs for --node NAME)
    DIR/client.key[_secret]        dpctl's pair (plus client-NAME pairs for --client NAME)
    DIR/allowed/*.key              copies of every node and client public key: the allow-list

Secret files are written 0600 (the umask is 077 while they are made), DIR and DIR/allowed 0700.
Existing keys are never overwritten without --force: a pool's running nodes hold them; missing
pairs are added (`dpctl keys init DIR --node mac3` admits one more node).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import zmq.auth

from dpool.protocol.security import ALLOWED, ClientKeys, client_keys, keys_dir

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


class KeysExist(Exception):
    """Keys are already there (exit 1 unless --force)."""


def pair_names(nodes: list[str], clients: list[str]) -> list[str]:
    names = ["coordinator", "node", "client"]
    for role, extra in (("node", nodes), ("client", clients)):
        for n in extra:
            if not NAME.fullmatch(n):
                raise ValueError(f"--{role} {n!r}: a name of 1-63 characters a-z, 0-9 and '-'")
            names.append(f"{role}-{n}")
    return names


def init_keys(directory: Path, *, nodes: list[str] = [], clients: list[str] = [], force: bool = False) -> list[Path]:  # noqa: B006 -- never mutated
    """Create the pairs that are missing (all of them with `force`); returns the files written.

    Without `force` an existing pair is kept, so `keys init DIR --node NAME` adds one node to a pool;
    with nothing left to create it refuses. A pair's public key in allowed/ has the pair's name, so
    a replaced pair's old key is overwritten there, not left admitted."""
    names = pair_names(nodes, clients)
    have = [n for n in names if (directory / f"{n}.key").exists() or (directory / f"{n}.key_secret").exists()]
    todo = names if force else [n for n in names if n not in have]
    if not todo:
        raise KeysExist(f"{directory}: keys exist already ({', '.join(have)}); pass --force to replace them (every node and client then needs the new files)")
    old_umask = os.umask(0o077)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        allowed = directory / ALLOWED
        allowed.mkdir(exist_ok=True)
        written: list[Path] = []
        for n in todo:
            for ext in (".key", ".key_secret"):
                (directory / f"{n}{ext}").unlink(missing_ok=True)
            public, secret = zmq.auth.create_certificates(directory, n)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            written += [Path(public), Path(secret)]
            if n != "coordinator":
                shutil.copyfile(public, allowed / f"{n}.key")
                os.chmod(allowed / f"{n}.key", 0o644)
                written.append(allowed / f"{n}.key")
        os.chmod(directory, 0o700)
        os.chmod(allowed, 0o700)
    finally:
        os.umask(old_umask)
    return written


def cmd_keys_init(a: argparse.Namespace) -> int:
    directory = Path(a.dir).expanduser().absolute()
    try:
        written = init_keys(directory, nodes=a.node or [], clients=a.client or [], force=a.force)
    except ValueError as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return 2
    except KeysExist as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    print(
        f"\nCopy {directory} to each machine (secret files stay 0600), then:\n"
        f"  the serving daemon:  dpd run --serve tcp://0.0.0.0:7340 --keys {directory}  (uses coordinator.key_secret, allowed/)\n"
        f"  every other daemon:  dpd run --join tcp://HOST:7340 --keys {directory}      (node.key_secret, coordinator.key)\n"
        f"  dpctl:               dpctl --keys {directory} ...  or  export DPOOL_KEYS={directory}\n"
        "A machine needs only its own secret file and coordinator.key; delete a file in allowed/ to revoke a key.",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="the pool's CURVE keys")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    init = ksub.add_parser("init", help="create the pool's key pairs (coordinator, nodes, clients) in DIR")
    init.add_argument("dir", help="the key directory (created 0700)")
    init.add_argument("--node", action="append", metavar="NAME", help="also a pair for node NAME (node-NAME.key_secret); repeatable")
    init.add_argument("--client", action="append", metavar="NAME", help="also a pair for client NAME; repeatable")
    init.add_argument("--force", action="store_true", help="replace existing pairs")
    init.set_defaults(fn=None, local_fn=cmd_keys_init)


def load_client_keys(flag: str | None, config_file: Path) -> ClientKeys | None:
    """dpctl's keys: --keys, else $DPOOL_KEYS, else `keys` in the config file, else none."""
    config = None
    try:
        with open(config_file, "rb") as f:
            value = tomllib.load(f).get("keys")
        config = value if isinstance(value, str) else None
    except (OSError, tomllib.TOMLDecodeError):
        pass
    directory = keys_dir(flag, config)
    return None if directory is None else client_keys(directory, "client")
