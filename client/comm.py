"""What `dpctl submit` (and `--dry-run`) predicts of a job's communication, before it runs.

- The bytes of one all_sum: the job's trainable parameters (`trainable_params`: the built-in GPT's
  shapes from the job file; an mlx_lm model's from the tensors or `config.json` in `model.path`,
  with its LoRA settings, when that folder is on this machine) in the `[sync] dtype`.
- The link: the slowest the pool measured (`dpctl nodes --json` "links") between the nodes the job
  would use now (the usable nodes, in name order, until `workers.max` slots).
- The compute of a step: only measured ones. The newest job of the same name and the same
  trainable parameters (in either `[sync] dtype`) that measured a step (`status --json` "comm" keeps a finished job's) gives it, scaled to this
  job's sequences per rank. Without one the prediction says the seconds of all_sum per step and
  the bytes, and that the share needs a measured step.

The model itself is protocol/commmodel.py's, the one the pool uses for running jobs.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpool.protocol.commmodel import (
    DTYPE_BYTES,
    Link,
    bound_warning,
    comm_share,
    describe_link,
    gpt_params,
    step_comm,
)
from dpool.protocol.jobspec import JobSpec, lora_blocks
from dpool.protocol.payloads import JobStatus, NodeRow

GPT_VOCAB = 256  # the built-in GPT's byte-level vocabulary (trainer/data.py VOCAB_SIZE)
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not read
LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Forecast:
    params: int
    nbytes: int  # one all_sum
    every: int  # steps per all_sum
    ranks: int
    nodes: list[str]
    link: Link | None  # the slowest measured between `nodes` (None: none measured)
    pace: tuple[str, str] | None
    measured_pairs: int
    pairs: int
    seconds: float | None  # all_sum per step
    compute_s: float | None
    compute_from: str | None  # the job whose measured step gave compute_s
    share: float | None
    warmup: int = 0  # diloco: warm-up steps first, one all_sum each (not in `seconds` or `share`; 0 in sync mode)
    warmup_share: float | None = None  # of each warm-up step, in all_sum (None: no warm-up, or not known)

    def lines(self) -> list[str]:
        """What --dry-run says (stderr)."""
        per = "each step" if self.every == 1 else f"every {self.every} steps (diloco)"
        if self.warmup:
            per += f", each of the first {self.warmup} steps (sync.warmup_steps; the figures below are for the steps after)"
        out = [f"communication: {per} all_sums {_mb(self.nbytes)} ({self.params:,} trainable parameters) over {self.ranks} rank{'s' if self.ranks != 1 else ''} on {', '.join(self.nodes)}"]
        if self.ranks < 2:
            out.append("communication: one rank sums nothing: no time in all_sum")
            return out
        if self.link is None or self.seconds is None or self.pace is None:
            where = "on this node (its ranks share it)" if len(self.nodes) == 1 else f"between {', '.join(self.nodes)}"
            out.append(f"communication: no link {where} measured yet (a group's start-up probe measures its ring): no prediction")
            return out
        out.append(
            f"communication: about {_secs(self.seconds)} of all_sum per step on the slowest link measured, "
            f"{describe_link(*self.pace, self.link)} ({self.measured_pairs} of {self.pairs} node pairs measured)"
        )
        if self.share is None:
            out.append("communication: the share of a step needs a measured step (none of a job of this name and size yet)")
        else:
            out.append(f"communication: about {_pct(self.share)} of each step (compute {_secs(self.compute_s or 0.0)} per step, as {self.compute_from} measured it)")
        if self.warmup_share is not None:
            out.append(f"communication: about {_pct(self.warmup_share)} of each of the first {self.warmup} steps (the warm-up's all_sum every step)")
        return out

    def warning(self) -> str | None:
        if self.share is None or self.link is None or self.pace is None:
            return None
        return bound_warning(self.share, describe_link(*self.pace, self.link))


def forecast(spec: JobSpec, nodes: list[NodeRow], jobs: list[JobStatus]) -> Forecast | None:
    """The prediction for `spec` on the pool as `nodes` and `jobs` describe it; None when its
    parameters are not known here (an mlx_lm model whose folder is not on this machine)."""
    params = trainable_params(spec)
    if params is None:
        return None
    sync = spec.sync
    most = spec.max_workers()  # workers.max, a sequence each at least, one per replica (diloco)
    usable = [n for n in sorted(nodes, key=lambda n: n.name) if n.state in ("idle", "busy") and not n.reason]
    chosen, slots = [], 0
    for n in usable:
        if slots >= most:
            break
        chosen.append(n.name)
        slots += n.slots
    ranks = max(1, min(slots, most))
    figures: dict[tuple[str, str], Link] = {}
    for n in nodes:
        for ln in n.links:
            if n.name in chosen and ln.peer in chosen:
                figures[(min(n.name, ln.peer), max(n.name, ln.peer))] = Link(ln.bandwidth_bps, ln.latency_s)
    pairs = len(chosen) * (len(chosen) - 1) // 2
    pace = min(figures, key=lambda p: figures[p].bandwidth_bps) if figures else None
    link = figures[pace] if pace else None
    ring = link or Link(1.0, 0.0)  # the bytes only, when no link is measured
    comm = step_comm(params, ranks, ring, dtype=sync.dtype, mode=sync.mode, inner_steps=sync.inner_steps)
    seconds = comm.seconds if link is not None else None
    compute, source = _compute(spec, params, ranks, jobs)
    share = warm = None
    if seconds is not None and compute is not None:
        share = comm_share(seconds, compute)
        if sync.warmup_steps:
            warm = comm_share(step_comm(params, ranks, ring, dtype=sync.dtype).seconds, compute)
    if ranks < 2:
        seconds, share, warm = 0.0, 0.0, None
    return Forecast(
        params, comm.nbytes, comm.every, ranks, chosen, link, pace, len(figures), pairs, seconds, compute, source, share, sync.warmup_steps, warm,
    )


def _compute(spec: JobSpec, params: int, ranks: int, jobs: list[JobStatus]) -> tuple[float | None, str | None]:
    """A step's compute from the newest job of this name and size (its trainable parameters, in
    whichever dtype it summed them) that measured one, scaled to this job's sequences per rank."""
    nbytes = params * DTYPE_BYTES.get(spec.sync.dtype, 4)
    for j in sorted(jobs, key=lambda j: j.submitted or 0.0, reverse=True):
        c = j.comm
        size = c.params == params if c is not None and c.params is not None else c is not None and c.bytes == nbytes  # (a pool before params: its bytes)
        if j.name != spec.name or c is None or c.compute_s is None or not size or not c.global_batch:
            continue
        scale = (spec.train.global_batch / ranks) / (c.global_batch / c.ranks)
        return c.compute_s * scale, f"job {j.id}"
    return None, None


