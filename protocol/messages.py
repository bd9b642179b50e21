"""dpool's control-plane messages: the envelope, the message types, their bodies.

Every message is two ZeroMQ frames (a ROUTER prepends the peer's routing id, which is not ours):

    frame 0  header  msgpack array  ["dpool", VERSION, type: str, id: int]
    frame 1  body    msgpack map    {field: value, ...}   (the message's dataclass fields)

`protocol/README.md` is the written contract: who sends each message and what it gets back. Here
every type is one frozen dataclass; `to_frames(msg_id)` encodes it and `decode(frames)` turns bytes
back into a `Message` or raises `ProtocolError`, whose `code` goes into the `error` reply. Decoding
never trusts its input: frame count and size are capped, a receiver names the types it accepts
(others are refused from the header), a body may hold at most so many objects (counted before
anything is built), maps must have string keys (`strict_map_key`), every field is checked against
its type and bound (protocol/schema.py; nested maps are the records of protocol/payloads.py), unknown
fields are refused, and no pickle or other code-carrying format is ever used.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeAlias, TypeVar

import msgpack

from dpool.protocol.payloads import (
    ERROR_LINE_MAX,
    LOG_LINE_MAX,
    MAX_SLOTS,
    MAX_WORLD,
    ROWS_MAX,
    AliveWorker,
    Count,
    EventRow,
    ExitCode,
    ExitedWorker,
    ExportFile,
    Generation,
    Holding,
    JobId,
    JobRef,
    JobStatus,
    JoiningName,
    LogLine,
    MetricRow,
    Name,
    NodeInfo,
    NodeName,
    NodeRow,
    Number,
    Pid,
    Port,
    Rank,
    RankSlot,
    RemovedRows,
    RunningWorker,
    SampleRow,
    Seconds,
    Shares,
    SlotIndex,
    Step,
    Text,
    Token,
    WorldSize,
)
from dpool.protocol.schema import (
    MAX_INT,
    OMIT_NONE,
    Bytes,
    Field,
    Float,
    Int,
    Invalid,
    Items,
    OneOf,
    Record,
    Str,
    check_fields,
    count_objects,
    field_converters,
)

PROTOCOL = "dpool"
VERSION = 1
MAX_HEADER_BYTES = 256
MAX_BODY_BYTES = 4 * 1024 * 1024  # a frame above this is refused before it is parsed
MAX_MESSAGE_BYTES = MAX_HEADER_BYTES + MAX_BODY_BYTES  # zmq.MAXMSGSIZE on listening sockets
MAX_FRAMES = 2  # header and body; a message with more is refused without holding its frames
PAGE_LIMIT = 2000  # the most rows one query reply carries; clients page with `after`
EXPORT_CHUNK_MAX = 1024 * 1024  # the most bytes one export.read / export.fetch asks for
EXPORT_PREPARE_TIMEOUT_S = 720.0  # the coordinator answers `export` within this (a node's trainer gets 600 s)
EXPORT_FETCH_TIMEOUT_S = 60.0  # and each `export.read` within this
ERROR_MESSAGE_MAX = 16384  # characters of an `error` reply's message (a longer one is cut)
EXPORT_NAME_MAX = 1024
EXPORT_NAME_PART_MAX = 255
EXPORT_NAME_DEPTH_MAX = 8
EXPORT_FILES_MAX = 1000  # files in one export's manifest
EXITS_MAX = 1024  # worker exits in one node.register
HOLDINGS_MAX = 10_000  # run dirs with a checkpoint in one node.register
LOG_LINES_MAX = 10_000  # lines in one node.logs


class MsgType(enum.StrEnum):
    """Every message type on the wire. The prefix says who sends it (README: "Messages")."""

    ERROR = "error"
    # dpctl -> coordinator, each with its reply
    SUBMIT = "submit"
    SUBMITTED = "submitted"
    STATUS = "status"
    STATUS_REPLY = "status.reply"
    NODES = "nodes"
    NODES_REPLY = "nodes.reply"
    METRICS = "metrics"
    METRICS_REPLY = "metrics.reply"
    EVENTS = "events"
    EVENTS_REPLY = "events.reply"
    SAMPLES = "samples"
    SAMPLES_REPLY = "samples.reply"
    LOGS = "logs"
    LOGS_REPLY = "logs.reply"
    CANCEL = "cancel"
    CANCEL_REPLY = "cancel.reply"
    DRAIN = "drain"
    DRAIN_REPLY = "drain.reply"
    UNDRAIN = "undrain"
    UNDRAIN_REPLY = "undrain.reply"
    EXPORT = "export"
    EXPORT_REPLY = "export.reply"
    EXPORT_READ = "export.read"
    EXPORT_DATA = "export.data"
    EXPORT_CLOSE = "export.close"
    EXPORT_CLOSED = "export.closed"
    RM = "rm"
    RM_REPLY = "rm.reply"
    # dpd (node agent) -> coordinator
    NODE_REGISTER = "node.register"
    NODE_REGISTERED = "node.registered"  # coordinator's reply
    NODE_HEARTBEAT = "node.heartbeat"
    NODE_BYE = "node.bye"
    NODE_PREPARED = "node.prepared"
    NODE_WORKER_STARTED = "node.worker_started"
    NODE_WORKER_HELLO = "node.worker_hello"
    NODE_PROGRESS = "node.progress"
    NODE_WAITING = "node.waiting"
    NODE_METRIC = "node.metric"
    NODE_SAMPLE = "node.sample"
    NODE_CHECKPOINT = "node.checkpoint"
    NODE_LOGS = "node.logs"
    NODE_WORKER_EXITED = "node.worker_exited"
    NODE_EXPORT_READY = "node.export_ready"  # answers export.prepare
    NODE_EXPORT_DATA = "node.export_data"  # answers export.fetch
    NODE_REMOVED = "node.removed"  # answers job.remove
    NODE_WARMED = "node.warmed"  # answers job.warm
    # coordinator -> dpd
    COORD_HEARTBEAT = "coord.heartbeat"
    GROUP_PREPARE = "group.prepare"
    GROUP_START = "group.start"
    GROUP_STOP = "group.stop"
    EXPORT_PREPARE = "export.prepare"
    EXPORT_FETCH = "export.fetch"
    EXPORT_RELEASE = "export.release"
    JOB_REMOVE = "job.remove"
    JOB_WARM = "job.warm"
    JOB_ENDED = "job.ended"
    # staging (protocol/stage_messages.py): can this node serve a job, and the files it lacks
    JOB_STAGE = "job.stage"  # coordinator -> dpd
    NODE_STAGED = "node.staged"  # dpd -> coordinator
    STAGE_OFFER = "stage.offer"  # dpctl -> coordinator
    STAGE_OFFER_REPLY = "stage.offer.reply"
    CACHE = "cache"  # dpctl -> coordinator: what each node's staging cache holds
    CACHE_REPLY = "cache.reply"
    CACHE_PRUNE = "cache.prune"  # dpctl -> coordinator
    CACHE_PRUNE_REPLY = "cache.prune.reply"
    STAGE_PRUNE = "stage.prune"  # coordinator -> dpd
    STAGE_ACCEPT = "stage.accept"  # coordinator -> dpd
    STAGE_PEERS = "stage.peers"  # coordinator -> dpd
    # sharing the pool (protocol/sharing.py): the queue as the scheduler sees it, a job's priority
    QUEUE = "queue"  # dpctl -> coordinator
    QUEUE_REPLY = "queue.reply"
    PRIORITY = "priority"  # dpctl -> coordinator
    PRIORITY_REPLY = "priority.reply"
    # the ring's measured link (protocol/link_messages.py): a trainer's probe, relayed by its dpd
    WORKER_LINK = "worker.link"  # trainer -> its dpd
    NODE_LINK = "node.link"  # dpd -> coordinator
    # a Mac that yields to its owner (protocol/owner_messages.py): why it yields, or that it is back
    NODE_YIELD = "node.yield"  # dpd -> coordinator
    # trainer -> its dpd (over ipc), and the two messages back
    WORKER_HELLO = "worker.hello"
    WORKER_PROGRESS = "worker.progress"
    WORKER_WAITING = "worker.waiting"
    WORKER_METRIC = "worker.metric"
    WORKER_SAMPLE = "worker.sample"
    WORKER_CHECKPOINT = "worker.checkpoint"
    WORKER_STOP = "worker.stop"
    WORKER_READY = "worker.ready"
    WORKER_GO = "worker.go"


class ErrorCode(enum.StrEnum):
    """`error.code` values. The first five are about the frame itself; the rest about its meaning."""

    BAD_FRAME = "bad_frame"  # wrong frame count, not msgpack, wrong shapes
    TOO_LARGE = "too_large"  # a frame over the size cap
    BAD_VERSION = "bad_version"  # another protocol or another version of this one
    UNKNOWN_TYPE = "unknown_type"
    BAD_BODY = "bad_body"  # missing, unknown or mistyped fields
    UNEXPECTED = "unexpected"  # a valid message this peer does not accept
    NOT_REGISTERED = "not_registered"  # a node message from a peer that has not registered
    DUPLICATE_NAME = "duplicate_name"
    POOL_FULL = "pool_full"  # a node.register of a new name in a pool of MAX_NODES nodes, none of them forgettable
    NODE_BUSY = "node_busy"  # a node.register with a node's own key while that node's dpd still heartbeats: asked again
    FORBIDDEN = "forbidden"  # a message this peer's key may not send (its role, or another node's name)
    NOT_FOUND = "not_found"
    BAD_JOB = "bad_job"
    BAD_REQUEST = "bad_request"  # values out of range (a read past a file's end), or a trainer refusing an export
    NOT_FINISHED = "not_finished"  # `rm` of a job that has not finished (cancel it first)
    EXPORT_FAILED = "export_failed"  # the export could not be made or delivered (trainer crash, timeout, node lost)
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A frame that cannot be a valid message. `msg_id` is set when the header could be read."""

    def __init__(self, code: ErrorCode, message: str, msg_id: int = 0) -> None:
        super().__init__(message)
        self.code, self.message, self.msg_id = code, message, msg_id



