"""The job file: typed, validated, hashed.

`load_job(path)` reads a `job.toml` into a frozen `JobSpec`, one dataclass per section. Unknown keys,
wrong types and out-of-range values raise `JobFileError`, whose message names the file, the key, the
value given and what is allowed, on one line. Shared by dpctl (validation at submit), the
coordinator (admission) and the trainer (everything else); no MLX here.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from dpool.protocol import mlxlm_config
from dpool.protocol.hf_dataset import HFDatasetSpec, parse_hf_datasets
from dpool.protocol.joberrors import MISSING as _MISSING
from dpool.protocol.joberrors import JobFileError, read_job_file
from dpool.protocol.optimizers import (
    OPTIMIZERS,
    LrSchedule,
    OptionError,
    lr_schedule,
    optimizer_config,
)
from dpool.protocol.schema import MAX_INT

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # not starting with '-': its id would read as a flag


# ---------------------------------------------------------------------------------------------
# Field checks: each returns an error message (what is allowed) or None.


def _int(lo: int | None = None, hi: int | None = None):
    top = MAX_INT if hi is None else hi  # the wire carries no integer beyond 2^53 - 1

    def check(v: Any) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool)
        if ok and (lo is None or v >= lo) and v <= top:
            return None
        rng = f" >= {lo} (and below 2^53)" if hi is None else f" in [{lo}, {hi}]"
        return f"must be an integer{rng if lo is not None else ''}"

    return check


def _float(lo: float, hi: float | None = None, *, lo_open: bool = False):
    def check(v: Any) -> str | None:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if ok and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi):
            return None
        low = f"> {lo}" if lo_open else f">= {lo}"
        return f"must be a finite number {low}" + (f" and <= {hi}" if hi is not None else "")

    return check


def _choice(*allowed: str):
    def check(v: Any) -> str | None:
        return None if v in allowed else "must be one of " + ", ".join(repr(a) for a in allowed)

    return check


def _str():
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v else "must be a non-empty string"

    return check


def _opt(inner):
    def check(v: Any) -> str | None:
        return None if v is None else inner(v)

    return check


def _is_minus_one(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == -1


def _table(v: Any) -> str | None:
    return None if isinstance(v, dict) else "must be a table"


def _spec(check, doc: str, default: Any = _MISSING):
    """A dataclass field with a validator and a docstring kept in its metadata."""
    meta = {"check": check, "doc": doc}
    if default is _MISSING:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------------------
# Sections.


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkersSpec:
    min: int = _spec(_int(1), "the job stays queued until this many worker slots are free", 1)
    max: int = _spec(_int(1), "the most worker slots the job takes", 8)
    balance: bool = _spec(
        lambda v: None if isinstance(v, bool) else "must be true or false",
        "move sequences of the global batch to faster workers while the job runs",
        True,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    kind: str = _spec(_choice("gpt", "mlx_lm"), "'gpt' (built in) or 'mlx_lm' (a language model that mlx-lm loads)", "gpt")
    context: int = _spec(
        _int(2, 65536), "gpt: tokens per sequence; mlx_lm: the longest example in tokens (longer ones are truncated)",
        None,
    )
    # kind = "gpt"
    layers: int = _spec(_int(1, 256), "gpt: transformer blocks", 4)
    dim: int = _spec(_int(8, 16384), "gpt: model width", 128)
    heads: int = _spec(_int(1, 256), "gpt: attention heads; must divide dim", 4)
    positions: str = _spec(_choice("rope", "learned"), "gpt: position encoding", "rope")
    # kind = "mlx_lm"
    path: str | None = _spec(
        _opt(_str()),
        "mlx_lm: a model directory as mlx-lm loads it (resolved on each worker), or a Hugging Face repo id",
        None,
    )
    fine_tune: str = _spec(_choice("lora", "dora", "full"), "mlx_lm: what is trained", "lora")
    lora_rank: int = _spec(_int(1, 1024), "mlx_lm, lora/dora: adapter rank", 8)
    lora_scale: float = _spec(_float(0.0, 1e6, lo_open=True), "mlx_lm, lora/dora: adapter scale", 20.0)
    lora_dropout: float = _spec(_float(0.0, 0.95), "mlx_lm, lora/dora: dropout on the adapters' input", 0.0)
    lora_layers: int | None = _spec(
        lambda v: None if v is None or _is_minus_one(v) else _int(1, 100000)(v) and "must be -1 (every block) or an integer in [1, 100000]",
        "mlx_lm: the last N transformer blocks are trained (-1 or N above the model's count: all), mlx-lm's num_layers. "
        "lora/dora: the blocks that get adapters; unset means 16, mlx-lm's default. full: the blocks unfrozen, with "
        "embeddings, final norm and head frozen, as mlx-lm's full fine-tune; unset means the whole model, as dpool "
        "trained before the key applied to full (so existing jobs keep their curve and hash)",
        None,
    )
    lora_keys: list[str] | None = _spec(  # noqa: RUF009 (_spec only attaches the check; the default is None)
        lambda v: None
        if v is None or (isinstance(v, list) and 0 < len(v) <= 64 and all(isinstance(k, str) and 0 < len(k) <= 256 for k in v))
        else "must be a non-empty list (at most 64) of module paths inside a block, e.g. [\"self_attn.q_proj\", \"self_attn.v_proj\"]",
        "mlx_lm, lora/dora: the layers of each block that get adapters (mlx-lm's lora_parameters.keys); unset: "
        "mlx-lm's default, every linear layer of the block",
        None,
    )
    adapters: str | None = _spec(
        _opt(_str()),
        "mlx_lm, lora/dora: start from trained adapters (mlx-lm's resume_adapter_file): an adapter directory "
        "(adapters.safetensors, as `dpctl export` or `mlx_lm lora` writes it) or the .safetensors file",
        None,
    )
    grad_checkpoint: bool = _spec(
        lambda v: None if isinstance(v, bool) else "must be true or false",
        "mlx_lm: recompute each block's activations in the backward pass (less memory, more time)",
        False,
    )

    def __post_init__(self) -> None:
        if self.context is None:  # the kind's own default: a window for the GPT, an example's cap for mlx_lm
            object.__setattr__(self, "context", DEFAULT_CONTEXT.get(self.kind, 128))


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    source: str = _spec(
        _str(),
        "gpt: 'stdlib' or a path/glob of .txt/.jsonl files; mlx_lm: a directory with train.jsonl (and valid.jsonl), "
        "or a Hugging Face dataset id (owner/name, its train, valid and test splits; a directory that exists wins)",
        "stdlib",
    )
    val_fraction: float = _spec(
        _float(0.0, 0.5, lo_open=True), "fraction of documents (mlx_lm: examples, without a valid.jsonl) held out", 0.05
    )
    mask_prompt: bool = _spec(
        lambda v: None if isinstance(v, bool) else "must be true or false",
        "mlx_lm: train on the completion (or the last assistant message) only, as mlx-lm's --mask-prompt",
        False,
    )
    prompt_feature: str | None = _spec(_opt(_str()), "mlx_lm: the key (column) of the prompt, mlx-lm's prompt_feature; unset: 'prompt'", None)
    completion_feature: str | None = _spec(_opt(_str()), "mlx_lm: the key of the completion; unset: 'completion'", None)
    chat_feature: str | None = _spec(_opt(_str()), "mlx_lm: the key of the chat messages; unset: 'messages'", None)
    text_feature: str | None = _spec(_opt(_str()), "mlx_lm: the key of plain text; unset: 'text'", None)
    hf_dataset: tuple[HFDatasetSpec, ...] | None = field(
        default=None,
        metadata={
            "check": lambda v: None,  # checked field by field as it is built
            "build": parse_hf_datasets,
            "doc": "mlx_lm: Hugging Face datasets instead of data.source, mlx-lm's hf_dataset: a table "
            "(path, config, train_split, valid_split, test_split, prompt_feature, completion_feature, "
            "text_feature, chat_feature) or a list of them ([[data.hf_dataset]], concatenated)",
        },
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    steps: int = _spec(_int(1), "optimizer steps", 2000)
    global_batch: int = _spec(_int(1), "sequences per optimizer step, whatever the number of workers", 64)
    micro_batch: int | str = _spec(
        lambda v: None
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_INT)
        else "must be 'auto' or an integer >= 1 (and below 2^53)",
        "the most sequences per forward/backward; accumulation fills the share",
        "auto",
    )
    lr: float = _spec(_float(0.0, 10.0, lo_open=True), "peak learning rate", 3e-4)
    warmup_steps: int = _spec(_int(0), "linear warm-up steps (unset: 100, or a tenth of train.steps where those are fewer)", 100)
    weight_decay: float = _spec(_float(0.0, 10.0), "AdamW decoupled weight decay", 0.1)
    grad_clip: float = _spec(_float(0.0), "clip the global gradient norm to this (0: off)", 1.0)
    seed: int = _spec(_int(0, 2**31 - 1), "seeds weights, data order and sampling", 1234)
    log_every_steps: int = _spec(_int(1), "a metrics row every this many steps", 10)
    optimizer: str | None = _spec(
        _opt(_choice(*OPTIMIZERS)),
        "unset: AdamW with betas [0.9, 0.95] and train.weight_decay (dpool's own); or one of mlx-lm's: "
        + ", ".join(OPTIMIZERS) + ", built as `mlx_lm lora` builds it, with [train.optimizer_config]",
        None,
    )
    optimizer_config: dict[str, Any] | None = _spec(  # noqa: RUF009 (_spec only attaches the check; the default is None)
        _opt(_table),
        "with train.optimizer: its class's keyword arguments (e.g. betas, eps, weight_decay, momentum); "
        "unset ones take MLX's defaults",
        None,
    )
    lr_schedule: LrSchedule | None = _spec(  # noqa: RUF009 (_spec only attaches the check; the default is None)
        _opt(_table),
        "mlx-lm's lr_schedule: name (cosine_decay, exponential_decay, linear_schedule, step_decay, or 'constant'), "
        "arguments (the first is the peak), warmup, warmup_init; replaces train.lr and train.warmup_steps",
        None,
    )

    def unused(self) -> list[str]:
        """Keys that say nothing in this job: the optimizer keys while unset (so jobs from before
        them keep their hash and their wire form), and the keys they replace: weight_decay (the
        default AdamW's) with an optimizer, lr and warmup_steps with a schedule."""
        out = [k for k in ("optimizer", "optimizer_config", "lr_schedule") if getattr(self, k) is None]
        if self.optimizer is not None:
            out.append("weight_decay")
        if self.lr_schedule is not None:
            out += ["lr", "warmup_steps"]
        return out

    def hashed(self) -> dict[str, Any]:
        """What of it shapes the curve."""
        out = dataclasses.asdict(self)
        out.pop("log_every_steps")
        out.pop("micro_batch")  # accumulation does not change the math
        for key in self.unused():
            out.pop(key)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointSpec:
    every_steps: int | str = _spec(
        lambda v: None
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_INT)
        else "must be 'auto' (measured: checkpoints cost under 2% of the time) or an integer >= 1",
        "'auto': as often as keeps checkpoint time under 2% of training time (measured); or every this many steps",
        "auto",
    )
    keep: int = _spec(_int(1, 1000), "newest checkpoints kept per rank", 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSpec:
    every_steps: int = _spec(_int(1), "validation loss every this many steps", 100)
    batches: int = _spec(
        lambda v: None if type(v) is int and v == -1 else _int(1)(v) and "must be an integer >= 1, or -1 (mlx_lm: every held-out example)",
        "held-out batches (of global_batch sequences) per evaluation; mlx_lm: -1 for all", 20,
    )
    sample_every_steps: int = _spec(_int(1), "a generated text sample every this many steps", 200)
    sample_tokens: int = _spec(_int(1, 100000), "tokens per sample", 200)
    sample_prompt: str | None = _spec(
        _opt(_str()), "the sample's prompt: a user message for chat data, else plain text (default: 'def ' / 'Hello')", None
    )
    test: bool = _spec(
        lambda v: None if isinstance(v, bool) else "must be true or false",
        "mlx_lm: the test loss on data.source's test.jsonl after the last step (a metrics row of kind 'test')",
        False,
    )
    test_batches: int = _spec(
        lambda v: None if _is_minus_one(v) else _int(1)(v) and "must be -1 (all) or an integer >= 1",
        "with test: batches of train.global_batch test examples scored (-1: all, as mlx-lm's --test-batches)",
        -1,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoverySpec:
    max_restarts: int = _spec(_int(0), "crash restarts allowed before the job fails (membership changes are free)", 10)
    start_timeout_s: float = _spec(_float(1.0), "deadline for a group's start and first step", 120.0)
    step_timeout_floor_s: float = _spec(
        _float(0.5), "the per-step progress deadline never goes below this (2 s: just above the heartbeat expiry)", 2.0
    )
    step_timeout_factor: float = _spec(
        _float(1.0), "a group is stalled when no step completes within this many times its median step time", 8.0
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSpec:
    """How the workers combine their work (README: "Communication"). "sync": every step's gradients
    are all_summed (exact: the same curve on any number of workers). "diloco": `replicas` virtual
    replicas each take `inner_steps` AdamW steps on their slice of each global batch, then their
    parameter changes are averaged (weighted by tokens) and applied by the outer step: by default
    as they are (outer lr 1, no momentum: plain averaging; DiLoCo's lr 0.7 with Nesterov momentum
    0.9 fell further behind synchronous training over tens of outer steps, BENCHMARKS.md
    "Communication"); one all_sum per `inner_steps` steps instead of one per step, after the first
    `warmup_steps` (an average every step: H = 1, close to synchronous training)."""

    mode: str = _spec(_choice("sync", "diloco"), "'sync' (all_sum every step) or 'diloco' (all_sum every inner_steps steps)", "sync")
    inner_steps: int = _spec(_int(1, 100000), "diloco: inner steps per outer step (H)", 50)
    replicas: int = _spec(
        _int(1, 1024), "diloco: virtual replicas (K), fixed by the job, not by the machines present; at most this many workers", 4
    )
    outer_lr: float = _spec(_float(0.0, 10.0, lo_open=True), "diloco: the outer step's learning rate (1: apply the replicas' average)", 1.0)
    outer_momentum: float = _spec(_float(0.0, 0.999), "diloco: the outer step's Nesterov momentum (0: none, plain averaging)", 0.0)
    warmup_steps: int = _spec(
        _int(0, 10**9), "diloco: steps averaged every step (as H = 1, close to sync) before the outer steps of inner_steps; 0: none", 0
    )
    dtype: str = _spec(
        _choice("float32", "bfloat16"),
        "what is all_summed: 'float32' (exact) or 'bfloat16' (half the bytes; sums still divided by the pool's tokens)",
        "float32",
    )

    def hashed(self) -> dict[str, Any] | None:
        """What of it shapes the curve (None: the default, exact synchronous mode, as before [sync] existed)."""
        if self.mode == "sync":
            return None if self.dtype == "float32" else {"dtype": self.dtype}
        out = dataclasses.asdict(self)
        if not self.warmup_steps:
            out.pop("warmup_steps")  # absent when unset: diloco jobs from before it keep their hash
        return out


SYNC_DILOCO_KEYS = ("inner_steps", "replicas", "outer_lr", "outer_momentum", "warmup_steps")

REPORT_TO = ("wandb",)
WANDB_RESERVED = "/\\#?%:"  # W&B refuses these in project and entity names


def _report_to(v: Any) -> str | None:
    ok = isinstance(v, list | tuple) and all(x in REPORT_TO for x in v) and len(set(v)) == len(v)
    return None if ok else "must be a list of where rank 0 reports, each once: [] (nowhere) or " + ", ".join(f"[{a!r}]" for a in REPORT_TO)


def _wandb_name(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and 0 < len(v) <= 128 and not any(c in WANDB_RESERVED for c in v)):
        return None
    return f"must be a name of 1 to 128 characters without any of {WANDB_RESERVED}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportSpec:
    """Where rank 0 reports the job's metrics as it trains (README: "Prometheus and W&B"). Not in
    the training hash: reporting elsewhere trains the same job."""

    to: tuple[str, ...] = _spec(_report_to, "where rank 0 reports: [] or ['wandb'] (Weights & Biases; pip install 'dpool[wandb]')", ())
    project: str | None = _spec(_wandb_name, "wandb: the W&B project (default: $WANDB_PROJECT, else 'dpool')", None)
    entity: str | None = _spec(_wandb_name, "wandb: the W&B team or user (default: W&B's own default entity)", None)
    run_name: str | None = _spec(_opt(_str()), "wandb: the run's display name (default: the job's name); its id comes from the job's id", None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "to", tuple(self.to))  # a TOML list, kept as a tuple (the spec is frozen)


DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")


def _digest(v: Any) -> str | None:
    return None if v is None or (isinstance(v, str) and DIGEST_RE.fullmatch(v)) else "must be a sha256 digest (64 hex digits)"


@dataclass(frozen=True, kw_only=True, slots=True)
class ContentSpec:
    """What the job's files are, by content: written by `dpctl submit` (it hashes them where it
    runs), so every node trains on the same bytes wherever they sit (README: "Data and models")."""

    data: str | None = _spec(_digest, "the digest of data.source's files (their manifest: relative paths, sizes, sha256)", None)
    model: str | None = _spec(_digest, "mlx_lm: the digest of model.path's files", None)
    adapters: str | None = _spec(_digest, "mlx_lm: the digest of model.adapters' files (the adapters to start from)", None)


SECTIONS: dict[str, type] = {
    "workers": WorkersSpec,
    "model": ModelSpec,
    "data": DataSpec,
    "train": TrainSpec,
    "checkpoint": CheckpointSpec,
    "eval": EvalSpec,
    "recovery": RecoverySpec,
    "sync": SyncSpec,
    "content": ContentSpec,
    "report": ReportSpec,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    name: str
    workers: WorkersSpec = dataclasses.field(default_factory=WorkersSpec)
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    data: DataSpec = dataclasses.field(default_factory=DataSpec)
    train: TrainSpec = dataclasses.field(default_factory=TrainSpec)
    checkpoint: CheckpointSpec = dataclasses.field(default_factory=CheckpointSpec)
    eval: EvalSpec = dataclasses.field(default_factory=EvalSpec)
    recovery: RecoverySpec = dataclasses.field(default_factory=RecoverySpec)
    sync: SyncSpec = dataclasses.field(default_factory=SyncSpec)
    content: ContentSpec = dataclasses.field(default_factory=ContentSpec)
    report: ReportSpec = dataclasses.field(default_factory=ReportSpec)
    priority: int = 0  # higher runs first (README: "Sharing the pool"); not in the training hash
    base_dir: str = "."  # where relative paths are resolved: the folder of the job file as submitted

    def to_dict(self) -> dict[str, Any]:
        """The job as plain data (what travels on the wire and into SQLite): the keys of its kind."""
        out = dataclasses.asdict(self)
        out["model"] = self._model_fields()
        if self.model.kind == "gpt":
            out["data"].pop("mask_prompt")
        # Absent when unset (jobs from before it keep their hash); when set, data.source is unused.
        out["data"].pop("hf_dataset" if self.data.hf_dataset is None else "source")
        if self.data.hf_dataset is not None:
            out["data"]["hf_dataset"] = list(out["data"]["hf_dataset"])  # a list on the wire
        for key in DATA_FEATURES:
            if out["data"][key] is None:
                out["data"].pop(key)
        if self.sync.mode == "sync":
            for key in SYNC_DILOCO_KEYS:
                out["sync"].pop(key)
        elif not self.sync.warmup_steps:
            out["sync"].pop("warmup_steps")  # absent when unset: peers from before it read the job
        for key in self.train.unused():
            out["train"].pop(key)
        if self.report.to:
            out["report"]["to"] = list(self.report.to)
        else:
            out.pop("report")  # absent when it reports nowhere: peers from before [report] read the job
        if not self.priority:
            out.pop("priority")  # absent at the default: peers from before priorities read the job as before
        return out

    def max_workers(self) -> int:
        """The most workers the job can use: workers.max, at most one per sequence of the global
        batch, and in diloco mode one per replica."""
        top = min(self.workers.max, self.train.global_batch)
        return min(top, self.sync.replicas) if self.sync.mode == "diloco" else top

    def training_hash(self) -> str:
        """Hash of everything that shapes the loss curve; checkpoints of another hash are refused.

        Where the job names its files by content (`[content]`), the digests stand for the paths:
        a node that runs the job from the pool's copy in its cache (another path) trains the same
        job. Otherwise paths enter as the user wrote them, not resolved: `~/data` is the same job
        on every machine although it names a different folder on each (the content is compared
        across ranks separately, by fingerprint)."""
        train = self.train.hashed()
        model, data = self._model_fields(), self.to_dict()["data"]
        if self.content.data is not None:
            data["source"] = f"sha256:{self.content.data}"
        if self.content.model is not None:
            model["path"] = f"sha256:{self.content.model}"
        if self.content.adapters is not None and model.get("adapters") is not None:
            model["adapters"] = f"sha256:{self.content.adapters}"
        body = {"model": model, "data": data, "train": train}
        if self.model.kind == "mlx_lm":
            _hash_lm_keys(self.model, model)
        if (sync := self.sync.hashed()) is not None:
            body["sync"] = sync  # absent in the default mode: jobs from before [sync] keep their hash
        return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def schedule_hash(self) -> str:
        """Hash of what decides when the ranks of a group meet in a collective beyond the step
        (the evaluations, samples and test; the checkpoints' interval): equal on every rank of a
        group, or one rank waits in an all_sum the others never enter (trainer/agreement.py)."""
        d = self.to_dict()
        body = {"eval": d["eval"], "checkpoint": d["checkpoint"]}
        return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def _model_fields(self) -> dict[str, Any]:
        """The model keys that apply to this kind (the others are refused in the job file)."""
        model = dataclasses.asdict(self.model)
        keep = GPT_KEYS if self.model.kind == "gpt" else MLX_LM_KEYS
        return {k: v for k, v in model.items() if k in keep or k in ("kind", "context")}

    def resolve(self, path: str) -> str:
        """A local path of the job file, on this machine: `~` is this machine's home, and a relative
        path is taken from the job file's folder."""
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(path)))

    def resolved_source(self) -> str:
        if self.data.source == "stdlib":
            return "stdlib"
        return self.resolve(self.data.source)


GPT_KEYS = ("layers", "dim", "heads", "positions")
DATA_FEATURES = ("prompt_feature", "completion_feature", "chat_feature", "text_feature")
MLX_LM_KEYS = (
    "path", "fine_tune", "lora_rank", "lora_scale", "lora_dropout", "lora_layers", "lora_keys", "adapters", "grad_checkpoint",
)
LORA_LAYERS_DEFAULT = 16  # mlx-lm's num_layers default


def _hash_lm_keys(m: ModelSpec, model: dict[str, Any]) -> None:
    """The hashed form of the mlx_lm keys added after jobs existed: unset keys are left out, and an
    unset lora_layers hashes as the 16 it always meant, so existing jobs keep their hash. full with
    an explicit lora_layers trains only the last N blocks (before, full trained the whole model
    whatever lora_layers said): it hashes apart from the old meaning."""
    for key in ("lora_keys", "adapters"):
        if model.get(key) is None:
            model.pop(key, None)
    if m.lora_keys is not None:
        model["lora_keys"] = sorted(set(m.lora_keys))  # a set in mlx-lm: order and repeats mean nothing
    model["lora_layers"] = LORA_LAYERS_DEFAULT if m.lora_layers is None else m.lora_layers
    if m.fine_tune == "full" and m.lora_layers is not None:
        model["full_layers"] = m.lora_layers


def lora_blocks(m: ModelSpec, blocks: int) -> int:
    """How many of the model's last blocks are trained: adapters (lora/dora) or unfrozen (full)."""
    if m.lora_layers is None:
        return blocks if m.fine_tune == "full" else min(LORA_LAYERS_DEFAULT, blocks)
    return blocks if m.lora_layers == -1 else min(m.lora_layers, blocks)


DEFAULT_CONTEXT = {"gpt": 128, "mlx_lm": 2048}
HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_location(spec: JobSpec) -> tuple[str, str]:
    """Where an mlx_lm job's model is on this machine: ("dir", path) for a local directory, or
    ("repo", id) for a Hugging Face repo id that mlx-lm resolves (its cache, else a download).
    A path that exists here wins, as in mlx-lm; a repo id is never made into a path."""
    assert spec.model.path is not None
    local = spec.resolve(spec.model.path)
    if os.path.exists(local) or not HF_REPO_RE.match(spec.model.path):
        return "dir", local
    return "repo", spec.model.path


def data_location(spec: JobSpec) -> tuple[str, str]:
    """Where an mlx_lm job's examples come from on this machine: ("dir", folder) for a local folder
    of jsonl files (what dpool stages), ("hub", id) for a Hugging Face dataset id in data.source
    that the `datasets` package loads, or ("hf_dataset", "") for data.hf_dataset. A folder that
    exists here wins over an id of the same spelling, as in mlx-lm."""
    if spec.data.hf_dataset is not None:
        return "hf_dataset", ""
    local = spec.resolved_source()
    if os.path.exists(local) or not HF_REPO_RE.match(spec.data.source):
        return "dir", local
    return "hub", spec.data.source


# ---------------------------------------------------------------------------------------------
# Loading.


def _build(cls: type, table: Any, prefix: str, source: str) -> Any:
    if not isinstance(table, dict):
        raise JobFileError(source, prefix, table, "must be a table")
    known = {f.name: f for f in fields(cls)}
    for key in table:
        if key not in known:
            raise JobFileError(source, f"{prefix}.{key}", table[key], "unknown key; allowed: " + ", ".join(known))
    values = {}
    for name, f in known.items():
        if name not in table:
            if f.default is dataclasses.MISSING:
                raise JobFileError(source, f"{prefix}.{name}", _MISSING, "required")
            continue
        err = f.metadata["check"](table[name])
        if err:
            raise JobFileError(source, f"{prefix}.{name}", table[name], err)
        if "build" in f.metadata:  # a nested table: built (and checked) by its own module
            values[name] = f.metadata["build"](table[name], f"{prefix}.{name}", source)
            continue
        values[name] = float(table[name]) if f.type == "float" else table[name]
    return cls(**values)


def parse_job(data: dict[str, Any], source: str = "<job>", base_dir: str | None = None) -> JobSpec:
    """Validate a parsed TOML document (or the dict of `JobSpec.to_dict`, which carries base_dir).

    Pure: no file system access. Paths are resolved where the training runs (`check_paths`, in the
    trainer), never on the coordinator or the client."""
    data = dict(data)
    carried = data.pop("base_dir", None)
    if carried is not None and not isinstance(carried, str):
        raise JobFileError(source, "base_dir", carried, "must be a string (a folder)")
    base_dir = carried or base_dir or "."
    for key in data:
        if key not in ("name", "priority") and key not in SECTIONS:
            raise JobFileError(source, key, data[key], "unknown key; allowed: name, priority, base_dir, " + ", ".join(SECTIONS))
    name = data.get("name", _MISSING)
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise JobFileError(source, "name", name, "required, 1-63 characters of a-z, 0-9 and '-', not starting with '-'")
    priority = data.get("priority", 0)
    if (err := check_priority(priority)) is not None:
        raise JobFileError(source, "priority", priority, err)
    sections = {key: _build(cls, data.get(key, {}), key, source) for key, cls in SECTIONS.items()}
    sections["train"] = _check_optimizer(sections["train"], data.get("train", {}), source)
    _check_kind_keys(sections["model"].kind, data.get("model", {}), data.get("data", {}), source, data.get("eval", {}))
    spec = JobSpec(name=name, base_dir=str(base_dir), priority=priority, **sections)
    _cross_check(spec, source)
    _check_sync(spec, data.get("sync", {}), source)
    _check_report(spec, source)
    return spec


PRIORITY_MAX = 1_000_000_000  # as Kubernetes' PriorityClass values for users


def check_priority(v: Any) -> str | None:
    """What is wrong with a job's priority (None: nothing): an integer, higher runs first."""
    if isinstance(v, bool) or not isinstance(v, int) or not -PRIORITY_MAX <= v <= PRIORITY_MAX:
        return f"must be an integer from {-PRIORITY_MAX} to {PRIORITY_MAX} (higher runs first; default 0)"
    return None


def _check_optimizer(t: TrainSpec, given: dict[str, Any], source: str) -> TrainSpec:
    """The optimizer and schedule keys checked and in their normal form (the optimizer's config with
    MLX's defaults filled in). A key they replace, given too, is refused: it would silently not apply."""
    if t.optimizer_config is not None and t.optimizer is None:
        raise JobFileError(
            source, "train.optimizer_config", t.optimizer_config, "only with train.optimizer set (one of " + ", ".join(OPTIMIZERS) + ")"
        )
    if t.optimizer is not None and "weight_decay" in given:
        raise JobFileError(
            source, "train.weight_decay", given["weight_decay"],
            f"applies to dpool's default AdamW only; with train.optimizer = '{t.optimizer}' set train.optimizer_config.weight_decay",
        )
    if t.lr_schedule is not None:
        for key in ("lr", "warmup_steps"):
            if key in given:
                raise JobFileError(
                    source, f"train.{key}", given[key],
                    "not used with train.lr_schedule: the schedule's first argument is the peak learning rate, "
                    "and train.lr_schedule.warmup its warm-up",
                )
    if "warmup_steps" not in given and t.lr_schedule is None and t.steps < t.warmup_steps:
        t = dataclasses.replace(t, warmup_steps=t.steps // 10)  # a short run is not all warm-up (nor refused for a default)
    try:
        config = None if t.optimizer is None else optimizer_config(t.optimizer, given.get("optimizer_config", {}))
        schedule = None if t.lr_schedule is None else lr_schedule(given["lr_schedule"])
    except OptionError as e:
        raise JobFileError(source, f"train.{e.key}", e.given, e.allowed) from None
    return dataclasses.replace(t, optimizer_config=config, lr_schedule=schedule)


def _check_kind_keys(kind: str, model: dict[str, Any], data: dict[str, Any], source: str, evals: Any = None) -> None:
    """A key of the other kind is refused, not silently ignored: it would not do what it says."""
    other = MLX_LM_KEYS if kind == "gpt" else GPT_KEYS
    for key in other:
        if key in model:
            owner = "mlx_lm" if kind == "gpt" else "gpt"
            raise JobFileError(source, f"model.{key}", model[key], f"only for model.kind = '{owner}'")
    if kind == "gpt" and "mask_prompt" in data:
        raise JobFileError(source, "data.mask_prompt", data["mask_prompt"], "only for model.kind = 'mlx_lm'")
    if kind == "gpt" and data.get("hf_dataset") is not None:
        raise JobFileError(source, "data.hf_dataset", data["hf_dataset"], "only for model.kind = 'mlx_lm'")
    for key in DATA_FEATURES:
        if data.get(key) is not None and (kind == "gpt" or data.get("hf_dataset") is not None):
            allowed = "only for model.kind = 'mlx_lm'" if kind == "gpt" else f"each data.hf_dataset names its own {key} (as in mlx-lm)"
            raise JobFileError(source, f"data.{key}", data[key], allowed)
    if kind == "gpt" and isinstance(evals, dict) and evals.get("test"):
        raise JobFileError(source, "eval.test", evals["test"], "only for model.kind = 'mlx_lm' (the test loss of test.jsonl)")


def _cross_check(spec: JobSpec, source: str) -> None:
    m, t, w = spec.model, spec.train, spec.workers
    if m.kind == "gpt":
        if spec.eval.batches == -1:
            raise JobFileError(source, "eval.batches", -1, "-1 (every held-out example) is for model.kind = 'mlx_lm'; the GPT's held-out windows are counted in batches >= 1")
        if m.dim % m.heads:
            raise JobFileError(source, "model.heads", m.heads, f"must divide model.dim = {m.dim}")
        if (m.dim // m.heads) % 2 and m.positions == "rope":
            raise JobFileError(source, "model.dim", m.dim, "dim / heads must be even for rotary positions")
    else:
        if not m.path:
            raise JobFileError(source, "model.path", _MISSING, "required when model.kind = 'mlx_lm'")
        hf = spec.data.hf_dataset
        if hf is not None and spec.data.source != "stdlib":
            raise JobFileError(
                source, "data.source", spec.data.source,
                "data.hf_dataset names the data already: give data.source or data.hf_dataset, not both",
            )
        if hf is None and spec.data.source == "stdlib":
            raise JobFileError(
                source, "data.source", spec.data.source,
                "model.kind = 'mlx_lm' needs a directory holding train.jsonl (and optionally valid.jsonl), "
                "a Hugging Face dataset id, or data.hf_dataset",
            )
        if hf is not None and spec.eval.test:
            for i, d in enumerate(hf):
                if d.test_split is None:
                    key = "data.hf_dataset" + (f"[{i}]" if len(hf) > 1 else "")
                    raise JobFileError(source, f"{key}.test_split", _MISSING, "required with eval.test = true (the test examples)")
        if m.fine_tune == "full":
            for key in ("lora_keys", "adapters"):
                if getattr(m, key) is not None:
                    raise JobFileError(source, f"model.{key}", getattr(m, key), "only for model.fine_tune = 'lora' or 'dora'")
    if w.max < w.min:
        raise JobFileError(source, "workers.max", w.max, f"must be >= workers.min = {w.min}")
    if t.global_batch < w.min:
        raise JobFileError(
            source, "train.global_batch", t.global_batch, f"must be >= workers.min = {w.min} (every worker needs a sequence)"
        )
    if t.warmup_steps > t.steps and t.lr_schedule is None:
        raise JobFileError(source, "train.warmup_steps", t.warmup_steps, f"must be <= train.steps = {t.steps}")


def _check_report(spec: JobSpec, source: str) -> None:
    r = spec.report
    if "wandb" not in r.to:
        for key in ("project", "entity", "run_name"):
            if getattr(r, key) is not None:
                raise JobFileError(source, f"report.{key}", getattr(r, key), "only with report.to = ['wandb'] (it names the W&B run)")


def _check_sync(spec: JobSpec, given: Any, source: str) -> None:
    s = spec.sync
    if s.mode == "sync":
        for key in SYNC_DILOCO_KEYS:
            if isinstance(given, dict) and key in given:
                raise JobFileError(source, f"sync.{key}", given[key], "only for sync.mode = 'diloco'")
        return
    if spec.workers.min > s.replicas:
        raise JobFileError(
            source, "workers.min", spec.workers.min,
            f"must be <= sync.replicas = {s.replicas} (each worker runs whole replicas; more workers than replicas would idle)",
        )
    if spec.train.global_batch < s.replicas:
        raise JobFileError(
            source, "train.global_batch", spec.train.global_batch, f"must be >= sync.replicas = {s.replicas} (each replica trains a slice of it)"
        )


def not_here(spec: JobSpec) -> tuple[str, str, str] | None:
    """(key, value, problem) when a relative model.path or data.source names nothing under the
    job file's folder, where it is taken from, while the current folder holds it: the user meant
    that one. Run from one folder mlx-lm (or `datasets`) would load it, from another the Hub's
    repo of that spelling, so one job file would train different things depending on where it
    was started; a GPT job was queued, and failed on every node."""
    if spec.model.kind != "mlx_lm":
        given = spec.data.source
        if given == "stdlib" or os.path.isabs(os.path.expanduser(given)) or os.path.abspath(given) == spec.resolved_source():
            return None  # (from the job file's own folder: the same place, and check_paths says what is missing there)
        if not glob.glob(given, recursive=True) or data_files(spec):  # (the job folder's files listed only when it matters:
            return None  # the trainer's and dpctl's own checks list them again)
        return "data.source", given, (
            f"no .txt or .jsonl files match it under the job file's folder ({spec.resolved_source()}), where a relative path is "
            f"taken from; {os.path.abspath(given)} under the current folder is not used: give the path from the job file's folder, "
            "or an absolute one"
        )
    for key, given, (kind, _) in (("model.path", spec.model.path, model_location(spec)), ("data.source", spec.data.source, data_location(spec))):
        if kind in ("repo", "hub") and given is not None and os.path.exists(given):
            return key, given, (
                f"no such folder under the job file's folder ({spec.resolve(given)}), where a relative path is taken from, "
                f"and {os.path.abspath(given)} under the current folder is not used (nor a Hugging Face id of that spelling): "
                "give the path from the job file's folder, or an absolute one"
            )
    return None


def check_paths(spec: JobSpec, source: str) -> None:
    """The job's local paths exist on this machine (the trainer calls it before anything else)."""
    if (shadowed := not_here(spec)) is not None:
        raise JobFileError(source, *shadowed)
    if spec.model.kind == "mlx_lm":
        where, path = model_location(spec)
        if where == "dir" and not os.path.isdir(path):
            what = "a file, not a model directory" if os.path.exists(path) else "no such directory"
            raise JobFileError(source, "model.path", spec.model.path, f"{what} on this machine ({path})")
        kind, folder = data_location(spec)  # a dataset id or hf_dataset: the `datasets` package loads it (trainer/hf_data.py)
        if kind == "dir" and not os.path.isfile(os.path.join(folder, "train.jsonl")):
            what = "no such directory" if not os.path.isdir(folder) else "it holds no train.jsonl"
            hint = "; a Hugging Face dataset id is owner/name" if not os.path.isdir(folder) and "/" not in spec.data.source else ""
            raise JobFileError(source, "data.source", spec.data.source, f"{what} on this machine ({folder}){hint}")
        if kind == "dir" and spec.eval.test and not os.path.isfile(os.path.join(folder, "test.jsonl")):
            raise JobFileError(
                source, "data.source", spec.data.source,
                f"eval.test = true needs a test.jsonl beside train.jsonl, and {os.path.join(folder, 'test.jsonl')} does not exist on this machine",
            )
        if spec.model.adapters is not None:
            adapters = spec.resolve(spec.model.adapters)
            if not (os.path.isfile(adapters) or os.path.isfile(os.path.join(adapters, "adapters.safetensors"))):
                raise JobFileError(
                    source, "model.adapters", spec.model.adapters,
                    f"no adapters.safetensors in that directory, nor such a .safetensors file, on this machine ({adapters})",
                )
    elif spec.data.source != "stdlib" and not data_files(spec):
        raise JobFileError(
            source, "data.source", spec.data.source,
            f"no .txt or .jsonl files match this path or glob on this machine ({spec.resolved_source()})",
        )


def data_files(spec: JobSpec) -> list[str]:
    """The data files a non-stdlib source names, sorted (a file, a folder, or a glob)."""
    src = spec.resolved_source()
    if os.path.isdir(src):
        matches = [str(p) for p in Path(src).rglob("*") if p.is_file()]
    else:
        matches = glob.glob(src, recursive=True)
    return sorted(p for p in matches if p.endswith((".txt", ".jsonl")) and os.path.isfile(p))


def load_job(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a job file, or an `mlx_lm lora` config (`.yaml`: its paths are taken from
    the current folder, as mlx-lm takes them); raises JobFileError (one line, for the user)."""
    path = str(path)
    if mlxlm_config.is_mlx_lm_config(path):
        made = mlxlm_config.job_document(mlxlm_config.read_config(path), path, mlxlm_config.job_name(path))
        try:
            return parse_job(made.job, source=path, base_dir=os.getcwd())
        except JobFileError as e:
            raise mlxlm_config.explained(e, made.job) from None
    return parse_job(read_toml(path), source=path, base_dir=os.path.dirname(os.path.abspath(path)))


def read_toml(path: str) -> dict[str, Any]:
    """A job file's TOML document, unvalidated; JobFileError (naming the file) when it cannot be read."""
    data = read_job_file(path)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise JobFileError(path, "toml", f"byte {e.start}", "must be UTF-8 text (TOML)") from None
    except tomllib.TOMLDecodeError as e:
        raise JobFileError(path, "toml", str(e), "must be valid TOML", said=f"not valid TOML: {e}") from None


def describe() -> str:
    """Every key with its default and meaning, for `--help` and the README."""
    lines = [
        "name  (required)  [a-z0-9-]{1,63}, not starting with '-'", "priority = 0  # higher runs first, taking slots from lower ones (README: Sharing the pool)",
        "base_dir  (default: the job file's folder)  where relative paths are resolved",
    ]
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        for f in fields(cls):
            lines.append(f"  {f.name} = {f.default!r}  # {f.metadata['doc']}")
    return "\n".join(lines)
