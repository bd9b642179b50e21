"""dpool against mlx-lm: tokens/s of `python -m dpool.trainer` against `python -m mlx_lm lora
--train` on the same tiny mlx-lm model, chat data, batch, sequence length and steps.

    python bench/mlx_lm.py [--trials 3] [--steps 40] [--layers 2 --hidden 64] [--world 3] [--same-length]

1. One rank: the trainer against `mlx_lm lora`. Goal: ratio >= 0.95.
2. `--world` ranks on this machine, same global batch (mlx-lm needs it divisible by the ranks:
   batch x world): `mlx.launch --backend ring -n N` around `mlx_lm lora` and around the trainer
   (the same launcher on both sides), and the trainer's ranks started directly with MLX_RANK and
   MLX_HOSTFILE, as dpd starts them. No goal: on a 2-core box three ranks oversubscribe the CPU,
   so this compares the two at the same oversubscription. OPENBLAS_NUM_THREADS=1 for every rank.
   mlx.launch's own CPU is printed too: it polls its ranks' pipes without blocking.

Both sides run in fresh processes with the same BLAS (`preload_env()`: what the trainer would
re-execute itself with), the same OPENBLAS_NUM_THREADS, and the same model and data, written here
by `dpool.trainer.tinylm`; trials interleaved (order alternating), figures the medians.

Each side's own step timer is used. mlx-lm reports trained tokens over the training time of every
5 iterations (validation excluded); it prints the running token count rounded to 0.1k, so it runs
as `python -m mlx_lm` (runpy) with its report hook wrapped to print the exact figures it is given
(outside its timer). The trainer's metrics.jsonl has trained tokens and wall time per step. Both:
trained tokens / time over the steps after the first window of 5 (compilation).

mlx-lm is given the trainer's optimizer (AdamW, betas 0.9/0.95, weight decay 0.1, cosine decay to
a tenth) through a config file; it does not clip gradients (the trainer clips the global norm at
1.0). The two build batches differently. The trainer sorts examples by length within seeded pools
of 16 batches. mlx-lm means to batch neighbours in length order, but its trainer sorts the
`CacheDataset` it is given by `len()` of each raw row (a chat row is a dict with one key), so every
row has length 1 and batches are consecutive lines of train.jsonl (mlx-lm 0.32.2; ml-explore/mlx-lm
issue 596). The padding line prints tokens computed per trained token for each, from each side's
own batching code: a cost per trained token. `--same-length` (one example repeated) takes the
difference out and leaves the cost of the step itself. OpenBLAS threads at one rank are as
inherited; set OPENBLAS_NUM_THREADS=1 to compare the two per core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import parse_job

HERE = Path(__file__).resolve().parent
# This file is named mlx_lm.py: with its folder on the import path, `import mlx_lm` would find it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

REPORT = 5  # mlx-lm's --steps-per-report; the first window of each side is not timed

# `python -m mlx_lm lora ...`, with TrainUI.report_train (called outside mlx-lm's timer, on every
# rank, printing on rank 0) also printing its arguments unrounded.
MLX_LM_HOOK = """
import json, runpy, sys
import mlx_lm.cli_ui as ui
report = ui.TrainUI.report_train
def report_train(self, it, loss, tokens_per_s, trained_tokens):
    if self._rank == 0:
        row = {"it": it, "loss": float(loss), "tokens_per_s": float(tokens_per_s), "trained": float(trained_tokens)}
        print("BENCH " + json.dumps(row), flush=True)
    report(self, it, loss, tokens_per_s, trained_tokens)
