"""A job's curves as inline SVG, drawn where the page is rendered: the training and validation loss
and the pool's tokens/s against the step, each restart marked and the recomputed span shaded by the
rules `dpctl plot` follows (client/plot.py). No script and no chart library: the browser draws
the SVG as it comes, and a page with scripts off shows the same figure.

At most POINTS_MAX points a line: more rows are averaged in consecutive runs (a 100,000-step curve
keeps its shape in a few kilobytes)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape
from typing import Any

W, LEFT, RIGHT = 960, 64, 16
LOSS_TOP, LOSS_H = 28, 250
TPS_TOP, TPS_H = LOSS_TOP + LOSS_H + 34, 110
H = TPS_TOP + TPS_H + 34
POINTS_MAX = 600
RESTARTS_DRAWN = 100
TRAIN, VAL, TPS, RESTART, REDO = "#2171b5", "#d94801", "#238b45", "#a50f15", "#fdae6b"


def thin(points: Sequence[tuple[float, float]], most: int = POINTS_MAX) -> list[tuple[float, float]]:
    """`points` as at most `most`: means of consecutive runs, the last point kept as it is."""
    if len(points) <= most:
        return list(points)
    size = math.ceil(len(points) / most)
    out = []
    for i in range(0, len(points), size):
        run = points[i : i + size]
        out.append((sum(p[0] for p in run) / len(run), sum(p[1] for p in run) / len(run)))
    out[-1] = points[-1]
    return out


def ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten apart) between lo and hi."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / most
    power = 10 ** math.floor(math.log10(raw))
    step = next(k * power for k in (1, 2, 5, 10) if k * power >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def label(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.4g}"


def _line(points: list[tuple[float, float]], color: str, cls: str, width: float = 1.6) -> str:
    if not points:
        return ""
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return f'<polyline class="{cls}" fill="none" stroke="{color}" stroke-width="{width}" stroke-linejoin="round" points="{coords}"/>'


def svg(*, steps: int, train: Sequence[tuple[int, float, float]], evals: Sequence[tuple[int, float]], restarts: Sequence[dict[str, Any]]) -> str:
    """The figure: `train` (step, loss, tokens/s), `evals` (step, val_loss), `restarts` as
    client/plot.py's `restarts()` lists them, on an x axis to `steps` (or the last step)."""
    last = max([r[0] for r in train] + [r[0] for r in evals] + [1])
    xmax = max(steps, last, 1)
    span = W - LEFT - RIGHT

    def x(step: float) -> float:
        return LEFT + span * step / xmax

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" role="img" aria-label="loss and tokens per second against step">']
    losses = [r[1] for r in train] + [v for _, v in evals]
    if losses:
        lo, hi = min(losses), max(losses)
        # The first steps of a fresh model sit far above the rest: keep them from flattening the curve (as dpctl plot).
        settled = sorted(losses)[int(0.98 * (len(losses) - 1))]
        top = min(hi, settled + 0.35 * (settled - lo)) if len(losses) > 20 else hi
        pad = 0.05 * max(top - lo, 1e-3)
        lo, top = lo - pad, top + pad
    else:
        lo, top = 0.0, 1.0

    def y_loss(v: float) -> float:
        return LOSS_TOP + LOSS_H * (1 - (min(v, top) - lo) / (top - lo))

    speeds = sorted(r[2] for r in train)
    tps_top = (speeds[int(0.98 * (len(speeds) - 1))] * 1.3) if speeds and speeds[-1] > 0 else 1.0

    def y_tps(v: float) -> float:
        return TPS_TOP + TPS_H * (1 - min(v, tps_top) / tps_top)

    # frames, grid and axes
    for top_y, height, name in ((LOSS_TOP, LOSS_H, "loss"), (TPS_TOP, TPS_H, "tokens/s")):
        parts.append(f'<rect x="{LEFT}" y="{top_y}" width="{span}" height="{height}" fill="#fff" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 8}" y="{top_y - 10}" font-size="12" fill="#555">{escape(name)}</text>')
    for v in ticks(lo, top):
        yy = y_loss(v)
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/><text x="{LEFT - 6}" y="{yy + 4:.1f}" font-size="11" fill="#666" text-anchor="end">{label(v)}</text>')
    for v in ticks(0, tps_top, 3):
        yy = y_tps(v)
        parts.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/><text x="{LEFT - 6}" y="{yy + 4:.1f}" font-size="11" fill="#666" text-anchor="end">{label(v)}</text>')
    for v in ticks(0, xmax, 8):
        xx = x(v)
        parts.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{LOSS_TOP}" y2="{TPS_TOP + TPS_H}" stroke="#f3f3f3"/><text x="{xx:.1f}" y="{TPS_TOP + TPS_H + 16}" font-size="11" fill="#666" text-anchor="middle">{int(v)}</text>')
    parts.append(f'<text x="{W - RIGHT}" y="{H - 4}" font-size="11" fill="#666" text-anchor="end">step</text>')

    # restarts: the recomputed span shaded, the restart a dotted line (as dpctl plot); the newest
    # RESTARTS_DRAWN (a job that restarted thousands of times is a figure of its own)
    for rs in restarts[-RESTARTS_DRAWN:]:
        at, redo = rs["from_step"], rs["steps_recomputed"]
        words = [f"generation {rs['generation']}", f"resumed from step {at}"]
        if rs.get("seconds") is not None:
            words.append(f"{rs['seconds']:.1f} s after the failure")
        if redo:
            words.append(f"{redo} step{'s' if redo != 1 else ''} recomputed")
        tip = escape(", ".join(words))
        if redo > 0:
            w = max(1.0, x(at + redo) - x(at))
            parts.append(f'<rect class="recomputed" x="{x(at):.1f}" y="{LOSS_TOP}" width="{w:.1f}" height="{TPS_TOP + TPS_H - LOSS_TOP}" fill="{REDO}" fill-opacity="0.3"><title>{tip}</title></rect>')
        parts.append(
            f'<line class="restart" data-generation="{rs["generation"]}" x1="{x(at):.1f}" x2="{x(at):.1f}" y1="{LOSS_TOP}" y2="{TPS_TOP + TPS_H}" '
            f'stroke="{RESTART}" stroke-width="1.6" stroke-dasharray="3 3"><title>{tip}</title></line>'
        )
        parts.append(f'<text x="{x(at) + 4:.1f}" y="{LOSS_TOP + 12}" font-size="11" fill="{RESTART}">gen {rs["generation"]}</text>')

    parts.append(_line(thin([(x(s), y_loss(v)) for s, v, _ in train]), TRAIN, "train-loss"))
    parts.append(_line(thin([(x(s), y_tps(v)) for s, _, v in train]), TPS, "tokens-per-s", 1.2))
    if evals:
        parts.append(_line([(x(s), y_loss(v)) for s, v in evals], VAL, "val-loss"))
        parts += [f'<circle class="val-point" cx="{x(s):.1f}" cy="{y_loss(v):.1f}" r="3" fill="{VAL}"><title>step {s}: {v:.4f}</title></circle>' for s, v in evals[-200:]]
    if not train and not evals:
        parts.append(f'<text x="{LEFT + span / 2}" y="{LOSS_TOP + LOSS_H / 2}" font-size="14" fill="#888" text-anchor="middle">no metrics yet</text>')

    # legend
    items = [(TRAIN, "train loss"), (VAL, "validation loss"), (TPS, "tokens/s (pool)"), (RESTART, "restart"), (REDO, "recomputed")]
    lx = LEFT + 90
    for color, name in items:
        parts.append(f'<rect x="{lx}" y="{LOSS_TOP - 20}" width="10" height="10" fill="{color}"/><text x="{lx + 14}" y="{LOSS_TOP - 11}" font-size="11" fill="#444">{name}</text>')
        lx += 14 + 7 * len(name) + 18
    parts.append("</svg>")
    return "".join(parts)
