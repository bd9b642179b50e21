"""CURVE on the control plane: the key directory `dpctl keys init` writes, the sockets that use it,
and who may send what (roles).

The pool's key directory, on the machine that serves (protocol/README.md, "Security"):

    DIR/coordinator.key[_secret]     the coordinator's pair (the secret never leaves this machine)
    DIR/node-NAME.key[_secret]       one pair per node, bound to its name
    DIR/client.key[_secret]          dpctl's default pair
    DIR/allowed/nodes/NAME.key       the allow-list, one folder per role: a key in nodes/ may
    DIR/allowed/clients/NAME.key     register as node NAME only, one in clients/ may send dpctl's
    DIR/allowed/viewers/NAME.key     requests, one in viewers/ only the read-only ones
    DIR/bundles/NAME/                what machine NAME needs: coordinator.key and its own pair(s)

A bundle holds `coordinator.key`, `node-NAME.key[_secret]` when NAME is a node, and
`client.key[_secret]` when it is a client: `--keys` takes it as it takes the full directory.

Secret files are 0600 and refused when group or others can read them (as ssh does); a key directory
or allow-list folder that group or others can write is refused. The coordinator reads `allowed/`
again only when one of its folders changed, so deleting a key file revokes that key: a new
connection is refused its handshake, and an open one its next message (the connection's User-Id
carries its key, checked against the allow-list as it is when the coordinator reads that message's
batch). The ipc socket between a daemon and its trainers stays plain: it is local and protected
by the state directory's permissions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from dpool.protocol import messages as m
from dpool.protocol.logs import Throttle
from dpool.protocol.messages import MsgType
from dpool.protocol.sockets import pending

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
ALLOWED = "allowed"
BUNDLES = "bundles"
KEYS_ENV = "DPOOL_KEYS"
REFUSAL_LOG_S = 10.0
RECOPY = "copy it again from the pool's key directory (`dpctl keys init DIR` made it)"
SETTLED_S = 2.0  # allowed/ is trusted from its cache once its folders are this much older than the read
RECHECK_S = 0.1  # while it is not: read again at most this often for the per-message check (handshakes: each)
HANDSHAKE_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the peer does not use CURVE (a dpd or dpctl without --keys)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the peer's CURVE handshake does not decrypt (it holds another pool's coordinator.key)",
}
HANDSHAKE_DROPPED = "the peer closed the connection during the CURVE handshake (a dpd or dpctl without --keys?)"
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

# -- roles: who may send what (protocol/README.md, "Roles") -----------------------------------

ROLE_FOLDERS = {"node": "nodes", "client": "clients", "viewer": "viewers"}  # role -> its folder in allowed/
READ_ONLY = frozenset({MsgType.STATUS, MsgType.NODES, MsgType.METRICS, MsgType.EVENTS, MsgType.SAMPLES, MsgType.LOGS, MsgType.CACHE, MsgType.QUEUE})
ROLE_SENDS: dict[str, frozenset[MsgType]] = {
    "node": m.FROM_NODE | {MsgType.ERROR},
    "client": m.FROM_CLIENT,
    "viewer": READ_ONLY,
}
# What a key refused for its role is told (daemon/coordinator.py): written from the sets above, so
# that it names every request a viewer may send however READ_ONLY grows.
ROLE_RULE = f"node keys send node.*, client keys dpctl's requests, viewer keys only {', '.join(str(t) for t in MsgType if t in READ_ONLY)}"


def zap_answer(frames: list[bytes], reply: Callable[[list[bytes]], list[bytes]], warn: Callable[..., None]) -> list[bytes]:
    """`reply(frames)` for a ZAP request (RFC 27), or 500 where it fails (logged by `warn`): answered
    all the same, since an unanswered request hangs that handshake. The control socket's and the
    data channel's handlers both answer through it."""
    try:
        return reply(frames)
    except Exception as e:
        warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")
        return [frames[0] if frames else b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"internal error", b"", b""]


