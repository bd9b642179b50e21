"""What communication costs a step, on shaped links: the ring model against measurement, dpool's
all_sum against its old form and mlx-lm's, and DiLoCo against synchronous training (issue 19).

    sudo python bench/comm.py [--steps 150] [--quick-steps 30] [--reps 3] [--inner-steps 20,50,50:bf16,20:paper] [--out FILE] [--keep]
    sudo python bench/comm.py --hosts 2 --pin --inner-steps none   # figures 1 and 2, each rank on a core of its own

Three hosts (r0, r1, r2), a network namespace each on one bridge (bench/netns.py), every rank of a
3-rank MLX ring in its own namespace (`ip netns exec`), as on three machines. The links, each in
turn, shaped at both ends of every host's veth pair: unlimited (as fast as veth goes, no qdisc),
1 Gbit/s with 0.2 ms one way between two hosts, 300 Mbit/s with 3 ms (netem: each end delays half
of it, so a packet from one host to the next crosses both). Where the kernel has no netem (the
project's box), tbf shapes the rate alone, with a 50 ms queue (TBF_QUEUE says why), and there is no
delay: the JSON and the table say which was applied, and the model is given the latency that was
(0 without netem; the share with the nominal latency is in the JSON too). The trainers are started
directly as ring ranks (as tests/ring.py does, MLX_RANK and MLX_HOSTFILE naming the namespaces'
addresses), not through dpd: what is measured is the ring and the step, which dpd does not touch.
The three ranks share this machine's cores, as no three machines would: where the machine is busy,
every figure here carries its CPU's contention as well as its link. `--hosts N` runs N hosts
(ranks, replicas) instead, and `--pin` puts rank i on core i mod the machine's cores (`taskset`):
with as many cores as ranks, each host computes and runs its ring threads on a core of its own, as
on machines of their own (the JSON's `affinity` says where each rank could run).

The job: a GPT of 4 layers of width 256 (3.3 M parameters, 13.1 MB of float32 gradients: one
32 MiB bucket), 6 sequences of 64 tokens a step (2 a rank), lr 2e-3, OPENBLAS_NUM_THREADS=1 (three
ranks on two cores). A small batch makes the 300 Mbit/s step mostly all_sum (with 12 sequences it
was 55% on this busy box), which is the case the issue asks about.

Figures, each beside its baseline from the same run:

1. all_sum, per link, of the same gradients (a tree of the model's trainable parameters' shapes,
   the gradient of one batch): dpool's bucketed all_sum (Group.all_sum_fused, 32 MiB buckets) in
   float32 and in bfloat16 (cast before and back after, as trainer/step.py does for `sync.dtype`),
   each with the step's 13-float control vector as the trainer sends it (float32: in the
   bfloat16 case, a second all_sum); against "today's fused all_sum", the behaviour before
   buckets (one concatenated buffer per dtype: Group.all_sum_fused with a bucket larger than the
   whole buffer), and against mlx-lm's `average_gradients(tree, group)` (its default 32 MiB
   groups). Also for a larger GPT (`--large`, default 6 layers of width 512: 76 MB, three buckets),
   where the buckets differ. Each: median seconds of `--reps` calls (after one unmeasured), the
   methods taken in turn so the machine's drift falls on all alike, the ranks lined up by a tiny
   all_sum before each call; the peak memory a call adds on rank 0 (mx.get_peak_memory over what
   was allocated before); the bytes all three hosts sent per call (their interfaces' tx_bytes,
   read by each rank in its namespace), against the ring's 2(n-1)/n of the buffer each.
2. The communication share of a synchronous step, predicted against measured, per shaped link.
   Measured, in the training run on that link: per step, S / T, with T the step's time (the
   metrics row's tokens over its tokens/s: the step alone, without evaluation or logging) and S
   what the step spent in its all_sum: the row's `all_sum_s` (rank 0's time in the all_sum, which
   the trainer evaluates apart from the update), less rank 0's wait for the slowest rank's
   compute (the control vector carries each rank's compute seconds, metrics' rank_tokens_per_s);
   the median over the steps after the first 3. Beside it, the measure of the runs before
   `all_sum_s` existed, 1 - C / T with C the slowest rank's compute: it counts the update (AdamW,
   compiled) and the step's other work as all_sum (on the unshaped link here, 50 ms of a 320 ms
   step), and is what a trainer without `all_sum_s` is judged by. Both come from the same steps, so
   the machine's drift cancels. Also beside it, two that mix moments: A / T, with A the median of
   figure 1's bucketed float32 all_sum of the same gradients on that link, measured alone minutes
   before, and (T - C0) / T, the step-time difference against the unshaped link's step without
   its all_sum. Predicted: R / (R + C0), with R = protocol/commmodel.py's
   `ring_seconds(bytes, 3, Link(rate, latency), BUCKET_BYTES)` and C0 the step's time without its
   all_sum, measured on the unshaped link (the median of T - S over its steps): what the pool
   knows (a step's compute) and what it assumes (the link), not what it measures on the link
   itself; and R from the group's own start-up probe (`group.joined`) against the compute of that
   run's own steps (the median of T - S), which is what `dpctl status` shows. Goal: within 15% of
   measured (|pred - meas| / meas).
3. DiLoCo against synchronous training on the 300 Mbit/s link, the same job and tokens (`--steps`
   steps of 6 sequences; [sync] mode = "diloco", replicas 3, inner_steps H for each H of
   `--inner-steps`, the outer step's defaults (SyncSpec: plain averaging, outer lr 1.0 without
   momentum), H = 50 with `dtype = "bfloat16"`, and H = 20 with the DiLoCo paper's outer lr 0.7 and
   Nesterov momentum 0.9 as the reference the defaults replaced; `H:wN` adds N synchronous
   warm-up steps, sync.warmup_steps): bytes sent per trained token, counted from the
   model (trainable bytes x all_sums per step x 2(n-1)/n, summed over the ranks) and measured:
   the bytes out of the three hosts' links between the rows of two steps, read as rank 0 writes
   them (`Tap`): sync from step 3 to its second-last, diloco from the end of its first outer step
   of H to the end of its second-last, so start-up, evaluation and the last checkpoint (which gathers
   every replica's AdamW state) fall outside; the whole run's bytes beside them. Ratio sync /
   diloco (goal >= 50x). Wall time per token (the sum
   of the metrics rows' step times, over the tokens; for diloco a row's time is its outer round's
   time spread over its inner steps, the outer all_sum included), ratio sync / diloco (goal >= 3x
   where sync spends 60% or more of its steps in all_sum, figure 2's measure); and the validation
   loss at the last step (equal tokens), diloco against sync (goal: within 3%).

Prints a table and writes the figures as JSON (`--out FILE`). Every namespace and link is removed
at the end and every process it started is ended by its process group, on failure, Ctrl-C and
SIGTERM too. The temporary folder (logs, run dirs) is kept with --keep or when something failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    del sys.path[0]  # run as a script: bench/mlx_lm.py would shadow mlx-lm itself
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
try:
    import netns  # a sibling script: the hosts' namespaces and shaped links
    import ring  # the tests' ring launcher: each rank's environment, a group's wait and kill
    from jobs import write_job  # the tests' job writer (validated by the daemon's own parser)
finally:
    sys.path.remove(str(HERE))  # bench/mlx_lm.py would shadow mlx-lm itself
    sys.path.remove(str(HERE.parent / "tests"))

from dpool.protocol.commmodel import Link, rank_compute_seconds, ring_seconds, timed_comm  # noqa: E402
from dpool.protocol.jobspec import SyncSpec  # noqa: E402
from dpool.protocol.rounds import Rounds  # noqa: E402
from dpool.trainer.dist import BUCKET_BYTES  # noqa: E402

HOSTS = ("r0", "r1", "r2")  # the default: three hosts (--hosts N takes r0..rN-1)
# Where the kernel has no netem, the links are tbf's (rate only). At 300 Mbit/s the ring's TCP
# flows through tbf's default 2 ms queue (bench/netns.py) retransmitted ~60k segments in 7 all_sums
# of 13 MiB, through a 50 ms queue a handful; one flow alone reached 93% of the rate with either.
# (Faster links still retransmit on a busy machine, unshaped ones too: the receiving namespace's
# backlog overflows while its CPU is elsewhere. The JSON counts them: tcp_retransmits.)
TBF_QUEUE = "50ms"
SKIP = 3  # steps of each run left out of medians: compilation
FUSED_BYTES = 1 << 40  # "today's" all_sum: one bucket larger than any buffer, so one per dtype
SHARE_GOAL, BYTES_GOAL, SPEED_GOAL, SPEED_WHERE, LOSS_GOAL = 0.15, 50.0, 3.0, 0.60, 0.03
DEFAULT_OUTER = (SyncSpec().outer_lr, SyncSpec().outer_momentum)
PAPER_OUTER = (0.7, 0.9)  # DiLoCo's (Douillard et al., 2023): `H:paper` runs with them
METHODS = ("bucketed fp32", "bucketed bf16", "fused fp32 (before)", "mlx-lm average_gradients")


@dataclasses.dataclass(frozen=True)
class LinkCase:
    key: str
    rate: str | None  # tc's units
    bandwidth_bps: float | None
    latency_s: float | None  # one way, host to host

    def delay_each_end(self) -> str | None:
        return None if self.latency_s is None else f"{self.latency_s * 1e3 / 2:g}ms"

    def model(self, delayed: bool) -> Link | None:
        """The ring model's link: the nominal rate, and the latency where it was applied (netem)."""
        if self.bandwidth_bps is None or self.latency_s is None:
            return None
        return Link(self.bandwidth_bps, self.latency_s if delayed else 0.0)


