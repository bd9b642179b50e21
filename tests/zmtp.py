"""A ZeroMQ peer written by hand over a plain TCP socket: ZMTP 3.0 with the NULL mechanism (RFC 23),
so a test can send what libzmq never would, such as a multipart message whose last frame never
comes. Greeting, READY, then frames (flags byte, size, body); no CURVE (tests run the coordinator
without keys on loopback)."""

from __future__ import annotations

import socket
import struct

MORE, LONG, COMMAND = 0x01, 0x02, 0x04


def greeting() -> bytes:
    """Signature, version 3.0, mechanism NULL, as-server 0, filler: 64 bytes."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def frame_header(size: int, *, more: bool = False, command: bool = False) -> bytes:
    flags = (MORE if more else 0) | (COMMAND if command else 0)
    if size > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", size)
    return bytes([flags, size])


def frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    return frame_header(len(body), more=more, command=command) + body


def ready(socket_type: bytes = b"DEALER") -> bytes:
    """The READY command with one property, Socket-Type."""
    name = b"Socket-Type"
    return frame(b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type, command=True)


class RawPeer:
    """A TCP connection to `host:port` that has done the ZMTP handshake as a DEALER."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.sendall(greeting() + ready())
        self._read_exactly(64)  # the server's greeting; its READY follows and is never read

    def _read_exactly(self, n: int) -> bytes:
        got = b""
        while len(got) < n:
            chunk = self.sock.recv(n - len(got))
            if not chunk:
                raise ConnectionError("closed during the handshake")
            got += chunk
        return got

    def send_parts(self, count: int, size: int) -> int:
        """`count` frames of `size` bytes, each with MORE set (so the message never ends); the
        bytes sent before the other end closed the connection."""
        part = b"\x00" * size
        header = frame_header(size, more=True)
        sent = 0
        try:
            for _ in range(count):
                self.sock.sendall(header + part)
                sent += len(header) + size
        except OSError:  # reset or broken pipe: the server closed the connection
            pass
        return sent

    def closed_by_peer(self, timeout: float = 10.0) -> bool:
        """Whether the server closed the connection (reading gives end of file or a reset)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass  # its READY, then the end
        except TimeoutError:
            return False
        except OSError:
            return True
        return True

    def close(self) -> None:
        self.sock.close()
