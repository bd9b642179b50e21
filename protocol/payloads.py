"""The records nested in message bodies, and the bounded types their fields and the messages' use.

One frozen record per kind of map on the wire: what a node says about itself (`NodeInfo`), the
workers it runs and the ones that exited, the checkpoints it holds, a trainer's metrics and sample
rows, and the rows of the coordinator's replies (`JobStatus`, `NodeRow`, `EventRow`, `LogLine`).
The daemon builds them, `decode` validates them, and dpctl, `watch`, `plot` and the demo read them;
`to_wire()` is the map that travels, and what `--json` prints.

The bounds are the real ranges where there is one (a slot of a node, a port, an exit code) and
2^53 - 1 where there is none (a step, a byte count): an integer beyond that is never exact in JSON.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeAlias

from dpool.protocol.schema import (
    MAX_INT,
    OMIT_NONE,
    Float,
    Int,
    Invalid,
    Items,
    OneOf,
    Record,
    Str,
    check_fields,
    record,
)

MAX_SLOTS = 1024  # worker slots one node offers
MAX_WORLD = 16384  # ranks in one group
MAX_GENERATION = 2**31 - 1
MAX_PID = 2**31 - 1
MAX_SECONDS = 1e7  # a step, a checkpoint: longer than 115 days is not a measurement
ERROR_LINE_MAX = 400  # characters of a trainer's `error: ...` line carried in node.worker_exited
LOG_LINE_MAX = 8192  # characters of one output line of a worker
EVENT_FIELDS_MAX = 32
TEXT_MAX = 1024 * 1024  # a generated sample
ROWS_MAX = 100_000  # rows in one reply (paged replies hold PAGE_LIMIT; status and nodes list all)

# -- bounded scalars -----------------------------------------------------------------------------

Count: TypeAlias = Annotated[int, Int(0, MAX_INT)]  # steps, tokens, bytes, offsets, cursors
Step: TypeAlias = Annotated[int, Int(0, MAX_INT)]
Generation: TypeAlias = Annotated[int, Int(0, MAX_GENERATION)]
Rank: TypeAlias = Annotated[int, Int(0, MAX_WORLD - 1)]
WorldSize: TypeAlias = Annotated[int, Int(1, MAX_WORLD)]
SlotIndex: TypeAlias = Annotated[int, Int(0, MAX_SLOTS - 1)]
Slots: TypeAlias = Annotated[int, Int(1, MAX_SLOTS)]
Pid: TypeAlias = Annotated[int, Int(0, MAX_PID)]  # 0: not known
Port: TypeAlias = Annotated[int, Int(1, 65535)]
ExitCode: TypeAlias = Annotated[int, Int(-128, 255)]  # negative: killed by that signal
Seconds: TypeAlias = Annotated[float, Float(0.0, MAX_SECONDS)]
Number: TypeAlias = Annotated[float, Float()]  # any finite number
UnixTime: TypeAlias = Annotated[float, Float(0.0, 1e11)]
JobId: TypeAlias = Annotated[str, Str(128, 1)]  # `<name>-<6 hex>`
JobRef: TypeAlias = Annotated[str, Str(128, 1)]  # an id, a unique id prefix, or a job name
NodeName: TypeAlias = Annotated[str, Str(63, 1)]
# What a dpd may call itself (`--name`, node.register) and a key may be named (`dpctl keys`): a host
# name's characters in lower case, so that a name is never a path ('/', '..'), a flag ('-'), a
# terminal's control sequence, nor two names one key file on a Mac's case-insensitive disk.
NODE_NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,62}"
NODE_NAME_MEANS = "1-63 lower-case letters, digits, '.', '_' and '-', starting with a letter or a digit"
JoiningName: TypeAlias = Annotated[str, Str(63, 1, NODE_NAME_PATTERN, NODE_NAME_MEANS)]


def name_from_host(host: str) -> str:
    """A host name (`Johns-MacBook-Pro.local`, `build_box`) as a node name by that rule: up to its
    first dot, in lower case, any other character as '-' (dpd's default --name, and `dpctl keys
    init`'s default node: a host name the rule refuses must not stop a dpd given no --name)."""
    name = re.sub(r"[^a-z0-9._-]", "-", host.split(".")[0].lower()).lstrip("-._")[:63]
    return name or "node"
Token: TypeAlias = Annotated[str, Str(128, 1)]  # incarnations, export ids
Name: TypeAlias = Annotated[str, Str(64)]  # short names: a state, a platform, a version
Text: TypeAlias = Annotated[str, Str(4096)]  # a reason, a detail, an address
BitsPerSecond: TypeAlias = Annotated[float, Float(1.0, 1e13)]  # a link's measured bandwidth (1 bit/s .. 10 Tbit/s)
LinkLatency: TypeAlias = Annotated[float, Float(0.0, 60.0)]  # a link's measured one-way latency, seconds
LINKS_MAX = 4096  # measured links one node row lists


# -- what a node says about itself ---------------------------------------------------------------


@record
@dataclass(frozen=True, slots=True)
class NodeInfo(Record):
    """node.register's `info`: the machine, found without MLX (`daemon/sysinfo.py`)."""

    slots: Slots = 1
    platform: Name = ""
    chip: Annotated[str, Str(256)] = ""
    cpus: Annotated[int, Int(0, 1 << 20)] = 0
    memory_bytes: Count = 0
    mlx_version: Name = ""
    backend: Name = ""
    python: Name = ""
    advertise: Annotated[str, Str(255)] = ""  # the IP MLX collectives use to reach the node
    pid: Pid = 0
    interface: Annotated[str, Str(64)] = ""  # the network interface that holds `advertise` ("": not known)


@record
@dataclass(frozen=True, slots=True)
class RunningWorker(Record):
    """A worker a daemon runs now (node.register's `running`)."""

    job: JobId
    generation: Generation
    rank: Rank
    slot: SlotIndex
    pid: Pid = 0


@record
@dataclass(frozen=True, slots=True)
class ExitedWorker(Record):
    """A worker's exit (node.register's `exited`; the fields of node.worker_exited)."""

    job: JobId
    generation: Generation
    rank: Rank
    slot: SlotIndex
    code: ExitCode
    stopped: bool = False
    error: Annotated[str, Str(ERROR_LINE_MAX)] | None = None
    # node.register's: the last step the worker reported, which a coordinator that was away when
    # the reports were sent learns here (how many steps its next generation recomputes)
    step: Step | None = field(default=None, metadata=OMIT_NONE)


@record
@dataclass(frozen=True, slots=True)
class Holding(Record):
    """The newest checkpoint step of one slot's run dir of a job (node.register's `holdings`);
    `memory`: the newest step of the state kept in memory (it resumes a group, it is not exported)."""

    job: JobId
    slot: SlotIndex
    step: Step
    memory: bool = False


@record
@dataclass(frozen=True, slots=True)
class AliveWorker(Record):
    """A worker alive now (node.heartbeat's `workers`)."""

    job: JobId
    generation: Generation
    slot: SlotIndex


@record
@dataclass(frozen=True, slots=True)
class RankSlot(Record):
    """Which slot of the node runs which rank (group.start's `ranks`)."""

    slot: SlotIndex
    rank: Rank


@record
@dataclass(frozen=True, slots=True)
class ExportFile(Record):
    """One file of an export's manifest. The name is checked as a path by whoever writes or reads
    it (`export_name_problem`); here only its length."""

    name: Annotated[str, Str(1024, 1)]
    bytes: Count
    sha256: Annotated[str, Str(64)]


# -- a trainer's rows (metrics.jsonl, samples.jsonl) ---------------------------------------------

Shares: TypeAlias = Annotated[list[Count], Items(MAX_WORLD)]


@record
@dataclass(frozen=True, slots=True)
class TrainRow(Record):
    """A training step's metrics row (rank 0, every `log_every_steps`). `loss` and `grad_norm` are
    null when not finite (a diverged step); `shares` and `rank_tokens_per_s` (the split in force and
    each rank's speed) are what the coordinator balances with; `checkpoint_every` is the interval in
    force when `checkpoint.every_steps = "auto"` chose it; `all_sum_s` is what the step's all_sum
    took rank 0 (a group's sync steps; its wait for slower ranks included), and diloco rows name
    their `outer_step` and what its outer all_sum took."""

    TAG: ClassVar[tuple[str, str] | None] = ("kind", "train")
    kind: Annotated[str, OneOf("train")]
    step: Step
    loss: Number | None
    lr: Number
    tokens: Count
    tokens_per_s: Annotated[float, Float(0.0)]
    world_size: WorldSize
    generation: Generation | None = field(default=None, metadata=OMIT_NONE)
    grad_norm: Number | None = field(default=None, metadata=OMIT_NONE)
    shares: Shares | None = field(default=None, metadata=OMIT_NONE)
    rank_tokens_per_s: Annotated[list[Annotated[float, Float(0.0)]], Items(MAX_WORLD)] | None = field(default=None, metadata=OMIT_NONE)
    checkpoint_every: Count | None = field(default=None, metadata=OMIT_NONE)  # the interval "auto" chose
    outer_step: Count | None = field(default=None, metadata=OMIT_NONE)  # diloco: the outer step this inner step belongs to
    all_sum_s: Annotated[float, Float(0.0)] | None = field(default=None, metadata=OMIT_NONE)  # rank 0's seconds in the step's (diloco: the outer) all_sum


@record
@dataclass(frozen=True, slots=True)
class EvalRow(Record):
    """A validation row: the held-out loss at `step` (null when not finite)."""

    TAG: ClassVar[tuple[str, str] | None] = ("kind", "eval")
    kind: Annotated[str, OneOf("eval")]
    step: Step
    val_loss: Number | None


@record
@dataclass(frozen=True, slots=True)
class TestLossRow(Record):
    """The test loss (test.jsonl) of the trained model at `step`, the job's last (null when not finite)."""

    TAG: ClassVar[tuple[str, str] | None] = ("kind", "test")
    kind: Annotated[str, OneOf("test")]
    step: Step
    test_loss: Number | None


MetricRow: TypeAlias = TrainRow | EvalRow | TestLossRow


@record
@dataclass(frozen=True, slots=True)
class SampleRow(Record):
    step: Step
    text: Annotated[str, Str(TEXT_MAX)]


def metric_row(row: dict[str, Any]) -> MetricRow:
    """A trainer's metrics row as a record: a number that is not finite (a diverged loss) becomes
    null, as it is in metrics.jsonl. Raises Invalid when the row is not a metrics row."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    if clean.get("kind") == "eval":
        return EvalRow.from_wire(clean)  # type: ignore[no-any-return]
    if clean.get("kind") == "test":
        return TestLossRow.from_wire(clean)  # type: ignore[no-any-return]
    return TrainRow.from_wire(clean)  # type: ignore[no-any-return]


# -- the coordinator's replies to dpctl ----------------------------------------------------------


@record
@dataclass(frozen=True, slots=True)
class WorkerStatus(Record):
    rank: Rank
    node: NodeName
    share: Count
    tokens_per_s: Annotated[float, Float(0.0)]
    pid: Pid | None = None


@record
@dataclass(frozen=True, slots=True)
class CommRow(Record):
    """`status JOB --json`'s "comm": what its `comm_share` was predicted from (protocol/commmodel.py);
    a job that is not running keeps its last group's. `link`: the two nodes of the link that paces
    the ring (one node twice: its ranks share it)."""

    bytes: Count  # one all_sum: the trainable parameters, in the dtype that travels
    every: Annotated[int, Int(1, 100_000)]  # steps per all_sum (1: sync; diloco: inner_steps)
    ranks: WorldSize  # of the ring
    global_batch: Count  # the job's: with `ranks`, what each rank's compute was measured on
    seconds: Seconds  # predicted all_sum seconds per step
    compute_s: Seconds | None  # measured compute seconds per step (null: no step measured yet)
    link: Annotated[list[NodeName], Items(2)]
    bandwidth_bps: BitsPerSecond
    latency_s: LinkLatency
    warning: Text | None = None  # the share is above 0.5: what paces it and what to do
    # The share of the group's recent sync steps spent communicating, as timed (metrics' all_sum_s,
    # less rank 0's wait there for the slowest rank, over the step's time; left out: not timed yet,
    # a diloco job, a group of one)
    measured_share: Annotated[float, Float(0.0, 1.0)] | None = field(default=None, metadata=OMIT_NONE)
    params: Count | None = field(default=None, metadata=OMIT_NONE)  # the trainable parameters summed (`bytes` is them in the dtype that travels)


@record
@dataclass(frozen=True, slots=True)
class StageRow(Record):
    """One node's staging of a job's files (`status JOB --json`'s "staging"): what it has of them,
    how fast it gets the rest, and when it will be done (null: not known yet). `state`: "staging"
    (fetching), "ready" or "unfit" (`reason` says why it sits the job out)."""

    node: NodeName
    state: Annotated[str, OneOf("checking", "staging", "ready", "unfit")]
    bytes: Count
    total: Count
    rate_bps: Annotated[float, Float(0.0)]
    eta_s: Annotated[float, Float(0.0, 1e11)] | None = None
    reason: Text | None = None


@record
@dataclass(frozen=True, slots=True)
class JobStatus(Record):
    """`dpctl status --json`'s object (INTERFACE.md)."""

    id: JobId
    name: Name
    state: Annotated[str, OneOf("queued", "starting", "running", "recovering", "succeeded", "failed", "cancelled")]
    step: Step
    steps: Step
    generation: Generation
    world_size: Annotated[int, Int(0, MAX_WORLD)]
    workers: Annotated[list[WorkerStatus], Items(MAX_WORLD)]
    checkpoint_step: Step | None
    loss: Number | None
    val_loss: Number | None
    error: Text | None
    submitted: UnixTime | None = None
    started: UnixTime | None = None  # its first group launched
    finished: UnixTime | None = None
    elapsed_s: Annotated[float, Float(0.0, 1e11)] | None = None  # from started to finished (or now)
    eta_s: Annotated[float, Float(0.0, 1e11)] | None = None  # running: the steps left at its recent pace
    staging: Annotated[list[StageRow], Items(MAX_WORLD)] = field(default_factory=list)  # nodes checking or fetching its files, or unfit
    comm_share: Annotated[float, Float(0.0, 1.0)] | None = None  # predicted share of a step spent in all_sum (null: not known)
    comm: CommRow | None = field(default=None, metadata=OMIT_NONE)
    test_loss: Number | None = None  # [eval] test: the test loss after the last step (null until known)
    priority: Annotated[int, Int(-MAX_INT, MAX_INT)] | None = field(default=None, metadata=OMIT_NONE)  # left out at 0
    waiting: Text | None = field(default=None, metadata=OMIT_NONE)  # queued (or stopped): what it waits for (daemon/scheduler.py)


@record
@dataclass(frozen=True, slots=True)
class LinkRow(Record):
    """A node row's measured link to `peer` (`dpctl nodes --json`'s "links"): its newest figures,
    `age_s` old. `source` "ring": a group's all_sum probe, which measures its ring's slowest link;
    the figure is given to every pair of neighbouring nodes of that ring (each is at least that fast)."""

    peer: NodeName
    bandwidth_bps: BitsPerSecond
    latency_s: LinkLatency
    age_s: Annotated[float, Float(0.0, 1e11)]
    source: Annotated[str, OneOf("ring")] = "ring"


@record
@dataclass(frozen=True, slots=True)
class NodeRow(Record):
    """`dpctl nodes --json`'s object (INTERFACE.md)."""

    name: NodeName
    address: Annotated[str, Str(255)]
    state: Annotated[str, OneOf("idle", "busy", "draining", "lost", "yielding")]
    platform: Name
    chip: Annotated[str, Str(256)]
    memory_bytes: Count
    mlx_version: Name
    backend: Name
    slots: Slots
    busy_slots: Annotated[int, Int(0, MAX_SLOTS)]
    job: Annotated[str, Str(MAX_SLOTS * 130)] | None  # the jobs its slots run, comma-separated
    ranks: Annotated[list[Rank], Items(MAX_WORLD)]
    heartbeat_age_s: Annotated[float, Float(0.0)]
    reason: Text | None
    interface: Annotated[str, Str(64)] | None = None  # the node's interface that holds `address` (null: not known)
    links: Annotated[list[LinkRow], Items(LINKS_MAX)] = field(default_factory=list)  # measured links to other nodes, newest figure each


@record
@dataclass(frozen=True, slots=True)
class LogLine(Record):
    """One output line of a worker, as `dpctl logs` pages them."""

    seq: Count
    t: UnixTime
    rank: Rank
    generation: Generation
    text: Annotated[str, Str(LOG_LINE_MAX)]


@record
@dataclass(frozen=True, slots=True)
class RemovedRows(Record):
    """What `dpctl rm` deleted from the coordinator's database: the job's rows of each table."""

    jobs: Count
    metrics: Count
    samples: Count
    events: Count
    logs: Count


EventScalar: TypeAlias = Text | Annotated[int, Int(-MAX_INT, MAX_INT)] | Number | bool | None
EventValue: TypeAlias = EventScalar | Annotated[list[EventScalar], Items(MAX_WORLD)]


@record
@dataclass(frozen=True, slots=True)
class EventRow(Record):
    """`dpctl events --json`'s object: `{"t", "kind", ...}`, its other keys depending on the kind
    (INTERFACE.md); here they are `fields`. On the wire and in JSON the map is flat."""

    t: UnixTime
    kind: Annotated[str, Str(64, 1)]
    fields: Annotated[dict[str, EventValue], Items(EVENT_FIELDS_MAX)] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, value: Any) -> EventRow:
        if type(value) is not dict:
            raise Invalid("a map (an event)", value)
        rest = dict(value)
        head = {k: rest.pop(k) for k in ("t", "kind") if k in rest}
        try:
            return cls(**check_fields(cls.FIELDS, {**head, "fields": rest}, "EventRow"))
        except Invalid as e:
            if e.path[:1] == ["fields"]:
                e.path.pop(0)  # flat on the wire: `node`, not `fields.node`
            raise

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.t, "kind": self.kind, **self.fields}
