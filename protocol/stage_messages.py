"""The messages of staging: whether a node can serve a job, and where the job's files are.

    coordinator -> dpd    job.stage          check (and fetch what is missing of) the job's files;
                                             re-sent when the holders of its content change
    dpd -> coordinator    node.staged        ready, staging (with progress) or unfit (with why);
                                             also says which content this node holds, and where
                                             its data channel listens
    dpctl -> coordinator  stage.offer        before a submit: which of these digests does the pool
                                             hold, and which node takes an upload of the rest
                          stage.offer.reply
    dpctl -> coordinator  cache, cache.prune what each node's cache holds (as the nodes last said);
                                             prune the trees no live job uses, on one node or all
    coordinator -> dpd    stage.prune        prune this node's cache (answered by node.staged about
                                             no job, with what it holds now)
    coordinator -> dpd    stage.accept       take this client's upload of these digests (with keys,
                                             a client may put nothing else)
    coordinator -> dpd    stage.peers        the pool's node keys: with keys, only they may read
                                             this node's data channel

The bytes themselves never travel here: they go on each dpd's data channel (staging/README.md).
Registered in messages.REGISTRY on import; a process that does not import this module refuses
these types as unexpected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, TypeAlias

from dpool.protocol.messages import JobDoc, Message, MsgType, message
from dpool.protocol.payloads import Count, JobId, NodeName, Text
from dpool.protocol.schema import Float, Items, OneOf, Record, Str, record

DIGESTS_MAX = 16  # content digests one message names (a job has two: data and model)
SOURCES_MAX = 256  # holders named for one digest
MAX_PEERS = 16384  # node keys one job.stage names
CACHE_ROWS_MAX = 1024  # trees one node's cache lists
Digest: TypeAlias = Annotated[str, Str(64, 64)]
Endpoint: TypeAlias = Annotated[str, Str(300)]  # tcp://host:port
PublicKey: TypeAlias = Annotated[str, Str(40)]  # z85; "" on a pool without keys


@record
@dataclass(frozen=True, slots=True)
class StageSource(Record):
    """A node that holds content `digest` (or, `partial`, is fetching it and serves what it has),
    and its data channel."""

    digest: Digest
    node: NodeName
    endpoint: Endpoint
    key: PublicKey = ""
    partial: bool = False


@record
@dataclass(frozen=True, slots=True)
class CacheRow(Record):
    """One tree in a node's staging cache (`dpctl cache --json`'s object, with `node`)."""

    digest: Digest
    bytes: Count
    files: Count
    last_used: Annotated[float, Float(0.0, 1e11)]
    complete: bool
    pinned: bool  # a live job uses it: never evicted
    adopted: Annotated[str, Str(4096)] | None = None  # served from this folder outside the cache (the node's own copy)
    node: Annotated[str, Str(63)] = ""
    held: Count | None = None  # of `bytes`, what the node holds verified (a tree being fetched: part of them)


@message
@dataclass(frozen=True, slots=True)
class JobStage(Message):
    """Can this node serve the job? Check its files (its own copy at the job's paths, or its cache)
    and fetch what it lacks from `sources`. Answered by node.staged, at once and as it progresses."""

    TYPE: ClassVar[MsgType] = MsgType.JOB_STAGE
    SHARED: ClassVar[frozenset[str]] = frozenset({"spec"})
    job: JobId
    spec: JobDoc
    sources: Annotated[list[StageSource], Items(DIGESTS_MAX * SOURCES_MAX)] = field(default_factory=list)
    rate_bps: Annotated[float, Float(0.0, 1e13)] = 0.0  # pace the fetch to this (its sources train); 0: unpaced


@message
@dataclass(frozen=True, slots=True)
class NodeStaged(Message):
    """Where this node stands with a job's files: "checking", "staging" (fetching: `done_bytes` of
    `total_bytes`, at `rate_bps`), "ready", or "unfit" (`reason`: it sits this job out). `holds`:
    the content digests this node serves (complete); `endpoint`/`key`: its data channel. `asked`:
    which version of the job the answer is about (the job names its content once a node found it)."""

    TYPE: ClassVar[MsgType] = MsgType.NODE_STAGED
    job: JobId
    state: Annotated[str, OneOf("checking", "staging", "ready", "unfit")]
    reason: Text | None = None
    done_bytes: Count = 0
    total_bytes: Count = 0
    rate_bps: Annotated[float, Float(0.0, 1e13)] = 0.0
    holds: Annotated[list[Digest], Items(DIGESTS_MAX)] = field(default_factory=list)
    endpoint: Endpoint = ""
    key: PublicKey = ""
    cached: Annotated[list[CacheRow], Items(CACHE_ROWS_MAX)] | None = None  # what its cache holds (None: unchanged)
    found_data: Digest | None = None  # a job that names no content: the digest of the data it found at the job's path
    found_model: Digest | None = None  # ... and of the model
    asked: Annotated[list[Digest], Items(3)] | None = None  # the content the answered job.stage's spec named, sorted (None: an older node)


@message
@dataclass(frozen=True, slots=True)
class StageOffer(Message):
    """dpctl holds these trees (by digest) and is about to submit a job that names them."""

    TYPE: ClassVar[MsgType] = MsgType.STAGE_OFFER
    digests: Annotated[list[Digest], Items(DIGESTS_MAX)]
    exclude: Annotated[list[NodeName], Items(SOURCES_MAX)] = field(default_factory=list)  # nodes that could not take an upload


@message
@dataclass(frozen=True, slots=True)
class StageOfferReply(Message):
    """`held`: the digests some node holds already (nothing to send). The rest go to `target`'s data
    channel (`endpoint`, `key`), which accepts them from this client; `target` "" when no node can
    take them now (dpctl then says so)."""

    TYPE: ClassVar[MsgType] = MsgType.STAGE_OFFER_REPLY
    held: Annotated[list[Digest], Items(DIGESTS_MAX)]
    target: Annotated[str, Str(63)] = ""
    endpoint: Endpoint = ""
    key: PublicKey = ""


@message
@dataclass(frozen=True, slots=True)
class Cache(Message):
    """What the nodes' staging caches hold (`node`: one node's only)."""

    TYPE: ClassVar[MsgType] = MsgType.CACHE
    node: Annotated[str, Str(63)] | None = None


@message
@dataclass(frozen=True, slots=True)
class CacheReply(Message):
    TYPE: ClassVar[MsgType] = MsgType.CACHE_REPLY
    rows: Annotated[list[CacheRow], Items(CACHE_ROWS_MAX * 64)]


@message
@dataclass(frozen=True, slots=True)
class CachePrune(Message):
    """Prune the trees no live job uses, on `node` (None: every live node)."""

    TYPE: ClassVar[MsgType] = MsgType.CACHE_PRUNE
    node: Annotated[str, Str(63)] | None = None


@message
@dataclass(frozen=True, slots=True)
class CachePruneReply(Message):
    """The nodes asked to prune; each says what it holds after (`cache` shows it)."""

    TYPE: ClassVar[MsgType] = MsgType.CACHE_PRUNE_REPLY
    nodes: Annotated[list[NodeName], Items(100_000)]


@message
@dataclass(frozen=True, slots=True)
class StagePrune(Message):
    """Prune this node's cache: every tree no live job of this node uses. No answer but a
    node.staged about no job, with `cached`."""

    TYPE: ClassVar[MsgType] = MsgType.STAGE_PRUNE


@message
@dataclass(frozen=True, slots=True)
class StageAccept(Message):
    """Take an upload of `digests` from client `client` (its public key `key`): it offered them
    before a submit and this node is the target (stage.offer.reply). No answer. Good for
    ACCEPT_S; with keys, a client may put nothing else."""

    TYPE: ClassVar[MsgType] = MsgType.STAGE_ACCEPT
    key: PublicKey
    client: Annotated[str, Str(63, 1)]
    digests: Annotated[list[Digest], Items(DIGESTS_MAX)]


@message
@dataclass(frozen=True, slots=True)
class StagePeers(Message):
    """The public keys of the pool's nodes (their data channels): with keys, only they may read
    this node's data channel. Sent to every node whenever the set changes. No answer."""

    TYPE: ClassVar[MsgType] = MsgType.STAGE_PEERS
    peers: Annotated[list[PublicKey], Items(MAX_PEERS)]


ACCEPT_S = 3600.0  # how long a node takes a client's upload after the coordinator said so
