"""What one peer may have queued in a dpd, in bytes, each way; a peer past it is dropped.

ZeroMQ bounds a peer's queues in messages (HWM: 1,000 each way) and each frame in bytes
(ZMQ_MAXMSGSIZE), never the bytes of a queue or of a whole message, so one connection could pin
hundreds of megabytes of a ROUTER's memory, two ways:
- a client that asks and never reads: its replies wait in the ROUTER's outbound queue (256
  requests for 1 MiB sample pages grew the coordinator by 263 MiB, and it stayed);
- a peer that sends a multipart message and never its last frame: libzmq holds an unfinished
  message's frames until it ends, out of the reader's sight (libzmq's v2_decoder.cpp compares
  ZMQ_MAXMSGSIZE with each frame's size, and a pipe shows a message to the reader only once its
  last frame is written: 256 parts of 1 MiB grew the coordinator by 257 MiB).

Neither queue shows through ZeroMQ's API, but each is a difference of two byte counts:
- out: the bytes of the messages the loop queued for a connection, less those the peer's TCP has
  acknowledged (the kernel's count: TCP_INFO's tcpi_bytes_acked on Linux; on macOS
  TCP_CONNECTION_INFO's bytes sent once, tcpi_txbytes - tcpi_txretransmitbytes);
- in: the bytes the kernel received on the connection (tcpi_bytes_received, tcpi_rxbytes), less
  those of the whole messages the loop read from it, each frame counted as it travelled
  (`wire_size`: its ZMTP header, and with CURVE its box).
Each message read names its connection (ZMQ_SRCFD), and a socket monitor tells when one is
accepted and when it closes. A connection whose count passes `budget` (PEER_BYTES) is dropped:
its TCP socket is shut down under libzmq, which closes it and frees its queues, and a log line
`peer.dropped` names it (address, direction, bytes). Outbound is checked as the loop sends (the
kernel is asked once per `budget` bytes sent to one peer). Inbound is checked by a thread, since an
unfinished message wakes no reader: it reads the process's resident memory every SAMPLE_S and
looks at every connection once memory has grown by TRIGGER since it last looked, and every SCAN_S
regardless. A fast sender adds at most one sample's worth before it is seen.

Freed memory is then given back to the system (glibc keeps what is freed in its arenas:
`malloc_trim`), so a dpd shrinks back once such a peer is gone.

Limits, by construction: the counts are per file descriptor, and a descriptor's count starts when
the monitor's accept event is seen, a few milliseconds after the accept; messages still queued from
the connection a descriptor had before are counted to the next, so a peer can hold up to twice the
budget, never more. Counts that cannot be right (more taken or read than sent or received: another
kernel's layout) turn that direction's check off with a `peer_budget.off` line rather than drop
every peer.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import dataclasses
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

PEER_BYTES = 32 << 20  # queued per peer, each way: eight of the largest messages the protocol sends
TRIGGER = 8 << 20  # resident memory grown by this since the last look: look at every connection
SAMPLE_S = 0.005  # how often the resident memory is read
SCAN_S = 0.25  # every connection is looked at this often in any case
TRIM_FOR_S = 10.0  # after a drop: memory is given back every TRIM_EVERY_S for this long (a dropped
TRIM_EVERY_S = 0.5  # connection's queues are freed when the loop next touches its socket, soon but not at once)
SLACK = 1 << 20  # counts off by more than this (the wrong way) are not the kernel's as read: the check is off
ROUTES_KEPT = 65536  # routing id -> connection, for the newest peers (a stale one costs nothing)
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def wire_size(size: int, curve: bool) -> int:
    """The bytes a frame of `size` bytes takes on a ZMTP 3 connection: a 1- or 8-byte length after
    its flags; with CURVE each frame travels as a MESSAGE command holding its nonce, its box's MAC
    and its flags (8 + 8 + 16 + 1 bytes more; libzmq's curve_mechanism_base.cpp)."""
    if curve:
        size += 33
    return size + (2 if size <= 255 else 9)


# -- the kernel's counts of a TCP connection ---------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
if sys.platform == "darwin":
    _TCP_OPT, _INFO_LEN = 0x106, 112  # TCP_CONNECTION_INFO, struct tcp_connection_info


    def _counts(info: bytes) -> tuple[int, int]:
        tx, retx, _, rx = struct.unpack_from("=QQQQ", info, 64)  # txbytes, txretransmitbytes, rxpackets, rxbytes
        return rx, tx - retx
else:
    _TCP_OPT, _INFO_LEN = 11, 136  # TCP_INFO, struct tcp_info up to tcpi_bytes_received (Linux 4.1)


    def _counts(info: bytes) -> tuple[int, int]:
        acked, received = struct.unpack_from("=QQ", info, 120)  # tcpi_bytes_acked, tcpi_bytes_received
        return received, acked


def tcp_counts(fd: int) -> tuple[int, int] | None:
    """(bytes received, bytes the peer has taken) of the TCP connection on `fd`; None when `fd` is
    no TCP socket or the kernel does not count them."""
    buf = ctypes.create_string_buffer(_INFO_LEN)
    size = ctypes.c_uint32(_INFO_LEN)
    if _libc.getsockopt(fd, socket.IPPROTO_TCP, _TCP_OPT, buf, ctypes.byref(size)) != 0 or size.value < _INFO_LEN:
        return None
    return _counts(buf.raw)


def peer_of(fd: int) -> str | None:
    """The remote "address:port" of socket `fd`, or None."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        host, port, *_ = s.getpeername()
        return f"{host}:{port}"
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def shut(fd: int, peer: str) -> bool:
    """Shut down the TCP connection on `fd` if it still goes to `peer` (the number may have been
    given to another connection since): libzmq then sees it end, closes it and frees its queues."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        host, port, *_ = s.getpeername()
        if f"{host}:{port}" != peer:
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except (OSError, ValueError):
        return False
    finally:
        s.close()


def trim() -> None:
    """Give freed memory back to the system where the allocator keeps it (glibc's arenas)."""
    with contextlib.suppress(AttributeError, OSError):
        if sys.platform == "darwin":
            _libc.malloc_zone_pressure_relief(None, 0)
        else:
            _libc.malloc_trim(0)


def _rss_reader() -> Callable[[], int]:
    if sys.platform.startswith("linux"):
        fd, page = os.open("/proc/self/statm", os.O_RDONLY), os.sysconf("SC_PAGE_SIZE")
        return lambda: int(os.pread(fd, 128, 0).split()[1]) * page
    import psutil

    me = psutil.Process()
    return lambda: int(me.memory_info().rss)


# -- the budget ----------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Conn:
    """One accepted connection, by its file descriptor. The loop's counts of bytes read and sent
    are per descriptor over its whole life: a connection's are those less what they were when the
    descriptor's previous connection closed (not when the accept was seen: the loop may have read
    its first messages before the monitor's event reached the guard, and they are this one's)."""

    fd: int
    peer: str
    read0: int
    sent0: int
    taken: int = 0  # bytes the peer had taken when the kernel was last asked (the loop's thread)
    inbound: int = 0  # in flight at the last look (the guard's thread)
    dropped: bool = False
    # The routing ids read from it (one; two when the next connection on this descriptor was read
    # before its accept was seen). Once it is dropped, only these are refused: a new connection
    # that got the same descriptor is served before the monitor's events say so.
    rids: set[bytes] = dataclasses.field(default_factory=set)


class PeerBudget:
    """The per-peer byte budget of one listening ROUTER. Made before the socket binds (its monitor
    must see every connection); the loop calls `read` for each message it reads and sends through
    `send`; `close` before the socket closes."""

    def __init__(
        self, ctx: zmq.Context[Any], sock: zmq.Socket[Any], log: Any, *, curve: bool, budget: int = PEER_BYTES,
        name_of: Callable[[bytes], str | None] | None = None, events: int = 0, on_event: Callable[[Any], None] | None = None,
    ) -> None:
        """`name_of`: a routing id's node name, for the log line. libzmq gives a socket one monitor,
        and this is it: `events` more are handed to `on_event` (on this budget's thread)."""
        self.log, self.curve, self.budget = log, curve, budget
        self.name_of = name_of or (lambda rid: None)
        self.on_event = on_event
        self.conns: dict[int, Conn] = {}  # written by the guard's thread
        self.read_bytes: dict[int, int] = collections.defaultdict(int)  # fd -> bytes of whole messages read (the loop's thread)
        self.sent_bytes: dict[int, int] = collections.defaultdict(int)  # fd -> bytes of messages queued (the loop's thread)
        self.routes: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # routing id -> fd (the loop's thread)
        self.closed: dict[int, tuple[int, int]] = {}  # fd -> (read, sent) when its last connection closed (the guard's thread)
        self.dropped = 0
        self.off: set[str] = set()  # "inbound", "outbound": the kernel's counts proved unusable here
        self.freed = threading.Event()  # a drop, or a connection gone with much queued: give memory back
        self.rss = _rss_reader()
        address = f"inproc://dpool-peer-budget-{id(self):x}"
        sock.monitor(address, EVENTS | events)
        self.sock = sock
        self.monitor: zmq.Socket[bytes] = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.monitor.connect(address)  # before the socket binds: no connection goes unseen
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._guard, name="peer-budget", daemon=True)
        self.thread.start()

    # -- the loop's side ------------------------------------------------------------------------------

    def read(self, rid: bytes, fd: int | None, wire: int) -> bool:
        """A whole message of `wire` bytes was read from connection `fd` (routing id `rid`). False:
        the connection was dropped, and the message is not to be served (its reply would be
        dropped too: the work and the memory are spared)."""
        if fd is None or fd < 0:
            return True
        self.read_bytes[fd] += wire
        if self.routes.get(rid) != fd:
            self.routes[rid] = fd
            self.routes.move_to_end(rid)
            if len(self.routes) > ROUTES_KEPT:
                self.routes.popitem(last=False)
        conn = self.conns.get(fd)
        if conn is None:
            return True
        if conn.dropped:
            return rid not in conn.rids
        conn.rids.add(rid)
        return True

    def send(self, raw: zmq.Socket[Any], frames: list[bytes]) -> bool:
        """Queue a message (routing id first) for its peer, unless the peer has more than the
        budget queued already: then it is dropped. False when nothing was queued (a peer gone, full
        or dropped: a ROUTER never blocks)."""
        fd = self.routes.get(frames[0])
        conn = self.conns.get(fd) if fd is not None else None
        if conn is not None and frames[0] not in conn.rids:
            conn = None  # a new connection on a descriptor whose accept the monitor has not told yet
        box = 33 if self.curve else 0  # wire_size, inline: this runs for every message sent
        size = 0
        for f in frames[1:]:
            n = len(f) + box
            size += n + (2 if n <= 255 else 9)
        if conn is not None and "outbound" not in self.off:
            if conn.dropped:
                return False
            queued = self.sent_bytes[conn.fd] - conn.sent0 + size - conn.taken
            if queued > self.budget and (counts := tcp_counts(conn.fd)) is not None:
                conn.taken = counts[1]  # the kernel is asked once per `budget` bytes sent to a peer that reads
                queued = self.sent_bytes[conn.fd] - conn.sent0 + size - conn.taken
                if queued < -SLACK:  # it took more than was ever sent to it: counts this kernel does not keep as assumed
                    self._off("outbound", f"a peer took {-queued} bytes more than were sent to it")
                    queued = 0
            if queued > self.budget:
                self._drop(conn, "outbound", queued, frames[0])
                return False
        try:
            raw.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; EAGAIN: its queue is full (HWM)
            return False
        if fd is not None:
            self.sent_bytes[fd] += size
        return True

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()

    # -- the guard's thread ---------------------------------------------------------------------------

    def _guard(self) -> None:
        low = self.rss()
        next_scan = trim_until = last_trim = 0.0
        try:
            while not self.stopping.is_set():
                if self.monitor.poll(int(SAMPLE_S * 1000)):
                    while self.monitor.poll(0):
                        if self._event(self.monitor.recv_multipart()):
                            self.freed.set()
                rss, now = self.rss(), time.monotonic()
                low = min(low, rss)
                if rss - low >= TRIGGER or now >= next_scan:
                    if self._scan():
                        self.freed.set()
                    low, next_scan = rss, now + SCAN_S
                if self.freed.is_set():
                    self.freed.clear()
                    trim_until = now + TRIM_FOR_S
                if now < trim_until and now - last_trim >= TRIM_EVERY_S:
                    trim()
                    last_trim = now
                    low = min(low, self.rss())
        except Exception as e:  # never the loop's end: the budget is off, and it says so
            self.log.error("peer_budget.failed", error=f"{type(e).__name__}: {e}", exc_info=e)
        finally:
            self.monitor.close(linger=0)

    def _event(self, frames: list[bytes]) -> bool:
        """A monitor event: a connection accepted or gone. True when a trim is due (a connection
        that had much queued has closed)."""
        event = parse_monitor_message(frames)
        if not event["event"] & EVENTS:
            if self.on_event is not None:
                self.on_event(event)
            return False
        fd = int(event["value"])
        if event["event"] == zmq.EVENT_ACCEPTED:
            peer = peer_of(fd)
            if peer is not None:
                read0, sent0 = self.closed.get(fd, (0, 0))
                self.conns[fd] = Conn(fd, peer, read0, sent0)
            return False
        # Any connection's end (TCP or not, counted or not): where a later one on this fd starts.
        self.closed[fd] = (self.read_bytes.get(fd, 0), self.sent_bytes.get(fd, 0))
        conn = self.conns.pop(fd, None)
        if conn is None:
            return False
        queued = self.sent_bytes.get(fd, 0) - conn.sent0 - conn.taken
        return conn.dropped or conn.inbound > (1 << 20) or queued > (1 << 20)

    def _scan(self) -> bool:
        """Look at every connection's inbound bytes in flight; True when one was dropped."""
        dropped = False
        for conn in list(self.conns.values()):
            counts = tcp_counts(conn.fd)
            if counts is None or conn.dropped or "inbound" in self.off:
                continue
            conn.inbound = counts[0] - (self.read_bytes.get(conn.fd, 0) - conn.read0)
            if conn.inbound < -2 * self.budget:  # more read than received (beyond what a reused descriptor explains)
                self._off("inbound", f"{-conn.inbound} bytes more were read from a peer than the kernel says it received")
                continue
            if conn.inbound > self.budget:
                self._drop(conn, "inbound", conn.inbound, None)
                dropped = True
        return dropped

    def _off(self, direction: str, why: str) -> None:
        """Stop checking one direction: the kernel's counts do not mean what this module reads
        them as (another kernel's layout), and a wrong count must not drop every peer."""
        self.off.add(direction)
        self.log.error("peer_budget.off", direction=direction, reason=why, platform=sys.platform)

    def _drop(self, conn: Conn, direction: str, queued: int, rid: bytes | None) -> None:
        if not shut(conn.fd, conn.peer):
            return
        conn.dropped = True
        self.dropped += 1
        self.freed.set()
        name = self.name_of(rid) if rid is not None else None
        why = "replies it does not read" if direction == "outbound" else "a message it does not finish"
        self.log.warning(
            "peer.dropped", peer=conn.peer, direction=direction, bytes=queued, budget=self.budget,
            **({"node": name} if name else {}), **({"routing_id": rid.hex()} if rid else {}),
            reason=f"{queued} bytes queued {'to' if direction == 'outbound' else 'from'} it ({why}), budget {self.budget}",
        )
