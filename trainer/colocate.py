"""Ranks that share a machine: split its cores between their BLAS threads, keep the ring's waits
from spinning, and let the ranks wait for each other asleep before the step's all_sum.

Co-located ranks fight (3 ranks of the demo GPT on 2 cores, BENCHMARKS.md "Ranks that share a
machine"). Each rank's OpenBLAS starts one thread per core, so 3 ranks run 6 BLAS threads on 2
cores. And MLX's ring backend busy-polls its sockets while a rank waits in `all_sum`
(mlx/distributed/ring/ring.cpp: one `SocketThread` per socket loops on non-blocking send/recv), so
a rank that finished its share burns a core that a peer still computing needs, and during the
all_sum itself six spinning threads share two cores: the demo's 3.4 MB all_sum of 3 local ranks
entering it together took 56 to 123 ms, against 4 to 9 ms with a shim that sleeps 50 us whenever a
socket would block. So:

- `split_blas_threads`: each rank's OpenBLAS gets max(1, cores // ranks on this machine) threads,
  set at run time (`openblas_set_num_threads`), because a warm trainer imports MLX, and with it
  loads OpenBLAS, before it learns its rank and hostfile.
- `quiet_ring`: when every rank of the group is on this machine, the ring's sockets become blocking
  with a 1 ms timeout, and all_sums go one way round the ring (`one_way_bytes`): a waiting socket
  thread sleeps in the kernel until its data comes (5 to 12 ms for that all_sum).
- `LocalBarrier`: before the step's all_sum, co-located ranks wait for each other in a blocking
  `recv` on a Unix-domain socket, so none of them spins in the ring while a neighbour computes
  (the only remedy where some of the ring's sockets lead to other machines).

Co-located means: the ranks whose address in the ring hostfile (MLX_HOSTFILE, as `mlx.launch
--backend ring` writes it: a JSON list of ["host:port", ...] per rank) names the same host.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dpool.trainer.blas import MARK

THREADS_ENV = "DPOOL_BLAS_THREADS"  # an explicit per-rank BLAS thread count (wins over the split)
BARRIER_ENV = "DPOOL_LOCAL_BARRIER"  # "0" turns the barrier off (benchmarks, and to compare)
QUIET_ENV = "DPOOL_QUIET_RING"  # "0" leaves the ring's sockets and all_sums as MLX makes them
# Setting up the barrier waits at most this long for co-located peers: they are past the ring's
# start-up already (that is what returned before we got here), so only a dead peer takes this long.
JOIN_TIMEOUT_S = 60.0


def host_of(address: str) -> str:
    """The host of a hostfile entry: "10.0.0.2:5000" -> "10.0.0.2", "[::1]:5000" -> "[::1]"."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"hostfile entry {address!r}: expected host:port")
    return host