# ---------------------------------------------------------------------------------------------
# Messages. `Message` is the base; each subclass is one type, registered in REGISTRY. Every field's
# type carries its bound (protocol/schema.py, protocol/payloads.py); `message` refuses a class
# with an unbounded field, so the whole contract is bounded by construction.

REGISTRY: dict[MsgType, type[Message]] = {}
MAX_OBJECTS = 100_000  # objects (maps, lists, scalars) one body may hold, by default
REPLY_OBJECTS = 2_000_000  # in a reply that carries rows (read by dpctl, from its coordinator)
REPLY_BODY_BYTES = 16 << 20  # and its bytes: every node of a full pool, every job of a long history


@dataclass(frozen=True, slots=True)
class Message:
    TYPE: ClassVar[MsgType]
    FIELDS: ClassVar[tuple[Field, ...]] = ()
    MAX_OBJECTS: ClassVar[int] = MAX_OBJECTS
    MAX_BYTES: ClassVar[int] = MAX_BODY_BYTES  # of the body (a reply that carries rows: REPLY_BODY_BYTES)
    # Fields whose value many messages of one burst share (group.start's job file and hostfile, to
    # every node of a group): packed once, by identity. Such a value is never changed once sent.
    SHARED: ClassVar[frozenset[str]] = frozenset()

    def to_body(self) -> dict[str, Any]:
        # A field marked OMIT_NONE is left out while None: a peer of a version before it still reads the message.
        return {f.name: v for f in self.FIELDS if (v := getattr(self, f.name)) is not None or not f.omit_none}

    def to_frames(self, msg_id: int = 0) -> list[bytes]:
        """The two frames of this message; `msg_id` pairs a reply with its request."""
        packer = _packer()
        header = packer.pack([PROTOCOL, VERSION, str(self.TYPE), msg_id])
        body = self._packed_body(packer) if self.SHARED else packer.pack(self.to_body())
        if len(body) > self.MAX_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{self.TYPE} body is {len(body)} bytes, cap {self.MAX_BYTES}")
        return [header, body]

    @classmethod
    def from_body(cls, body: dict[str, Any], msg_id: int = 0) -> Message:
        try:
            return cls(**check_fields(cls.FIELDS, body, str(cls.TYPE)))
        except Invalid as e:  # mistyped: bad_body; of the right type but out of its bound: bad_request
            code = ErrorCode.BAD_REQUEST if e.out_of_range else ErrorCode.BAD_BODY
            raise ProtocolError(code, f"{cls.TYPE} {e}", msg_id) from None


    def _packed_body(self, packer: msgpack.Packer) -> bytes:
        """The body as `pack(to_body())` writes it (a map is its header, then key and value after
        key and value): the header and keys packed once per class, the shared fields' values from
        the cache."""
        head, keys = _shared.keys(type(self), packer)
        parts = [head]
        for key, (name, *_) in zip(keys, self.FIELDS, strict=True):
            value = getattr(self, name)
            parts += (key, _shared.pack(value, packer) if name in self.SHARED else packer.pack(value))
        return b"".join(parts)


