"""Trainer overhead: tokens/s of `python -m dpool.trainer` at one rank vs a minimal hand-written
MLX loop of the same model, batch and optimizer (no data pipeline, no accumulation, no metrics,
no checkpoints). Both run in fresh processes with the same BLAS. Goal: ratio >= 0.95.

    python bench/overhead.py [--job examples/demo.toml] [--steps 60] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def baseline(job_path: str, steps: int, compiled: bool) -> None:
    """The minimal loop: random tokens, mean cross-entropy, AdamW, one eval per step."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    from dpool.protocol.jobspec import load_job
    from dpool.trainer.model import GPT

    spec = load_job(job_path)
    mx.random.seed(0)
    model = GPT(spec.model, 256)
    opt = optim.AdamW(learning_rate=spec.train.lr, weight_decay=spec.train.weight_decay)
    b, t = spec.train.global_batch, spec.model.context
    data = mx.random.randint(0, 256, (steps, b, t + 1))

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    vg = nn.value_and_grad(model, loss_fn)

    def lg(x, y):
        return vg(model, x, y)

    if compiled:
        lg = mx.compile(lg, inputs=model.state, outputs=model.state)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        loss, grads = lg(data[s, :, :-1], data[s, :, 1:])
        grads, _ = optim.clip_grad_norm(grads, spec.train.grad_clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"tokens_per_s": b * t / statistics.median(times[5:])}))


def run_baseline(job: str, steps: int, env: dict[str, str], compiled: bool = False) -> float:
    flags = ["--compiled"] if compiled else []
    out = subprocess.run([sys.executable, __file__, "--baseline", *flags, "--job", job, "--steps", str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def run_trainer(job: str, steps: int, env: dict[str, str], work: Path) -> float:
    text = Path(job).read_text()
    from dpool.protocol.jobspec import load_job

    spec = load_job(job)
    # Same model and batch; this many steps; logs every step; evaluation and checkpoints as rare as allowed.
    patched = work / "job.toml"
    lines = []
    section = ""
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("["):
            section = s
        key = s.split("=")[0].strip()
        if section == "[train]" and key in ("steps", "log_every_steps", "warmup_steps"):
            line = {"steps": f"steps = {steps}", "log_every_steps": "log_every_steps = 1", "warmup_steps": "warmup_steps = 1"}[key]
        if section in ("[checkpoint]", "[eval]") and key in ("every_steps", "sample_every_steps"):
            line = f"{key} = {steps}"
        lines.append(line)
    patched.write_text("\n".join(lines) + "\n")
    assert load_job(patched).model == spec.model
    run_dir = work / f"run-{time.monotonic_ns()}"
    subprocess.run([sys.executable, "-m", "dpool.trainer", str(patched), "--run-dir", str(run_dir)],
                   env=env, capture_output=True, check=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if r["kind"] == "train" and r["step"] > 5 and r["step"] < steps]
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=str(ROOT / "examples" / "demo.toml"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline:
        return baseline(args.job, args.steps, args.compiled)

    from dpool.trainer.blas import preload_env

    env = preload_env() or dict(os.environ)  # the BLAS the trainer would pick, for both sides
    with tempfile.TemporaryDirectory() as tmp:
        env.setdefault("DPOOL_CACHE_DIR", str(Path(tmp) / "cache"))
        run_trainer(args.job, 8, env, Path(tmp))  # builds the token cache outside the timed runs
        base, comp, train = [], [], []
        for _ in range(args.trials):  # interleaved, so drift in machine load hits every side
            base.append(run_baseline(args.job, args.steps, env))
            comp.append(run_baseline(args.job, args.steps, env, compiled=True))
            train.append(run_trainer(args.job, args.steps, env, Path(tmp)))
    b, c, t = statistics.median(base), statistics.median(comp), statistics.median(train)

    def trials(xs: list[float]) -> str:
        return ", ".join(f"{x:.0f}" for x in xs)

    print(f"job: {args.job}  blas: {env.get('DPOOL_BLAS_PRELOADED', 'bundled')}  trials: {args.trials} x {args.steps} steps")
    print(f"minimal MLX loop            {b:10.0f} tokens/s   ({trials(base)})")
    print(f"minimal loop, mx.compile    {c:10.0f} tokens/s   ({trials(comp)})")
    print(f"dpool trainer               {t:10.0f} tokens/s   ({trials(train)})")
    print(f"ratio trainer / minimal:          {t / b:.3f}   goal >= 0.95")
    print(f"ratio trainer / compiled minimal: {t / c:.3f}")


if __name__ == "__main__":
    main()
