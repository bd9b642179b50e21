"""Checkpoint overhead of `checkpoint.every_steps = "auto"` (goal: <= 2% of the training time).

    python bench/checkpoint_interval.py [--trials 3] [--demo-steps 100] [--lora-steps 80]

Two jobs, each run at one rank with "auto" and with no checkpoint but the last one (every_steps
above the step count), trials interleaved (order alternating), in fresh processes:
- demo: examples/demo.toml (the byte-level GPT, 0.8 M parameters: every weight is checkpointed);
- lora: LoRA (rank 8) on a tiny mlx-lm llama written here by `dpool.trainer.tinylm`: the
  checkpoint holds the adapters only.
Evaluation and samples only at the last step, so both runs do the same work but the checkpoints.

The window: from step 1 done (compiled) to the last step done (its final checkpoint is after it),
from the trainer's own log timestamps. Per job:
- `ckpt/wall`: the checkpoints' cost as "auto" measures it (writer seconds + host copy) summed
  over the window, over the window's wall time: what "auto" budgets;
- `slowdown`: median window wall of "auto" over the median of the twin without checkpoints, - 1:
  what the checkpoints cost the job, measured (noise on a shared 2-core machine is ~1-2%);
- the intervals chosen, and the checkpoints taken in the window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# bench/mlx_lm.py would shadow mlx-lm itself while this folder is on the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def write(path: Path, doc: dict) -> Path:
    from dpool.protocol.jobfile import dump_job
    from dpool.protocol.jobspec import parse_job

    path.write_text(dump_job(parse_job(doc, source=str(path), base_dir=str(path.parent))))
    return path


def demo_job(work: Path, steps: int, every: int | str) -> Path:
    doc = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    doc["train"] |= {"steps": steps, "warmup_steps": min(doc["train"]["warmup_steps"], steps)}
    doc["checkpoint"] |= {"every_steps": every}
    doc["eval"] |= {"every_steps": steps, "sample_every_steps": steps, "sample_tokens": 8}
    return write(work / f"demo-{every}.toml", doc)


def lora_job(work: Path, steps: int, every: int | str) -> Path:
    model, data = work / "lm-model", work / "lm-data"
    if not model.exists():
        from dpool.trainer import tinylm

        tinylm.make_model(model, layers=4, hidden=256, heads=8, kv_heads=4, intermediate=512, vocab_size=512)
        tinylm.make_chat_data(data, train=96, valid=12, seed=3, fmt="chat")
    doc = {
        "name": "bench-lora",
        "model": {"kind": "mlx_lm", "path": str(model), "fine_tune": "lora", "lora_rank": 8, "lora_layers": 4, "context": 256},
        "data": {"source": str(data), "mask_prompt": True},
        "train": {"steps": steps, "global_batch": 8, "lr": 1e-3, "warmup_steps": 2, "log_every_steps": 1},
        "checkpoint": {"every_steps": every, "keep": 3},
        "eval": {"every_steps": steps, "batches": 1, "sample_every_steps": steps, "sample_tokens": 8},
    }
    return write(work / f"lora-{every}.toml", doc)


def run(job: Path, run_dir: Path, steps: int, env: dict[str, str]) -> dict:
    """One trainer process; the window's wall time, its checkpoints and the intervals chosen."""
    done = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir)],
        env=env, capture_output=True, text=True, timeout=1800, start_new_session=True,
    )
    if done.returncode:
        raise SystemExit(f"{job.name}: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    at: dict[int, float] = {}
    saved: list[tuple[int, float]] = []
    intervals: list[int] = []
    for line in (done.stdout + "\n" + done.stderr).splitlines():
        if not line.startswith("{"):
            continue
        e = json.loads(line)
        t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        if e.get("event") == "step.done":
            at[e["step"]] = t
        elif e.get("event") == "checkpoint.saved":
            saved.append((e["step"], e["seconds"] + e.get("copy_s", 0.0)))
        elif e.get("event") == "checkpoint.interval":
            intervals.append(e["every_steps"])
    wall = at[steps] - at[1]
    inside = [s for step, s in saved if 1 < step < steps]
    return {"wall": wall, "ckpt_s": sum(inside), "checkpoints": len(inside), "intervals": intervals}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--demo-steps", type=int, default=100)
    ap.add_argument("--lora-steps", type=int, default=80)
    ap.add_argument("--only", choices=("demo", "lora"), default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dpool-ckpt-bench-") as tmp:
        work = Path(tmp)
        env = {**os.environ, "DPOOL_CACHE_DIR": str(work / "cache")}
        env.pop("DPOOL_CHECKPOINT_OVERHEAD", None)
        for name, make, steps in (("demo", demo_job, a.demo_steps), ("lora", lora_job, a.lora_steps)):
            if a.only and name != a.only:
                continue
            jobs = {"auto": make(work, steps, "auto"), "none": make(work, steps, steps + 1)}
            run(jobs["none"], work / f"{name}-warm", steps, env)  # data and token caches built, not timed
            got: dict[str, list[dict]] = {"auto": [], "none": []}
            for trial in range(a.trials):
                for variant in ("auto", "none") if trial % 2 == 0 else ("none", "auto"):
                    r = run(jobs[variant], work / f"{name}-{variant}-{trial}", steps, env)
                    got[variant].append(r)
                    print(f"  {name} {variant} trial {trial}: window {r['wall']:.2f} s, {r['checkpoints']} checkpoints, "
                          f"{r['ckpt_s']:.3f} s in them, intervals {r['intervals']}", flush=True)
            auto_wall = statistics.median(r["wall"] for r in got["auto"])
            none_wall = statistics.median(r["wall"] for r in got["none"])
            frac = statistics.median(r["ckpt_s"] / r["wall"] for r in got["auto"])
            chosen = sorted({r["intervals"][-1] for r in got["auto"] if r["intervals"]})
            print(
                f"{name}: {steps} steps, step {none_wall / (steps - 1) * 1000:.0f} ms; auto interval {chosen} "
                f"({statistics.median(r['checkpoints'] for r in got['auto'])} checkpoints); ckpt/wall {frac * 100:.2f}%; "
                f"window {auto_wall:.2f} s auto vs {none_wall:.2f} s without: slowdown {(auto_wall / none_wall - 1) * 100:+.2f}%",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