LINKS = (
    LinkCase("unlimited", None, None, None),
    LinkCase("1gbit", "1gbit", 1e9, 0.2e-3),
    LinkCase("300mbit", "300mbit", 300e6, 3e-3),
)
SLOW = LINKS[-1]


class BenchError(RuntimeError):
    """A figure could not be measured: which, and why."""


def model_section(args: argparse.Namespace, large: bool = False) -> dict[str, Any]:
    layers, dim = (args.large_layers, args.large_dim) if large else (args.layers, args.dim)
    return {"kind": "gpt", "layers": layers, "dim": dim, "heads": 4, "context": args.context}


def job_sections(args: argparse.Namespace, steps: int, sync: dict[str, Any]) -> dict[str, dict[str, Any]]:
    never = 1_000_000
    return {
        "workers": {"min": 1, "max": 3, "balance": False},
        "model": model_section(args),
        "train": {"steps": steps, "global_batch": args.global_batch, "micro_batch": args.global_batch, "lr": args.lr,
                  "warmup_steps": min(10, steps // 4), "log_every_steps": 1},
        "checkpoint": {"every_steps": never, "keep": 1},
        "eval": {"every_steps": never, "batches": args.eval_batches, "sample_every_steps": never, "sample_tokens": 4},
        "sync": sync,
    }


def ring_probe(log: str) -> dict[str, float] | None:
    """The ring's pace as the group timed it at its start (`group.joined`: trainer/linkprobe.py),
    from rank 0's log; None where it did not probe."""
    for line in log.splitlines():
        if line.startswith("{") and '"group.joined"' in line:
            e = json.loads(line)
            if "ring_mbit_s" in e:
                return {"bandwidth_bps": e["ring_mbit_s"] * 1e6, "latency_s": e["ring_latency_ms"] / 1e3}
    return None


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


# -- the all_sum worker: one rank, in its namespace ------------------------------------------------


def allsum_methods(group: Any, flat: list[tuple[str, Any]], control: Any) -> dict[str, Callable[[], list[Any]]]:
    """Figure 1's methods, each a call that all_sums the same gradients (`flat`: names and float32
    arrays) and returns what it summed; dpool's with the step's control vector, as the trainer sends it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.trainer import average_gradients

    arrays = [g for _, g in flat]

    def bucketed() -> list[mx.array]:
        return group.all_sum_fused([*arrays, control])

    def bf16() -> list[mx.array]:
        summed = group.all_sum_fused([*(a.astype(mx.bfloat16) for a in arrays), control])
        return [s.astype(mx.float32) for s in summed[:-1]] + [summed[-1]]

    def fused() -> list[mx.array]:
        return group.all_sum_fused([*arrays, control], bucket_bytes=FUSED_BYTES)

    def mlx_lm() -> list[mx.array]:
        averaged = average_gradients(tree_unflatten(flat), group=group.group)
        return [v for _, v in tree_flatten(averaged)]

    return dict(zip(METHODS, (bucketed, bf16, fused, mlx_lm), strict=True))


def allsum_worker(config: Path) -> None:
    """Figure 1 on one rank: every method on the same gradients, in turn; rank 0 writes the results."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dpool.protocol.jobspec import load_job
    from dpool.trainer.dist import Group
    from dpool.trainer.step import masked_loss_sum
    from dpool.trainer.task import build_task

    cfg = json.loads(config.read_text())
    group = Group()
    rank, world = group.rank, group.size
    tx = Path("/sys/class/net") / cfg["iface"] / "statistics" / "tx_bytes"

    def sent() -> int:
        return int(tx.read_text())

    def barrier() -> None:
        mx.eval(group.all_sum(mx.array([1.0])))

    cores = os.cpu_count() or 1
    mine = [0] * (world * cores)  # each rank's row: the cores it may run on (--pin)
    for c in os.sched_getaffinity(0):
        mine[rank * cores + c] = 1
    every = group.sum_ints(mine)
    out: dict[str, Any] = {"affinity": [[c for c in range(cores) if every[r * cores + c]] for r in range(world)]}
    for case in cfg["cases"]:
        spec = load_job(case["job"])
        model = build_task(spec, config.parent, with_data=False).model
        ctx, share = spec.model.context, case["share"]
        tokens = mx.random.randint(0, 256, (share, ctx + 1), key=mx.random.key(rank))
        lengths = mx.array([[0, ctx]] * share, dtype=mx.int32)
        _, grads = nn.value_and_grad(model, masked_loss_sum)(model, tokens, lengths)
        flat = [(k, g.astype(mx.float32)) for k, g in tree_flatten(grads)]
        mx.eval([g for _, g in flat])
        arrays = [g for _, g in flat]
        control = mx.zeros((4 + 3 * world,), dtype=mx.float32)  # the step's control vector (trainer/step.py)
        nbytes = sum(a.nbytes for a in arrays)

        methods = allsum_methods(group, flat, control)
        seconds: dict[str, list[float]] = {m: [] for m in methods}
        peak: dict[str, int] = dict.fromkeys(methods, 0)
        wire: dict[str, int] = dict.fromkeys(methods, 0)
        names = list(methods)
        for rep in range(cfg["reps"] + 1):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                barrier()
                mx.synchronize()
                before_mem, before_tx = mx.get_active_memory(), sent()
                mx.reset_peak_memory()
                t0 = time.perf_counter()
                result = methods[name]()
                mx.eval(result)
                took = time.perf_counter() - t0
                grew = mx.get_peak_memory() - before_mem
                del result
                barrier()  # what this rank sent last has left its queue (a round trip since) when it is counted
                time.sleep(0.01)
                if rep:  # the first round is not measured
                    seconds[name].append(took)
                    wire[name] += sent() - before_tx
                    peak[name] = max(peak[name], grew)
        wire_all = group.sum_ints([wire[m] for m in names])
        out[case["name"]] = {
            "params": sum(a.size for a in arrays), "arrays": len(arrays), "bytes": nbytes,
            "buckets": -(-(nbytes + control.nbytes) // BUCKET_BYTES),
            "methods": {m: {"seconds": seconds[m], "median_s": statistics.median(seconds[m]), "peak_extra_bytes": peak[m],
                            "wire_bytes_per_call": wire_all[i] / cfg["reps"]} for i, m in enumerate(names)},
        }
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(out, indent=1))


# -- the controller --------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path, net: netns.Namespaces) -> None:
        self.args, self.root, self.net = args, root, net
        self.port = 21000
        self.group: ring.Group | None = None  # the ranks running now (ended on failure)
        self.hosts = tuple(net.ns)
        # With --pin, rank i runs on core i mod the cores (taskset): where there are as many cores as
        # ranks, each host has a core of its own, as on machines of their own.
        self.cores = {h: i % (os.cpu_count() or 1) for i, h in enumerate(self.hosts)} if args.pin else {}
        self.doc: dict[str, Any] = {"links": {c.key: dataclasses.asdict(c) for c in LINKS}, "allsum": {}, "allsum_tcp_retransmits": {}, "train": {},
                                    "hosts": list(self.hosts), "pinned": {h: c for h, c in self.cores.items()}}

    def say(self, line: str) -> None:
        print(line, flush=True)

    def start(self, name: str, argv: Sequence[str] | Callable[[str], Sequence[str]]) -> ring.Group:
        """One process per host in its namespace, ranks 0..2 of a ring on the hosts' addresses;
        `argv` the command, or what gives each host's."""
        self.port += 10  # a fresh port for each group: no wait on the last group's sockets
        hostfile = self.root / f"{name}-hosts.json"
        hostfile.write_text(json.dumps([[f"{self.net.address(h)}:{self.port}"] for h in self.hosts]))
        procs, logs = [], []
        for rank, h in enumerate(self.hosts):
            log = self.root / f"{name}-rank{rank}.log"
            env = ring.trainer_env({"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), "DPOOL_CACHE_DIR": str(self.root / "cache")})
            cmd = [*(["taskset", "-c", str(self.cores[h])] if h in self.cores else []), *(argv(h) if callable(argv) else argv)]
            with open(log, "wb") as f:
                procs.append(subprocess.Popen([*self.net.prefix(h), *cmd], env=env, stdout=f, stderr=subprocess.STDOUT,
                                              start_new_session=True, cwd=self.root))
            logs.append(log)
        self.group = ring.Group(procs, logs)
        return self.group

    def finish(self, name: str, group: ring.Group, timeout: float) -> None:
        try:
            codes = group.wait(timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"{name}: not done in {timeout:.0f} s; logs in {self.root}") from None
        finally:
            group.kill()
            self.group = None
        if any(codes):
            tail = "\n".join(f"--- rank {r}\n" + group.output(r)[-2000:] for r in range(len(self.hosts)))
            raise BenchError(f"{name}: exit codes {codes}\n{tail}")

    def sent(self) -> dict[str, int]:
        return {h: self.net.counters(h)[1] for h in self.hosts}

    def retransmits(self) -> int:
        """TCP segments the hosts have retransmitted so far (each namespace's /proc/net/snmp)."""
        total = 0
        for h in self.hosts:
            text = subprocess.run([*self.net.prefix(h), "cat", "/proc/net/snmp"], capture_output=True, text=True, timeout=30).stdout
            head, values = [line.split() for line in text.splitlines() if line.startswith("Tcp:")][:2]
            total += int(values[head.index("RetransSegs")])
        return total

    # figure 1

    def allsum(self, link: LinkCase) -> None:
        a = self.args
        cases = [{"name": "train", "job": str(self.job_file("comm-allsum", model_section(a))), "share": a.global_batch // len(self.hosts)}]
        if a.large_layers > 0:
            cases.append({"name": "large", "job": str(self.job_file("comm-allsum-large", model_section(a, large=True))), "share": 1})
        out = self.root / f"allsum-{link.key}.json"
        for h in self.hosts:  # each rank reads its own (its interface's name)
            (self.root / f"allsum-{link.key}-{h}.json").write_text(
                json.dumps({"cases": cases, "reps": a.reps, "iface": self.net.inner(h), "out": str(out)}))
        me = str(Path(__file__).resolve())
        retrans = self.retransmits()
        group = self.start(f"allsum-{link.key}", lambda h: [sys.executable, me, "--allsum-worker", str(self.root / f"allsum-{link.key}-{h}.json")])
        self.finish(f"all_sum on {link.key}", group, 600)
        got = json.loads(out.read_text())
        self.doc.setdefault("affinity", got.pop("affinity"))
        self.doc["allsum_tcp_retransmits"][link.key] = self.retransmits() - retrans  # every case and method together
        for case in got.values():
            case["ring_bytes_per_call"] = 2 * (len(self.hosts) - 1) * case["bytes"]  # 2(n-1)/n of it, from each of n ranks
            model = link.model(self.net.delayed)
            if model is not None:
                case["predicted_s"] = ring_seconds(case["bytes"], len(self.hosts), model, BUCKET_BYTES)
        self.doc["allsum"][link.key] = got

    def job_file(self, name: str, model: dict[str, Any]) -> Path:
        return write_job(self.root, name, base={}, **(job_sections(self.args, 1, {"mode": "sync"}) | {"model": model}))

    # figures 2 and 3

    def train(self, key: str, link: LinkCase, steps: int, sync: dict[str, Any]) -> dict[str, Any]:
        """One 3-rank run of the job on `link`: its metrics rows, and the bytes the hosts sent, in
        all and at each step rank 0 wrote (`Tap`)."""
        job = write_job(self.root, key, base={}, **job_sections(self.args, steps, sync))
        run_dir = self.root / "runs" / key
        before, retrans, t0 = self.sent(), self.retransmits(), time.monotonic()
        group = self.start(key, [sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(run_dir / "r{rank}")])
        tap = Tap(run_dir / "r0" / "metrics.jsonl", lambda: sum(self.sent().values()))
        tap.start()
        try:
            self.finish(f"training {key} on {link.key}", group, 60 + 10.0 * steps)
        finally:
            tap.stop()
        wall = time.monotonic() - t0
        sent = {h: n - before[h] for h, n in self.sent().items()}
        rows = ring.metrics(run_dir / "r0")
        evals = ring.metrics(run_dir / "r0", "eval")
        if sorted(rows) != list(range(1, steps + 1)):
            raise BenchError(f"{key}: metrics rows for steps {sorted(rows)[:3]}..{sorted(rows)[-3:]}, expected 1..{steps}")
        step_s = [rows[s]["tokens"] / rows[s]["tokens_per_s"] for s in range(1, steps + 1)]
        tokens = [rows[s]["tokens"] for s in range(1, steps + 1)]
        out = {
            "link": link.key, "sync": sync, "steps": steps, "wall_s": wall, "step_s": step_s, "tokens": tokens,
            "median_step_s": statistics.median(step_s[SKIP:]), "tokens_total": sum(tokens),
            "seconds_per_token": sum(step_s) / sum(tokens), "sent_bytes": sent, "sent_at_step": tap.at,
            "tcp_retransmits": self.retransmits() - retrans,
            "val_loss": evals[max(evals)]["val_loss"], "val_loss_step": max(evals), "val_loss_start": evals[min(evals)]["val_loss"],
            "loss_last": rows[steps]["loss"], "rank_compute_s": [rank_compute(rows[s]) for s in range(1, steps + 1)],
            "comm_s": [step_comm(rows[s]) for s in range(1, steps + 1)],
            "probe": ring_probe(group.output(0)),
        }
        self.doc["train"][key] = out
        return out

    def run(self) -> None:
        a = self.args
        for link in LINKS:
            shaping = self.net.shape(link.rate, link.delay_each_end())
            self.say(f"[{time.strftime('%H:%M:%S')}] link {link.key}: {shaping}")
            self.doc["links"][link.key] |= {"shaping": shaping, "delayed": self.net.delayed}
            self.allsum(link)
            self.say("  all_sum: " + ", ".join(
                f"{c} {m} {1e3 * v['median_s']:.1f} ms" for c, case in self.doc["allsum"][link.key].items() for m, v in case["methods"].items()))
            steps = a.steps if link is SLOW else a.quick_steps
            r = self.train(f"sync-{link.key}", link, steps, {"mode": "sync"})
            self.say(f"  sync: {steps} steps, median step {1e3 * r['median_step_s']:.0f} ms, val loss {r['val_loss']:.4f}, {r['wall_s']:.0f} s")
        if not a.inner_steps:
            self.doc["diloco"] = "not run (--inner-steps none)"
            return
        if not diloco_available():
            self.doc["diloco"] = "not run: this trainer has no DiLoCo mode (dpool.trainer.diloco)"
            self.say(f"  diloco: {self.doc['diloco']}")
            return
        for h, dtype, paper, warm in a.inner_steps:
            lr, momentum = PAPER_OUTER if paper else DEFAULT_OUTER
            sync = {"mode": "diloco", "inner_steps": h, "replicas": len(self.hosts), "outer_lr": lr, "outer_momentum": momentum, "dtype": dtype}
            if warm:
                sync["warmup_steps"] = warm
            key = f"diloco-h{h}{'-bf16' if dtype == 'bfloat16' else ''}{'-paper' if paper else ''}{f'-w{warm}' if warm else ''}-{SLOW.key}"
            r = self.train(key, SLOW, a.steps, sync)
            self.say(f"  diloco {diloco_label(sync)}: {a.steps} steps, {1e3 * r['seconds_per_token'] * r['tokens_total'] / a.steps:.0f} ms a step on average,"
                     f" val loss {r['val_loss']:.4f}, {r['wall_s']:.0f} s")


class Tap:
    """The bytes out of every host's link (`sent()`) at the moment rank 0's metrics file first shows
    each step, read every 10 ms: the traffic between two steps, without start-up, evaluation or
    the last checkpoint (DiLoCo writes an outer step's rows once its all_sum is done)."""

    def __init__(self, metrics: Path, sent: Callable[[], int]) -> None:
        self.metrics, self.sent = metrics, sent
        self.at: dict[int, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.offset, self.partial = 0, b""

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def run(self) -> None:
        while not self.done.wait(0.01):
            data = b""
            with contextlib.suppress(OSError), open(self.metrics, "rb") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
            if not data:
                continue
            *lines, self.partial = (self.partial + data).split(b"\n")
            steps = [row["step"] for row in map(json.loads, filter(None, lines)) if row.get("kind") == "train"]
            if steps:
                now = self.sent()
                for step in steps:
                    self.at.setdefault(step, now)


def rank_compute(row: dict[str, Any]) -> float:
    """The slowest rank's compute seconds in a step (its tokens over its tokens/s, without the all_sum)."""
    return max(rank_compute_seconds(row["tokens"], row.get("shares"), row["rank_tokens_per_s"]))


def step_comm(row: dict[str, Any]) -> float | None:
    """The seconds a step spent communicating, as its row measured them (commmodel.timed_comm, as
    the pool reads it: rank 0's time in the step's all_sum, `all_sum_s`, timed apart from the
    update, less its wait for the slowest rank's compute); None for a trainer whose rows do not
    carry it."""
    if row.get("all_sum_s") is None:
        return None
    return timed_comm(row["all_sum_s"], row["tokens"], row.get("shares"), row.get("rank_tokens_per_s"))


def timed_comms(run: dict[str, Any]) -> list[float] | None:
    """Each measured step's communicating seconds (after the first SKIP), or None where the run's
    rows did not time their all_sum (runs before all_sum_s)."""
    got = run.get("comm_s")
    if not got or any(c is None for c in got[SKIP:]):
        return None
    return got[SKIP:]


def diloco_available() -> bool:
    return importlib.util.find_spec("dpool.trainer.diloco") is not None


# -- the figures -----------------------------------------------------------------------------------


def figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures from the measurements: each value beside its baseline, the ratio, the goal."""
    out: dict[str, Any] = {"allsum": {}, "share": {}, "diloco": {}}
    n = len(doc.get("hosts", HOSTS))  # ranks (runs before --hosts: three)
    for link, cases in doc["allsum"].items():
        for case, got in cases.items():
            m = got["methods"]
            base_fused, base_lm = m["fused fp32 (before)"]["median_s"], m["mlx-lm average_gradients"]["median_s"]
            out["allsum"][f"{link}/{case}"] = {
                name: {"median_s": v["median_s"], "vs_fused": v["median_s"] / base_fused, "vs_mlx_lm": v["median_s"] / base_lm,
                       "peak_extra_bytes": v["peak_extra_bytes"], "wire_bytes_per_call": v["wire_bytes_per_call"]}
                for name, v in m.items()
            } | {"bytes": got["bytes"], "buckets": got["buckets"], "ring_bytes_per_call": got["ring_bytes_per_call"], "predicted_s": got.get("predicted_s")}
    train = doc["train"]
    base = LINKS[0].key
    if f"sync-{base}" in train and base in doc["allsum"]:
        a0 = doc["allsum"][base]["train"]["methods"]["bucketed fp32"]["median_s"]
        compute = max(0.0, train[f"sync-{base}"]["median_step_s"] - a0)  # as commmodel.measured_compute: never below 0
        unshaped = train[f"sync-{base}"]
        if (comms := timed_comms(unshaped)) is not None:
            # The step less its all_sum, both from the same steps (older runs: figure 1's all_sum).
            compute = statistics.median(t - c for t, c in zip(unshaped["step_s"][SKIP:], comms, strict=True))
        for c in LINKS:
            r = train.get(f"sync-{c.key}")
            if r is None or c.key not in doc["allsum"]:
                continue
            got = doc["allsum"][c.key]["train"]
            a = got["methods"]["bucketed fp32"]["median_s"]
            t = r["median_step_s"]
            rest = [1 - c / x for c, x in zip(r["rank_compute_s"][SKIP:], r["step_s"][SKIP:], strict=True)]
            timed = timed_comms(r)
            in_run = rest if timed is None else [c / x for c, x in zip(timed, r["step_s"][SKIP:], strict=True)]
            row: dict[str, Any] = {"step_s": t, "allsum_s": a, "compute_s": compute, "measured": statistics.median(in_run),
                                   "measured_timed": in_run is not rest, "all_but_compute": statistics.median(rest),
                                   "allsum_over_step": a / t, "by_step_difference": (t - compute) / t}
            model = c.model(doc["links"][c.key].get("delayed", False))
            if model is not None:
                sent = got["bytes"] + 4 * (4 + 3 * n)  # the gradients and the control vector
                pred_s = ring_seconds(sent, n, model, BUCKET_BYTES)
                row |= {"predicted_allsum_s": pred_s, "predicted": pred_s / (pred_s + compute)}
                nominal = ring_seconds(sent, n, c.model(True), BUCKET_BYTES)  # with the issue's latency, applied or not
                row["predicted_nominal_latency"] = nominal / (nominal + compute)
                row["error"] = relative_error(row["predicted"], row["measured"])
                row["met"] = row["error"] is not None and row["error"] <= SHARE_GOAL
            if (probe := r.get("probe")) is not None:
                # What the pool shows as comm_share: the model on the ring the group timed at its start.
                sent = got["bytes"] + 4 * (4 + 3 * n)
                by_probe = ring_seconds(sent, n, Link(probe["bandwidth_bps"], probe["latency_s"]), BUCKET_BYTES)
                # As dpctl status predicts it: against the compute the steps of this run spent outside
                # their timed all_sum (daemon/links.py), where the rows time it; else the unshaped link's.
                here = compute if timed is None else statistics.median(x - c for x, c in zip(r["step_s"][SKIP:], timed, strict=True))
                row |= {"probe": probe, "predicted_probe": by_probe / (by_probe + here), "compute_probe_s": here}
                row["error_probe"] = relative_error(row["predicted_probe"], row["measured"])
            out["share"][c.key] = row
    sync = train.get(f"sync-{SLOW.key}")
    nbytes = doc["allsum"].get(SLOW.key, {}).get("train", {}).get("bytes")
    if sync is not None and nbytes:
        per_step_tokens = sync["tokens_total"] / sync["steps"]
        wire = n * 2 * (n - 1) / n * nbytes  # all ranks together, one all_sum of the trainable parameters' size
        share = out["share"].get(SLOW.key, {}).get("measured")
        sync_steady = steady_bytes_per_token(sync, SKIP, sync["steps"] - 1)
        for key, r in train.items():
            if not key.startswith("diloco-"):
                continue
            h, warm = r["sync"]["inner_steps"], r["sync"].get("warmup_steps", 0)
            half = 2 if r["sync"].get("dtype") == "bfloat16" else 1
            # Outer steps of H past the warm-up, whole: a row first shows when its outer step ends
            # (its all_sum sent), so the span runs from one outer step's end to another's.
            rounds = Rounds(h, warm).after(0, r["steps"])  # the trainer's cut of the run
            ends = [o[-1] for o in rounds if o[-1] > warm and o[-1] < r["steps"]]
            dl_steady = steady_bytes_per_token(r, ends[0], ends[-1]) if len(ends) >= 2 else None
            sums = len(rounds)  # all_sums in the whole run
            whole = (sum(sync["sent_bytes"].values()) / sync["tokens_total"], sum(r["sent_bytes"].values()) / r["tokens_total"])
            speed = sync["seconds_per_token"] / r["seconds_per_token"]
            loss = r["val_loss"] / sync["val_loss"] - 1
            out["diloco"][diloco_label(r["sync"])] = {
                "bytes_per_token_model": {"sync": wire / per_step_tokens, "diloco": wire / h / half / per_step_tokens, "ratio": float(h * half)},
                "bytes_per_token_measured": {"sync": sync_steady, "diloco": dl_steady,
                                             "ratio": sync_steady / dl_steady if sync_steady and dl_steady else None},
                "bytes_per_token_whole_run": {"sync": whole[0], "diloco": whole[1], "ratio": whole[0] / whole[1],
                                              "model_ratio": r["steps"] * half / sums},
                "bytes_met": sync_steady / dl_steady >= BYTES_GOAL if sync_steady and dl_steady else None,
                "seconds_per_token": {"sync": sync["seconds_per_token"], "diloco": r["seconds_per_token"], "speedup": speed},
                "sync_share": share, "speed_goal_applies": share is not None and share >= SPEED_WHERE,
                "speed_met": speed >= SPEED_GOAL,
                "val_loss": {"sync": sync["val_loss"], "diloco": r["val_loss"], "difference": loss, "step": r["val_loss_step"]},
                "loss_met": abs(loss) <= LOSS_GOAL,
            }
    return out


def steady_bytes_per_token(run: dict[str, Any], first: int, last: int) -> float | None:
    """Bytes out of every host between the rows of steps `first` and `last` (Tap), over the tokens
    of steps first+1..last; None where the run has no such span."""
    at = {int(k): v for k, v in run["sent_at_step"].items()}
    if last <= first or first not in at or last not in at:
        return None
    return (at[last] - at[first]) / sum(run["tokens"][first:last])


def relative_error(predicted: float, measured: float) -> float | None:
    """|predicted - measured| / measured; None where nothing was measured (a step too small for its
    all_sum to show, as in the tests' smallest form)."""
    return abs(predicted - measured) / measured if measured > 0 else None


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def met(ok: bool | None) -> str:
    return "-" if ok is None else "met" if ok else "NOT met"


def table(doc: dict[str, Any], figs: dict[str, Any]) -> list[str]:
    lines = ["", f"1. all_sum of the same gradients, {len(doc.get('hosts', HOSTS))} ranks (median of the calls; ratio to today's fused all_sum and to mlx-lm's)"]
    lines.append(f"   {'method':28} {'ms':>8} {'/fused':>7} {'/mlx-lm':>8} {'peak+ (rank 0)':>15} {'sent, all hosts':>16}")
    for key, f in figs["allsum"].items():
        pred = f", ring model {1e3 * f['predicted_s']:.0f} ms" if f.get("predicted_s") else ""
        lines.append(f"   {key}: {mib(f['bytes'])} of gradients, {f['buckets']} bucket{'s' if f['buckets'] > 1 else ''}, "
                     f"the ring sends {mib(f['ring_bytes_per_call'])}{pred}")
        for name in METHODS:
            v = f[name]
            lines.append(f"     {name:26} {1e3 * v['median_s']:8.1f} {v['vs_fused']:7.2f} {v['vs_mlx_lm']:8.2f} {mib(v['peak_extra_bytes']):>15} "
                         f"{mib(v['wire_bytes_per_call']):>16}")
    lines += ["", f"2. share of a synchronous step spent in all_sum: predicted (ring model) against measured (goal within {SHARE_GOAL:.0%})"]
    lines.append(f"   {'link':10} {'step ms':>8} {'measured':>9} {'1-C/T':>6} {'all_sum ms':>11} {'A/T':>6} {'by diff':>8} {'model ms':>9} "
                 f"{'predicted':>10} {'error':>6}")
    for key, r in figs["share"].items():
        pred = f"{1e3 * r['predicted_allsum_s']:9.1f} {r['predicted']:10.1%} {percent(r['error']):>6} {met(r['met'])}" if "predicted" in r else f"{'-':>9} {'-':>10}"
        rest = f"{r['all_but_compute']:6.1%}" if r.get("measured_timed") else f"{'-':>6}"
        lines.append(f"   {key:10} {1e3 * r['step_s']:8.1f} {r['measured']:9.1%} {rest} {1e3 * r['allsum_s']:11.1f} {r['allsum_over_step']:6.1%} "
                     f"{r['by_step_difference']:8.1%} {pred}")
        if "predicted_probe" in r:
            p = r["probe"]
            lines.append(f"   {'':10} from the group's own probe ({p['bandwidth_bps'] / 1e6:.0f} Mbit/s, {1e3 * p['latency_s']:.2f} ms): "
                         f"predicted {r['predicted_probe']:.1%}, error {percent(r['error_probe'])} "
                         f"{met(r['error_probe'] is not None and r['error_probe'] <= SHARE_GOAL)}")
    if figs["share"]:
        lines.append(f"   the step without its all_sum (unshaped link): {1e3 * next(iter(figs['share'].values()))['compute_s']:.1f} ms")
    lines += ["", f"3. DiLoCo against synchronous training on {SLOW.key}, the same job and tokens"]
    if isinstance(doc.get("diloco"), str):
        lines.append(f"   {doc['diloco']}")
    for key, d in figs["diloco"].items():
        b, bm, s, v = d["bytes_per_token_measured"], d["bytes_per_token_model"], d["seconds_per_token"], d["val_loss"]
        w = d["bytes_per_token_whole_run"]
        fewer = f"{b['diloco']:.0f} against sync {b['sync']:.0f}: {b['ratio']:.1f}x fewer" if b["ratio"] else "n/a (too few outer steps)"
        lines.append(f"   {key}: bytes sent per token {fewer} (model {bm['diloco']:.0f} against {bm['sync']:.0f}: {bm['ratio']:.0f}x; "
                     f"goal >= {BYTES_GOAL:g}x: {met(d['bytes_met'])}); over the whole run, start and last checkpoint included, "
                     f"{w['diloco']:.0f} against {w['sync']:.0f}: {w['ratio']:.1f}x (all_sums: {w.get('model_ratio', bm['ratio']):.1f}x)")
        applies = "" if d["speed_goal_applies"] else f" (goal applies only where sync spends >= {SPEED_WHERE:.0%} in all_sum)"
        lines.append(f"   {'':{len(key)}}  wall per token {1e6 * s['diloco']:.0f} us against sync {1e6 * s['sync']:.0f} us: {s['speedup']:.2f}x faster "
                     f"(sync share {d['sync_share']:.0%}; goal >= {SPEED_GOAL:g}x: {met(d['speed_met'])}{applies})")
        lines.append(f"   {'':{len(key)}}  validation loss at step {v['step']}: {v['diloco']:.4f} against sync {v['sync']:.4f}: {v['difference']:+.1%} "
                     f"(goal within {LOSS_GOAL:.0%}: {met(d['loss_met'])})")
    return lines


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def diloco_label(sync: dict[str, Any]) -> str:
    outer = (sync.get("outer_lr", DEFAULT_OUTER[0]), sync.get("outer_momentum", DEFAULT_OUTER[1]))
    return (f"H={sync['inner_steps']}" + (" bf16" if sync.get("dtype") == "bfloat16" else "")
            + ("" if outer == DEFAULT_OUTER else f" outer {outer[0]:g}/{outer[1]:g}")
            + (f" warm-up {sync['warmup_steps']}" if sync.get("warmup_steps") else ""))


def inner_steps_list(text: str) -> list[tuple[int, str, bool, int]]:
    """`20,50,50:bf16,20:paper,20:w30`: each diloco run's H, what its all_sum carries (float32
    unless `:bf16`), its outer step (the defaults, or with `:paper` DiLoCo's lr 0.7 and momentum
    0.9) and its synchronous warm-up (`:wN`: sync.warmup_steps = N; none by default); `none`: no
    diloco run."""
    if text.strip() == "none":
        return []
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        h, *kinds = item.split(":")
        warm = [k for k in kinds if k[:1] == "w" and k[1:].isdigit()]
        flags = [k for k in kinds if k not in warm]
        if not h.isdigit() or int(h) < 1 or not set(flags) <= {"bf16", "paper"} or len(set(kinds)) != len(kinds) or len(warm) > 1:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected H (a positive integer) with any of :bf16, :paper and :wN (N warm-up steps), e.g. 20,50,50:bf16,20:paper,20:w30"
            )
        out.append((int(h), "bfloat16" if "bf16" in flags else "float32", "paper" in flags, int(warm[0][1:]) if warm else 0))
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one H, or none")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="steps of the runs on the 300 Mbit/s link (sync and each diloco)")
    ap.add_argument("--quick-steps", type=int, default=30, help="steps of the sync runs on the faster links (figure 2 only)")
    ap.add_argument("--reps", type=int, default=3, help="measured calls of each all_sum method per link")
    ap.add_argument("--inner-steps", type=inner_steps_list, default=inner_steps_list("20,50,50:bf16,20:paper"),
                    help="the diloco runs' H, comma-separated; H:bf16 all_sums in bfloat16, H:paper takes DiLoCo's outer lr 0.7 and momentum 0.9 "
                         "(default 20,50,50:bf16,20:paper; none: no diloco run)")
    ap.add_argument("--hosts", type=int, default=len(HOSTS), help="hosts, one ring rank each (default 3)")
    ap.add_argument("--pin", action="store_true", help="run rank i on core i mod the machine's cores (taskset): a core of its own where there are as many")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=6)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches (of global-batch sequences) of the final validation loss")
    ap.add_argument("--large-layers", type=int, default=6, help="figure 1's larger GPT (0: none)")
    ap.add_argument("--large-dim", type=int, default=512)
    ap.add_argument("--out", help="also write the measurements and figures here (JSON)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, run dirs)")
    ap.add_argument("--report", type=Path, help="print the figures of an earlier run's --out FILE again (measures nothing)")
    ap.add_argument("--allsum-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.allsum_worker:
        allsum_worker(args.allsum_worker)
        return 0
    if args.report:
        doc = json.loads(args.report.read_text())
        print("\n".join(table(doc["measured"], figures(doc["measured"]))))
        return 0
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("bench/comm.py: shaped links need Linux, root, iproute2 and tc", file=sys.stderr)
        return 2
    hosts = tuple(f"r{i}" for i in range(args.hosts))
    if args.hosts < 2:
        print(f"bench/comm.py: --hosts {args.hosts}: a ring needs at least 2", file=sys.stderr)
        return 2
    if args.global_batch % len(hosts):
        print(f"bench/comm.py: --global-batch must divide by {len(hosts)} (the ranks' shares are equal)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the ranks and the links are ended below
    root = Path(tempfile.mkdtemp(prefix="dpool-comm-"))
    net = netns.Namespaces(hosts, rate=None, delay=None, name="dpcm", veth="cm", queue=TBF_QUEUE)
    bench = Bench(args, root, net)
    load, started, ok, stopped = os.getloadavg(), time.monotonic(), False, False
    try:
        net.up()
        bench.run()
        ok = True
    except (BenchError, netns.NetnsError, subprocess.CalledProcessError) as e:
        print(f"bench/comm.py: {e}\n  the logs are kept in {root}", file=sys.stderr)
    except KeyboardInterrupt:
        stopped = True
        print("bench/comm.py: interrupted: ending the ranks and removing the links", file=sys.stderr)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave namespaces behind
        if bench.group is not None:
            bench.group.kill()
        net.down()
        if (ok or stopped) and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if stopped:
        return 130
    if not ok:
        return 1
    figs = figures(bench.doc)
    pinned = "" if not args.pin else ", each on a core of its own" if len(hosts) <= (os.cpu_count() or 1) else f", pinned to {os.cpu_count()} cores in turn"
    print(f"\nCommunication, {len(hosts)} ranks in network namespaces{pinned}; {args.layers}x{args.dim} GPT, {args.global_batch} sequences of {args.context} tokens a step; "
          f"load average before {', '.join(f'{x:.2f}' for x in load)}, after {', '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{time.monotonic() - started:.0f} s in all")
    print("\n".join(table(bench.doc, figs)))
    if args.out:
        doc = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "ok": ok, "tag": net.tag, "root": str(root),
               "load_before": load, "load_after": os.getloadavg(), "measured": bench.doc, "figures": figs}
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