def split_address(address: str) -> tuple[str, int]:
    """A hostfile entry as a socket address: "10.0.0.2:5000" -> ("10.0.0.2", 5000), "[::1]:5000"
    -> ("::1", 5000)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class RingSetupError(ValueError):
    """MLX_RANK or MLX_HOSTFILE as given cannot form a group (bad input: exit 2, naming it)."""


def read_hostfile(path: str) -> list[list[str]]:
    """The ring hostfile: one list of "host:port" addresses per rank."""
    try:
        with open(path, "rb") as f:
            hosts = json.load(f)
    except (OSError, ValueError) as e:
        raise RingSetupError(f"MLX_HOSTFILE {path}: cannot read the ring hostfile ({e})") from None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, list) and h and all(isinstance(a, str) for a in h) for h in hosts):
        raise RingSetupError(f"MLX_HOSTFILE {path}: expected a JSON list of [\"host:port\", ...] per rank, got {hosts!r:.200}")
    return hosts


def colocated(hosts: Sequence[Sequence[str]], rank: int) -> list[int]:
    """The ranks on this rank's machine (itself included), in rank order. A rank's addresses all
    belong to one machine, so its first one names it."""
    mine = host_of(hosts[rank][0])
    return [r for r, addrs in enumerate(hosts) if host_of(addrs[0]) == mine]


def usable_cores() -> int:
    """The cores this process may run on (a `taskset` or cgroup cpuset counts, unlike cpu_count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def split_threads(cores: int, ranks_here: int) -> int:
    """BLAS threads per rank when `ranks_here` ranks share `cores` cores: never below one."""
    return max(1, cores // max(1, ranks_here))


def _openblas() -> Any | None:
    """The OpenBLAS this process already runs (the one trainer/blas.py preloaded, or any other
    loaded with global symbols), or None: the bundled reference BLAS, Accelerate on macOS."""
    preloaded = os.environ.get(MARK)
    if preloaded:
        with contextlib.suppress(OSError):
            # RTLD_NOLOAD: the already loaded copy, never a second one that nothing calls.
            lib = ctypes.CDLL(preloaded, mode=os.RTLD_NOLOAD)
            if hasattr(lib, "openblas_set_num_threads"):
                return lib
    glob = ctypes.CDLL(None)
    return glob if hasattr(glob, "openblas_set_num_threads") else None


def set_blas_threads(n: int) -> int | None:
    """Set this process's OpenBLAS thread count; returns the count now in effect, None without one."""
    lib = _openblas()
    if lib is None:
        return None
    lib.openblas_set_num_threads(ctypes.c_int(n))
    lib.openblas_get_num_threads.restype = ctypes.c_int
    return int(lib.openblas_get_num_threads())


def split_blas_threads(ranks_here: int, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Give this rank its share of the machine's cores for BLAS; returns what was chosen (logged).

    An explicit choice wins: DPOOL_BLAS_THREADS=N sets N, and OPENBLAS_NUM_THREADS (read by OpenBLAS
    when it loads) is left alone. A rank alone on its machine keeps OpenBLAS's own default."""
    explicit = env.get(THREADS_ENV, "").strip()
    if explicit:
        if not explicit.isdigit() or int(explicit) < 1:
            return {"blas_threads": None, "blas_threads_from": f"{THREADS_ENV}={explicit!r} is not a positive integer: ignored"}
        want, source = int(explicit), THREADS_ENV
    elif env.get("OPENBLAS_NUM_THREADS"):
        return {"blas_threads": env["OPENBLAS_NUM_THREADS"], "blas_threads_from": "OPENBLAS_NUM_THREADS"}
    elif ranks_here <= 1:
        return {"blas_threads": None, "blas_threads_from": "OpenBLAS default (alone on this machine)"}
    else:
        cores = usable_cores()
        want, source = split_threads(cores, ranks_here), f"{cores} cores / {ranks_here} ranks"
    got = set_blas_threads(want)
    if got is None:
        return {"blas_threads": None, "blas_threads_from": f"no OpenBLAS loaded ({source} not applied)"}
    return {"blas_threads": got, "blas_threads_from": source}


# MLX's ring all_sum (ring.cpp) runs both ways round the ring at once when a buffer holds at least
# 2 * world * 256 KiB: then each socket thread both sends and receives, and a blocking receive
# would hold up its send. Below that size each socket only sends or only receives.
MLX_MIN_SEND = 262_144


def one_way_bytes(world: int) -> int:
    """The largest buffer MLX's ring all_sum sends one way round a ring of `world` ranks."""
    return 2 * world * MLX_MIN_SEND - 1


def quiet_ring(hosts: Sequence[Sequence[str]], rank: int, timeout_s: float = 0.001) -> int:
    """Make this rank's ring sockets blocking, with a `timeout_s` timeout on each send and receive;
    returns how many it changed (its left and right neighbours': 2 per address).

    MLX's socket threads treat a timed-out call like a non-blocking one that would block (EAGAIN:
    try again), so nothing else changes; the timeout is what keeps a thread that has both a send and
    a receive queued (an all_sum two ways round) from waiting on one while the other could go. The
    sockets are found by address: the left neighbour's connection was accepted on this rank's
    address, the right neighbour's leads to its address. A socket MLX left blocking is left alone
    (an MLX that does not poll)."""
    mine, right = _endpoints(hosts[rank]), _endpoints(hosts[(rank + 1) % len(hosts)])
    timeout = struct.pack("@ll", int(timeout_s), int(timeout_s % 1 * 1e6))  # struct timeval
    changed = 0
    for fd in _open_fds():
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue  # not a socket
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            if s.getsockname()[:2] not in mine and s.getpeername()[:2] not in right:
                continue
            if os.get_blocking(fd):
                continue
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
            os.set_blocking(fd, True)
            changed += 1
        except OSError:
            continue  # a listening or unconnected socket has no peer
        finally:
            s.detach()  # the fd stays MLX's
    return changed


def _endpoints(addresses: Sequence[str]) -> set[tuple[str, int]]:
    """The (ip, port) pairs a rank's hostfile addresses resolve to, as sockets report them."""
    out = set()
    for a in addresses:
        host, port = split_address(a)
        with contextlib.suppress(OSError):
            for *_, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                out.add((str(addr[0]), int(addr[1])))
    return out


def _open_fds() -> list[int]:
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def barrier_address(hosts: Sequence[Sequence[str]]) -> str:
    """Where the co-located ranks of this group meet, the same for all of them and for no other
    group: named after the hostfile's content. The hostfile holds the ring ports of this
    generation, and the ring keeps its ports bound (its accepted sockets) while the group lives, so
    no other live group, of this job or another, on this machine has the same hostfile. Linux: an
    abstract socket (no file; it goes when the leader's socket closes). Elsewhere: a file under the
    temp folder, removed once every member has connected."""
    digest = hashlib.sha256(json.dumps(hosts, separators=(",", ":")).encode()).hexdigest()
    if sys.platform == "linux":
        return f"\0dpool-colocated-{digest[:32]}"
    folder = tempfile.gettempdir()
    if len(folder) > 70:  # sun_path holds 104 bytes on macOS
        folder = "/tmp"
    return os.path.join(folder, f"dpool-{digest[:16]}.sock")


class LocalBarrier:
    """A barrier for the ranks of a group that share a machine, waited in blocking calls.

    The leader (the lowest co-located rank) listens; every other rank connects and says its rank.
    `wait()`: each member sends one byte and blocks until the leader, having received a byte from
    every member, sends one back. A member that exits closes its socket, so the leader's `recv` and
    then every member's return empty: the barrier raises RuntimeError rather than waiting for a
    rank that is gone. (A peer that is alive but stuck makes its neighbours wait, asleep, as it would
    in the ring; the daemon's step deadline covers that.) Each byte is a round counter, so ranks
    that call `wait()` a different number of times are caught, not silently paired.
    """

    def __init__(self, rank: int, leader: int, peers: dict[int, socket.socket]) -> None:
        self.rank, self.leader = rank, leader
        self.peers = peers  # the leader: rank -> socket per member; a member: {leader: socket}
        self.round = 0

    @classmethod
    def join(cls, address: str, rank: int, ranks: Sequence[int], timeout: float = JOIN_TIMEOUT_S) -> LocalBarrier:
        """Meet the other `ranks` (this one included) at `address`; returns once all have."""
        leader = min(ranks)
        deadline = time.monotonic() + timeout
        if rank == leader:
            return cls(rank, leader, _accept_members(address, [r for r in ranks if r != rank], deadline))
        return cls(rank, leader, {leader: _connect_to_leader(address, rank, leader, deadline)})

    def wait(self) -> None:
        """Return once every co-located rank has called wait() as often as this one."""
        if not self.peers:
            raise RuntimeError("co-located barrier: closed")
        mark = bytes([self.round])
        self.round = (self.round + 1) % 256
        peer = self.leader
        try:
            if self.rank == self.leader:
                for peer, s in self.peers.items():
                    self._expect(s, peer, mark)
                for peer, s in self.peers.items():  # noqa: B007 (`peer` is named if the send fails)
                    s.sendall(mark)
            else:
                s = self.peers[self.leader]
                s.sendall(mark)
                self._expect(s, self.leader, mark)
        except OSError as e:
            self.close()
            raise RuntimeError(f"co-located barrier: rank {peer} on this machine closed its connection ({e})") from None
        except RuntimeError:
            self.close()  # the others learn at once, not when this process exits
            raise

    def _expect(self, s: socket.socket, peer: int, mark: bytes) -> None:
        got = s.recv(1)
        if not got:
            raise RuntimeError(f"co-located barrier: rank {peer} on this machine closed its connection (it exited)")
        if got != mark:
            raise RuntimeError(f"co-located barrier: rank {peer} is at round {got[0]}, rank {self.rank} at {mark[0]}")

    def close(self) -> None:
        for s in self.peers.values():
            s.close()
        self.peers = {}


def _accept_members(address: str, members: list[int], deadline: float) -> dict[int, socket.socket]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conns: dict[int, socket.socket] = {}
    try:
        if not address.startswith("\0"):
            # A file left by a leader that crashed: its name is this group's, so it is no one else's.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)
        try:
            listener.bind(address)
        except OSError as e:
            raise RuntimeError(f"co-located barrier: cannot listen at {address!r} ({e}); is a copy of this group still running?") from None
        listener.listen(len(members))
        while len(conns) < len(members):
            listener.settimeout(_left(deadline, members, conns))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue  # _left raises, naming the ranks that did not come
            try:
                conn.settimeout(_left(deadline, members, conns))
                (r,) = struct.unpack("!i", _recv_exactly(conn, 4))
                if r not in members or r in conns:
                    raise RuntimeError(f"co-located barrier: rank {r} joined, expected one of {sorted(set(members) - set(conns))}")
            except TimeoutError:
                conn.close()
                continue
            except BaseException:
                conn.close()
                raise
            conns[r] = conn
        for conn in conns.values():
            conn.sendall(b"\1")  # everyone is here: the members' join returns
            conn.settimeout(None)
        return conns
    except BaseException:
        for conn in conns.values():
            conn.close()
        raise
    finally:
        listener.close()
        if not address.startswith("\0"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address)


def _connect_to_leader(address: str, rank: int, leader: int, deadline: float) -> socket.socket:
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(address)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()  # the leader is not listening yet: it is still joining the ring
            if time.monotonic() > deadline:
                raise RuntimeError(f"co-located barrier: rank {leader} on this machine did not listen within {JOIN_TIMEOUT_S:.0f} s") from None
            time.sleep(0.002)
    try:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        s.sendall(struct.pack("!i", rank))
        if _recv_exactly(s, 1) != b"\1":
            raise RuntimeError("co-located barrier: unexpected reply from the leader")
        s.settimeout(None)
        return s
    except TimeoutError:
        s.close()
        raise RuntimeError(f"co-located barrier: not every rank on this machine joined within {JOIN_TIMEOUT_S:.0f} s") from None
    except BaseException:
        s.close()
        raise


def _left(deadline: float, members: list[int], conns: dict[int, socket.socket]) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        missing = sorted(set(members) - set(conns))
        raise RuntimeError(f"co-located barrier: ranks {missing} on this machine did not join within {JOIN_TIMEOUT_S:.0f} s")
    return left


def recv_exactly(s: socket.socket, n: int) -> bytes:
    """`n` bytes from a stream socket; EOFError when the peer closes first."""
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise EOFError(f"the peer closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return data


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    try:
        return recv_exactly(s, n)
    except EOFError:
        raise RuntimeError("co-located barrier: a rank on this machine closed its connection while joining") from None
