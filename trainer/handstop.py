"""A trainer run by hand (no daemon) stops cleanly on its first SIGTERM or Ctrl-C.

The daemon asks a trainer to stop over its link, and the request rides the step's all_sum, so
every rank stops after the same step with a checkpoint of it. By hand there is no link: a signal
killed the rank at once, and the steps since the newest checkpoint were trained again at the next
start. Here the first SIGTERM or SIGINT sets the same flag instead (one rank signalled is enough:
the all_sum carries it to the others); the group checkpoints the step under way and exits 75. A
second signal ends the process at once, as before.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalStop:
    """Callable: whether a stop was asked by a signal. `install()` takes SIGTERM and SIGINT (from
    the main thread only: Python runs handlers there)."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.signal: int | None = None

    def install(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._on)
        return self

    def _on(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:  # the second: at once, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        self.signal = signum
        self.log.warning(
            "trainer.stop_requested", signal=signal.Signals(signum).name,
            then="a checkpoint of the step under way on every rank, then exit 75; the same signal again stops at once",
        )

    def __call__(self) -> bool:
        return self.signal is not None
