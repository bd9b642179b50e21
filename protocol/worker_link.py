"""The trainer's side of its link to the daemon that started it.

The daemon sets `DPOOL_WORKER_ADDR` (a ZeroMQ address it listens on) when it starts a trainer;
`WorkerLink.from_env()` connects a DEALER there, or returns None when the trainer runs by hand. Every
send is non-blocking into a bounded queue: when the daemon is slow or gone, reports are dropped
(and counted) rather than ever slowing a training step. The one message back, `worker.stop`, is
read by `stop_requested()`, a non-blocking poll.
"""

from __future__ import annotations

import os
from typing import Any

import zmq

from dpool.protocol.messages import (
    Message,
    MsgType,
    ProtocolError,
    WorkerCheckpoint,
    WorkerHello,
    WorkerMetric,
    WorkerProgress,
    WorkerSample,
    decode,
)

ENV_ADDR = "DPOOL_WORKER_ADDR"
SEND_HWM = 10_000  # messages queued for the daemon before further sends are dropped
LINGER_MS = 500  # how long close() waits to deliver what is queued (the last checkpoint report)


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

    @classmethod
    def from_env(cls) -> WorkerLink | None:
        addr = os.environ.get(ENV_ADDR)
        return cls(addr) if addr else None

    # -- reports -------------------------------------------------------------------------------

    def hello(self, *, rank: int, world_size: int, generation: int, pid: int, resume_step: int) -> None:
        self._send(WorkerHello(rank=rank, world_size=world_size, generation=generation, pid=pid, resume_step=resume_step))

    def progress(self, *, step: int, loss: float, tokens: int, seconds: float) -> None:
        self._send(WorkerProgress(step=step, loss=float(loss), tokens=int(tokens), seconds=float(seconds)))

    def metric(self, row: dict[str, Any]) -> None:
        self._send(WorkerMetric(row=dict(row)))

    def sample(self, row: dict[str, Any]) -> None:
        self._send(WorkerSample(row=dict(row)))

    def checkpoint(self, *, step: int, seconds: float) -> None:
        self._send(WorkerCheckpoint(step=step, seconds=float(seconds)))

    def _send(self, msg: Message) -> None:
        frames = msg.to_frames(self._next_id)
        self._next_id += 1
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # the daemon is not reading: never wait for it

    # -- the daemon's request ------------------------------------------------------------------

    def stop_requested(self) -> bool:
        """True once the daemon asked this worker to checkpoint at the next step boundary and exit."""
        while not self._stop:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg, _ = decode(frames)
            except ProtocolError:
                continue  # the daemon is trusted, but a bad frame must not kill training
            if msg.TYPE is MsgType.WORKER_STOP:
                self._stop = True
        return self._stop

    def close(self) -> None:
        self._sock.close()  # lingers LINGER_MS to deliver what is queued
        self._ctx.term()

    def __enter__(self) -> WorkerLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
