"""The data channel's wire format: a versioned header, an op, a typed body, and the bytes it moves.

Every message is two or three ZeroMQ frames (a ROUTER sees the peer's routing id in front):

    frame 0  header  msgpack array  ["dpool.data", VERSION, op: str, id: int]          <= 256 bytes
    frame 1  body    msgpack map    the op's fields by name, each typed and bounded    <= 4 KiB
    frame 2  data    raw bytes: a chunk, a manifest or a bitmap (only the ops that carry one)

The data frame is never msgpack: a 4 MiB chunk goes out as the buffer the cache read (pyzmq
`copy=False`) and is hashed where it landed. `staging/README.md` is the contract (every op, who
sends it, its reply, the error codes); this module implements it, and refuses everything else with
a `WireError` whose code goes back in an `error` reply. Nothing here touches a socket but `pending`,
which reads one without blocking and without keeping more frames than a message may have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import typing
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeAlias

import msgpack
import zmq

from dpool.protocol.peerbudget import wire_size
from dpool.protocol.schema import (
    MAX_INT,
    Field,
    Float,
    Int,
    Invalid,
    Str,
    check_fields,
    field_converters,
)
from dpool.protocol.sockets import read_rest, unfinished
from dpool.staging.manifest import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Limits

PROTOCOL = "dpool.data"
VERSION = 1
MAX_HEADER_BYTES = 256
MAX_BODY_BYTES = 4096
MAX_MANIFEST_BYTES = Limits().max_manifest_bytes
# The largest data frame: a chunk (at most MAX_CHUNK_BYTES), a manifest, or an offer's bitmap (one
# bit a chunk). zmq.MAXMSGSIZE on every socket of the channel: libzmq drops a connection that sends
# a larger frame before any of it is kept.
MAX_DATA_BYTES = max(MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES)
MAX_FRAMES = 3  # header, body, data
MAX_HOLD_S = 60.0
MAX_MESSAGE_CHARS = 2000  # of an error's message
_HEX = frozenset("0123456789abcdef")


class Op(enum.StrEnum):
    """Every op on the wire. Requests go from a fetcher (or dpctl) to a node; the rest are replies."""

    MANIFEST = "manifest"
    MANIFEST_DATA = "manifest.data"
    CHUNK = "chunk"
    CHUNK_DATA = "chunk.data"
    OFFER = "offer"
    OFFER_REPLY = "offer.reply"
    PUT = "put"
    PUT_DONE = "put.done"
    ERROR = "error"


class Code(enum.StrEnum):
    """`error.code`: why a request was not served (README: "Errors")."""

    BAD_REQUEST = "bad_request"  # not a message of this protocol, or a field of the wrong type or bound
    BAD_VERSION = "bad_version"
    TOO_LARGE = "too_large"  # a frame over its cap
    REFUSED = "refused"  # this peer's key may not do that (any more)
    NOT_HERE = "not_here"  # this node does not hold it (`later`: it is fetching it; ask again)
    BUSY = "busy"  # too much in progress here: ask again shortly
    FULL = "full"  # no room in the cache for an offered manifest
    BAD_CHUNK = "bad_chunk"  # a put whose bytes do not hash to the chunk's sha256
    INTERNAL = "internal"  # the node failed at it (a disk error, a bug): the message says what


class WireError(Exception):
    """A frame that cannot be served; `msg_id` is set when the header could be read."""

    def __init__(self, code: Code, message: str, msg_id: int = 0) -> None:
        super().__init__(message)
        self.code, self.message, self.msg_id = code, message, msg_id


# -- bounded field types ---------------------------------------------------------------------------

HEX = "hex"  # a field's mark: lowercase hex digits only (Message.__post_init__ checks it)
Hex64: TypeAlias = Annotated[str, Str(64, 64), HEX]  # a sha256
Index: TypeAlias = Annotated[int, Int(0, MAX_INT)]
ChunkBytes: TypeAlias = Annotated[int, Int(MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)]
Count: TypeAlias = Annotated[int, Int(0, MAX_INT)]
HoldS: TypeAlias = Annotated[float, Float(0.0, MAX_HOLD_S)]


@dataclass(frozen=True, slots=True)
class Message:
    OP: ClassVar[Op]
    DATA: ClassVar[bool] = False  # carries a data frame
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    HEX_FIELDS: ClassVar[tuple[str, ...]] = ()  # the fields typed Hex64

    def __post_init__(self) -> None:
        for name in self.HEX_FIELDS:
            value = getattr(self, name)
            if value is not None and not _HEX.issuperset(value):
                err = Invalid("64 lowercase hex digits", value, out_of_range=True)
                err.path.append(name)
                raise err

    def frames(self, msg_id: int) -> list[bytes]:
        """Header and body (the caller adds the data frame of an op that has one)."""
        body = {name: getattr(self, name) for name, *_ in self.FIELDS}
        return [msgpack.packb([PROTOCOL, VERSION, str(self.OP), msg_id]), msgpack.packb(body, use_bin_type=True)]


REGISTRY: dict[Op, type[Message]] = {}


def _op(cls: type[Message]) -> type[Message]:
    """Register an op's class: its fields' checks compiled once, its hex fields found."""
    REGISTRY[cls.OP] = cls
    cls.FIELDS = field_converters(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    cls.HEX_FIELDS = tuple(f.name for f in dataclasses.fields(cls) if _marked_hex(hints[f.name]))
    return cls


def _marked_hex(hint: Any) -> bool:
    if typing.get_origin(hint) is Annotated:
        return HEX in typing.get_args(hint)[1:]
    return any(_marked_hex(a) for a in typing.get_args(hint))


@_op
@dataclass(frozen=True, slots=True)
class GetManifest(Message):
    """The manifest whose canonical bytes hash to `digest`; answered by manifest.data."""

    OP: ClassVar[Op] = Op.MANIFEST
    digest: Hex64
    hold_s: HoldS = 0.0


@_op
@dataclass(frozen=True, slots=True)
class ManifestData(Message):
    OP: ClassVar[Op] = Op.MANIFEST_DATA
    DATA: ClassVar[bool] = True


@_op
@dataclass(frozen=True, slots=True)
class GetChunk(Message):
    """Chunk `index` (of `chunk_bytes` pieces) of the file whose sha256 is `sha256`. A node that is
    fetching that chunk itself (or manifest `digest`, before it knows its chunks) holds the request
    up to `hold_s` (capped by its own limit) before it answers not_here."""

    OP: ClassVar[Op] = Op.CHUNK
    sha256: Hex64
    index: Index
    chunk_bytes: ChunkBytes
    hold_s: HoldS = 0.0
    digest: Hex64 | None = None  # the manifest the asker is fetching: held while this node learns its chunks


@_op
@dataclass(frozen=True, slots=True)
class ChunkData(Message):
    OP: ClassVar[Op] = Op.CHUNK_DATA
    DATA: ClassVar[bool] = True


@_op
@dataclass(frozen=True, slots=True)
class Offer(Message):
    """dpctl -> node: the manifest's bytes (the data frame; they must hash to `digest`). The node
    keeps it, makes room, and answers which chunks it lacks; when it lacks none it builds the tree."""

    OP: ClassVar[Op] = Op.OFFER
    DATA: ClassVar[bool] = True
    digest: Hex64


@_op
@dataclass(frozen=True, slots=True)
class OfferReply(Message):
    """The data frame is a bitmap over the manifest's chunks in order (entries by path, each entry's
    chunks by index; bit k of chunk n is byte n // 8, bit n % 8): 1 = send it."""

    OP: ClassVar[Op] = Op.OFFER_REPLY
    DATA: ClassVar[bool] = True
    missing: Count  # chunks to send
    bytes: Count  # their bytes