def user_parts(user_id: str) -> tuple[str, str, str]:
    """("node", "mac1", KEY) from the User-Id "node:mac1:KEY" the ZAP handler gave a connection
    (KEY: its public key, 40 z85 characters, which may include ':'; a name never does)."""
    role, _, rest = user_id.partition(":")
    name, _, key = rest.partition(":")
    return role, name, key


def role_of(user_id: str) -> tuple[str, str]:
    """("node", "mac1") from the User-Id "node:mac1:KEY"."""
    role, name, _ = user_parts(user_id)
    return role, name


class KeysError(Exception):
    """A key directory that cannot be used; the message names the file and what to do."""


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a CURVE client (dpd's link to the coordinator, dpctl) needs."""

    public: bytes
    secret: bytes
    server_public: bytes
    source: str  # the secret file, for messages


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """What the coordinator needs: its own pair and the allow-list directory."""

    public: bytes
    secret: bytes
    allowed_dir: Path


def _z85_key(value: Any) -> bool:
    """A CURVE key as ZeroMQ takes it: 40 z85 characters (32 bytes)."""
    if not isinstance(value, bytes) or len(value) != 40:
        return False
    try:
        return len(z85.decode(value)) == 32
    except Exception:  # z85 raises several types on characters outside its alphabet
        return False


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) from a ZeroMQ certificate file; raises KeysError naming the file.
    zmq.auth.load_certificate raises IndexError, ValueError, UnicodeDecodeError... on garbage."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise KeysError(f"{path}: {e.strerror or e}") from None
    except Exception as e:
        raise KeysError(f"{path}: not a CURVE key file ({type(e).__name__}: {e}); {RECOPY}") from None
    if not _z85_key(public) or (secret is not None and not _z85_key(secret)):
        raise KeysError(f"{path}: not a CURVE key file (a key is not 40 z85 characters); {RECOPY}")
    return public, secret


def writable_by_others(path: Path) -> str | None:
    """Why `path` (a folder or a public key file) is not trusted: group or others may write it."""
    mode = path.stat().st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(mode):o}); run `chmod go-w {path}`"
    return None


def _check_dir(directory: Path, what: str = "key directory") -> None:
    if not directory.is_dir():
        raise KeysError(f"{directory}: no such {what}; make one with `dpctl keys init DIR`")
    problem = writable_by_others(directory)
    if problem:
        raise KeysError(f"{directory}: {what} {problem}")


