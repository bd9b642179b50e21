"""Viewer tokens: the dashboard's HTTP credential, issued and revoked like the pool's other keys.

`dpctl keys add-viewer NAME` makes viewer NAME's CURVE pair (read-only on the control plane) and a
token, `dpv1.NAME.SECRET` (32 random bytes), written in three places:

    DIR/viewer-NAME.token               0600, the token (on the machine that holds the pool's keys)
    DIR/bundles/NAME/viewer.token       0600, the same, for the viewer to take away
    DIR/allowed/viewers/NAME.token      its SHA-256, beside NAME.key: what the dashboard checks

A token is accepted while `NAME.token` holds its hash and `NAME.key` is there, so deleting the
viewer's key file (the way any key is revoked) revokes its token too, at the next request, with no
restart; deleting NAME.token revokes the token alone. The secret is 256 random bits, so one SHA-256
(no salt, no stretching) is enough; the comparison takes constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import tempfile
from pathlib import Path

from dpool.protocol.payloads import NODE_NAME_PATTERN

PREFIX = "dpv1"
# The viewer's name as `dpctl keys` names it (dots too: the secret after the last dot has none)
TOKEN_RE = re.compile(rf"dpv1\.({NODE_NAME_PATTERN})\.([A-Za-z0-9_-]{{43}})")
HASH_PREFIX = "sha256:"


def new_token(name: str) -> str:
    return f"{PREFIX}.{name}.{secrets.token_urlsafe(32)}"


def digest(token: str) -> str:
    return HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def write_hash(folder: Path, name: str, token: str) -> Path:
    """`folder/NAME.token` holding the token's hash, written by rename (a reader sees the old
    file or the new one)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    dest = folder / f"{name}.token"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
    try:
        os.write(fd, (digest(token) + "\n").encode())
    finally:
        os.close(fd)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)
    return dest


def write_secret(path: Path, token: str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return path


class Tokens:
    """The viewers' token hashes in `folder` (the pool's allowed/viewers/, or a copy), read at
    every check: two small files, so a revocation holds at the next request."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def viewer(self, token: str) -> str | None:
        """The viewer a token belongs to, or None: malformed, unknown, or revoked."""
        found = TOKEN_RE.fullmatch(token.strip()) if len(token) < 200 else None
        if found is None:
            return None
        name = found.group(1)
        try:
            if not (self.folder / f"{name}.key").is_file():
                return None  # the viewer's key was removed: revoked
            stored = (self.folder / f"{name}.token").read_text(errors="replace").strip()
        except OSError:
            return None
        return name if hmac.compare_digest(stored.encode(), digest(token.strip()).encode()) else None
