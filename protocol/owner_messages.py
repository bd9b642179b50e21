"""The message of a machine that yields to its owner (`dpd run --yield-when`).

    dpd -> coordinator    node.yield    `reason`: why this node yields now ("owner active",
                                        "on battery", ...; several joined by ", "), or null: it
                                        takes work again. Sent when that changes, and after each
                                        registration (a restarted coordinator learns it so)

The coordinator moves the node's work off it as `dpctl drain` does (a checkpoint at the next step,
0 steps recomputed), gives it none while it yields (`dpctl nodes`: state `yielding`, the reason),
and takes it back when it says null. A dpd started without --yield-when never sends it, so a pool
of older coordinators sees nothing new. Registered in messages.REGISTRY on import; a process that
does not import this module refuses the type as unexpected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, TypeAlias

from dpool.protocol.messages import Message, MsgType, message
from dpool.protocol.schema import Str

REASON_MAX = 200
YieldReason: TypeAlias = Annotated[str, Str(REASON_MAX, 1)]


@message
@dataclass(frozen=True, slots=True)
class NodeYield(Message):
    """dpd -> coordinator: the node yields to its owner for `reason`, or (None) no longer."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_YIELD
    reason: YieldReason | None = None
