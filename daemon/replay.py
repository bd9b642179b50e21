"""A job's rows a dpd sent to a coordinator that may not have stored them: sent again on the next
registration.

A coordinator that dies (or restarts) is noticed by its dpds only after `liveness` heartbeat
periods of silence; what they sent it meanwhile went into a connection that is then closed, and a
coordinator that restarted before the silence was noticed refuses it as from an unregistered node.
With fast steps that is a hundred metrics rows or more, a gap in the curve `dpctl metrics` shows
(log_every_steps = 1 promises every step). So the rows sent lately (metrics and samples, which the
coordinator stores once per job, kind and step, the newest generation's) are kept for a while, and
those sent since shortly before the coordinator was last heard from are sent again after the next
registration. A row it had stored already is stored again, unchanged.
"""

from __future__ import annotations

import collections

from dpool.protocol import messages as m

KEEP_S = 60.0  # rows older than this are not kept (a coordinator silent this long was noticed long ago)
MARGIN_S = 2.0  # before the coordinator was last heard: what it may have had queued, unread, when it died
KEEP_MAX = 20_000


class RowReplay:
    def __init__(self) -> None:
        self.sent: collections.deque[tuple[float, m.Message]] = collections.deque(maxlen=KEEP_MAX)
        self.heard = 0.0  # when the coordinator last said anything

    def on_sent(self, msg: m.Message, now: float) -> None:
        """`msg` went to the coordinator; kept if it is a row."""
        if isinstance(msg, m.NodeMetric | m.NodeSample):
            self.sent.append((now, msg))
            while self.sent and self.sent[0][0] < now - KEEP_S:
                self.sent.popleft()

    def on_heard(self, now: float) -> None:
        self.heard = now

    def again(self) -> list[m.Message]:
        """At a registration: the rows the last coordinator may not have stored, oldest first; the
        rest are forgotten."""
        out = [msg for t, msg in self.sent if t >= self.heard - MARGIN_S]
        self.sent.clear()
        return out
