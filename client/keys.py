"""`dpctl keys`: the pool's CURVE key pairs, laid out as protocol/security.py reads them.

    dpctl keys init DIR [--node NAME ...] [--client NAME ...]   the pool's keys (on the machine that serves)
    dpctl keys add-node NAME [--dir DIR]                         one more node
    dpctl keys add-client NAME [--read-only] [--dir DIR]         one more client (or viewer)
    dpctl keys add-viewer NAME [--dir DIR]                       a viewer: read-only key and dashboard token

    DIR/coordinator.key[_secret]   the coordinator's pair
    DIR/client.key[_secret]        dpctl's default pair, for this machine
    DIR/node-NAME.key[_secret]     one pair per node (default: this machine's host name, dpd's --name)
    DIR/client-NAME.key[_secret]   named clients; DIR/viewer-NAME.key[_secret] read-only ones
    DIR/viewer-NAME.token          a viewer's dashboard token (its hash: allowed/viewers/NAME.token)
    DIR/allowed/nodes/NAME.key     the allow-list, by role: nodes, clients, viewers
    DIR/bundles/NAME/              what machine NAME needs, and nothing more: coordinator.key, plus
                                   node-NAME.key[_secret] (a node) and client.key[_secret] (a client)

Secret files are written 0600 (the umask is 077 while they are made), folders 0700. Files in
allowed/ are written by rename, so the coordinator sees every change in its folders' times.
Existing keys are never overwritten without --force: a pool's running nodes hold them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.auth

from dpool.dashboard import auth
from dpool.protocol.config import ConfigError, load_config
from dpool.protocol.payloads import NODE_NAME_MEANS, NODE_NAME_PATTERN, name_from_host
from dpool.protocol.security import (
    ALLOWED,
    BUNDLES,
    ROLE_FOLDERS,
    ClientKeys,
    KeysError,
    client_keys,
    keys_dir,
)

NAME = re.compile(NODE_NAME_PATTERN)  # a node's, a client's or a viewer's: one rule with dpd's --name


class KeysExist(Exception):
    """Keys are already there (exit 1 unless --force)."""


@dataclass(frozen=True, slots=True)
class Pair:
    """One key pair of the pool: its role and name (None: the coordinator's, or dpctl's default)."""

    role: str  # "coordinator", "node", "client", "viewer"
    name: str | None = None

    @property
    def stem(self) -> str:
        """Its files in DIR: STEM.key, STEM.key_secret."""
        return self.role if self.name is None else f"{self.role}-{self.name}"

    @property
    def allowed(self) -> str | None:
        """Its public key's place in allowed/ (the coordinator's is never there)."""
        if self.role == "coordinator":
            return None
        return f"{ROLE_FOLDERS[self.role]}/{self.name or self.role}.key"

    @property
    def bundled_as(self) -> str:
        """Its files' stem in its machine's bundle: a node's keeps its name (bound to its key), a
        client's is the `client` pair dpctl looks for."""
        return self.stem if self.role == "node" else "client"


def this_machine() -> str:
    """dpd's default --name: the host name up to its first dot, in lower case (`name_from_host`)."""
    return name_from_host(socket.gethostname())


def check_name(flag: str, name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"{flag} {name!r}: a name of {NODE_NAME_MEANS}")
    return name


def named_pair(role: str, flag: str, name: str) -> Pair:
    """Pair `role` NAME, its name checked. A client may not be named `client`: its public key would
    take allowed/clients/client.key, the place of dpctl's default pair's, and lock out the dpctl of
    the machine that serves."""
    pair = Pair(role, check_name(flag, name))
    if pair.allowed == Pair("client").allowed:
        raise ValueError(f"{flag} {name!r}: that name is the default client's (its key is allowed/clients/client.key); choose another")
    return pair


def pairs_for(nodes: list[str], clients: list[str], viewers: list[str] = []) -> list[Pair]:  # noqa: B006 -- never mutated
    """The coordinator's pair, dpctl's default, then the named ones."""
    out = [Pair("coordinator"), Pair("client")]
    for role, names in (("node", nodes), ("client", clients), ("viewer", viewers)):
        out += [named_pair(role, f"--{role}", n) for n in names]
    return list(dict.fromkeys(out))  # a name given twice is one pair


def _write_public(source: Path, dest: Path) -> None:
    """Copy a public key file into place by rename: a reader sees the old file or the new one, and
    the folder's time changes (the coordinator reads allowed/ again on that)."""
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".", suffix=".tmp")
    os.close(fd)
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)