def _packable(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_wire()
    raise TypeError(f"cannot send {type(value).__name__}")


class _PackCache:
    """The packed bytes of the few newest shared values, by identity. The value is held with its
    bytes, so its id cannot be reused by another object while it is cached."""

    def __init__(self, size: int = 8) -> None:
        self.size, self.lock = size, threading.Lock()
        self.heads: dict[type[Message], tuple[bytes, list[bytes]]] = {}
        self.entries: collections.OrderedDict[int, tuple[Any, bytes]] = collections.OrderedDict()

    def pack(self, value: Any, packer: msgpack.Packer) -> bytes:
        with self.lock:
            hit = self.entries.get(id(value))
            if hit is not None and hit[0] is value:
                self.entries.move_to_end(id(value))
                return hit[1]
        packed: bytes = packer.pack(value)
        with self.lock:
            self.entries[id(value)] = (value, packed)
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return packed


    def keys(self, cls: type[Message], packer: msgpack.Packer) -> tuple[bytes, list[bytes]]:
        """A message class's map header and packed field names."""
        got = self.heads.get(cls)
        if got is None:
            got = self.heads[cls] = (packer.pack_map_header(len(cls.FIELDS)), [packer.pack(name) for name, *_ in cls.FIELDS])
        return got


_shared = _PackCache()
_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's packer (making one per message costs more than packing a small one)."""
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=_packable)
    return packer

M = TypeVar("M", bound=type[Message])


def message(cls: M) -> M:
    """Register a message class under its TYPE and compile its fields' checks once."""
    REGISTRY[cls.TYPE] = cls
    cls.FIELDS = field_converters(cls)
    return cls


# Bounded types of message fields (and of the job document, which parse_job then validates).
JobNumbers: TypeAlias = Annotated[list[Annotated[int, Int(-MAX_INT, MAX_INT)] | Number], Items(64)]  # lr_schedule.arguments, betas
JobOption: TypeAlias = Annotated[str, Str(4096)] | Annotated[int, Int(-MAX_INT, MAX_INT)] | Number | bool | JobNumbers | None
JobText: TypeAlias = Annotated[str, Str(4096)]
JobFiles: TypeAlias = JobText | Annotated[list[JobText], Items(64)] | Annotated[dict[str, JobText | Annotated[list[JobText], Items(64)]], Items(64)]
# One data.hf_dataset table: strings, and `config` (datasets.load_dataset's keyword arguments, where
# data_files is a string, a list or a map of splits to either).
JobDataset: TypeAlias = Annotated[dict[str, JobText | Annotated[dict[str, JobOption | JobFiles], Items(64)] | None], Items(16)]
JobScalar: TypeAlias = (
    Annotated[str, Str(4096)] | Annotated[int, Int(-MAX_INT, MAX_INT)] | Number | bool
    | Annotated[list[Annotated[str, Str(256)]], Items(64)]  # model.lora_keys
    | JobNumbers
    | Annotated[dict[str, JobOption], Items(64)]  # train.optimizer_config, train.lr_schedule
    | Annotated[list[JobDataset], Items(64)]  # data.hf_dataset
    | None
)
# Top level: name and base_dir (strings), priority (an integer, left out at 0), and the sections.
JobDoc: TypeAlias = Annotated[dict[str, Annotated[str, Str(4096)] | Annotated[int, Int(-MAX_INT, MAX_INT)] | Annotated[dict[str, JobScalar], Items(64)]], Items(16)]
Cursor: TypeAlias = Annotated[int, Int(0, MAX_INT)]
Limit: TypeAlias = Annotated[int, Int(0, 2**31 - 1)]  # rows asked for; more than PAGE_LIMIT gets PAGE_LIMIT
ExportId: TypeAlias = Token
ExportName: TypeAlias = Annotated[str, Str(EXPORT_NAME_MAX, 1)]
ChunkSize: TypeAlias = Annotated[int, Int(0, EXPORT_CHUNK_MAX + 1)]  # the coordinator answers bad_request outside 1..EXPORT_CHUNK_MAX
Chunk: TypeAlias = Annotated[bytes, Bytes(EXPORT_CHUNK_MAX)]
Files: TypeAlias = Annotated[list[ExportFile], Items(EXPORT_FILES_MAX)]
SlotList: TypeAlias = Annotated[list[SlotIndex], Items(MAX_SLOTS)]


# -- common ------------------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Error(Message):
    """The reply to anything that could not be served; `code` is an ErrorCode value. A message
    longer than ERROR_MESSAGE_MAX characters is cut to it."""

    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: Annotated[str, Str(64, 1)]
    message: Annotated[str, Str(ERROR_MESSAGE_MAX)]

    def __post_init__(self) -> None:
        if len(self.message) > ERROR_MESSAGE_MAX:
            object.__setattr__(self, "message", self.message[: ERROR_MESSAGE_MAX - 3] + "...")


