"""`dpctl demo`: the whole product in one command, on one machine.

It starts a local pool (`localpool.py`: one `dpd` that also serves the control plane, plus one more
`dpd` per further worker, each with its own state dir, on loopback and a free port), submits the
demo job (a small GPT on Python's standard library, `demo.toml`, shipped inside this package and
identical to `examples/demo.toml`), and shows it training. At `--kill-at` it SIGKILLs one trainer,
found by the pid the control plane reports for its rank, and shows the pool noticing and resuming
from the newest checkpoint as the next generation. When the job is done it prints the final
validation loss and a text sample, writes `demo-loss.png` (the same figure as `dpctl plot`), and
stops the pool: SIGTERM to each daemon, then SIGKILL to anything of it still running.

`dpctl demo --lm` runs the same flow on a language model (`demo_lm.py`): a tiny model that mlx-lm
loads, made offline, gets LoRA adapters on two workers; one is killed and the pool resumes; then
`dpctl export` fetches the adapters and `mlx_lm generate` answers a prompt with them; the model
and the adapters stay in `./dpool-demo-lm/` for the `mlx_lm generate` line it prints.

Exit codes: 0 the job succeeded after an automatic resume; 1 anything went wrong (the message says
what; the pool's logs are kept); 2 bad flags; 130 interrupted (Ctrl-C stops the pool too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dpool.client.demo_lm import (
    KEEP_DIR,
    PROMPT,
    AssetsFailed,
    check_keep,
    export_and_generate,
    lm_spec,
    make_assets,
    with_steps,
)
from dpool.client.localpool import STOP_TIMEOUT_S, LocalPool, LocalPoolError
from dpool.client.plot import JobRecord, fetch_job, plot
from dpool.client.rpc import Client, RemoteError, Unreachable
from dpool.protocol import messages as m
from dpool.protocol.jobspec import JobFileError, JobSpec, parse_job
from dpool.protocol.payloads import EventRow, JobStatus, WorkerStatus
from dpool.trainer import blas

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_WORKERS = 2  # two cores are enough for two workers; the demo's point is the restart, not scale
PLOT_FILE = "demo-loss.png"
POLL_S = 0.2  # how often the demo asks the control plane for news
STALL_TIMEOUT_S = 240.0  # no news at all from the job for this long: something is wrong
TERMINAL = {"succeeded", "failed", "cancelled"}
SAY_STYLE = (
    ("SIGKILL", "bold red"), ("worker.failed", "red"), ("group.resumed", "green"), ("job.succeeded", "bold green"),
    ("job.failed", "bold red"), ("demo failed", "bold red"), ("note:", "yellow"),
)


class DemoFailed(Exception):
    """The demo could not show what it promised; the message says what happened."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop the pool and leave."""


def demo_job_text() -> str:
    """The demo job file shipped in this package (the same bytes as examples/demo.toml)."""
    return resources.files("dpool.client").joinpath("demo.toml").read_text(encoding="utf-8")


def blas_note() -> str | None:
    """What to do when this machine's trainers will run on the reference BLAS that the Linux
    `mlx[cpu]` wheel bundles (trainer/blas.py preloads OpenBLAS when it finds one): the demo
    then takes about 2.5 minutes on two cores instead of about one."""
    choice = os.environ.get("DPOOL_BLAS", "")
    if sys.platform != "linux" or choice == "reference" or not blas.mlx_uses_reference_blas() or blas.find_openblas() is not None:
        return None
    why = f"DPOOL_BLAS={choice} is no file" if choice and choice not in ("auto", "openblas") else "no OpenBLAS is installed"
    return (
        f"note: {why}, so the workers use the reference BLAS that mlx[cpu] bundles and run several times slower\n"
        "      (about 2.5 minutes for this demo on two cores instead of one). Install OpenBLAS and the trainer preloads it:\n"
        "      sudo apt-get install libopenblas0-pthread    (Debian, Ubuntu; elsewhere set DPOOL_BLAS=/path/to/libopenblas.so)"
    )


def demo_spec(steps: int | None) -> JobSpec:
    return parse_job(with_steps(tomllib.loads(demo_job_text()), steps), source="demo.toml")


# -- showing it ----------------------------------------------------------------------------------