def _exists(directory: Path, pair: Pair) -> bool:
    return (directory / f"{pair.stem}.key").exists() or (directory / f"{pair.stem}.key_secret").exists()


def _bundle(directory: Path, pair: Pair) -> list[Path]:
    """The pair's machine's folder: coordinator.key and its own pair (never the coordinator's secret)."""
    if pair.name is None:
        return []
    folder = directory / BUNDLES / pair.name
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory / BUNDLES, 0o700)
    os.chmod(folder, 0o700)
    written = []
    for src, dest, mode in (
        (directory / "coordinator.key", folder / "coordinator.key", 0o644),
        (directory / f"{pair.stem}.key", folder / f"{pair.bundled_as}.key", 0o644),
        (directory / f"{pair.stem}.key_secret", folder / f"{pair.bundled_as}.key_secret", 0o600),
    ):
        dest.unlink(missing_ok=True)
        shutil.copyfile(src, dest)
        os.chmod(dest, mode)
        written.append(dest)
    return written


def _make(directory: Path, pair: Pair) -> list[Path]:
    for ext in (".key", ".key_secret"):
        (directory / f"{pair.stem}{ext}").unlink(missing_ok=True)
    public, secret = (Path(p) for p in zmq.auth.create_certificates(directory, pair.stem))
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    written = [public, secret]
    if pair.allowed is not None:
        _write_public(public, directory / ALLOWED / pair.allowed)
        written.append(directory / ALLOWED / pair.allowed)
    return written + _bundle(directory, pair)


def _conflict(directory: Path, pair: Pair) -> str | None:
    """A client and a viewer of one name would share a bundle's client.key_secret."""
    if pair.role in ("client", "viewer") and pair.name is not None:
        other = Pair("viewer" if pair.role == "client" else "client", pair.name)
        if _exists(directory, other):
            return f"{pair.name!r} is a {other.role} already ({directory / (other.stem + '.key')}): a machine is a client or a viewer, not both"
    return None


def init_keys(directory: Path, *, nodes: list[str] | None = None, clients: list[str] = [], viewers: list[str] = [], force: bool = False) -> list[Path]:  # noqa: B006 -- never mutated
    """Create the pairs that are missing (all of them with `force`); returns the files written.

    `nodes` None: one node, this machine (dpd's default --name). Without `force` an existing pair
    is kept, so `keys init DIR --node NAME` adds one node to a pool; with nothing left to create it
    refuses. A pair's public key in allowed/ has the pair's name, so a replaced pair's old key is
    replaced there, not left admitted."""
    pairs = pairs_for(nodes if nodes is not None else [check_name("this machine's name (pass --node NAME)", this_machine())], clients, viewers)
    for p in pairs:
        if (problem := _conflict(directory, p)) is not None:
            raise ValueError(problem)
    if not force and any((directory / ALLOWED).glob("*.key")):
        raise KeysExist(
            f"{directory}: made before keys had roles (one shared node pair, allowed/*.key); `--force` makes every pair "
            "again in the new layout (then hand out the new bundles)"
        )
    have = [p.stem for p in pairs if _exists(directory, p)]
    todo = pairs if force else [p for p in pairs if p.stem not in have]
    if not todo:
        raise KeysExist(f"{directory}: keys exist already ({', '.join(have)}); pass --force to replace them (every node and client then needs the new files)")
    old_umask = os.umask(0o077)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        if force:
            for stray in (directory / ALLOWED).glob("*.key"):
                stray.unlink()  # the layout before roles
        for folder in ROLE_FOLDERS.values():
            (directory / ALLOWED / folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory / ALLOWED, 0o700)
        written: list[Path] = []
        for p in todo:
            written += _make(directory, p)
        if any(p.role == "coordinator" for p in todo):  # every bundle needs the new coordinator.key
            for p in pairs_in(directory):
                if p not in todo:
                    written += _bundle(directory, p)
    finally:
        os.umask(old_umask)
    return written


def pairs_in(directory: Path) -> list[Pair]:
    """The named pairs of a key directory (nodes, clients, viewers), from their secret files."""
    out = []
    for path in sorted(directory.glob("*-*.key_secret")):
        role, _, name = path.name[: -len(".key_secret")].partition("-")
        if role in ROLE_FOLDERS and NAME.fullmatch(name):
            out.append(Pair(role, name))
    return out