# -- dpctl -> coordinator ----------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class Submit(Message):
    """Queue a job. `job` is `JobSpec.to_dict()`; the coordinator validates it again."""

    TYPE: ClassVar[MsgType] = MsgType.SUBMIT
    job: JobDoc
    source: Annotated[str, Str(4096)] = "<job>"


@message
@dataclass(frozen=True, slots=True)
class Submitted(Message):
    TYPE: ClassVar[MsgType] = MsgType.SUBMITTED
    job_id: JobId


@message
@dataclass(frozen=True, slots=True)
class Status(Message):
    """One job (`job` = an id, a unique id prefix, or a name: its newest job), or all when None.
    With `limit` (and no job): a page of the list, the `limit` newest jobs (capped at PAGE_LIMIT)
    submitted before job `before` (the previous page's last; None: the first page)."""

    TYPE: ClassVar[MsgType] = MsgType.STATUS
    job: JobRef | None = None
    limit: Limit | None = field(default=None, metadata=OMIT_NONE)
    before: JobRef | None = field(default=None, metadata=OMIT_NONE)
    active: bool | None = field(default=None, metadata=OMIT_NONE)  # true (and no job): every job not finished, newest first


@message
@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.STATUS_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    jobs: Annotated[list[JobStatus], Items(ROWS_MAX)]
    more: bool | None = field(default=None, metadata=OMIT_NONE)  # a page (status with `limit`): whether older jobs follow
    total: Count | None = field(default=None, metadata=OMIT_NONE)  # a page: every job the pool holds


@message
@dataclass(frozen=True, slots=True)
class Nodes(Message):
    TYPE: ClassVar[MsgType] = MsgType.NODES


@message
@dataclass(frozen=True, slots=True)
class NodesReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.NODES_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    nodes: Annotated[list[NodeRow], Items(ROWS_MAX)]


@message
@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """Metric rows after row `after` (0: from the start), at most `limit` (capped at PAGE_LIMIT)."""

    TYPE: ClassVar[MsgType] = MsgType.METRICS
    job: JobRef
    after: Cursor = 0
    limit: Limit = PAGE_LIMIT


@message
@dataclass(frozen=True, slots=True)
class MetricsReply(Message):
    """`cursor` is the `after` of the next page; `more` says whether there is one now."""

    TYPE: ClassVar[MsgType] = MsgType.METRICS_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    job_id: JobId
    rows: Annotated[list[MetricRow], Items(PAGE_LIMIT)]
    cursor: Cursor
    more: bool


@message
@dataclass(frozen=True, slots=True)
class Events(Message):
    TYPE: ClassVar[MsgType] = MsgType.EVENTS
    job: JobRef
    after: Cursor = 0
    limit: Limit = PAGE_LIMIT


@message
@dataclass(frozen=True, slots=True)
class EventsReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.EVENTS_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    job_id: JobId
    events: Annotated[list[EventRow], Items(PAGE_LIMIT)]
    cursor: Cursor
    more: bool


@message
@dataclass(frozen=True, slots=True)
class Samples(Message):
    TYPE: ClassVar[MsgType] = MsgType.SAMPLES
    job: JobRef
    after: Cursor = 0
    limit: Limit = PAGE_LIMIT


@message
@dataclass(frozen=True, slots=True)
class SamplesReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.SAMPLES_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    job_id: JobId
    rows: Annotated[list[SampleRow], Items(PAGE_LIMIT)]
    cursor: Cursor
    more: bool


@message
@dataclass(frozen=True, slots=True)
class Logs(Message):
    """Worker output lines after sequence number `after`; `rank` None means every rank."""

    TYPE: ClassVar[MsgType] = MsgType.LOGS
    job: JobRef
    after: Cursor = 0
    rank: Rank | None = None
    limit: Limit = PAGE_LIMIT


@message
@dataclass(frozen=True, slots=True)
class LogsReply(Message):
    """`lines`: [{"seq", "t", "rank", "generation", "text"}]; `state` lets `--follow` stop."""

    TYPE: ClassVar[MsgType] = MsgType.LOGS_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    job_id: JobId
    lines: Annotated[list[LogLine], Items(PAGE_LIMIT)]
    cursor: Cursor
    more: bool
    state: Name


@message
@dataclass(frozen=True, slots=True)
class Cancel(Message):
    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    job: JobRef


@message
@dataclass(frozen=True, slots=True)
class CancelReply(Message):
    """`state` is the job's state after the request (a finished job keeps its own)."""

    TYPE: ClassVar[MsgType] = MsgType.CANCEL_REPLY
    job_id: JobId
    state: Name


@message
@dataclass(frozen=True, slots=True)
class Drain(Message):
    """Its groups checkpoint and restart without it; the node takes no new work until undrain."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN
    node: NodeName


@message
@dataclass(frozen=True, slots=True)
class DrainReply(Message):
    """`state`: the node's state after the request (`draining` while its workers leave)."""

    TYPE: ClassVar[MsgType] = MsgType.DRAIN_REPLY
    node: NodeName
    state: Name
    reason: Text | None = None


@message
@dataclass(frozen=True, slots=True)
class Undrain(Message):
    """Take work again (also lifts a node set aside after repeated failures)."""

    TYPE: ClassVar[MsgType] = MsgType.UNDRAIN
    node: NodeName


@message
@dataclass(frozen=True, slots=True)
class UndrainReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.UNDRAIN_REPLY
    node: NodeName
    state: Name
    reason: Text | None = None


@message
@dataclass(frozen=True, slots=True)
class Export(Message):
    """Export a job's trained result: its newest checkpoint held by a live node, or step `step`.

    The coordinator has a node holding it run the trainer's `--export` and answers, once that is
    done, with the manifest; the client then reads the files (export.read) and closes the export."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT
    job: JobRef
    step: Step | None = None
    # What is made (absent: the adapters or the model, as before): `dpctl export --fuse
    # [--dequantize]`, or `dpctl test` (the checkpoint's test loss, as the one file test.json).
    fuse: bool | None = field(default=None, metadata=OMIT_NONE)
    dequantize: bool | None = field(default=None, metadata=OMIT_NONE)
    test: bool | None = field(default=None, metadata=OMIT_NONE)


@message
@dataclass(frozen=True, slots=True)
class ExportReply(Message):
    """The export is ready on `node`. `files`: [{"name", "bytes", "sha256"}]; a name is a relative
    path of "/"-separated parts (the client checks it before writing anything)."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_REPLY
    export_id: ExportId
    job_id: JobId
    node: NodeName
    step: Step
    files: Files


