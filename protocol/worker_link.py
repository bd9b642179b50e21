"""The trainer's side of its link to the daemon that started it.

The daemon sets `DPOOL_WORKER_ADDR` (a ZeroMQ address it listens on) when it starts a trainer;
`WorkerLink.from_env()` connects a DEALER there, or returns None when the trainer runs by hand. Every
send is non-blocking into a bounded queue: when the daemon is slow or gone, reports are dropped
(and counted) rather than ever slowing a training step. Two messages come back: `worker.stop`, read
by `stop_requested()`, a non-blocking poll; and, for a warm trainer (started ahead of need, its
model and data built), `worker.go`, which `wait_go()` blocks on after `worker.ready`.

A trainer must not outlive its daemon (nobody would stop it, and its slot would be given to another
worker). On Linux the daemon asks the kernel to SIGKILL it (PR_SET_PDEATHSIG); on macOS there is no
such call, so the link watches the parent pid (`DPOOL_DAEMON_PID`): once it changes, the next step
boundary counts as a stop request (checkpoint, exit 75), and a trainer still alive `ORPHAN_GRACE_S`
later (stuck in MLX's init, or in an all_sum whose peers are gone) exits at once.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from typing import Any

import zmq

from dpool.protocol.link_messages import RingProbe
from dpool.protocol.link_messages import WorkerLink as LinkReport
from dpool.protocol.messages import (
    TO_WORKER,
    Message,
    MsgType,
    ProtocolError,
    WorkerCheckpoint,
    WorkerGo,
    WorkerHello,
    WorkerMetric,
    WorkerProgress,
    WorkerReady,
    WorkerSample,
    WorkerWaiting,
    decode,
)
from dpool.protocol.payloads import SampleRow, metric_row
from dpool.protocol.schema import Invalid
from dpool.protocol.sockets import pending

ENV_ADDR = "DPOOL_WORKER_ADDR"
SEND_HWM = 10_000  # messages queued for the daemon before further sends are dropped
LINGER_MS = 500  # how long close() waits to deliver what is queued (the last checkpoint report)
ENV_PARENT = "DPOOL_DAEMON_PID"
ORPHAN_CHECK_S = 0.5
ORPHAN_GRACE_S = 10.0
EXIT_ORPHANED = 70


class WorkerLink:
    def __init__(self, addr: str) -> None:
        self.addr = addr
        self.dropped = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.RCVHWM, 100)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.connect(addr)
        self._next_id = 1
        self._stop = False
        self.orphaned = False
        self._said: set[str] = set()
        parent = os.environ.get(ENV_PARENT, "")
        self._parent = int(parent) if parent.isdigit() else os.getppid()
        self._closed = threading.Event()
        threading.Thread(target=self._watch_parent, name="dpool-parent-watch", daemon=True).start()

    @classmethod
    def from_env(cls) -> WorkerLink | None:
        addr = os.environ.get(ENV_ADDR)
        return cls(addr) if addr else None

    # -- reports -------------------------------------------------------------------------------

    def hello(
        self, *, rank: int, world_size: int, generation: int, pid: int, resume_step: int, ring: Any = None, params: int | None = None,
    ) -> None:
        """The group is up. `ring`: its start-up probe (trainer/linkprobe.py `Probe`, None: none),
        and `params`: the trainable parameters a step all_sums, both sent after the hello as
        `worker.link` (rank 0 only: they are the group's, not the rank's)."""
        self._send(WorkerHello(rank=rank, world_size=world_size, generation=generation, pid=pid, resume_step=resume_step))
        if rank != 0 or params is None:
            return
        probe = None
        if ring is not None:
            try:
                probe = RingProbe.from_wire({"bandwidth_bps": float(ring.bandwidth_bps), "latency_s": float(ring.latency_s), "bytes": int(ring.bytes), "seconds": float(ring.seconds)})
            except Invalid as e:  # a figure outside the protocol's bounds: said once, the rest still goes
                self._refused("link probe", e)
        self._send(LinkReport(ring=probe, params=int(params)))

    def progress(self, *, step: int, loss: float, tokens: int, seconds: float, resplit: bool = False, gather: bool = False) -> None:
        """Step `step` is done; `resplit`: the next step runs under a new split (sync mode);
        `gather`: the outer step that ends at `step` gathers replica states (diloco)."""
        loss = float(loss)
        self._send(WorkerProgress(
            step=step, loss=loss if math.isfinite(loss) else None, tokens=int(tokens), seconds=float(seconds), resplit=bool(resplit), gather=bool(gather),
        ))

    def waiting(self, step: int) -> None:
        """This rank's part of step `step` is computed; it waits on its peers from now on."""
        self._send(WorkerWaiting(step=step))

    def metric(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row (a non-finite number travels as null, as it is written there)."""
        try:
            self._send(WorkerMetric(row=metric_row(row)))
        except Invalid as e:
            self._refused("metric", e)

    def sample(self, row: dict[str, Any]) -> None:
        try:
            self._send(WorkerSample(row=SampleRow.from_wire(dict(row))))
        except Invalid as e:
            self._refused("sample", e)

    def _refused(self, what: str, e: Invalid) -> None:
        """A row the protocol cannot carry is dropped, not raised into the training loop; said once."""
        self.dropped += 1
        if what not in self._said:
            self._said.add(what)
            print(f"dpool: a {what} row was not sent to the daemon: {e}", file=sys.stderr, flush=True)

    def checkpoint(self, *, step: int, seconds: float, memory: bool = False) -> None:
        self._send(WorkerCheckpoint(step=step, seconds=float(seconds), memory=memory))

    def _send(self, msg: Message) -> None:
        frames = msg.to_frames(self._next_id)
        self._next_id += 1
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # the daemon is not reading: never wait for it

    # -- the daemon's request ------------------------------------------------------------------

    def _watch_parent(self) -> None:
        while not self._closed.wait(ORPHAN_CHECK_S):
            if os.getppid() != self._parent:
                self.orphaned = True
                print(f"dpool: the daemon (pid {self._parent}) is gone; stopping at the next step", file=sys.stderr, flush=True)
                if not self._closed.wait(ORPHAN_GRACE_S):
                    os._exit(EXIT_ORPHANED)  # stuck where no step boundary comes: leave now
                return

    def wait_go(self) -> WorkerGo | None:
        """A warm trainer: say `worker.ready`, then block until `worker.go` (None: stop instead,
        by `worker.stop` or because the daemon is gone). Blocking in poll uses no CPU while the
        group this trainer may join trains on the same machine."""
        self._send(WorkerReady(pid=os.getpid()))
        while not self.orphaned:
            if not self._sock.poll(int(ORPHAN_CHECK_S * 1000)):
                continue
            for frames in pending(self._sock):
                try:
                    msg, _ = decode(frames, TO_WORKER)
                except ProtocolError:
                    continue
                if isinstance(msg, WorkerGo):
                    return msg
                if msg.TYPE is MsgType.WORKER_STOP:
                    self._stop = True
                    return None
        return None

    def stop_requested(self) -> bool:
        """True once the daemon asked this worker to checkpoint at the next step boundary and exit
        (or the daemon is gone)."""
        if self.orphaned or self._stop:
            return True
        for frames in pending(self._sock):
            try:
                msg, _ = decode(frames, TO_WORKER)
            except ProtocolError:
                continue  # the daemon is trusted, but a bad frame must not kill training
            if msg.TYPE is MsgType.WORKER_STOP:
                self._stop = True
                break
        return self._stop

    def close(self) -> None:
        self._closed.set()
        self._sock.close()  # lingers LINGER_MS to deliver what is queued
        self._ctx.term()

    def __enter__(self) -> WorkerLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