class Screen:
    """Progress on a live line at the bottom of a terminal (rich: a bar, colors unless NO_COLOR,
    redrawn at the terminal's width); a line every few steps otherwise. Everything else (events,
    messages) is printed above the progress line."""

    def __init__(self, out: TextIO, started: float, *, tty: bool | None = None) -> None:
        self.out, self.started = out, started
        self.tty = out.isatty() if tty is None else tty
        self.console = Console(file=out, force_terminal=True, highlight=False) if self.tty else None
        self.live: Live | None = None
        self.last_step_printed = -1

    def clock(self, t: float | None = None) -> str:
        return f"[{(t if t is not None else time.time()) - self.started:6.1f}s]"

    def say(self, text: str, t: float | None = None) -> None:
        line = f"{self.clock(t)} {text}"
        if self.console is None:
            print(line, file=self.out, flush=True)
            return
        style = next((style for start, style in SAY_STYLE if text.startswith(start)), "")
        self.console.print(Text(line, style=style), soft_wrap=True)  # above the live line

    def plain(self, text: str = "") -> None:
        if self.console is None:
            print(text, file=self.out, flush=True)
        else:
            self.console.print(Text(text), soft_wrap=True)

    def progress(self, s: JobStatus, every: int) -> None:
        step, steps = s.step, s.steps
        tps = sum(w.tokens_per_s for w in s.workers)
        parts = [
            f"step {step:>{len(str(steps))}}/{steps}",
            f"loss {s.loss:.3f}" if s.loss is not None else "loss   -  ",
            f"val {s.val_loss:.3f}" if s.val_loss is not None else "val   -  ",
            f"{tps:>6.0f} tok/s",
            f"{s.world_size} worker{'s' if s.world_size != 1 else ''}",
            f"gen {s.generation}",
            s.state,
        ]
        line = "  ".join(parts)
        if self.console is not None:
            row = Table.grid(padding=(0, 1))
            row.add_column(no_wrap=True)
            row.add_column(no_wrap=True)
            row.add_column(no_wrap=True, overflow="ellipsis")
            row.add_row(self.clock(), ProgressBar(total=max(steps, 1), completed=min(step, steps), width=24), line)
            if self.live is None:
                self.live = Live(row, console=self.console, auto_refresh=True, refresh_per_second=4, redirect_stdout=False, redirect_stderr=False)
                self.live.start()
            else:
                self.live.update(row, refresh=True)
        elif step // every != self.last_step_printed // every or (step == steps and step != self.last_step_printed):
            print(f"{self.clock()} {line}", file=self.out, flush=True)
            self.last_step_printed = step

    def done(self) -> None:
        """The progress line stays as it was last drawn; what follows is printed below it."""
        if self.live is not None:
            self.live.stop()
            self.live = None


def describe_event(e: EventRow, killed_at: float | None) -> str | None:
    """A sentence for the events the demo is about (None: not worth a line)."""
    kind, f = e.kind, e.fields
    if kind == "node.joined":
        return f"node.joined      {f.get('node')} ({f.get('slots', 1)} slot)"
    if kind == "group.started":
        return f"group.started    generation {f.get('generation')}, {f.get('world_size')} workers"
    if kind == "worker.failed":
        code = f.get("code")
        how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}" if code is not None else f.get("detail", "")
        after = f", detected {e.t - killed_at:.2f}s after the kill" if killed_at is not None else ""
        return f"worker.failed    rank {f.get('rank')} on {f.get('node', '?')}: {f.get('reason')} ({how}){after}"
    if kind == "group.stopped":
        return f"group.stopped    generation {f.get('generation')} ({f.get('reason')})"
    if kind == "group.resumed":
        return (
            f"group.resumed    generation {f.get('generation')} resumed from step {f.get('from_step')}"
            f"{'' if f.get('cause', 'failure') == 'failure' else ' after a ' + str(f.get('cause')) + ' change'}: "
            f"{f.get('seconds_since_failure')}s after the failure, {f.get('steps_recomputed')} steps recomputed"
        )
    if kind == "group.warming":
        return f"group.warming    warm trainers on {', '.join(f.get('nodes', []))}, while the group trains on"
    if kind == "group.growing":
        return f"group.growing    generation {f.get('generation')}: {f.get('free_slots')} free slot(s), checkpoint and restart wider"
    if kind == "node.drained":
        return f"node.drained     {f.get('node')}"
    if kind == "job.queued" and f.get("reason"):
        return f"job.queued       {f.get('reason')}"
    if kind in ("job.succeeded", "job.failed", "job.cancelled"):
        return f"{kind:<16} {f.get('error') or ''}".rstrip()
    return None


