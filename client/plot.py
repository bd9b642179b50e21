"""`dpctl plot JOB -o FILE.png`: the loss curve and throughput of a job, with its restarts marked.

The figure has two panels sharing the step axis: training loss (every logged step) with the
validation loss on top of it, and tokens/s. A restart is drawn where it happened: a dotted line at
the step the next generation resumed from, and the span of steps that had to be computed again
shaded. The same code writes `demo-loss.png` for `dpctl demo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from dpool.client.errors import BadInput
from dpool.client.rpc import Client, pages
from dpool.protocol import messages as m
from dpool.protocol.payloads import EvalRow, EventRow, JobStatus, MetricRow, SampleRow, TrainRow


@dataclass(slots=True)
class JobRecord:
    """What the control plane knows of one job: enough to plot it or summarise it."""

    status: JobStatus
    metrics: list[MetricRow] = field(default_factory=list)
    events: list[EventRow] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)

    @property
    def train(self) -> list[TrainRow]:
        """Training rows with a loss (a diverged step's is null)."""
        return [r for r in self.metrics if isinstance(r, TrainRow) and r.loss is not None]

    @property
    def evals(self) -> list[EvalRow]:
        return [r for r in self.metrics if isinstance(r, EvalRow) and r.val_loss is not None]

    @property
    def resumes(self) -> list[EventRow]:
        return [e for e in self.events if e.kind == "group.resumed"]


def fetch_job(c: Client, job: str, *, samples: bool = False) -> JobRecord:
    """Status, every metric row and every event of `job` (and its samples when asked)."""
    status = c.call(m.Status(job=job), m.StatusReply).jobs[0]
    job_id = status.id
    rec = JobRecord(status)
    for reply in pages(lambda after: c.call(m.Metrics(job=job_id, after=after), m.MetricsReply)):
        rec.metrics += reply.rows
    for reply in pages(lambda after: c.call(m.Events(job=job_id, after=after), m.EventsReply)):
        rec.events += reply.events
    if samples:
        for reply in pages(lambda after: c.call(m.Samples(job=job_id, after=after), m.SamplesReply)):
            rec.samples += reply.rows
    return rec


def restarts(rec: JobRecord) -> list[dict[str, Any]]:
    """One entry per restart: {generation, from_step, steps_recomputed, seconds}. From the
    `group.resumed` events; a generation change in the metrics that has no event (an older
    coordinator) still shows, without timings."""
    out: dict[int, dict[str, Any]] = {}
    for e in rec.resumes:
        f = e.fields
        g = int(f.get("generation", 0))
        out[g] = {
            "generation": g,
            "from_step": int(f.get("from_step", 0)),
            "steps_recomputed": int(f.get("steps_recomputed", 0) or 0),
            "seconds": f.get("seconds_since_failure"),
        }
    prev: int | None = None
    for r in rec.train:
        g = r.generation
        if g is not None and prev is not None and g != prev and g not in out:
            out[g] = {"generation": g, "from_step": r.step - 1, "steps_recomputed": 0, "seconds": None}
        prev = g if g is not None else prev
    return [out[g] for g in sorted(out)]


def centred_mean(xs: list[Any], ys: list[float]) -> tuple[list[Any], list[float], int]:
    """A moving mean over about a tenth of the points (at most 21): centred, so it does not lag,
    and only where its whole window exists, so it does not bend at the ends. Returns the points
    and the window (1: too few points to smooth)."""
    h = max(0, min(10, len(ys) // 20))
    if h == 0:
        return xs, ys, 1
    inner = range(h, len(ys) - h)
    return [xs[i] for i in inner], [sum(ys[i - h : i + h + 1]) / (2 * h + 1) for i in inner], 2 * h + 1


FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp")  # what `-o FILE`'s suffix may be (Agg and its vector backends write them)


def output_path(name: str) -> Path:
    """`-o FILE` as a path the figure can be written to (".png" added when it has no suffix);
    BadInput naming the problem when it cannot be, before anything is fetched or drawn."""
    out = Path(name).expanduser()
    if out.is_dir():
        raise BadInput(f"-o {name}: is a folder; name a file in it, e.g. {out / 'loss.png'}")
    if not out.suffix:
        out = out.with_suffix(".png")
    if out.suffix[1:].lower() not in FORMATS:
        raise BadInput(f"-o {name}: cannot write a {out.suffix!r} figure; name a file ending in " + ", ".join(f".{f}" for f in FORMATS))
    parent = next((p for p in out.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise BadInput(f"-o {name}: {parent} is not a folder")
    return out


def plot(rec: JobRecord, path: str | Path) -> Path:
    """Write the figure to `path` (its suffix names the format) and return it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    s = rec.status
    train, evals = rec.train, rec.evals
    fig, (ax_loss, ax_tps) = plt.subplots(
        2, 1, figsize=(10, 6.4), sharex=True, gridspec_kw={"height_ratios": [2.2, 1], "hspace": 0.08}, layout="constrained"
    )
    steps_total = s.steps
    last = max([r.step for r in train] + [r.step for r in evals] + [1])
    xmax = max(steps_total, last)

    for ax in (ax_loss, ax_tps):
        ax.grid(True, color="#e6e6e6", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.set_xlim(0, xmax * 1.01)

    # -- loss ------------------------------------------------------------------------------
    if train:
        xs = [r.step for r in train]
        sx, sy, n = centred_mean(xs, [r.loss for r in train])
        ax_loss.plot(xs, [r.loss for r in train], color="#9ecae1" if n > 1 else "#2171b5", linewidth=1.0 if n > 1 else 1.6, label="train loss (per step)")
        if n > 1:
            ax_loss.plot(sx, sy, color="#2171b5", linewidth=1.8, label=f"train loss ({n}-step mean)")
    if evals:
        ax_loss.plot(
            [r.step for r in evals], [r.val_loss for r in evals], color="#d94801", marker="o", markersize=5, linewidth=1.6, label="validation loss"
        )
        final = evals[-1]
        ax_loss.annotate(
            f"{final.val_loss:.3f}", (final.step, final.val_loss), textcoords="offset points", xytext=(6, 6), color="#d94801", fontsize=9
        )
    ax_loss.set_ylabel("loss (nats/token)")
    if train or evals:
        ys = [r.loss for r in train] + [r.val_loss for r in evals]
        lo, hi = min(ys), max(ys)
        # The first steps of a fresh model sit far above the rest: keep them from flattening the curve.
        settled = sorted(ys)[int(0.98 * (len(ys) - 1))]
        top = min(hi, settled + 0.35 * (settled - lo)) if len(ys) > 20 else hi
        pad = 0.05 * max(top - lo, 1e-3)
        ax_loss.set_ylim(lo - pad, top + pad)

    # -- tokens/s --------------------------------------------------------------------------
    tps = train
    if tps:
        xs = [r.step for r in tps]
        ys = [r.tokens_per_s for r in tps]
        sx, sy, n = centred_mean(xs, ys)
        ax_tps.plot(xs, ys, color="#a1d99b" if n > 1 else "#238b45", linewidth=0.9 if n > 1 else 1.4, label="tokens/s (whole pool)")
        if n > 1:
            ax_tps.plot(sx, sy, color="#238b45", linewidth=1.6, label=f"tokens/s ({n}-step mean)")
        # Mark the world size where it changes, so a slower stretch reads as fewer workers.
        prev_world = None
        for r in tps:
            w = r.world_size
            if w != prev_world:
                ax_tps.annotate(
                    f"{w} worker{'s' if w != 1 else ''}", xy=(r.step, 1.0), xycoords=("data", "axes fraction"), xytext=(4, -2),
                    textcoords="offset points", va="top", fontsize=8, color="#238b45",
                )
                prev_world = w
        vals = sorted(r.tokens_per_s for r in tps)
        ax_tps.set_ylim(0, vals[int(0.98 * (len(vals) - 1))] * 1.3)
    ax_tps.set_ylabel("tokens/s")
    ax_tps.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:.0f}k" if v >= 1000 else f"{v:.0f}"))
    ax_tps.yaxis.set_major_locator(MaxNLocator(4))
    ax_tps.set_xlabel("step")

    # -- restarts --------------------------------------------------------------------------
    for i, rs in enumerate(restarts(rec)):
        at, redo = rs["from_step"], rs["steps_recomputed"]
        for ax in (ax_loss, ax_tps):
            if redo > 0:
                ax.axvspan(at, at + redo, color="#fdae6b", alpha=0.25, linewidth=0, label="recomputed after a failure" if (ax is ax_loss and i == 0) else None)
            ax.axvline(at, color="#a50f15", linestyle=":", linewidth=1.4, label="restart" if (ax is ax_loss and i == 0) else None)
        words = [f"generation {rs['generation']}", f"resumed from step {at}"]
        if rs["seconds"] is not None:
            words.append(f"{rs['seconds']:.1f} s after the failure")
        if redo:
            words.append(f"{redo} step{'s' if redo != 1 else ''} recomputed")
        ax_loss.annotate(
            "\n".join(words), xy=(at, 1.0), xycoords=("data", "axes fraction"), xytext=(5, -4), textcoords="offset points",
            va="top", ha="left", fontsize=8, color="#a50f15", bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#fcbba1", "alpha": 0.9},
        )

    world = sorted({r.world_size for r in train})
    gens = max([r.generation or 1 for r in train] + [s.generation or 1])
    sub = [s.state, f"step {s.step}/{steps_total}"]
    if world:
        sub.append(f"{world[0]}-{world[-1]} workers" if len(world) > 1 else f"{world[0]} worker{'s' if world[0] != 1 else ''}")
    sub.append(f"{gens} generation{'s' if gens != 1 else ''}")
    if evals:
        sub.append(f"final val loss {evals[-1].val_loss:.3f}")
    job_id, name = s.id, s.name or "job"
    fig.suptitle(job_id if job_id.startswith(name) else f"{name}  ({job_id})", fontsize=12, fontweight="bold", x=0.01, ha="left")
    ax_loss.set_title(" · ".join(sub), fontsize=9, color="#555555", loc="left")
    if train or evals:
        ax_loss.legend(loc="upper right", fontsize=8, frameon=False)
    if tps:
        ax_tps.legend(loc="lower right", fontsize=8, frameon=False)
    if not train and not evals:
        ax_loss.text(0.5, 0.5, "no metrics yet", transform=ax_loss.transAxes, ha="center", va="center", color="#888888")

    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    except OSError as e:  # a read-only place, a full disk
        raise BadInput(f"-o {path}: cannot write the figure: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return out


def add_parser(sub: Any) -> None:
    s = sub.add_parser("plot", help="loss (train and validation) and tokens/s against step, restarts marked, as a PNG")
    s.add_argument("job", help="a job id, unique id prefix or name")
    s.add_argument("-o", "--output", required=True, metavar="FILE.png", help="where to write the figure (.png, .pdf, .svg, .jpg or .webp; .png when it has none)")
    s.add_argument("--json", action="store_true", help='print {"file", "job", "state", "steps", "evaluations", "restarts"}')
    s.set_defaults(fn=cmd_plot)


def cmd_plot(c: Client, a: Any) -> int:
    out = output_path(a.output)
    rec = fetch_job(c, a.job)
    out = plot(rec, out)
    n = len(restarts(rec))
    if getattr(a, "json", False):
        print(orjson.dumps({"file": str(out), "job": rec.status.id, "state": rec.status.state, "steps": len(rec.train), "evaluations": len(rec.evals), "restarts": n}, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"{out}: {len(rec.train)} steps, {len(rec.evals)} evaluations, {n} restart{'s' if n != 1 else ''} (job {rec.status.id}, {rec.status.state})")
    return 0