ui.TrainUI.report_train = report_train
sys.argv[0] = "mlx_lm"
runpy.run_module("mlx_lm", run_name="__main__")
"""

class RunFailed(RuntimeError):
    pass


class Procs:
    """Children in their own sessions, ended by process group (never by name)."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen] = []

    def run(self, cmds: list[list[str]], envs: list[dict[str, str]], logs: Path, timeout: float) -> list[str]:
        """Run the commands together; their stdout. RunFailed (with each stderr's tail) when one
        fails or time runs out; the rest are then killed, as a ring peer would wait forever."""
        logs.mkdir(parents=True, exist_ok=True)
        procs, outs, errs = [], [], []
        for i, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
            out, err = logs / f"{i}.out", logs / f"{i}.err"
            with open(out, "wb") as o, open(err, "wb") as e:
                p = subprocess.Popen(cmd, env=env, cwd=logs, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                     start_new_session=True)
            self.live.append(p)
            procs.append(p)
            outs.append(out)
            errs.append(err)
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                self.kill(p)
        codes = [p.returncode for p in procs]
        if any(codes):
            why = "timed out" if time.monotonic() > deadline else f"exit codes {codes}"
            tails = "\n".join(f"--- {' '.join(c[:8])} ... stderr:\n{e.read_text(errors='replace')[-2500:]}"
                              for c, e in zip(cmds, errs, strict=True))
            raise RunFailed(f"{why}\n{tails}")
        return [o.read_text(errors="replace") for o in outs]

    def kill(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if p in self.live:
            self.live.remove(p)

    def kill_all(self) -> None:
        for p in list(self.live):
            self.kill(p)


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """n free local ports; `consecutive` for mlx.launch, which takes a first port and counts up."""
    for _ in range(200):
        socks = [socket.socket() for _ in range(n)]
        try:
            base = random.randrange(20000, 60000 - n) if consecutive else 0
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", base + i if consecutive else 0))
            return [s.getsockname()[1] for s in socks]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RunFailed(f"found no {n} free local ports")


def mlx_launch(world: int) -> list[str]:
    launcher = Path(sys.executable).parent / "mlx.launch"
    return [str(launcher), "--backend", "ring", "-n", str(world),
            "--starting-port", str(free_ports(world, consecutive=True)[0]), "--"]


def rate(rows: list[tuple[float, float]]) -> float:
    """Tokens/s over (tokens, seconds) rows: total over total."""
    return sum(n for n, _ in rows) / sum(s for _, s in rows)


# -- the two sides ----------------------------------------------------------------------------------


def run_dpool(procs: Procs, args, job: Path, world: int, env: dict[str, str], work: Path, launcher: bool) -> dict:
    run_dir = work / f"dpool-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir / "r{rank}")]
    if world == 1:
        procs.run([cmd], [env], run_dir / "logs", args.timeout)
    elif launcher:
        procs.run([mlx_launch(world) + cmd], [env], run_dir / "logs", args.timeout)
    else:  # as dpd starts a group (and tests/ring.py): MLX_RANK and MLX_HOSTFILE per process
        hostfile = run_dir / "hosts.json"
        hostfile.parent.mkdir(parents=True)
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(world)]))
        envs = [{**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(world)]
        procs.run([cmd] * world, envs, run_dir / "logs", args.timeout)
    metrics = run_dir / "r0" / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    timed = [(r["tokens"], r["tokens"] / r["tokens_per_s"]) for r in train if r["step"] > REPORT]
    if not timed:
        raise RunFailed(f"dpool: no train rows after step {REPORT} in {metrics}")
    last = [r["loss"] for r in train if r["step"] > args.steps - REPORT]
    return {"rate": rate(timed), "loss": statistics.mean(last)}


def run_mlx_lm(procs: Procs, args, world: int, env: dict[str, str], work: Path, config: Path) -> dict:
    out = work / f"mlx-lm-{time.monotonic_ns()}"
    lora = [
        sys.executable, "-c", MLX_LM_HOOK, "lora", "--train", "--model", str(args.model_dir),
        "--data", str(args.data_dir), "-c", str(config), "--fine-tune-type", "lora",
        "--num-layers", str(args.layers), "--batch-size", str(args.batch * world),
        "--iters", str(args.steps), "--max-seq-length", str(args.context), "--mask-prompt",
        "--steps-per-report", str(REPORT), "--steps-per-eval", str(10 * args.steps), "--val-batches", "1",
        "--save-every", str(10 * args.steps), "--adapter-path", str(out / "adapters"),
    ]
    (text,) = procs.run([mlx_launch(world) + lora if world > 1 else lora], [env], out / "logs", args.timeout)
    reports = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("BENCH ")]
    timed, trained = [], 0.0
    for r in reports:  # each report: the tokens since the previous one, at its rate
        n, trained = r["trained"] - trained, r["trained"]
        if r["it"] > REPORT:
            timed.append((n, n / r["tokens_per_s"]))
    if not timed:
        raise RunFailed(f"mlx-lm: no training reports after iteration {REPORT}; its output ends:\n{text[-2500:]}")
    return {"rate": rate(timed), "loss": reports[-1]["loss"]}