# -- the demo ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """What the demo has seen of its job so far."""

    job_id: str = ""
    status: JobStatus | None = None
    events_after: int = 0
    events: list[EventRow] = field(default_factory=list)
    killed_at: float | None = None
    killed: str = ""
    resumed: EventRow | None = None
    news_at: float = field(default_factory=time.monotonic)


class Demo:
    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args, self.out = args, out
        self.signals = 0
        self.root = Path(tempfile.mkdtemp(prefix="dpool-demo-"))
        self.pool = LocalPool(self.root, env={"DPOOL_CACHE_DIR": str(self.root / "cache")})  # one machine: build the token cache once
        self.started = time.time()
        self.screen = Screen(out, self.started)
        self.run = Run()
        self.lm_model = Path()

    # Signal handlers only record; the loop raises Interrupted at its next turn.
    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals += 1

    def _check(self) -> None:
        if self.signals:
            raise Interrupted()
        self.pool.check_alive()

    def main(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code, kept = EXIT_FAILED, True
        try:
            code = self._demo()
            kept = False
        except Interrupted:
            self.screen.done()
            self.screen.plain()
            self.screen.say("interrupted: stopping the pool")
            code = EXIT_INTERRUPTED
        except (DemoFailed, AssetsFailed, LocalPoolError) as e:
            self.screen.done()
            self.screen.plain()
            self.screen.say(f"demo failed: {e}")
        except (Unreachable, RemoteError) as e:
            self.screen.done()
            self.screen.plain()
            self.screen.say(f"demo failed: the control plane: {getattr(e, 'message', e)}")
        except OSError as e:
            self.screen.done()
            self.screen.plain()
            self.screen.say(f"demo failed: {e}")  # e.g. demo-loss.png cannot be written here
        finally:
            self.screen.done()
            self.pool.stop(timeout=1.0 if self.signals > 1 else STOP_TIMEOUT_S, report=lambda line: print(f"  {line}", file=self.out))
            signal.signal(signal.SIGINT, old[signal.SIGINT])
            signal.signal(signal.SIGTERM, old[signal.SIGTERM])
            if kept or code != EXIT_OK:
                print(f"pool stopped; its logs and state are kept in {self.root}", file=self.out, flush=True)
            else:
                shutil.rmtree(self.root, ignore_errors=True)
                print("pool stopped", file=self.out, flush=True)
        return code

    def _demo(self) -> int:
        a, s = self.args, self.screen
        spec = lm_spec(a.steps) if a.lm else demo_spec(a.steps)
        steps = spec.train.steps
        kill_at = a.kill_at if a.kill_at is not None else max(1, steps // 3)
        if a.lm:
            s.plain(f"dpool demo --lm: {a.workers} local workers fine-tune LoRA adapters (rank {spec.model.lora_rank}) for a tiny")
            s.plain(f"language model that mlx-lm loads, on chat data with the prompts masked, {steps} steps; one worker is")
            s.plain(f"killed at step {kill_at}, the pool resumes on its own, and mlx-lm generates with the exported adapters.")
            s.plain()
            check_keep(Path.cwd() / KEEP_DIR)  # before training: what the end replaces is the demo's own
            t0 = time.time()
            self.lm_model, data = make_assets(self.root / "assets")
            spec = lm_spec(a.steps, self.lm_model, data)
            s.say(f"made a tiny llama model and chat data offline in {time.time() - t0:.1f}s: {self.root / 'assets'}")
        else:
            model = f"{spec.model.layers}-layer GPT (dim {spec.model.dim}, context {spec.model.context})"
            s.plain(f"dpool demo: {a.workers} local workers train a {model} on Python's standard library, {steps} steps;")
            s.plain(f"one worker is killed at step {kill_at}, and the pool resumes from its newest checkpoint on its own.")
            s.plain()
        note = blas_note()
        if note:
            s.say(note)

        for i in range(a.workers):
            self.pool.start_daemon(f"node-{i}", serve=i == 0)
        daemons = self.pool.daemons.values()
        s.say(f"pool: {', '.join(d.name for d in daemons)} (dpd pids {', '.join(str(d.pid) for d in daemons)}); control plane {self.pool.addr}; state in {self.root}")
        with Client(self.pool.addr, 5.0) as c:
            nodes = self.pool.wait_registered(a.workers, check=self._check)
            s.say(f"{len(nodes)} nodes registered: {', '.join(f'{x.name} ({x.platform}, mlx {x.mlx_version})' for x in nodes)}")
            reply = c.call(m.Submit(job=spec.to_dict(), source="demo-lm.toml" if a.lm else "demo.toml"), m.Submitted)
            self.run.job_id = reply.job_id
            s.say(f"submitted job {reply.job_id} ({spec.name}: {steps} steps, global batch {spec.train.global_batch}, {_every(spec.checkpoint.every_steps)})")
            st = self._follow(c, kill_at, every=max(1, steps // 20))
            if st.state != "succeeded":
                raise DemoFailed(f"job {self.run.job_id} {st.state}: {st.error or 'no reason given'}; the workers' output is in {self.root}/state-node-*/jobs/{self.run.job_id}/slot-*/worker.log")
            if self.run.resumed is None:
                raise DemoFailed(f"job {self.run.job_id} succeeded, but no automatic resume was seen ({self.run.killed or 'no worker was killed'})")
            rec = fetch_job(c, self.run.job_id, samples=True)
        self._finish(rec)
        return EXIT_OK

    def _follow(self, c: Client, kill_at: int, every: int) -> JobStatus:
        """Show the job until it ends; its final status."""
        run, s = self.run, self.screen
        while True:
            self._check()
            try:
                st: JobStatus | None = c.call(m.Status(job=run.job_id), m.StatusReply).jobs[0]
                self._events(c)
            except Unreachable:
                st = run.status  # a busy machine can delay an answer; the stall deadline still holds
            if st != run.status:
                run.news_at = time.monotonic()
            run.status = st
            if time.monotonic() - run.news_at > STALL_TIMEOUT_S:
                raise DemoFailed(f"job {run.job_id} made no progress for {STALL_TIMEOUT_S:.0f}s (state {st.state if st else 'unknown'}, step {st.step if st else '?'})")
            if st is None:
                continue
            if st.state in TERMINAL:
                s.progress(st, every)
                s.done()
                return st
            if st.state == "running" and st.step > 0 and any(w.tokens_per_s for w in st.workers):
                s.progress(st, every)
            if run.killed_at is None and st.state == "running" and st.step >= kill_at:
                self._kill(st)
            time.sleep(POLL_S)

    def _events(self, c: Client) -> None:
        run = self.run
        while True:
            reply = c.call(m.Events(job=run.job_id, after=run.events_after), m.EventsReply)
            run.events_after = reply.cursor
            for e in reply.events:
                run.events.append(e)
                run.news_at = time.monotonic()
                after_kill = run.killed_at is not None and e.t >= run.killed_at - 1.0
                if e.kind == "group.resumed" and run.resumed is None and after_kill and e.fields.get("cause", "failure") == "failure":
                    run.resumed = e  # the resume that the kill caused (not a growth or drain)
                text = describe_event(e, run.killed_at)
                if text:
                    self.screen.say(text, e.t)
            if not reply.more:
                return

    def _kill(self, st: JobStatus) -> None:
        """SIGKILL one trainer: the highest rank, preferring a node that does not serve the control
        plane (the serving node can die too, but that is a different demo)."""
        serving = {d.name for d in self.pool.daemons.values() if d.serving}
        workers = sorted(st.workers, key=lambda w: (w.node in serving, -w.rank))
        if not workers:
            return
        victim = workers[0]
        pid = self._trainer_pid(victim, st.generation)
        if pid is None:
            return  # its trainer is not up yet: try again at the next poll
        self.run.killed_at = time.time()
        self.run.killed = f"rank {victim.rank} on {victim.node}, pid {pid}, at step {st.step}"
        self.screen.say(f"SIGKILL -> trainer of rank {victim.rank} on {victim.node} (pid {pid}) at step {st.step}", self.run.killed_at)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _trainer_pid(self, worker: WorkerStatus, generation: int) -> int | None:
        """The pid of a rank's trainer: as the control plane reports it in the job's status when it
        does, else that node's trainer of this generation (one slot per dpd in the demo)."""
        pid = worker.pid
        if pid is not None and pid > 0:
            return pid
        if worker.node not in self.pool.daemons:
            return None
        return next(iter(self.pool.trainer_pids(worker.node, self.run.job_id, generation)), None)

    def _finish(self, rec: JobRecord) -> None:
        s, run = self.screen, self.run
        st = rec.status
        r = run.resumed.fields if run.resumed is not None else {}
        evals = rec.evals
        s.plain()
        s.say(f"job {st.id} succeeded: {st.steps} steps in {time.time() - self.started:.0f}s, {st.generation} generations")
        s.plain(
            f"  recovery:        {run.killed} was killed; generation {r.get('generation')} resumed from step {r.get('from_step')}, "
            f"{r.get('seconds_since_failure')}s after the failure, {r.get('steps_recomputed')} steps recomputed"
        )
        if evals:
            first = evals[0]
            s.plain(f"  validation loss: {evals[-1].val_loss:.4f} at step {evals[-1].step} (from {first.val_loss:.4f} at step {first.step})")
        else:
            s.plain("  validation loss: none was logged")
        if rec.samples:
            last = rec.samples[-1]
            s.plain(f"  sample at step {last.step}:")
            text = "".join(ch if ch.isprintable() or ch == "\n" else " " for ch in last.text.replace("\t", "    "))
            for line in [ln.rstrip() for ln in text.splitlines() if ln.strip()][:12]:
                s.plain(f"    | {line}")
        path = plot(rec, Path.cwd() / PLOT_FILE)
        s.plain(f"  loss curve:      {path}")
        if self.args.lm:
            kept = Path.cwd() / KEEP_DIR
            said, text = export_and_generate(self.pool.addr, st.id, self.lm_model, kept)
            s.plain(f"  export:          {said}")
            s.plain(f"  kept:            {kept} (model/ and adapters/; the next demo --lm replaces them)")
            s.plain(f"  mlx_lm generate --model {kept / 'model'} --adapter-path {kept / 'adapters'} --prompt {PROMPT!r}:")
            for line in [ln.rstrip() for ln in text.splitlines() if ln.strip()][:6] or [f"(whitespace only: {text!r})"]:
                s.plain(f"    | {line}")
            s.plain()
            s.plain("A real model: see \"Fine-tune a model\" in the README (submit, watch, export, generate).")
            return
        s.plain()
        s.plain("Your own pool: `dpd run --serve` on one machine, `dpd run --join tcp://HOST:7340` on the others (see README),")
        s.plain("then `dpctl submit examples/demo.toml`, `dpctl watch stdlib-gpt`, `dpctl plot stdlib-gpt -o loss.png`.")


def add_parser(sub: Any) -> None:
    s = sub.add_parser("demo", help="a local pool trains the demo job, survives a killed worker, and stops")
    s.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help=f"local workers, one dpd each (default {DEFAULT_WORKERS})")
    s.add_argument("--steps", type=int, help="override the demo job's train.steps (default: the job file's, 200); its warm-up is scaled with it")
    s.add_argument("--kill-at", dest="kill_at", type=int, help="the step at which one worker is SIGKILLed (default: a third of the way)")
    s.add_argument("--lm", action="store_true", help="fine-tune LoRA adapters for a tiny language model instead, export them, generate with mlx-lm")
    s.set_defaults(fn=None, local_fn=cmd_demo)  # its own pool: no --coordinator needed


def cmd_demo(a: argparse.Namespace) -> int:
    """The `dpctl demo` entry."""
    if a.workers < 1 or a.workers > 8:
        print(f"dpctl demo: --workers {a.workers}: must be between 1 and 8", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        spec = lm_spec(a.steps) if a.lm else demo_spec(a.steps)
    except JobFileError as e:
        print(f"dpctl demo: --steps {a.steps}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    steps = spec.train.steps
    if a.kill_at is not None and not 1 <= a.kill_at < steps:
        print(f"dpctl demo: --kill-at {a.kill_at}: must be between 1 and {steps - 1} (the job has {steps} steps)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if steps < 2:
        print(f"dpctl demo: --steps {steps}: must be at least 2, so that a worker can be killed mid-run", file=sys.stderr)
        return EXIT_BAD_INPUT
    here = Path.cwd()
    if not os.access(here, os.W_OK | os.X_OK):  # before training: the figure (and --lm's model) is written here at the end
        print(f"dpctl demo: cannot write {PLOT_FILE} in {here} (the current folder is not writable); run the demo from a folder you can write to", file=sys.stderr)
        return EXIT_BAD_INPUT
    return Demo(a, sys.stdout).main()


def _every(every: int | str) -> str:
    return "checkpoint interval measured (auto)" if every == "auto" else f"checkpoint every {every} steps"
