"""systemd's readiness protocol (`Type=notify`): one datagram to `$NOTIFY_SOCKET`, no extra package.

dpd says READY=1 once it has registered with its coordinator (after binding it, when it serves),
or after READY_WAIT_S of trying, so a node that boots before its coordinator does not hold
`systemctl start` until it times out; STATUS= tells which. STOPPING=1 when SIGTERM arrives.
Outside systemd (no `$NOTIFY_SOCKET`) every call does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any

READY_WAIT_S = 20.0


def notify(state: str, env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Send `state` ("READY=1", "STATUS=...", newline-separated) to the service manager.

    Returns whether a manager was there to receive it. A path, or an abstract socket name given
    with a leading '@' (sd_notify(3)); other families (vsock) are not used by user or system units."""
    addr = env.get("NOTIFY_SOCKET", "")
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError:
        return False  # the manager went away: nothing to tell
    return True


async def announce(agent: Any, stopping: asyncio.Event, *, wait_s: float = READY_WAIT_S) -> None:
    """READY=1 once `agent` has registered (or after `wait_s`), STOPPING=1 once `stopping` is set."""

    async def registered(poll_s: float) -> None:
        while not agent.registered and not stopping.is_set():
            await asyncio.sleep(poll_s)  # the agent has no callback for it; start-up only

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(registered(0.05), wait_s)
    if agent.registered:
        notify(f"READY=1\nSTATUS=registered with {agent.join} ({agent.slots} slots)")
    else:
        notify(f"READY=1\nSTATUS=waiting for the coordinator at {agent.join}")
        await registered(1.0)
        if agent.registered:
            notify(f"STATUS=registered with {agent.join} ({agent.slots} slots)")
    await stopping.wait()
    notify("STOPPING=1\nSTATUS=stopping workers")