@message
@dataclass(frozen=True, slots=True)
class ExportRead(Message):
    """`size` bytes (at most EXPORT_CHUNK_MAX) of file `name` of an export, from `offset`. Only the
    connection that asked for the export may read it."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_READ
    export_id: ExportId
    name: ExportName
    offset: Count
    size: ChunkSize = EXPORT_CHUNK_MAX


@message
@dataclass(frozen=True, slots=True)
class ExportData(Message):
    """Exactly min(size, file size - offset) bytes: empty only at the end of the file."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_DATA
    export_id: ExportId
    name: ExportName
    offset: Count
    data: Chunk


@message
@dataclass(frozen=True, slots=True)
class ExportClose(Message):
    """The client is done (or gives up): the node deletes the export's files."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_CLOSE
    export_id: ExportId


@message
@dataclass(frozen=True, slots=True)
class ExportClosed(Message):
    TYPE: ClassVar[MsgType] = MsgType.EXPORT_CLOSED
    export_id: ExportId


@message
@dataclass(frozen=True, slots=True)
class Rm(Message):
    """Remove a finished job: its rows in the coordinator's database and, on every node, its run
    dirs and checkpoints. A job that has not finished is refused (`not_finished`)."""

    TYPE: ClassVar[MsgType] = MsgType.RM
    job: JobRef


@message
@dataclass(frozen=True, slots=True)
class RmReply(Message):
    """`rows`: what was deleted from the database; `nodes`: the nodes told to delete the job's
    folder now; `later`: the nodes the coordinator knows that are not connected, told when they
    register again."""

    TYPE: ClassVar[MsgType] = MsgType.RM_REPLY
    MAX_OBJECTS: ClassVar[int] = REPLY_OBJECTS
    MAX_BYTES: ClassVar[int] = REPLY_BODY_BYTES
    job_id: JobId
    state: Name
    rows: RemovedRows
    nodes: Annotated[list[NodeName], Items(ROWS_MAX)]
    later: Annotated[list[NodeName], Items(ROWS_MAX)]


def export_name_problem(name: Any) -> str | None:
    """None when `name` is a safe relative file name inside an export folder, else what is wrong.

    Safe: "/"-separated parts, each 1-255 printable characters, none "." or "..", no backslash, at
    most 8 parts and 1024 characters in all. So a name can never reach outside the folder the
    client writes to, whatever the peer that sent it."""
    if not isinstance(name, str):
        return f"a file name must be a string, got {type(name).__name__}"
    if not 0 < len(name) <= EXPORT_NAME_MAX:
        return f"file name of {len(name)} characters (allowed 1-{EXPORT_NAME_MAX})"
    if name.startswith("/") or "\\" in name or not name.isprintable():
        return f"file name {name[:200]!r} is absolute or holds a backslash or an unprintable character"
    parts = name.split("/")
    if len(parts) > EXPORT_NAME_DEPTH_MAX or any(p in ("", ".", "..") or len(p) > EXPORT_NAME_PART_MAX for p in parts):
        return f"file name {name[:200]!r} is not a plain relative path (empty, '.' or '..' parts, or too deep)"
    return None



# -- dpd -> coordinator ------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class NodeRegister(Message):
    """A daemon joining (or re-joining) the pool.

    `incarnation` is random per daemon process: the same name with the same incarnation is a
    re-registration, with another one while the first is alive a duplicate. `info`: the machine
    (`NodeInfo`). `running`: the workers alive now; `exited`: the daemon's newest worker exits
    (their node.worker_exited may have been lost with the link). `holdings`: the newest checkpoint
    each slot's run dir holds.
    """

    TYPE: ClassVar[MsgType] = MsgType.NODE_REGISTER
    name: JoiningName
    incarnation: Token
    info: NodeInfo
    running: Annotated[list[RunningWorker], Items(MAX_SLOTS)] = field(default_factory=list)
    exited: Annotated[list[ExitedWorker], Items(EXITS_MAX)] = field(default_factory=list)
    holdings: Annotated[list[Holding], Items(HOLDINGS_MAX)] = field(default_factory=list)


@message
@dataclass(frozen=True, slots=True)
class NodeRegistered(Message):
    """Welcome; the coordinator's heartbeat interval and liveness, which the daemon adopts."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_REGISTERED
    heartbeat_s: Annotated[float, Float(0.001, 3600.0)]
    liveness: Annotated[int, Int(1, 1000)]


@message
@dataclass(frozen=True, slots=True)
class NodeHeartbeat(Message):
    """Sent every heartbeat period, and at once on a `group.stop now` (the answer the coordinator
    waits for). `workers`: the workers alive now, so the coordinator frees slots whose workers are
    gone. `heartbeat_s`: the period the daemon heartbeats at, sent only once a `coord.heartbeat`
    has told it one (an older coordinator never does, so never gets the field)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_HEARTBEAT
    workers: Annotated[list[AliveWorker], Items(MAX_SLOTS)] = field(default_factory=list)
    heartbeat_s: Annotated[float, Float(0.001, 3600.0)] | None = field(default=None, metadata=OMIT_NONE)


@message
@dataclass(frozen=True, slots=True)
class NodeBye(Message):
    """The daemon is stopping (its workers are stopped); its name is free again."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_BYE