@_op
@dataclass(frozen=True, slots=True)
class Put(Message):
    """dpctl -> node: chunk `index` of the file `sha256` of the offered manifest `digest` (data)."""

    OP: ClassVar[Op] = Op.PUT
    DATA: ClassVar[bool] = True
    digest: Hex64
    sha256: Hex64
    index: Index


@_op
@dataclass(frozen=True, slots=True)
class PutDone(Message):
    OP: ClassVar[Op] = Op.PUT_DONE


@_op
@dataclass(frozen=True, slots=True)
class Error(Message):
    """Any request that was not served. `later`: with not_here, this node is fetching it now."""

    OP: ClassVar[Op] = Op.ERROR
    code: Annotated[str, Str(32, 1)]
    message: Annotated[str, Str(MAX_MESSAGE_CHARS)]
    later: bool = False

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE_CHARS:  # a message longer than its bound is cut, not refused
            object.__setattr__(self, "message", self.message[: MAX_MESSAGE_CHARS - 3] + "...")


REQUESTS = frozenset({Op.MANIFEST, Op.CHUNK, Op.OFFER, Op.PUT})
REPLIES = frozenset(REGISTRY) - REQUESTS


# -- decoding ----------------------------------------------------------------------------------------


def _unpack(data: bytes, items: int) -> Any:
    return msgpack.unpackb(
        data, raw=False, strict_map_key=True, max_str_len=MAX_BODY_BYTES, max_bin_len=0,
        max_array_len=items, max_map_len=items, max_ext_len=0,
    )


def decode_header(frame: bytes) -> tuple[Op, int]:
    try:
        header = _unpack(frame, 4)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise WireError(Code.BAD_REQUEST, f"header is not msgpack: {type(e).__name__}") from None
    if not (isinstance(header, list) and len(header) == 4):
        raise WireError(Code.BAD_REQUEST, "header must be [protocol, version, op, id]")
    proto, version, op, msg_id = header
    if type(msg_id) is not int or not 0 <= msg_id < 2**63:
        raise WireError(Code.BAD_REQUEST, "header id must be an integer in [0, 2^63)")
    if proto != PROTOCOL or type(version) is not int:
        raise WireError(Code.BAD_VERSION, f"not a {PROTOCOL} header: protocol {str(proto)[:40]!r}", msg_id)
    if version != VERSION:
        raise WireError(Code.BAD_VERSION, f"version {version} is not spoken here; this peer speaks {VERSION}", msg_id)
    try:
        return Op(op), msg_id
    except ValueError:
        raise WireError(Code.BAD_REQUEST, f"unknown op {str(op)[:40]!r}", msg_id) from None


