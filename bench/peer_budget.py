"""What the per-peer byte budget and the reply bounds cost the coordinator's hot paths (issue 21,
part 4), each against its baseline measured in the same run.

    python bench/peer_budget.py [--messages 20000] [--trials 5]

- read: a ROUTER on loopback reads `--messages` small requests (a `status` of one job, as dpctl
  and the dashboards send) as the coordinator did (`pending_with_users`) and as it does now
  (`pending_from`, which also names each message's connection and its bytes on the wire, and
  `PeerBudget.read`);
- send: the same ROUTER sends as many 300-byte replies with `send_multipart` and through
  `PeerBudget.send` (the wire size, the per-connection count);
- fit: `protocol/fit.py` on a status reply of 20 jobs in memory (every row checked) and of 2,000
  stored jobs (rows the store read through `from_wire`, taken as they are), against encoding the
  same reply (`to_frames`), which the coordinator does for every reply anyway.

Trials alternate baseline and change; each figure is the median of its trials, per message.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import structlog
import zmq

from dpool.protocol import messages as m
from dpool.protocol.fit import fit
from dpool.protocol.payloads import JobStatus, WorkerStatus
from dpool.protocol.peerbudget import PeerBudget
from dpool.protocol.sockets import pending_from, pending_with_users


def pair(ctx: zmq.Context[bytes], budget: bool) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], PeerBudget | None]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    peers = PeerBudget(ctx, router, structlog.get_logger(), curve=False) if budget else None
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.setsockopt(zmq.SNDHWM, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer, peers


def read_and_send(n: int, budget: bool) -> tuple[float, float]:
    """Seconds per message to read `n` requests, and to send `n` replies."""
    ctx: zmq.Context[bytes] = zmq.Context()
    router, dealer, peers = pair(ctx, budget)
    request = m.Status(job="bench-000001").to_frames(7)
    for _ in range(n):
        dealer.send_multipart(request)
    got, rids = 0, []
    t0 = time.perf_counter()
    while got < n:
        router.poll(1000)
        if peers is None:
            for frames, _ in pending_with_users(router, 500, frames=m.MAX_FRAMES + 1, users=False):
                rids.append(frames[0])
                got += 1
        else:
            for inc in pending_from(router, 500, frames=m.MAX_FRAMES + 1, users=False):
                peers.read(inc.frames[0], inc.fd, inc.wire)
                rids.append(inc.frames[0])
                got += 1
    read_s = (time.perf_counter() - t0) / n
    reply = m.Error(code="not_found", message="x" * 260).to_frames(7)
    t0 = time.perf_counter()
    for rid in rids:
        if peers is None:
            router.send_multipart([rid, *reply], flags=zmq.NOBLOCK)
        else:
            peers.send(router, [rid, *reply])
    send_s = (time.perf_counter() - t0) / n
    if peers is not None:
        peers.close()
    router.close(linger=0)
    dealer.close(linger=0)
    ctx.term()
    return read_s, send_s


def status_reply(live: int, stored: int) -> tuple[m.StatusReply, Callable[[object], bool]]:
    workers = [WorkerStatus(rank=r, node=f"node-{r}", share=8, tokens_per_s=1234.5, pid=4000 + r) for r in range(4)]
    rows = [JobStatus(id=f"live-{i:06x}", name="live", state="running", step=500, steps=1000, generation=2, world_size=4, workers=workers, checkpoint_step=400, loss=1.5, val_loss=1.6, error=None, submitted=1.7e9, started=1.7e9, eta_s=300.0) for i in range(live)]
    rows += [JobStatus(id=f"old-{i:06x}", name="old", state="succeeded", step=1000, steps=1000, generation=3, world_size=2, workers=[], checkpoint_step=1000, loss=1.4, val_loss=1.5, error=None, submitted=1.6e9, started=1.6e9, finished=1.6e9, elapsed_s=100.0) for i in range(stored)]
    return m.StatusReply(jobs=rows), lambda row: isinstance(row, JobStatus) and row.id.startswith("old-")


def per_call(f: Callable[[], object], repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        f()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    figures: dict[str, list[float]] = {k: [] for k in ("read0", "read1", "send0", "send1")}
    for _ in range(args.trials):
        for budget in (False, True):
            r, s = read_and_send(args.messages, budget)
            figures[f"read{int(budget)}"].append(r)
            figures[f"send{int(budget)}"].append(s)
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"read a request:  {med['read0'] * 1e6:6.2f} us before, {med['read1'] * 1e6:6.2f} us with the budget  (x{med['read1'] / med['read0']:.2f})")
    print(f"send a reply:    {med['send0'] * 1e6:6.2f} us before, {med['send1'] * 1e6:6.2f} us with the budget  (x{med['send1'] / med['send0']:.2f})")
    for live, stored, repeat in ((20, 0, 200), (0, 2000, 10), (20, 2000, 10)):
        reply, trusted = status_reply(live, stored)
        enc = statistics.median(per_call(lambda r=reply: r.to_frames(1), repeat) for _ in range(args.trials))
        fitted = statistics.median(per_call(lambda r=reply, t=trusted: fit(r, t), repeat) for _ in range(args.trials))
        print(f"fit a status reply of {live} live + {stored} stored jobs: {fitted * 1e3:7.3f} ms; encoding it {enc * 1e3:7.3f} ms  (fit/encode {fitted / enc:.2f})")


if __name__ == "__main__":
    main()