@message
@dataclass(frozen=True, slots=True)
class NodePrepared(Message):
    """Reply to group.prepare: one free TCP port per prepared slot on `host` (empty when refused)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_PREPARED
    job: JobId
    generation: Generation
    host: Annotated[str, Str(255)]
    ports: Annotated[list[Port], Items(MAX_SLOTS)]
    error: Text | None = None


@message
@dataclass(frozen=True, slots=True)
class NodeWorkerStarted(Message):
    TYPE: ClassVar[MsgType] = MsgType.NODE_WORKER_STARTED
    job: JobId
    generation: Generation
    rank: Rank
    slot: SlotIndex
    pid: Pid


@message
@dataclass(frozen=True, slots=True)
class NodeWorkerHello(Message):
    """A worker's group is up and its checkpoint loaded (relayed worker.hello)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_WORKER_HELLO
    job: JobId
    generation: Generation
    rank: Rank
    pid: Pid
    resume_step: Step


@message
@dataclass(frozen=True, slots=True)
class NodeWaiting(Message):
    """One rank has computed its part of step `step` and waited on its peers for a while
    (relayed worker.waiting, once per rank and step, only after WAITING_SAID_S): when the group
    stalls, the ranks that never said it for the next step are the ones that froze."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_WAITING
    job: JobId
    generation: Generation
    rank: Rank
    step: Step


@message
@dataclass(frozen=True, slots=True)
class NodeProgress(Message):
    """One rank finished one step (relayed worker.progress). `loss` is null when not finite;
    `resplit`: the next step runs under a new split (the progress watch allows it a compile);
    `gather`: the outer step that ends at this step gathers replica states (allowed their bytes)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_PROGRESS
    job: JobId
    generation: Generation
    rank: Rank
    step: Step
    loss: Number | None
    tokens: Count
    seconds: Seconds
    resplit: bool = False
    gather: bool = False


@message
@dataclass(frozen=True, slots=True)
class NodeMetric(Message):
    TYPE: ClassVar[MsgType] = MsgType.NODE_METRIC
    job: JobId
    generation: Generation
    row: MetricRow


@message
@dataclass(frozen=True, slots=True)
class NodeSample(Message):
    TYPE: ClassVar[MsgType] = MsgType.NODE_SAMPLE
    job: JobId
    generation: Generation
    row: SampleRow


@message
@dataclass(frozen=True, slots=True)
class NodeCheckpoint(Message):
    """Rank `rank`'s step-`step` checkpoint is durable on this node (in slot `slot`'s run dir);
    `memory`: it is the state kept in memory after every step (it outlives the trainer, not the
    machine): a holding to resume from, not a checkpoint of the job's record."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_CHECKPOINT
    job: JobId
    generation: Generation
    rank: Rank
    slot: SlotIndex
    step: Step
    seconds: Seconds
    memory: bool = False


@message
@dataclass(frozen=True, slots=True)
class NodeLogs(Message):
    """Output lines of one worker, batched (stdout and stderr merged, in order)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_LOGS
    job: JobId
    generation: Generation
    rank: Rank
    lines: Annotated[list[Annotated[str, Str(LOG_LINE_MAX)]], Items(LOG_LINES_MAX)]


@message
@dataclass(frozen=True, slots=True)
class NodeWorkerExited(Message):
    """A worker process ended. `code` is its exit status (negative: killed by that signal);
    `stopped` says the daemon stopped it (group.stop or dpd shutting down); `error` is the last
    `error: ...` line the trainer printed (printable, one line, at most ERROR_LINE_MAX characters,
    without the prefix), or None."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_WORKER_EXITED
    job: JobId
    generation: Generation
    rank: Rank
    slot: SlotIndex
    code: ExitCode
    stopped: bool
    error: Annotated[str, Str(ERROR_LINE_MAX)] | None = None


@message
@dataclass(frozen=True, slots=True)
class NodeExportReady(Message):
    """Answers export.prepare (same id): the trainer wrote the export of `step`; `files` as in
    export.reply. A node that cannot make it answers `error` with that id instead."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_EXPORT_READY
    export_id: ExportId
    step: Step
    files: Files


@message
@dataclass(frozen=True, slots=True)
class NodeExportData(Message):
    """Answers export.fetch (same id) with exactly min(size, file size - offset) bytes."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_EXPORT_DATA
    export_id: ExportId
    name: ExportName
    offset: Count
    data: Chunk


@message
@dataclass(frozen=True, slots=True)
class NodeRemoved(Message):
    """Answers job.remove: the node's folder of the job is gone (or it never had one)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_REMOVED
    job: JobId


@message
@dataclass(frozen=True, slots=True)
class NodeWarmed(Message):
    """Answers job.warm: a warm trainer of the job is ready in each of `slots` (`error`: none
    will be, and why)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_WARMED
    job: JobId
    slots: SlotList
    error: Text | None = None


# -- coordinator -> dpd ------------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class CoordHeartbeat(Message):
    """The coordinator is alive. With `heartbeat_s` and `liveness` (left off otherwise): the
    node's new heartbeat period, as the pool grew or shrank (daemon/cadence.py), which it adopts
    and acknowledges on a `node.heartbeat` sent at once."""

    TYPE: ClassVar[MsgType] = MsgType.COORD_HEARTBEAT
    heartbeat_s: Annotated[float, Float(0.001, 3600.0)] | None = field(default=None, metadata=OMIT_NONE)
    liveness: Annotated[int, Int(1, 1000)] | None = field(default=None, metadata=OMIT_NONE)


@message
@dataclass(frozen=True, slots=True)
class GroupPrepare(Message):
    """Phase 1 of a start: reserve one TCP port on the node's advertised address per slot."""

    TYPE: ClassVar[MsgType] = MsgType.GROUP_PREPARE
    job: JobId
    generation: Generation
    slots: SlotList


@message
@dataclass(frozen=True, slots=True)
class GroupStart(Message):
    """Phase 2: start the node's ranks. `ranks`: which slot runs which rank on this node;
    `hostfile`: one ["ip:port"] per rank of the whole group; `shares`: sequences per rank (index =
    rank); `resume_max`: resume from no later step than this (the coordinator's record of the
    job's metrics would otherwise have a gap)."""

    TYPE: ClassVar[MsgType] = MsgType.GROUP_START
    SHARED: ClassVar[frozenset[str]] = frozenset({"spec", "shares", "hostfile"})
    job: JobId
    generation: Generation
    spec: JobDoc
    ranks: Annotated[list[RankSlot], Items(MAX_SLOTS)]
    shares: Shares
    hostfile: Annotated[list[Annotated[list[Annotated[str, Str(300)]], Items(16)]], Items(MAX_WORLD)]
    resume_max: Step | None = None