Frame: TypeAlias = bytes | zmq.Frame


def _bytes(frame: Frame) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else frame


def decode(frames: list[Frame], accept: Collection[Op], *, cut: bool = False) -> tuple[Message, int, memoryview | None]:
    """A message, its id and its data frame (None for an op without one) from its frames (a
    ROUTER's routing id already taken off); raises WireError. `accept`: the ops this receiver
    takes, refused from the header before the body is read. `cut`: it came with more frames than
    `pending` kept. The data is a view of the frame as it arrived: nothing is copied."""
    if not frames:
        raise WireError(Code.BAD_REQUEST, "an empty message")
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise WireError(Code.TOO_LARGE, f"header is {len(frames[0])} bytes, cap {MAX_HEADER_BYTES}")
    op, msg_id = decode_header(_bytes(frames[0]))
    if cut or len(frames) > MAX_FRAMES:
        raise WireError(Code.BAD_REQUEST, f"more than {MAX_FRAMES} frames", msg_id)
    if op not in accept:
        raise WireError(Code.BAD_REQUEST, f"{op} is not accepted here", msg_id)
    cls = REGISTRY[op]
    if len(frames) != (3 if cls.DATA else 2):
        want = "3 frames (header, body, data)" if cls.DATA else "2 frames (header, body)"
        raise WireError(Code.BAD_REQUEST, f"{op} is {want}, got {len(frames)}", msg_id)
    if len(frames[1]) > MAX_BODY_BYTES:
        raise WireError(Code.TOO_LARGE, f"{op} body is {len(frames[1])} bytes, cap {MAX_BODY_BYTES}", msg_id)
    try:
        body = _unpack(_bytes(frames[1]), 16)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise WireError(Code.BAD_REQUEST, f"{op} body is not msgpack: {type(e).__name__}", msg_id) from None
    if not isinstance(body, dict):
        raise WireError(Code.BAD_REQUEST, f"{op} body must be a map", msg_id)
    try:
        msg = cls(**check_fields(cls.FIELDS, body, str(op)))
    except Invalid as e:
        raise WireError(Code.BAD_REQUEST, f"{op} {e}", msg_id) from None
    data = None
    if cls.DATA:
        last = frames[2]
        data = last.buffer if isinstance(last, zmq.Frame) else memoryview(last)
    return msg, msg_id, data


def error_frames(err: WireError, *, later: bool = False) -> list[bytes]:
    return Error(code=str(err.code), message=err.message, later=later).frames(err.msg_id)


# -- reading a socket ----------------------------------------------------------------------------


@dataclass(slots=True)
class Incoming:
    """One message as it came: its frames (a ROUTER's routing id first), and with CURVE the role
    and key the ZAP handler gave its connection. `cut`: it had more frames than a message may."""

    frames: list[zmq.Frame]
    user: str | None = None
    key: str | None = None
    cut: bool = False
    keep: int = 0  # frames kept while it is read (the rest only counted as `cut`)
    fd: int | None = None  # the connection it came by (ZMQ_SRCFD), for the per-peer budget
    size: int = 0  # its bytes on the wire, counted as its frames are read
    curve: bool | None = None  # whether that connection uses CURVE (None: not counted)

    def take(self, frame: zmq.Frame) -> None:
        if self.curve is not None:
            self.size += wire_size(len(frame), self.curve)
        if len(self.frames) < self.keep:
            self.frames.append(frame)
        else:
            self.cut = True


def pending(sock: zmq.Socket[Any], limit: int, *, keep: int, metadata: bool, curve: bool | None = None) -> Iterator[Incoming]:
    """The messages waiting on `sock`, without blocking, at most `limit`. Frames are not copied (a
    chunk is hashed and written where libzmq put it); only the first `keep` are kept. ZeroMQ's
    descriptor is edge-triggered, so a reader takes every message there before it waits again, and
    a message of very many frames is read over several calls (protocol/sockets.py). `curve` (not
    None): each message names its connection and its size on the wire (protocol/peerbudget.py)."""
    for _ in range(limit):
        got = unfinished(sock)
        if got is None:
            try:
                first = sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            got = Incoming([first], keep=keep, curve=curve)
            if curve is not None:
                with contextlib.suppress(zmq.ZMQError):
                    got.fd = int(first.get(zmq.SRCFD))
            if metadata:
                with contextlib.suppress(zmq.ZMQError):  # EINVAL: a connection without CURVE
                    got.user, got.key = str(first.get("User-Id")), str(first.get("X-Key"))
        if not read_rest(sock, got, got.take, copy=False):
            return
        yield got