def add_key(directory: Path, pair: Pair, *, force: bool = False) -> list[Path]:
    """One more node, client or viewer of a pool: its pair, its allow-list entry and its bundle."""
    for needed in ("coordinator.key", "coordinator.key_secret", ALLOWED):
        if not (directory / needed).exists():
            raise KeysError(f"{directory / needed}: missing; keys are added in the pool's full key directory (`dpctl keys init DIR` made it), not in a bundle")
    if (problem := _conflict(directory, pair)) is not None:
        raise ValueError(problem)
    if _exists(directory, pair) and not force:
        raise KeysExist(f"{directory / (pair.stem + '.key')}: {pair.role} {pair.name!r} has keys already; pass --force to replace them (its machine then needs the new bundle)")
    old_umask = os.umask(0o077)
    try:
        return _make(directory, pair)
    finally:
        os.umask(old_umask)


# -- dpctl keys ... -----------------------------------------------------------------------------


def _issue(make: Callable[[], tuple[list[Path], str]]) -> int:
    """Run `make` (the files it wrote, what to tell the user): prints them, exit 0; bad input or an
    unusable directory exit 2, keys that exist already exit 1."""
    try:
        written, text = make()
    except (ValueError, KeysError) as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file where a folder must be, a read-only place, a full disk
        print(f"dpctl: cannot write the keys: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeysExist as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    print(text, file=sys.stderr)
    return 0


def _bundle_lines(directory: Path, pairs: list[Pair]) -> str:
    lines = []
    for p in pairs:
        if p.name is None:
            continue
        b = directory / BUNDLES / p.name
        if p.role == "node":
            lines.append(f"  {b}/  ->  machine {p.name}:  dpd run --join tcp://HOST:7340 --keys ~/dpool-keys --name {p.name}")
        else:
            lines.append(f"  {b}/  ->  {p.name}:  dpctl --keys ~/dpool-keys ...{'  (read-only)' if p.role == 'viewer' else ''}")
    return "\n".join(lines)


def cmd_keys_init(a: argparse.Namespace) -> int:
    directory = Path(a.dir).expanduser().absolute()

    def make() -> tuple[list[Path], str]:
        written = init_keys(directory, nodes=a.node, clients=a.client or [], force=a.force)
        here = [p for p in pairs_in(directory) if p.role == "node" and p.name == this_machine()]
        serving = here[0].name if here else "NAME"
        others = [p for p in pairs_in(directory) if p.name != serving or p.role != "node"]
        return written, (
            f"\nThe pool's keys are in {directory}. Keep that folder on the machine that serves: it holds\n"
            f"coordinator.key_secret, which no other machine may have.\n"
            f"  the serving daemon:  dpd run --serve tcp://0.0.0.0:7340 --keys {directory} --name {serving}\n"
            f"  dpctl there:         dpctl --keys {directory} ...  or  export DPOOL_KEYS={directory}\n"
            f"Every other machine gets its own bundle, and only that (copy it, e.g. scp -rp BUNDLE HOST:dpool-keys):\n"
            f"{_bundle_lines(directory, others)}\n"
            f"More later: `dpctl keys add-node NAME`, `dpctl keys add-client NAME [--read-only]` (with --dir {directory}).\n"
            f"Revoke one key: delete its file in {directory / ALLOWED}/ (nodes/, clients/, viewers/); no restart needed."
        )

    return _issue(make)


def add_viewer(directory: Path, name: str, *, force: bool = False) -> list[Path]:
    """Viewer NAME: its read-only pair (as add-client --read-only) and its dashboard token
    (dashboard/auth.py): the token in DIR/viewer-NAME.token and the bundle's viewer.token, its hash
    in allowed/viewers/NAME.token."""
    pair = named_pair("viewer", "add-viewer", name)
    written = add_key(directory, pair, force=force)
    token = auth.new_token(name)
    old_umask = os.umask(0o077)
    try:
        written.append(auth.write_secret(directory / f"{pair.stem}.token", token))
        written.append(auth.write_secret(directory / BUNDLES / name / "viewer.token", token))
        written.append(auth.write_hash(directory / ALLOWED / ROLE_FOLDERS["viewer"], name, token))
    finally:
        os.umask(old_umask)
    return written


def cmd_keys_add_viewer(a: argparse.Namespace) -> int:
    def make() -> tuple[list[Path], str]:
        directory = keys_dir(a.dir or getattr(a, "keys", None))
        if directory is None:
            raise KeysError("no key directory: pass --dir DIR (the pool's, made by `dpctl keys init DIR`), or set $DPOOL_KEYS")
        written = add_viewer(directory, a.name, force=a.force)
        bundle = directory / BUNDLES / a.name
        revoke = directory / ALLOWED / (Pair("viewer", a.name).allowed or "")
        return written, (
            f"\nViewer {a.name}: a read-only key for the control plane and a token for the dashboard.\n"
            f"  the dashboard:  open http://HOST:7341/?token=$(cat {bundle}/viewer.token) once (or send it as `Authorization: Bearer ...`)\n"
            f"  dpctl, read-only, on its machine: copy {bundle}/ there and run dpctl --keys ~/dpool-keys ...\n"
            f"A dashboard off loopback checks tokens against {directory / ALLOWED / ROLE_FOLDERS['viewer']}/ (dpd run --serve --keys {directory} --dashboard 0.0.0.0:7341).\n"
            f"Revoke both: delete {revoke}."
        )

    return _issue(make)


def cmd_keys_add(a: argparse.Namespace) -> int:
    role = "node" if a.keys_command == "add-node" else ("viewer" if getattr(a, "read_only", False) else "client")

    def make() -> tuple[list[Path], str]:
        directory = keys_dir(a.dir or getattr(a, "keys", None))
        if directory is None:
            raise KeysError("no key directory: pass --dir DIR (the pool's, made by `dpctl keys init DIR`), or set $DPOOL_KEYS")
        pair = named_pair(role, a.keys_command, a.name)
        return add_key(directory, pair, force=a.force), (
            f"\nCopy {directory / BUNDLES / a.name}/ to that machine, and only there (e.g. scp -rp it HOST:dpool-keys):\n"
            f"{_bundle_lines(directory, [pair])}\n"
            f"Revoke it: delete {directory / ALLOWED / (pair.allowed or '')}."
        )

    return _issue(make)


def add_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="the pool's CURVE keys")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    init = ksub.add_parser("init", help="create the pool's key pairs (coordinator, nodes, clients) and a bundle per machine in DIR")
    init.add_argument("dir", help="the key directory (created 0700); keep it on the machine that serves")
    init.add_argument("--node", action="append", metavar="NAME", help="a pair for node NAME (default: this machine's host name, dpd's default --name); repeatable")
    init.add_argument("--client", action="append", metavar="NAME", help="also a pair for client NAME; repeatable")
    init.add_argument("--force", action="store_true", help="replace existing pairs")
    init.set_defaults(fn=None, local_fn=cmd_keys_init)
    for command, what in (("add-node", "node: its pair, allowed/nodes/NAME.key and bundles/NAME/"), ("add-client", "client: its pair, allowed/clients/NAME.key and bundles/NAME/")):
        p = ksub.add_parser(command, help=f"issue keys for one more {what}")
        p.add_argument("name", help="its name (a node's: the --name its dpd runs under)")
        p.add_argument("--dir", help="the pool's key directory (default: --keys, else $DPOOL_KEYS)")
        p.add_argument("--force", action="store_true", help="replace its existing pair")
        if command == "add-client":
            p.add_argument("--read-only", action="store_true", help="a viewer (allowed/viewers/): requests that only read (status, queue, logs, ...)")
        p.set_defaults(fn=None, local_fn=cmd_keys_add)
    p = ksub.add_parser("add-viewer", help="issue a viewer: a read-only key (allowed/viewers/NAME.key) and a dashboard token (bundles/NAME/viewer.token)")
    p.add_argument("name", help="its name (a-z, 0-9, '-')")
    p.add_argument("--dir", help="the pool's key directory (default: --keys, else $DPOOL_KEYS)")
    p.add_argument("--force", action="store_true", help="replace its pair and token (the old token stops working)")
    p.set_defaults(fn=None, local_fn=cmd_keys_add_viewer)


class ConfigKeysError(KeysError):
    """The config file, read for its `keys`, cannot be used; the message names the file."""


def configured_keys_dir(flag: str | None, config_file: Path) -> Path | None:
    """dpctl's key directory: --keys, else $DPOOL_KEYS, else `keys` in the config file, else none."""
    try:
        config = load_config(config_file).get("keys")
    except ConfigError as e:
        raise ConfigKeysError(str(e)) from None
    return keys_dir(flag, config)


def load_client_keys(flag: str | None, config_file: Path) -> ClientKeys | None:
    """dpctl's keys: --keys, else $DPOOL_KEYS, else `keys` in the config file, else none."""
    directory = configured_keys_dir(flag, config_file)
    return None if directory is None else client_keys(directory, "client")