@message
@dataclass(frozen=True, slots=True)
class GroupStop(Message):
    """Stop the node's workers of this job and generation (generation 0: of any generation).
    mode "now": SIGTERM, then SIGKILL after the grace; "checkpoint": ask them (worker.stop) to
    checkpoint at the next step boundary and exit 75."""

    TYPE: ClassVar[MsgType] = MsgType.GROUP_STOP
    job: JobId
    generation: Generation
    mode: Annotated[str, OneOf("now", "checkpoint")] = "now"


@message
@dataclass(frozen=True, slots=True)
class ExportPrepare(Message):
    """Run the trainer's `--export` on this node's copy of job `job`'s checkpoint `step` (None: the
    newest it holds) into a temporary folder kept as `export_id`. Answered, with this message's id,
    by node.export_ready or `error` (not_found: no such checkpoint here; bad_request: the trainer
    refused it; export_failed: it crashed or timed out)."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_PREPARE
    export_id: ExportId
    job: JobId
    step: Step | None = None
    fuse: bool | None = field(default=None, metadata=OMIT_NONE)  # as in `export`: the trainer's --fuse, --dequantize, --test
    dequantize: bool | None = field(default=None, metadata=OMIT_NONE)
    test: bool | None = field(default=None, metadata=OMIT_NONE)


@message
@dataclass(frozen=True, slots=True)
class ExportFetch(Message):
    """Read part of one file of a prepared export; answered with node.export_data or `error`."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_FETCH
    export_id: ExportId
    name: ExportName
    offset: Count
    size: ChunkSize


@message
@dataclass(frozen=True, slots=True)
class ExportRelease(Message):
    """Delete a prepared export's files (the client is done, gave up, or went away). No answer."""

    TYPE: ClassVar[MsgType] = MsgType.EXPORT_RELEASE
    export_id: ExportId


@message
@dataclass(frozen=True, slots=True)
class JobWarm(Message):
    """Start a warm trainer of the job in each of `slots` (free ones), ahead of a group that will
    include them: the running group trains on meanwhile. Answered by node.warmed."""

    TYPE: ClassVar[MsgType] = MsgType.JOB_WARM
    SHARED: ClassVar[frozenset[str]] = frozenset({"spec"})
    job: JobId
    spec: JobDoc
    slots: SlotList


@message
@dataclass(frozen=True, slots=True)
class JobEnded(Message):
    """The job is over (succeeded, failed or cancelled): what a node kept for its restarts (warm
    trainers, the state in memory) goes; its checkpoints on disk stay. No answer."""

    TYPE: ClassVar[MsgType] = MsgType.JOB_ENDED
    job: JobId


@message
@dataclass(frozen=True, slots=True)
class JobRemove(Message):
    """Delete this node's folder of a removed job (`STATE/jobs/JOB`: its run dirs and checkpoints),
    once no worker of it runs here; answered `node.removed` when it is gone."""

    TYPE: ClassVar[MsgType] = MsgType.JOB_REMOVE
    job: JobId


# -- trainer <-> its dpd -----------------------------------------------------------------------