# -- what a step sums ------------------------------------------------------------------------------


def trainable_params(spec: JobSpec) -> int | None:
    """The job's trainable parameters, from the job file alone (gpt) or from the model's folder
    on this machine (mlx_lm; None when it is not here or cannot be read)."""
    m = spec.model
    if m.kind == "gpt":
        return gpt_params(m.layers, m.dim, GPT_VOCAB, m.context, m.positions == "learned")
    folder = Path(m.path or "")
    if not m.path or not folder.is_dir():
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    tensors = _tensor_shapes(folder, config)
    if m.fine_tune == "full":
        return sum(_count(s) for s in tensors.values()) if tensors else None
    return _lora_params(tensors, config, m.lora_rank, lora_blocks(m, 1 << 30), dora=m.fine_tune == "dora")  # -1: every block


def _lora_params(tensors: dict[str, tuple[int, ...]], config: dict[str, Any], rank: int, layers: int, *, dora: bool) -> int | None:
    """mlx-lm's adapters (`linear_to_lora_layers`): every linear layer of the last `layers` blocks
    gets A (in x r) and B (r x out), per expert for a layer of experts; DoRA adds a magnitude per
    output. From the weights' shapes (out, in), or, without them, a llama-style block from
    config.json (q, k, v, o; gate, up, down)."""
    if tensors:
        blocks: dict[int, list[tuple[int, ...]]] = {}
        for name, shape in tensors.items():
            found = LAYER_RE.search(name)
            if found and name.endswith(".weight") and len(shape) >= 2 and "norm" not in name and "embed" not in name:
                blocks.setdefault(int(found.group(1)), []).append(shape)
        if not blocks:
            return None
        total = 0
        for i in sorted(blocks)[-layers:]:
            for shape in blocks[i]:
                experts = _count(shape[:-2]) if len(shape) > 2 else 1
                out, inp = shape[-2], shape[-1]
                total += experts * (rank * (inp + out) + (out if dora else 0))
        return total
    try:
        h, n_layers, inter = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or h // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    shapes = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    per_block = sum(rank * (i + o) + (o if dora else 0) for o, i in shapes)
    return per_block * min(layers, n_layers)


def _tensor_shapes(folder: Path, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers in `folder` (a quantized weight's input
    width unpacked: `bits` per element in uint32 words); {} when there are none or one is bad."""
    bits = 0
    q = config.get("quantization") or config.get("quantization_config")
    if isinstance(q, dict) and isinstance(q.get("bits"), int) and q["bits"] > 0:
        bits = q["bits"]
    out: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > HEADER_MAX:
                    return {}
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            return {}
        if not isinstance(header, dict):
            return {}
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict) or not isinstance(info.get("shape"), list):
                continue
            shape = tuple(int(x) for x in info["shape"] if isinstance(x, int))
            if name.endswith((".scales", ".biases")) and bits:
                continue  # a quantized weight's: not trained, not a layer of its own
            if info.get("dtype") == "U32" and bits and shape:
                shape = (*shape[:-1], shape[-1] * 32 // bits)
            out[name] = shape
    return out


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def _pct(share: float) -> str:
    """A share as read: `32%`, and `under 1%` for what rounds to 0 but is not (diloco's)."""
    return "under 1%" if share > 0 and round(share * 100) == 0 else f"{share:.0%}"


def _secs(s: float) -> str:
    """Seconds as read: `1.25 s`, `9.8 ms`, `40 µs` (a diloco all_sum spread over its inner steps)."""
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 or s == 0 else f"{s * 1e6:.0f} µs"

