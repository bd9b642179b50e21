"""One rank of a job, top to bottom: set up, resume, train, evaluate, checkpoint, report.

Run as `python -m dpool.trainer JOB.toml --run-dir DIR [--shares N,N,...]`, alone or as one rank of
an MLX ring group (MLX_RANK / MLX_HOSTFILE as `mlx.launch --backend ring` sets them). When a dpd
started it, DPOOL_WORKER_ADDR names the daemon's socket and every step is reported there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from dpool.protocol.jobspec import JobSpec, check_paths
from dpool.protocol.logs import get_logger
from dpool.trainer import agreement, diloco, handstop, optimizers
from dpool.trainer import checkpoint as ckpt
from dpool.trainer import report as reporting
from dpool.trainer.balance import Balancer, fixed_shares, machine_memory_bytes, micro_from_memory
from dpool.trainer.blas import active_blas
from dpool.trainer.data import DataError, split_shares
from dpool.trainer.dist import Group
from dpool.trainer.interval import AutoInterval, overhead_target
from dpool.trainer.lm import ModelError
from dpool.trainer.memstate import MemoryState, memory_dir
from dpool.trainer.metrics import MetricsLog
from dpool.trainer.restore import generation_of
from dpool.trainer.restore import restore as _restore
from dpool.trainer.sameinput import same_everywhere
from dpool.trainer.step import Stepper
from dpool.trainer.task import build_task
from dpool.trainer.testloss import report_test, test_loss

EXIT_DONE, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 75
EVAL_MICRO = 8  # sequences per forward pass of a test loss computed outside training (no memory probe there)


class UsageError(ValueError):
    """Bad command-line input (exit 2)."""


def parse_shares(text: str | None, world: int, global_batch: int) -> list[int]:
    """Explicit shares, or the global batch split as evenly as possible (earlier ranks take the rest)."""
    if text is None:
        base, extra = divmod(global_batch, world)
        shares = [base + (1 if r < extra else 0) for r in range(world)]
    else:
        try:
            shares = [int(s) for s in text.split(",")]
        except ValueError:
            raise UsageError(f"--shares {text!r}: expected comma-separated integers, e.g. 4,8,12") from None
    if len(shares) != world:
        raise UsageError(f"--shares {text!r}: {len(shares)} shares for a group of {world} ranks")
    if (low := next((r for r, s in enumerate(shares) if s < 1), None)) is not None:
        if text is None:
            raise UsageError(f"train.global_batch = {global_batch} is less than the {world} ranks: every rank needs at least one sequence")
        raise UsageError(f"--shares {text!r}: every rank needs at least one sequence (a share of {shares[low]} at rank {low})")
    if sum(shares) != global_batch:
        raise UsageError(f"--shares {text!r}: they add up to {sum(shares)}, train.global_batch is {global_batch}")
    return shares


INPUT_ERRORS = (DataError, ModelError)  # a task this machine's files cannot build: exit 2


def _refuse_together(group: Group, task: Any, refused: Exception | None) -> Any:
    """The ranks say, in one all_sum, whether they could build the model and data, before any
    leaves; every rank takes part (a warm one built its task before it joined, and could). A rank
    that refuses its input (exit 2: its node sits the job out) would otherwise exit while a slower
    rank still builds, and the group's stop would kill that rank before it said that it refuses the
    input too: its node would be asked again later, for nothing. So each rank that refuses exits 2
    with its own reason, within a moment of the others; a rank that could build the task exits 1
    (a peer's failure, not held against its node)."""
    if group.size > 1:
        (count,) = group.sum_ints([int(refused is not None)])
        if refused is None and count:
            raise RuntimeError(f"{count} other rank(s) could not build the job's model or data on their machine")
    if refused is not None:
        raise refused
    return task


def run(
    spec: JobSpec, run_dir_arg: str, shares_arg: str | None, generation: int | None, source: str = "job file",
    warm: bool = False, resume_max: int | None = None, at_go: Callable[[], None] | None = None,
) -> int:
    """Train one rank. `warm`: build the model and data first, then wait for the daemon's
    `worker.go` (rank, generation, shares, hostfile) before joining the group: a trainer the daemon
    starts ahead of need, so that a restart finds one ready; `at_go` runs once it is told to go
    (the priority it built at is raised back)."""
    marks = {"process": time.time() - _process_start()}  # start-up phases, logged: a restart pays them
    t_mark = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t_mark
        now = time.perf_counter()
        marks[name] = round(now - t_mark, 3)
        t_mark = now

    # Paths first, before joining the group: a worker that lacks them fails its start at once,
    # with a message that names the path (its dpd adds the node), and the job fails.
    check_paths(spec, source)
    link = _worker_link()
    task = None
    if warm:
        if link is None or "{rank}" in run_dir_arg:
            raise UsageError("--warm needs a daemon (DPOOL_WORKER_ADDR) and a --run-dir without {rank}")
        task = build_task(spec, _cache_dir(Path(run_dir_arg)))
        mark("model_and_data")
        go = link.wait_go()
        if go is None:
            return EXIT_STOPPED  # not needed after all: stopped while waiting
        if at_go is not None:
            # Every rank takes its priority back before the ring's init. A rank that connects at
            # a low priority on a busy machine loses the race of trainer/dist.py far more often,
            # not less: with the ranks but the last at nice 19 during init, 2 ranks under load
            # retried (1 s) in 19 of 20 starts, at the usual priority in 2 of 20.
            at_go()
            at_go = None
        marks["warm_wait"] = round(time.perf_counter() - t_mark, 3)
        t_mark = time.perf_counter()
        os.environ.pop("MLX_RANK", None)
        os.environ.pop("MLX_HOSTFILE", None)
        if go.hostfile is not None:
            os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(go.rank), go.hostfile  # MLX reads them at init
        shares_arg, generation, resume_max = ",".join(str(n) for n in go.shares), go.generation, go.resume_max
    group = Group()
    mark("group")
    rank, world = group.rank, group.size
    log = get_logger(job=spec.name, rank=rank, generation=generation)
    shares_refused: UsageError | None = None
    try:
        shares = parse_shares(shares_arg, world, spec.train.global_batch)
        if spec.sync.mode == "diloco" and world > spec.sync.replicas:
            # every rank steps at least one replica (the pool never starts more: workers.max)
            raise UsageError(
                f"sync.replicas = {spec.sync.replicas}: a diloco group has at most one rank per replica, and this one has {world} "
                f"(MLX_HOSTFILE); start at most {spec.sync.replicas} rank(s), or raise sync.replicas"
            )
    except UsageError as e:
        shares_refused = e
    # Before anything is built: every rank was given the same job file and shares, or all exit 2
    # saying what differs (one small all_sum; trainer/agreement.py). A rank that refused its own
    # --shares takes part too, so that its peers exit with it instead of waiting for it.
    differs = agreement.disagreement(group, spec.training_hash(), None if shares_refused else shares, spec.schedule_hash())
    if shares_refused or differs:
        raise shares_refused or UsageError(differs)
    if not spec.workers.balance:
        try:
            shares = fixed_shares(world, spec.train.global_batch) or shares  # DPOOL_SHARES: a benchmark's fixed split
        except ValueError as e:
            raise UsageError(str(e)) from None
    run_dir = make_run_dir(Path(run_dir_arg.replace("{rank}", str(rank))))
    t = spec.train

    refused: Exception | None = None
    if task is None:
        try:
            task = build_task(spec, _cache_dir(run_dir))
        except INPUT_ERRORS as e:
            refused = e
        mark("model_and_data")
    task = _refuse_together(group, task, refused)
    same_everywhere(group, task.fingerprints, spec)
    hand = None if link else handstop.SignalStop(log).install()  # by hand: a first SIGTERM or Ctrl-C checkpoints, then stops
    if spec.sync.mode == "diloco":
        describe = {**task.describe(), "startup_s": marks, "warm": warm}
        stopped = diloco.train(spec, group, task, run_dir, shares, generation, link, log, resume_max, describe, stop_requested=hand)
        if spec.eval.test and not stopped:  # the outer parameters, after the last checkpoint
            micro = t.micro_batch if isinstance(t.micro_batch, int) else EVAL_MICRO
            report_test(spec, task, group, shares, micro, t.steps, MetricsLog(run_dir, t.steps, enabled=rank == 0), link, log)
        return _finish(link, log, stopped, t.steps)
    model = task.model
    optimizer = optimizers.build(t)
    lr_of = optimizers.learning_rate(t)
    optimizer.init(model.trainable_parameters())
    memory = memory_dir()
    resumed = _restore(spec, run_dir, group, model, optimizer, log, memory, resume_max, task.fingerprints)
    start, how = resumed.step, resumed.how
    generation = generation_of(generation, resumed)  # by hand: from the resumed checkpoint
    log = log.bind(generation=generation)
    mark("restore")
    kept = None
    if memory is not None:
        state_bytes = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
        state_bytes += sum(v.nbytes for _, v in tree_flatten(optimizer.state))
        kept = MemoryState(memory, state_bytes, machine_memory_bytes(), log)
    stepper = Stepper(task, optimizer, group, 1, t.grad_clip, t.seed, comm_dtype=spec.sync.dtype)
    per_example = stepper.probe_bytes() if t.micro_batch == "auto" else 0
    free = machine_memory_bytes() - mx.get_active_memory()

    def micro_for(share: int) -> int:
        if isinstance(t.micro_batch, int):
            return min(t.micro_batch, share)
        return micro_from_memory(share, per_example, free)

    offset, share = split_shares(shares)[rank]
    stepper.micro = micro_for(share)
    log.info(
        "trainer.started", world_size=world, shares=shares, resume_step=start, restored=how, **task.describe(),
        blas=active_blas(), micro_batch=stepper.micro,
        probe_bytes_per_example=per_example or None, startup_s=marks, warm=warm,
    )
    if link:
        link.hello(rank=rank, world_size=world, generation=generation, pid=os.getpid(), resume_step=start, ring=group.link,
                   params=sum(v.size for _, v in tree_flatten(model.trainable_parameters())))  # the ring's probe, and what a step all_sums

    balancer = Balancer(shares) if spec.workers.balance and world > 1 and rank == 0 else None
    announce: list[int] | None = None
    metrics = MetricsLog(run_dir, start, enabled=rank == 0)
    reporting.attach(spec, metrics, generation)  # [report]: rank 0's rows to W&B too
    writer = ckpt.CheckpointWriter(run_dir, spec.checkpoint.keep)
    every = spec.checkpoint.every_steps
    # "auto": rank 0 measures and decides, and its decision reaches every rank in the step's all_sum.
    auto = AutoInterval(start, target=overhead_target()) if every == "auto" and rank == 0 else None
    copy_s: dict[int, float] = {}  # a checkpoint's host copy on the step path, until its write is done
    job_hash = spec.training_hash()
    gb = t.global_batch

    def manifest(step: int) -> dict[str, Any]:
        return ckpt.run_manifest(spec, job_hash, world, shares, generation, task, step)

    def report_kept(done: list[tuple[int, float]]) -> None:
        if link:
            for step, seconds in done:
                link.checkpoint(step=step, seconds=seconds, memory=True)

    def evaluate(step: int) -> None:
        # Held-out examples in chunks of a global batch; each rank scores its share of each chunk.
        mine = [i for i in range(task.val_count) if offset <= i % gb < offset + share]
        t_eval = time.perf_counter()
        val_loss = stepper.eval_loss(task.val_examples(mine))
        row = {"kind": "eval", "step": step, "val_loss": val_loss}
        metrics.append(metrics.metrics, row, val_time=time.perf_counter() - t_eval)
        if rank == 0:
            log.info("eval.done", step=step, val_loss=round(val_loss, 4))
            if link:
                link.metric(row)

    def report_checkpoints(done: list[tuple[int, float, str | None, list[str]]]) -> None:
        for step, seconds, error, problems in done:
            if error:
                # This rank's failure, with the reason: the group restarts from the newest
                # checkpoint that was written (its folder of this one is already removed).
                log.error("checkpoint.failed", step=step, error=error)
                raise ckpt.CheckpointWriteError(f"checkpoint of step {step} not written: {error}")
            copied = copy_s.pop(step, 0.0)
            cpu = writer.cpu_s.pop(step, 0.0)  # the writer thread's CPU: hashing, copying, writing
            log.info("checkpoint.saved", step=step, seconds=round(seconds, 3), copy_s=round(copied, 4), cpu_s=round(cpu, 4))
            for p in problems:
                log.warning("checkpoint.prune_failed", problem=p)
            if link:
                link.checkpoint(step=step, seconds=seconds)
            # Every rank here writes its copy at the same step: on cores the ranks fill, each
            # rank's step pays for its neighbours' writers too.
            if auto and auto.observe_checkpoint(copied + cpu * group.crowding()):
                retuned(step)

    def retuned(step: int) -> None:
        assert auto is not None and auto.interval is not None
        step_s, cost = auto.step_time() or 0.0, auto.cost or 0.0
        log.info(
            "checkpoint.interval", step=step, every_steps=auto.interval, cost_s=round(cost, 4), step_s=round(step_s, 4),
            overhead=round(cost / (auto.interval * step_s), 4) if step_s else None,
        )

    if start == 0:
        evaluate(0)
    else:
        metrics.catch_up(group, spec, start, (start,), link, evaluate, task)
    stopped = False
    last = time.perf_counter()
    for step in range(start + 1, t.steps + 1):
        writing = bool(copy_s)  # a checkpoint is being written while this step runs
        examples = task.examples(step, offset, share)
        lr = lr_of(step)
        stats = stepper.step(
            examples, lr, stop_requested=link.stop_requested if link else (hand or False), announce=announce,
            checkpoint=bool(auto and auto.due(step)), computed=partial(link.waiting, step) if link and world > 1 else None,
        )
        now = time.perf_counter()
        seconds, last = now - last, now
        # `last` was taken after the previous step's evaluation, sampling and logging: `seconds` is the step alone.
        if auto and auto.observe_step(seconds, stats.tokens, writing=writing):
            retuned(step)
        if link:
            resplit = bool(stats.new_shares) and stats.new_shares != shares  # (adopted below, after the step's reports)
            link.progress(step=step, loss=stats.loss, tokens=stats.rank_tokens[rank], seconds=seconds, resplit=resplit)
        if rank == 0 and (step % t.log_every_steps == 0 or step == t.steps):
            row = {
                "kind": "train", "step": step, "loss": stats.loss, "lr": lr, "tokens": stats.tokens,
                "tokens_per_s": stats.tokens / seconds, "world_size": world, "generation": generation,
                "grad_norm": stats.grad_norm, "shares": shares,
                "rank_tokens_per_s": [n / max(c, 1e-9) for n, c in zip(stats.rank_tokens, stats.rank_seconds, strict=True)],
            }
            if world > 1:
                row["all_sum_s"] = stats.all_sum_s
            if auto and auto.interval is not None:
                row["checkpoint_every"] = auto.interval
            metrics.append(metrics.metrics, row)
            if link:
                link.metric(row)
            log.info("step.done", step=step, loss=round(stats.loss, 4), lr=f"{lr:.2e}", tokens_per_s=round(row["tokens_per_s"]))
        # Every rank saves its own copy at the same steps (all ranks hold identical state): a fixed
        # interval is the same everywhere; "auto" is rank 0's decision, carried by the step's all_sum.
        due = stats.checkpoint if every == "auto" else step % int(every) == 0
        if due or step == t.steps or stats.stop:
            t_copy = time.perf_counter()
            writer.submit(ckpt.Snapshot(
                step=step,
                model=ckpt.to_host(tree_flatten(model.trainable_parameters())),
                optimizer=ckpt.to_host(tree_flatten(optimizer.state)),
                manifest=manifest(step),
            ))
            copy_s[step] = time.perf_counter() - t_copy
            if auto:
                auto.saved(step)
        if kept is not None and step < t.steps:
            kept.offer(step, model, optimizer, manifest(step), seconds)  # a failure from here on recomputes no step before it
        if step % spec.eval.every_steps == 0 or step == t.steps:
            evaluate(step)
        if rank == 0 and (step % spec.eval.sample_every_steps == 0 or step == t.steps):
            metrics.sample(step, task.sample(step), link)
        report_checkpoints(writer.completed())
        if kept is not None:
            report_kept(kept.completed())
        # Balance: rank 0 proposes from measured speeds; the split it announced in this step's
        # all_sum reached every rank together, and all switch from the next step on.
        announce = None
        if stats.new_shares and stats.new_shares != shares:
            log.info("rebalanced", step=step, old=shares, shares=stats.new_shares)
            shares = stats.new_shares
            offset, share = split_shares(shares)[rank]
            stepper.micro = micro_for(share)
            if balancer:
                balancer.adopt(shares)
        elif balancer:
            balancer.observe(stats.rank_seconds, stats.rank_tokens)
            announce = balancer.propose()
        if stats.stop:
            # Every rank saw the flag in the same all_sum, so all stop after the same step.
            stopped = True
            log.info("trainer.stopping", step=step, reason="stop requested")
            break
        last = time.perf_counter()  # evaluation, sampling and logging are not the step's time
    report_checkpoints(writer.close())
    if kept is not None:
        report_kept(kept.close())
    if spec.eval.test and not stopped:  # after the last step's checkpoint: a failure here loses no training
        report_test(spec, task, group, shares, stepper.micro, t.steps, metrics, link, log)
    return _finish(link, log, stopped, t.steps)


def _finish(link, log, stopped: bool, steps: int) -> int:
    """The exit code of a rank whose training ended (or stopped on request), its link closed."""
    if link:
        link.close()
    if stopped:
        return EXIT_STOPPED
    log.info("trainer.finished", steps=steps)
    return EXIT_DONE


def export(
    spec: JobSpec, run_dir: Path, out: Path, step: int | None, source: str = "job file", *,
    fuse: bool = False, dequantize: bool = False, test: bool = False,
) -> tuple[int, list[str]]:
    """Write the trained result of checkpoint `step` (default: the newest valid one) to `out`:
    the adapters or the model (`fuse`: the adapters fused into the base, as `mlx_lm fuse` makes
    it), or with `test` its test loss, as `test.json`."""
    log = get_logger(job=spec.name)
    job_hash = spec.training_hash()
    if step is None:
        found = ckpt.newest_valid(run_dir, job_hash, log)
        if found is None:
            raise UsageError(f"{run_dir}: no valid checkpoint of job {spec.name!r} to export")
        step = found[0]
    else:
        if step not in ckpt.listed_steps(run_dir):
            have = ", ".join(str(s) for s in sorted(ckpt.listed_steps(run_dir))) or "none"
            raise UsageError(f"--step {step}: {run_dir} has no checkpoint of step {step} (its checkpoints: {have})")
        try:
            ckpt.verify(run_dir, step, job_hash)
        except ckpt.CheckpointMismatch:
            raise
        except ckpt.CheckpointError as e:
            raise UsageError(f"--step {step}: {e}") from None
    flag = "--test" if test else "--export"
    if out.is_symlink():
        out = Path(os.path.realpath(out))  # a link to an empty folder: that folder is filled
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{flag} {out}: exists and is not an empty directory; nothing was written")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"{flag} {out}: {parent} is a file, not a folder; nothing was written")
    if test and not (spec.model.kind == "mlx_lm"):
        raise UsageError(f"--test: job {spec.name!r} is of model.kind = {spec.model.kind!r}; the test loss is for 'mlx_lm' jobs (a test.jsonl)")
    if fuse and spec.model.kind != "mlx_lm":
        raise UsageError(f"--fuse: job {spec.name!r} is of model.kind = {spec.model.kind!r}; fusing is for 'mlx_lm' jobs")
    check_paths(spec, source)
    task = build_task(spec, _cache_dir(run_dir), with_data=test)
    weights, _ = ckpt.load_arrays(run_dir, step)
    ckpt.check_trained(weights, task.model, run_dir, step)
    task.model.load_weights(list(weights.items()), strict=False)
    mx.eval(task.model.parameters())
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if test:
            files = [_write_test(spec, task, step, tmp)]
        elif fuse:
            files = task.export_fused(tmp, dequantize=dequantize)  # type: ignore[attr-defined]
        else:
            files = task.export(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("export.done", step=step, out=str(out), files=files)
    return step, files


def _write_test(spec: JobSpec, task: Any, step: int, out: Path) -> str:
    """The checkpoint's test loss, computed here alone (a group of one), as test.json in `out`."""
    t = spec.train
    micro = t.micro_batch if isinstance(t.micro_batch, int) else EVAL_MICRO
    loss, count = test_loss(spec, task, Group(), [t.global_batch], micro)
    body = {"job": spec.name, "step": step, "test_loss": loss, "test_ppl": math.exp(min(loss, 700.0)), "examples": count}
    (out / "test.json").write_text(json.dumps(body) + "\n")
    return "test.json"


def _process_start() -> float:
    """When this process started (wall clock), to count interpreter and import time too."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()  # not Linux: start-up before this point is not counted


def make_run_dir(run_dir: Path) -> Path:
    """The run dir, made where it is not there; UsageError where it or a folder the trainer keeps
    in it (checkpoints, cache) is a file, found now rather than at the first checkpoint."""
    for path in (run_dir, *run_dir.parents):
        if path.exists() and not path.is_dir():
            raise UsageError(f"--run-dir {run_dir}: {path} is a file, not a folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    for inside in (ckpt.checkpoint_root(run_dir), run_dir / "cache"):
        if inside.exists() and not inside.is_dir():
            raise UsageError(f"--run-dir {run_dir}: {inside} is a file; the trainer keeps a folder there (move the file away)")
    return run_dir


def _cache_dir(run_dir: Path) -> Path:
    return Path(os.environ.get("DPOOL_CACHE_DIR") or run_dir / "cache")


def _worker_link():
    if not os.environ.get("DPOOL_WORKER_ADDR"):
        return None
    from dpool.protocol.worker_link import WorkerLink

    return WorkerLink.from_env()