@message
@dataclass(frozen=True, slots=True)
class WorkerHello(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_HELLO
    rank: Rank
    world_size: WorldSize
    generation: Generation
    pid: Pid
    resume_step: Step


@message
@dataclass(frozen=True, slots=True)
class WorkerProgress(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_PROGRESS
    step: Step
    loss: Number | None
    tokens: Count
    seconds: Seconds
    resplit: bool = False
    gather: bool = False


@message
@dataclass(frozen=True, slots=True)
class WorkerWaiting(Message):
    """This rank's own part of step `step` is done and it now waits on its peers (the co-located
    barrier, then the all_sum): a rank frozen inside a step never says it, so a stall can name
    the rank that froze rather than the ranks that wait for it."""

    TYPE: ClassVar[MsgType] = MsgType.WORKER_WAITING
    step: Step


@message
@dataclass(frozen=True, slots=True)
class WorkerMetric(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_METRIC
    row: MetricRow


@message
@dataclass(frozen=True, slots=True)
class WorkerSample(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_SAMPLE
    row: SampleRow


@message
@dataclass(frozen=True, slots=True)
class WorkerCheckpoint(Message):
    TYPE: ClassVar[MsgType] = MsgType.WORKER_CHECKPOINT
    step: Step
    seconds: Seconds
    memory: bool = False


@message
@dataclass(frozen=True, slots=True)
class WorkerStop(Message):
    """dpd -> trainer: checkpoint at the next step boundary, then exit 75."""

    TYPE: ClassVar[MsgType] = MsgType.WORKER_STOP


@message
@dataclass(frozen=True, slots=True)
class WorkerReady(Message):
    """A warm trainer (`--warm`): MLX imported, the job's model and data built; waiting for
    `worker.go`."""

    TYPE: ClassVar[MsgType] = MsgType.WORKER_READY
    pid: Pid


@message
@dataclass(frozen=True, slots=True)
class WorkerGo(Message):
    """dpd -> warm trainer: join generation `generation` as rank `rank`. `hostfile`: the path of
    the group's ring hostfile on this machine (None: a group of one)."""

    TYPE: ClassVar[MsgType] = MsgType.WORKER_GO
    rank: Rank
    generation: Generation
    shares: Shares
    hostfile: Annotated[str, Str(4096)] | None = None
    resume_max: Step | None = None


# Who accepts what: a receiver names the types it takes, and a frame of another type is refused
# from its header, before its body is read (a `status.reply` sent to the coordinator is not
# unpacked, whatever it holds).
FROM_CLIENT = frozenset({
    MsgType.SUBMIT, MsgType.STATUS, MsgType.NODES, MsgType.METRICS, MsgType.EVENTS, MsgType.SAMPLES,
    MsgType.LOGS, MsgType.CANCEL, MsgType.DRAIN, MsgType.UNDRAIN, MsgType.EXPORT, MsgType.EXPORT_READ,
    MsgType.EXPORT_CLOSE, MsgType.RM, MsgType.STAGE_OFFER, MsgType.CACHE, MsgType.CACHE_PRUNE,
    MsgType.QUEUE, MsgType.PRIORITY,
})
FROM_NODE = frozenset(t for t in MsgType if t.value.startswith("node.") and t is not MsgType.NODE_REGISTERED)
TO_NODE = frozenset({
    MsgType.NODE_REGISTERED, MsgType.COORD_HEARTBEAT, MsgType.GROUP_PREPARE, MsgType.GROUP_START,
    MsgType.GROUP_STOP, MsgType.EXPORT_PREPARE, MsgType.EXPORT_FETCH, MsgType.EXPORT_RELEASE, MsgType.JOB_REMOVE,
    MsgType.JOB_WARM, MsgType.JOB_ENDED, MsgType.JOB_STAGE, MsgType.STAGE_PRUNE, MsgType.STAGE_ACCEPT, MsgType.STAGE_PEERS, MsgType.ERROR,
})
FROM_WORKER = frozenset(t for t in MsgType if t.value.startswith("worker.") and t not in (MsgType.WORKER_STOP, MsgType.WORKER_GO))
COORDINATOR_ACCEPTS = FROM_CLIENT | FROM_NODE | {MsgType.ERROR}
TO_CLIENT = frozenset({
    MsgType.SUBMITTED, MsgType.STATUS_REPLY, MsgType.NODES_REPLY, MsgType.METRICS_REPLY, MsgType.EVENTS_REPLY,
    MsgType.SAMPLES_REPLY, MsgType.LOGS_REPLY, MsgType.CANCEL_REPLY, MsgType.DRAIN_REPLY, MsgType.UNDRAIN_REPLY,
    MsgType.EXPORT_REPLY, MsgType.EXPORT_DATA, MsgType.EXPORT_CLOSED, MsgType.RM_REPLY, MsgType.STAGE_OFFER_REPLY, MsgType.CACHE_REPLY, MsgType.CACHE_PRUNE_REPLY, MsgType.ERROR,
    MsgType.QUEUE_REPLY, MsgType.PRIORITY_REPLY,
})
TO_WORKER = frozenset({MsgType.WORKER_STOP, MsgType.WORKER_GO})


# ---------------------------------------------------------------------------------------------
# Decoding.


def _unpack(data: bytes, max_items: int = 16) -> Any:
    # strict_map_key: only str map keys; the limits bound what one container may hold (the body's
    # total is counted before this, by count_objects).
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_str_len=MAX_BODY_BYTES,
        max_bin_len=MAX_BODY_BYTES,
        max_array_len=max_items,
        max_map_len=max_items,
        max_ext_len=0,
    )


def decode_header(frame: bytes) -> tuple[MsgType, int]:
    """The type and id of a message, from its header frame; raises ProtocolError."""
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header is {len(frame)} bytes, cap {MAX_HEADER_BYTES}")
    try:
        header = _unpack(frame)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not msgpack: {type(e).__name__}") from None
    if not (isinstance(header, list) and len(header) == 4):
        raise ProtocolError(ErrorCode.BAD_FRAME, "header must be [protocol, version, type, id]")
    proto, version, type_name, msg_id = header
    if not isinstance(msg_id, int) or isinstance(msg_id, bool) or not 0 <= msg_id < 2**63:
        raise ProtocolError(ErrorCode.BAD_FRAME, "header id must be an integer in [0, 2^63)")
    if proto != PROTOCOL or not isinstance(version, int) or isinstance(version, bool):
        raise ProtocolError(ErrorCode.BAD_VERSION, f"not a {PROTOCOL} header: protocol {proto!r}", msg_id)
    if version != VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"protocol version {version} is not supported; this peer speaks {VERSION}", msg_id
        )
    try:
        return MsgType(type_name), msg_id
    except ValueError:
        shown = repr(type_name)[:64]
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {shown}", msg_id) from None


def decode(frames: list[bytes], accept: Collection[MsgType] | None = None) -> tuple[Message, int]:
    """A message and its id from its two frames (routing id already removed); raises ProtocolError.
    `accept`: the types this receiver takes (None: any); another is refused before its body is read."""
    if len(frames) != MAX_FRAMES:
        msg_id = 0
        if frames:
            try:
                _, msg_id = decode_header(frames[0])
            except ProtocolError as e:
                msg_id = e.msg_id
        got = len(frames) if len(frames) <= MAX_FRAMES else f"more than {MAX_FRAMES}"
        raise ProtocolError(ErrorCode.BAD_FRAME, f"expected 2 frames (header, body), got {got}", msg_id)
    msg_type, msg_id = decode_header(frames[0])
    if accept is not None and msg_type not in accept:
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{msg_type} is not accepted here", msg_id)
    cls = REGISTRY.get(msg_type)
    if cls is None:  # a type whose module this process never imported: it takes no such message
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{msg_type} is not accepted here", msg_id)
    if len(frames[1]) > cls.MAX_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{msg_type} body is {len(frames[1])} bytes, cap {cls.MAX_BYTES}", msg_id)
    if len(frames[1]) > cls.MAX_OBJECTS and count_objects(frames[1], cls.MAX_OBJECTS) is None:  # every object takes a byte
        raise ProtocolError(ErrorCode.TOO_LARGE, f"{msg_type} body holds more than {cls.MAX_OBJECTS} objects", msg_id)
    try:
        body = _unpack(frames[1], cls.MAX_OBJECTS)
    except Exception as e:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not msgpack: {type(e).__name__}", msg_id) from None
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_BODY, "body must be a map", msg_id)
    return cls.from_body(body, msg_id), msg_id


def error_frames(err: ProtocolError) -> list[bytes]:
    return Error(code=str(err.code), message=err.message).to_frames(err.msg_id)