def launcher_cpu(procs: Procs, world: int, env: dict[str, str], work: Path) -> float:
    """CPU seconds per wall second that mlx.launch itself takes around ranks that only sleep."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    procs.run([[*mlx_launch(world), "sleep", "3"]], [env], work / "launcher", 60)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - t0
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / wall


# -- setup, and the padding each side's batching costs ----------------------------------------------


def make_inputs(args, work: Path) -> None:
    from dpool.trainer import tinylm

    args.model_dir = tinylm.make_model(
        work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, vocab_size=512,
    )
    args.data_dir = tinylm.make_chat_data(work / "data", train=args.examples, valid=12, fmt="chat")
    if args.same_length:  # every example the first one: both sides pad alike
        for name in ("train.jsonl", "valid.jsonl"):
            path = args.data_dir / name
            lines = path.read_text().splitlines()
            path.write_text((lines[0] + "\n") * len(lines))


def write_job(args, work: Path, world: int) -> Path:
    """The LoRA job both sides train, as dpool's own writer writes job files."""
    job = work / f"job-{world}.toml"
    s = args.steps
    spec = parse_job({
        "name": "bench-mlx-lm",
        "model": {"kind": "mlx_lm", "path": str(args.model_dir), "fine_tune": "lora", "lora_rank": 8, "lora_scale": 20.0,
                  "lora_layers": args.layers, "context": args.context},
        "data": {"source": str(args.data_dir), "mask_prompt": True},
        "train": {"steps": s, "global_batch": args.batch * world, "micro_batch": args.batch, "lr": float(args.lr),
                  "warmup_steps": 0, "log_every_steps": 1},
        "checkpoint": {"every_steps": s},
        "eval": {"every_steps": s, "batches": 1, "sample_every_steps": s, "sample_tokens": 1},
    }, source=str(job), base_dir=str(work))
    job.write_text(dump_job(spec))
    return job


def write_mlx_lm_config(args, work: Path) -> Path:
    """The trainer's optimizer for mlx-lm: AdamW(betas 0.9/0.95, weight decay 0.1) and its schedule,
    cosine from lr to lr/10 over the run (mlx-lm's `lr_schedule`; no warm-up, as the job's)."""
    path = work / "mlx_lm.yaml"
    path.write_text(json.dumps({  # JSON is YAML
        "optimizer": "adamw",
        "optimizer_config": {"adamw": {"betas": [0.9, 0.95], "weight_decay": 0.1}},
        "lr_schedule": {"name": "cosine_decay", "arguments": [args.lr, args.steps, args.lr / 10]},
    }))
    return path


