"""CURVE on the control plane: the key directory `dpctl keys init` writes, and the sockets that use it.

Layout of a key directory (protocol/README.md, "Security"):

    DIR/coordinator.key          the coordinator's public key (every node and client needs it)
    DIR/coordinator.key_secret   its secret key (only the daemon that serves needs it)
    DIR/node.key[_secret]        the daemons' pair; `node-NAME.key_secret` is preferred by node NAME
    DIR/client.key[_secret]      dpctl's pair
    DIR/allowed/*.key            the allow-list: public keys the coordinator accepts

Secret files are 0600 and refused when group or others can read them (as ssh does). The coordinator
re-reads `allowed/` on every handshake, so deleting a key file revokes it for new connections.
The ipc socket between a daemon and its trainers stays plain: it is local and protected by the
state directory's permissions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from dpool.protocol.logs import Throttle
from dpool.protocol.sockets import pending

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
ALLOWED = "allowed"
KEYS_ENV = "DPOOL_KEYS"
REFUSAL_LOG_S = 10.0
HANDSHAKE_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "the peer does not use CURVE (a dpd or dpctl without --keys)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "the peer's CURVE handshake does not decrypt (it holds another pool's coordinator.key)",
}
HANDSHAKE_DROPPED = "the peer closed the connection during the CURVE handshake (a dpd or dpctl without --keys?)"
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


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


def _load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(f"{path}: cannot read a CURVE public key ({e}); make keys with `dpctl keys init DIR`") from None
    return public


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise KeysError(f"{path}: {e.strerror}; make keys with `dpctl keys init DIR`") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeysError(f"{path}: secret key readable by others (mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}`")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeysError(f"{path}: cannot read a CURVE key pair ({e})") from None
    if secret is None:
        raise KeysError(f"{path}: holds no secret key")
    return public, secret


def keys_dir(flag: str | None, config: str | None = None) -> Path | None:
    """The key directory: the flag, else $DPOOL_KEYS, else the config file's `keys`, else none."""
    chosen = flag or os.environ.get(KEYS_ENV) or config
    return Path(chosen).expanduser().absolute() if chosen else None


def client_keys(directory: Path, role: str, name: str | None = None) -> ClientKeys:
    """The pair for `role` ("node" or "client"); `ROLE-NAME` is preferred when it exists."""
    if not directory.is_dir():
        raise KeysError(f"{directory}: no such key directory; make one with `dpctl keys init {directory}`")
    path = directory / f"{role}.key_secret"
    if name and (directory / f"{role}-{name}.key_secret").exists():
        path = directory / f"{role}-{name}.key_secret"
    public, secret = _load_secret(path)
    return ClientKeys(public=public, secret=secret, server_public=_load_public(directory / "coordinator.key"), source=str(path))


def server_keys(directory: Path) -> ServerKeys:
    if not directory.is_dir():
        raise KeysError(f"{directory}: no such key directory; make one with `dpctl keys init {directory}`")
    public, secret = _load_secret(directory / "coordinator.key_secret")
    allowed = directory / ALLOWED
    if not allowed.is_dir():
        raise KeysError(f"{allowed}: no allow-list directory (public keys of nodes and clients); `dpctl keys init` makes it")
    return ServerKeys(public=public, secret=secret, allowed_dir=allowed)


def allowed_keys(allowed_dir: Path) -> dict[bytes, str]:
    """z85 public key -> its file's stem, for every readable key file in the allow-list."""
    out: dict[bytes, str] = {}
    for path in sorted(allowed_dir.glob("*.key")):
        with contextlib.suppress(OSError, ValueError):
            public, _ = zmq.auth.load_certificate(path)
            out[public] = path.stem
    return out


def curve_client(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Make `sock` a CURVE client; call before connect()."""
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = keys.server_public


class CurveServer:
    """The coordinator's side: a CURVE server socket, a ZAP handler that admits only the allow-list,
    and a socket monitor that logs handshakes failing before ZAP is asked (a peer without keys, or
    with another pool's coordinator key). Create before bind(), inside the running event loop."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: ServerKeys, log: Any) -> None:
        self.keys, self.log = keys, log
        self.zap = ctx.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)
        self.tasks: list[asyncio.Task[None]] = []
        self.monitor: zmq.asyncio.Socket | None = None
        self._throttle = Throttle(lines=1, every=REFUSAL_LOG_S)

    def apply(self, sock: zmq.asyncio.Socket) -> None:
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.zap_domain = b"dpool"
        self.monitor = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.tasks = [asyncio.create_task(self._drain(self.zap, self._on_zap)), asyncio.create_task(self._drain(self.monitor, self._on_event))]

    async def _drain(self, sock: zmq.asyncio.Socket, handle: Any) -> None:
        """Every message on `sock`, read until EAGAIN after each wake-up. The poll has a timeout
        because ZeroMQ's descriptor is edge-triggered: an event that arrives while the loop is busy
        elsewhere would otherwise wait for the next one."""
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        while True:
            await sock.poll(500)
            for frames in pending(raw, frames=None):  # from libzmq itself: a ZAP request has 7 frames
                handle(raw, frames)

    def _on_zap(self, zap: zmq.Socket[Any], frames: list[bytes]) -> None:
        if len(frames) < 6:  # not a ZAP request: libzmq never sends one, answer it anyway
            zap.send_multipart([b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"bad request", b"", b""])
            return
        version, request_id, _domain, address, _identity, mechanism, *creds = frames
        peer, ok, who = address.decode(errors="replace"), False, ""
        if mechanism == b"CURVE" and len(creds) == 1:
            key = z85.encode(creds[0])
            who = allowed_keys(self.keys.allowed_dir).get(key, "")
            ok = bool(who)
            if not ok:
                self._warn("auth.refused", f"{peer} {key!r}", peer=peer, key=key.decode(), reason=f"public key not in {self.keys.allowed_dir}")
        else:
            self._warn("auth.refused", "not curve", peer=peer, mechanism=mechanism.decode(errors="replace"), reason="not CURVE")
        status = [b"200", b"OK"] if ok else [b"400", b"public key not allowed"]
        zap.send_multipart([version, request_id, *status, who.encode(), b""])

    def _on_event(self, _mon: zmq.Socket[Any], frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
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