def _load_public(path: Path) -> bytes:
    if not path.exists():
        raise KeysError(f"{path}: missing; it comes with the pool's keys (`dpctl keys init DIR`, or a bundle DIR/{BUNDLES}/NAME/)")
    problem = writable_by_others(path)
    if problem:
        raise KeysError(f"{path}: {problem}")
    return _read_certificate(path)[0]


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise KeysError(f"{path}: {e.strerror}; make keys with `dpctl keys init DIR`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(f"{path}: secret key readable by others (mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}`")
    public, secret = _read_certificate(path)
    if secret is None:
        raise KeysError(f"{path}: holds no secret key")
    if zmq.curve_public(secret) != public:
        raise KeysError(f"{path}: its public and secret keys are not a pair")
    return public, secret


def keys_dir(flag: str | None, config: str | None = None) -> Path | None:
    """The key directory: the flag, else $DPOOL_KEYS, else the config file's `keys`, else none."""
    chosen = flag or os.environ.get(KEYS_ENV) or config
    return Path(chosen).expanduser().absolute() if chosen else None


def secret_file(directory: Path, role: str, name: str | None = None) -> Path:
    """Where a pair's secret is, in a full key directory and in a bundle alike: a node's is
    `node-NAME.key_secret` (its name is bound to its key), a client's `client.key_secret`."""
    return directory / (f"node-{name}.key_secret" if role == "node" else "client.key_secret")


def client_keys(directory: Path, role: str, name: str | None = None) -> ClientKeys:
    """The pair of node `name` (role "node") or of dpctl (role "client") in a full key directory
    or a bundle, with the coordinator's public key."""
    _check_dir(directory)
    path = secret_file(directory, role, name)
    if not path.exists():
        raise KeysError(_no_pair(directory, role, name, path))
    public, secret = _load_secret(path)
    return ClientKeys(public=public, secret=secret, server_public=_load_public(directory / "coordinator.key"), source=str(path))


def _no_pair(directory: Path, role: str, name: str | None, path: Path) -> str:
    if role != "node":
        return (
            f"{path}: no client key pair here; on the machine that holds the pool's keys run "
            f"`dpctl keys add-client NAME` and copy its bundle ({BUNDLES}/NAME/) here"
        )
    others = sorted(p.name[len("node-"):-len(".key_secret")] for p in directory.glob("node-*.key_secret"))
    held = ""
    if others:
        held = f"{directory} holds the pair of node {others[0]} (run dpd with --name {others[0]}); " if len(others) == 1 else f"{directory} holds the pairs of nodes {', '.join(others)}; "
    return (
        f"{path}: no key pair for node {name!r}: {held}on the machine that holds the pool's keys run "
        f"`dpctl keys add-node {name}` and copy its bundle ({BUNDLES}/{name}/) here"
    )


def server_keys(directory: Path) -> ServerKeys:
    _check_dir(directory)
    secret = directory / "coordinator.key_secret"
    if not secret.exists():
        raise KeysError(f"{secret}: missing; the serving daemon needs the pool's full key directory (`dpctl keys init DIR`), not a bundle")
    public, secret_key = _load_secret(secret)
    allowed = directory / ALLOWED
    _check_dir(allowed, "allow-list directory")
    if not any((allowed / folder).is_dir() for folder in ROLE_FOLDERS.values()):
        raise KeysError(
            f"{allowed}: no role folders ({', '.join(f + '/' for f in ROLE_FOLDERS.values())}); it was made before keys had "
            f"roles: make the pool's keys again with `dpctl keys init {directory} --force` and hand out the new bundles"
        )
    for folder in ROLE_FOLDERS.values():
        if (allowed / folder).is_dir():
            _check_dir(allowed / folder, "allow-list directory")
    return ServerKeys(public=public, secret=secret_key, allowed_dir=allowed)


class AllowList:
    """The coordinator's allow-list: a public key (z85) -> "ROLE:NAME", from
    `allowed/ROLES/NAME.key`. Read again only when one of its folders changed (their inode, mtime
    and ctime: a key file added, removed or renamed, a chmod), and on every handshake while the
    newest change is under SETTLED_S old, so a change within a file system's timestamp granularity
    is never missed (for the per-message check: at most every RECHECK_S meanwhile). A file that
    cannot be used is skipped and reported to `warn(event, what, **fields)`: malformed, not a
    regular file, writable by others, a name dpd would not take, a key that is in two places
    (refused in both: it could not have one role), a file outside the role folders. A folder that
    group or others can write admits no key."""

    def __init__(self, root: Path, warn: Callable[..., None], *, settled_s: float = SETTLED_S) -> None:
        self.root, self.warn, self.settled_s = root, warn, settled_s
        self.reads = 0  # how often the folders were read
        self._keys: dict[bytes, str] = {}
        self._folders = [str(root), *(str(root / f) for f in ROLE_FOLDERS.values())]
        self._seen: tuple[Any, ...] | None = None
        self._settled = False
        self._read_at = 0.0  # time.monotonic() of the last read

    def get(self, key: bytes) -> str | None:
        """The role and name ("node:mac1") of `key` (z85) as the folders are now; None: not allowed."""
        self.refresh()
        return self._keys.get(key)

    def roles(self) -> dict[str, str]:
        """Every key allowed now: its z85 text -> "role:name"."""
        self.refresh()
        return {key.decode(): who for key, who in self._keys.items()}

    def holds(self, key: bytes, who: str) -> bool:
        """Whether `key` (z85) is allowed as `who` ("node:mac1") as of the last read: no file system
        access (`refresh` looks)."""
        return self._keys.get(key) == who

    def refresh(self, *, recheck_s: float = 0.0) -> None:
        """Read the folders again if one of them changed (four stat calls tell), and while the
        newest change is under `settled_s` old also when the last read is `recheck_s` old (0: at
        every call)."""
        seen, newest = self._signature()
        if seen != self._seen or (not self._settled and time.monotonic() - self._read_at >= recheck_s):
            self._keys = self._read()
            self.reads += 1
            self._read_at = time.monotonic()
            self._seen, self._settled = seen, time.time() - newest > self.settled_s

    def _signature(self) -> tuple[tuple[Any, ...], float]:
        sig: list[Any] = []
        newest = 0.0
        for d in self._folders:
            try:
                st = os.stat(d)
            except OSError:
                sig.append(None)
                continue
            sig.append((st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
            newest = max(newest, st.st_mtime, st.st_ctime)
        return tuple(sig), newest

    def _read(self) -> dict[bytes, str]:
        try:
            stray = sorted(self.root.glob("*.key"))
            problem = writable_by_others(self.root)
        except OSError as e:
            self.warn("auth.allow_list_unreadable", str(self.root), folder=str(self.root), reason=str(e))
            return {}
        for path in stray:
            self._skip(path, f"outside the role folders: move it into {ALLOWED}/nodes/ (node NAME.key) or {ALLOWED}/clients/")
        if problem:
            self.warn("auth.allow_list_refused", str(self.root), folder=str(self.root), reason=problem)
            return {}
        found: dict[bytes, list[tuple[str, Path]]] = {}
        for role, folder in ROLE_FOLDERS.items():
            d = self.root / folder
            try:
                if not d.is_dir():
                    continue
                if problem := writable_by_others(d):
                    self.warn("auth.allow_list_refused", str(d), folder=str(d), reason=problem)
                    continue
                files = sorted(d.glob("*.key"))
            except OSError as e:
                self.warn("auth.allow_list_unreadable", str(d), folder=str(d), reason=str(e))
                continue
            for path in files:
                public = self._public(path)
                if public is not None:
                    found.setdefault(public, []).append((f"{role}:{path.stem}", path))
        keys: dict[bytes, str] = {}
        for public, holders in found.items():
            if len(holders) == 1:
                keys[public] = holders[0][0]
                continue
            for _, path in holders:
                self._skip(path, f"the same key is also in {', '.join(str(p) for _, p in holders if p != path)}; a key has one role and one name")
        return keys

    def _public(self, path: Path) -> bytes | None:
        problem = None
        try:
            name, st = path.stem, path.lstat()
            if not stat.S_ISREG(st.st_mode):
                problem = "not a regular file"
            elif not (0 < len(name) <= 63) or not name.isprintable() or any(c.isspace() or c == ":" for c in name):
                problem = f"{name!r} is not a node or client name (1-63 characters, no spaces or ':')"
            else:
                problem = writable_by_others(path)
            if problem is None:
                return _read_certificate(path)[0]
        except KeysError as e:
            problem = str(e)
        except OSError as e:
            problem = e.strerror or str(e)
        self._skip(path, problem)
        return None

    def _skip(self, path: Path, reason: str) -> None:
        self.warn("auth.key_skipped", str(path), file=str(path), reason=reason)


def curve_client(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Make `sock` a CURVE client; call before connect()."""
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = keys.server_public


class CurveServer:
    """The coordinator's side: a CURVE server socket, a ZAP handler that admits only the allow-list
    and names each connection's role, name and key ("node:mac1:KEY": its User-Id, on every message
    it sends, so that `admits` can check each message against the allow-list as it is now), and a
    socket monitor that logs handshakes failing before ZAP is asked (a peer without keys, or with
    another pool's coordinator key). Create before bind(), inside the running event loop.

    Neither loop ever dies: a request the handler cannot answer (a bug, a file system error) is
    answered "500" and logged, so the handshakes after it go on."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: ServerKeys, log: Any) -> None:
        self.keys, self.log = keys, log
        self.zap = ctx.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)
        self.tasks: list[asyncio.Task[None]] = []
        self.monitor: zmq.asyncio.Socket | None = None
        self._throttle = Throttle(lines=1, every=REFUSAL_LOG_S)
        self.allowed = AllowList(keys.allowed_dir, self._warn)

    def refresh(self) -> None:
        """Look for changes to the allow-list (four stat calls, and a read if one changed): the
        coordinator calls it once per batch of messages it reads, before `admits` judges them."""
        self.allowed.refresh(recheck_s=RECHECK_S)

    def admits(self, user_id: str) -> bool:
        """Whether a message of the connection whose User-Id is `user_id` may be served: its key is
        still in the allow-list with the same role and name, as of the last `refresh` (a dict
        lookup: this runs for every message)."""
        role, name, key = user_parts(user_id)
        return self.allowed.holds(key.encode(), f"{role}:{name}")

    def apply(self, sock: zmq.asyncio.Socket, *, monitor: bool = True) -> None:
        """`monitor` False: the caller owns the socket's monitor (libzmq keeps one per socket; the
        coordinator's is protocol/peerbudget.py's) and hands its HANDSHAKE_EVENTS to `handshake_event`."""
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = b"dpool"
        self.tasks = [asyncio.create_task(self._drain(self.zap, self._on_zap))]
        if monitor:
            self.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
            self.tasks.append(asyncio.create_task(self._drain(self.monitor, self._on_event)))

    async def _drain(self, sock: zmq.asyncio.Socket, handle: Callable[[zmq.Socket[Any], list[bytes]], None]) -> None:
        """Every message on `sock`, read until EAGAIN after each wake-up. The poll has a timeout
        because ZeroMQ's descriptor is edge-triggered: an event that arrives while the loop is busy
        elsewhere would otherwise wait for the next one."""
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        while True:
            await sock.poll(500)
            for frames in pending(raw, frames=None):  # from libzmq itself: a ZAP request has 7 frames
                try:
                    handle(raw, frames)
                except Exception as e:  # logged; the next request is served
                    self._warn("auth.handler_failed", type(e).__name__, error=f"{type(e).__name__}: {str(e)[:300]}")

    def _on_zap(self, zap: zmq.Socket[Any], frames: list[bytes]) -> None:
        zap.send_multipart(zap_answer(frames, self._zap_reply, self._warn))

    def _zap_reply(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:  # not a ZAP request: libzmq never sends one, answer it anyway
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *creds = frames
        peer, who = address.decode(errors="replace"), None
        if mechanism == b"CURVE" and len(creds) == 1:
            key = z85.encode(creds[0])
            who = self.allowed.get(key)
            if who is None:
                self._warn("auth.refused", f"{peer} {key!r}", peer=peer, key=key.decode(), reason=f"public key not in {self.keys.allowed_dir}/{{nodes,clients,viewers}}")
        else:
            self._warn("auth.refused", "not curve", peer=peer, mechanism=mechanism.decode(errors="replace"), reason="not CURVE")
        if who is None:
            return [version, request_id, b"400", b"public key not allowed", b"", b""]
        return [version, request_id, b"200", b"OK", f"{who}:{key.decode()}".encode(), b""]

    def _on_event(self, _mon: zmq.Socket[Any], frames: list[bytes]) -> None:
        self.handshake_event(parse_monitor_message(frames))

    def handshake_event(self, event: Any) -> None:
        """A failed handshake, as the socket's monitor told it: logged with its reason."""
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # the ZAP handler logged it, with the key
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # the peer hung up mid-handshake: what a peer without keys often does when it sees the
            # mismatch first (which side notices first is a race)
            reason = HANDSHAKE_DROPPED
        else:
            reason = HANDSHAKE_REASONS.get(int(event["value"]), f"CURVE handshake failed (ZMTP error {event['value']:#x})")
        self._warn("auth.handshake_failed", reason, endpoint=event["endpoint"].decode(errors="replace"), reason=reason)

    def _warn(self, event: str, what: str, **fields: Any) -> None:
        """One line per `what` every REFUSAL_LOG_S, with the count of those held back: a refused
        peer retries every 100 ms and must not flood the log."""
        held = self._throttle.allow(what, time.monotonic())
        if held is not None:
            self.log.warning(event, repeated=held, **fields)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.monitor is not None:
            self.monitor.close(linger=0)
        self.zap.close(linger=0)