def padding(args, job: Path, world: int, cache: Path) -> tuple[float, float]:
    """Tokens computed (batch rows x padded width) per trained token, each side's batches built by
    its own code: mlx-lm's `iterate_batches` over the `CacheDataset` its trainer uses (one epoch:
    the batches it cycles through), and the trainer's task and packing over its timed steps."""
    import numpy as np
    from mlx_lm.tuner.datasets import CacheDataset, create_dataset
    from mlx_lm.tuner.trainer import iterate_batches

    from dpool.protocol.jobspec import load_job
    from dpool.trainer.data import split_shares
    from dpool.trainer.loop import parse_shares
    from dpool.trainer.task import build_task, pack

    spec = load_job(job)
    task = build_task(spec, cache)
    rows = [json.loads(x) for x in (Path(args.data_dir) / "train.jsonl").read_text().splitlines() if x.strip()]
    dataset = CacheDataset(create_dataset(rows, task.tokenizer, SimpleNamespace(mask_prompt=True)))

    def trained(lengths: np.ndarray, width: int) -> int:  # mlx-lm's loss mask (and the trainer's)
        steps = np.arange(1, width)
        return int(((steps >= lengths[:, :1]) & (steps <= lengths[:, 1:])).sum())

    computed = counted = 0
    for rank in range(world):
        group = SimpleNamespace(rank=lambda r=rank: r, size=lambda: world) if world > 1 else None
        for batch, lengths in iterate_batches(dataset, spec.train.global_batch, args.context, comm_group=group):
            computed += batch.size
            counted += trained(np.array(lengths), batch.shape[1])
    mlx = computed / counted

    shares = split_shares(parse_shares(None, world, spec.train.global_batch))
    computed = counted = 0
    for step in range(REPORT + 1, args.steps + 1):
        for start, count in shares:
            for mb in pack(task.examples(step, start, count), args.batch, task.pad_to, task.width_cap):
                computed += mb.tokens.size
                counted += trained(mb.lengths, mb.tokens.shape[1])
    return mlx, computed / counted


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps (mlx-lm: iterations) per run")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, help="MLP width (default: 2 x hidden)")
    ap.add_argument("--batch", type=int, default=4, help="examples per step per rank")
    ap.add_argument("--context", type=int, default=2048, help="max sequence length (mlx-lm's --max-seq-length)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--examples", type=int, default=96, help="training examples written")
    ap.add_argument("--world", type=int, default=3, help="ranks of the group comparison (1: skip it)")
    ap.add_argument("--same-length", action="store_true", help="every example the same: no padding difference")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    args = ap.parse_args()
    args.intermediate = args.intermediate or 2 * args.hidden
    if args.steps < 2 * REPORT:
        ap.error(f"--steps must be at least {2 * REPORT}: the first {REPORT} steps are not timed")

    from dpool.trainer.blas import preload_env

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # finally blocks run on SIGTERM too
    procs = Procs()
    results: dict[str, list[dict]] = {k: [] for k in ("mlx1", "dpool1", "mlxN", "dpoolN", "directN")}
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-mlx-lm-") as tmp:
            work = Path(tmp)
            env = preload_env() or dict(os.environ)  # the BLAS the trainer would pick, for both sides
            for key in ("MLX_RANK", "MLX_HOSTFILE", "DPOOL_WORKER_ADDR"):
                env.pop(key, None)
            # Offline; mlx.launch's per-rank temp files (mktemp) land here and go with it.
            env |= {"HF_HUB_OFFLINE": "1", "TMPDIR": tmp, "DPOOL_CACHE_DIR": str(work / "cache")}
            one_env = env  # OPENBLAS_NUM_THREADS as the trainer would see it
            group_env = env | {"OPENBLAS_NUM_THREADS": "1"}
            make_inputs(args, work)
            config = write_mlx_lm_config(args, work)
            job1 = write_job(args, work, 1)
            jobN = write_job(args, work, args.world) if args.world > 1 else None
            pad1 = padding(args, job1, 1, work / "cache")
            padN = padding(args, jobN, args.world, work / "cache") if jobN else None
            spin = launcher_cpu(procs, args.world, group_env, work) if jobN else 0.0
            for trial in range(args.trials):  # interleaved, order alternating: drift hits every side
                runs = [
                    ("mlx1", lambda: run_mlx_lm(procs, args, 1, one_env, work, config)),
                    ("dpool1", lambda: run_dpool(procs, args, job1, 1, one_env, work, False)),
                ]
                if jobN:
                    runs += [
                        ("mlxN", lambda: run_mlx_lm(procs, args, args.world, group_env, work, config)),
                        ("dpoolN", lambda: run_dpool(procs, args, jobN, args.world, group_env, work, True)),
                        ("directN", lambda: run_dpool(procs, args, jobN, args.world, group_env, work, False)),
                    ]
                if trial % 2:
                    runs[0:2], runs[2:4] = runs[1::-1], runs[3:1:-1]
                for key, fn in runs:
                    results[key].append(fn())
                    print(f"  trial {trial + 1} {key:7s} {results[key][-1]['rate']:8.0f} tokens/s", file=sys.stderr, flush=True)
    except RunFailed as e:
        print(f"error: a run failed: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        procs.kill_all()

    def med(key: str) -> float:
        return statistics.median(r["rate"] for r in results[key])

    def trials(key: str) -> str:
        return f"{med(key):7.0f} tok/s (" + ", ".join(f"{r['rate']:.0f}" for r in results[key]) + ")"

    def loss(key: str) -> str:
        return f"{statistics.median(r['loss'] for r in results[key]):.3f}"

    cores = os.cpu_count()
    threads = one_env.get("OPENBLAS_NUM_THREADS", f"unset (OpenBLAS: {cores} threads)")
    data = f"{args.examples} chat examples" + (", all the same one" if args.same_length else "") + ", mask_prompt"
    print(f"blas: {one_env.get('DPOOL_BLAS_PRELOADED', 'bundled')}; OPENBLAS_NUM_THREADS at one rank: {threads}, "
          f"in groups: 1; {cores} cores")
    print(f"model: llama, {args.layers} layers, hidden {args.hidden}, heads {args.heads} ({args.kv_heads} kv), "
          f"mlp {args.intermediate}, BPE vocab 512; LoRA rank 8 scale 20 on all {args.layers} layers; {data}; "
          f"max seq {args.context}")
    print(f"trials: {args.trials} x {args.steps} steps, batch {args.batch} per rank; trained tokens / time over "
          f"steps {REPORT + 1}-{args.steps}; {time.monotonic() - t0:.0f} s in all")
    print("optimizer, both: AdamW(0.9, 0.95, weight decay 0.1), cosine lr to a tenth; dpool also clips the grad norm at 1.0")
    m1, d1 = med("mlx1"), med("dpool1")
    print(f"one rank:  mlx_lm lora {trials('mlx1')}   dpool {trials('dpool1')}   ratio {d1 / m1:.3f}  goal >= 0.95")
    if jobN:
        w = args.world
        mN, dN, xN = med("mlxN"), med("dpoolN"), med("directN")
        print(f"{w} ranks:   mlx.launch -n {w} mlx_lm lora {trials('mlxN')}   mlx.launch -n {w} dpool {trials('dpoolN')}"
              f"   ratio {dN / mN:.3f}")
        print(f"           dpool {w} ranks started directly (as dpd does) {trials('directN')}   ratio to mlx-lm {xN / mN:.3f}")
        print(f"           global batch {args.batch * w}; {w} ranks on {cores} cores oversubscribe the CPU, both sides "
              f"alike; no goal. mlx.launch itself: {spin:.2f} CPU-s per s around ranks that only sleep")
    print(f"padding, tokens computed per trained token: one rank mlx-lm {pad1[0]:.2f} dpool {pad1[1]:.2f}"
          + (f"; {args.world} ranks mlx-lm {padN[0]:.2f} dpool {padN[1]:.2f}" if padN else "")
          + " (mlx-lm: train.jsonl order, its length sort being a no-op on chat rows; dpool: length-sorted pools)")
    print(f"train loss, last {REPORT} steps (a check that both train alike): one rank mlx-lm {loss('mlx1')} "
          f"dpool {loss('dpool1')}" + (f"; {args.world} ranks mlx-lm {loss('mlxN')} dpool {loss('dpoolN')}" if jobN else ""))


if __name__ == "__main__":
    main()
