"""`dpctl`: submit jobs to a dpool and look at them.

Exit codes (INTERFACE.md): 0 ok; 1 the job or command failed; 2 bad input (the message names the
file, the field, what was given and what is allowed); 3 the control plane did not answer in time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import argcomplete
import orjson

from dpool.client import cache as client_cache
from dpool.client import comm as client_comm
from dpool.client import demo as client_demo
from dpool.client import keys as client_keys
from dpool.client import plot as client_plot
from dpool.client import queue as client_queue
from dpool.client import stage
from dpool.client import watch as client_watch
from dpool.client.errors import BadInput, Failed
from dpool.client.jobtimes import JobTimes, status_object
from dpool.client.rpc import Client, RemoteError, RideOut, Unreachable, all_jobs, pages
from dpool.client.tables import age, clock, duration, event_details, num, shown, size, table, when
from dpool.dashboard import cli as dashboard_cli
from dpool.protocol import messages as m
from dpool.protocol import mlxlm_config
from dpool.protocol.config import DEFAULT_CONFIG, ConfigError, load_config, value_problem
from dpool.protocol.endpoints import endpoint_problem
from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import (
    JobFileError,
    JobSpec,
    check_paths,
    check_priority,
    parse_job,
    read_toml,
)
from dpool.protocol.payloads import (
    MAX_WORLD,
    EvalRow,
    EventRow,
    ExportFile,
    JobStatus,
    LogLine,
    MetricRow,
    NodeRow,
    SampleRow,
    TestLossRow,
)
from dpool.protocol.security import KeysError

DEFAULT_COORDINATOR = "tcp://127.0.0.1:7340"
TERMINAL = {"succeeded", "failed", "cancelled"}
STATES = ("queued", "starting", "running", "recovering", "succeeded", "failed", "cancelled")
STATE_GROUPS = {"active": ("queued", "starting", "running", "recovering"), "ended": ("succeeded", "failed", "cancelled")}
FOLLOW_POLL_S = 0.5
EXPORT_WINDOW = 4  # reads in flight during an export: the link stays busy while a chunk is relayed
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3


DEFAULT_TIMEOUT_S = 5.0




def configured() -> dict[str, Any]:
    """The config file dpctl shares with dpd (`coordinator`, `timeout`, `keys`; dpd's `join` or
    `serve` name the coordinator too), checked as dpd checks it: a file that is there but wrong is
    BadInput naming the file and the key, not a silent fallback to the defaults."""
    try:
        return load_config(DEFAULT_CONFIG)
    except ConfigError as e:
        raise BadInput(str(e)) from None


def coordinator_address(flag: str | None) -> str:
    """flag > $DPOOL_COORDINATOR > the config file's `coordinator`, else its `join` or `serve` > default;
    BadInput naming where it came from when it is no ZeroMQ address."""
    if flag is not None:  # an empty one is an address that is wrong, not none given
        addr, where = flag, "--coordinator"
    elif os.environ.get("DPOOL_COORDINATOR"):
        addr, where = os.environ["DPOOL_COORDINATOR"], "$DPOOL_COORDINATOR"
    else:
        cfg = configured()
        key = next((k for k in ("coordinator", "join", "serve") if cfg.get(k)), None)
        if key is None:
            return DEFAULT_COORDINATOR
        addr, where = (DEFAULT_COORDINATOR if cfg[key] is True else cfg[key]), f"{DEFAULT_CONFIG}: {key}"
        if key == "serve":  # the coordinator this machine serves, bound maybe to every interface: reached here
            addr = addr.replace("tcp://*:", "tcp://127.0.0.1:", 1)
    problem = endpoint_problem(addr, connect=True)
    if problem is not None:
        raise BadInput(f"{where} {addr!r}: {problem}")
    return addr


def timeout_s(flag: float | None) -> float:
    """flag > the config file's `timeout` > 5 s; BadInput unless it is seconds in (0, a day]."""
    if flag is not None:
        value, where = flag, "--timeout"
    elif "timeout" in (cfg := configured()):
        value, where = float(cfg["timeout"]), f"{DEFAULT_CONFIG}: timeout ="
    else:
        return DEFAULT_TIMEOUT_S
    problem = value_problem("timeout", value)  # nan and inf too
    if problem:
        raise BadInput(f"{where} {value:g}: {problem} (default {DEFAULT_TIMEOUT_S:g})")
    return value


def emit_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


# -- commands ----------------------------------------------------------------------------------


def version() -> str:
    try:
        return importlib.metadata.version("dpool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def parse_set(item: str) -> tuple[list[str], Any]:
    """`--set KEY=VALUE`: the key's path and the value, read as a TOML value (`1e-4`, `2`, `true`,
    `"text"`, `[1, 2]`); a value that is no TOML (`~/corpus`, `auto`) is taken as a string."""
    key, sep, raw = item.partition("=")
    path = key.strip().split(".")
    if not sep or not all(p.strip() for p in path):
        raise BadInput(
            f"--set {item}: must be KEY=VALUE with KEY a top-level key (`name`) or a dotted path into the tables "
            "(e.g. --set train.lr=1e-4, --set train.optimizer_config.weight_decay=0.05)"
        )
    path = [p.strip() for p in path]
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def read_job(path: str, sets: Sequence[str] = (), notes: Callable[[str], None] | None = None) -> JobSpec:
    """The job file at `path` with each `--set KEY=VALUE` applied, validated (BadInput, naming the
    file, the key, the value and what is allowed, and the --set that gave it). An `mlx_lm lora`
    config (`.yaml`) is converted first (its relative paths are the current folder's, as in
    mlx-lm); what the conversion wants the user to know goes to `notes` (stderr by default)."""
    base_dir = os.path.dirname(os.path.abspath(path))
    try:
        if mlxlm_config.is_mlx_lm_config(path):
            made = mlxlm_config.job_document(mlxlm_config.read_config(path), path, mlxlm_config.job_name(path))
            data, base_dir = made.job, os.getcwd()
            for line in made.notes:
                (notes or (lambda s: print(s, file=sys.stderr)))(f"note: {path}: {line}")
        else:
            data = read_toml(path)
    except JobFileError as e:
        raise BadInput(str(e)) from None
    except OSError as e:  # an mlx_lm config that cannot be read
        raise BadInput(f"{path}: {e.strerror or e}") from None
    given: dict[str, str] = {}
    for item in sets:
        keys, value = parse_set(item)
        table_ = data
        for depth, key in enumerate(keys[:-1], 1):
            table_ = table_.setdefault(key, {})
            if not isinstance(table_, dict):
                name = ".".join(keys[:depth])
                raise BadInput(f"--set {item}: {path} has `{name}` as a value, not a [{name}] table")
        table_[keys[-1]] = value
        given[".".join(keys)] = item
    try:
        return parse_job(data, source=path, base_dir=base_dir)
    except JobFileError as e:
        # The --set behind the error: its key, or one inside the table the error names; else, for
        # an mlx_lm config, the config's key the value came from.
        set_by = given.get(e.key) or next((v for k, v in given.items() if k.startswith(f"{e.key}.")), None)
        if set_by is None and mlxlm_config.is_mlx_lm_config(path):
            e = mlxlm_config.explained(e, data)
        raise BadInput(f"{e} (from --set {set_by})" if set_by else str(e)) from None


def cmd_submit(c: Client | None, a: argparse.Namespace) -> int:
    spec = read_job(a.job, a.set or ())
    if a.priority is not None:
        if (err := check_priority(a.priority)) is not None:
            raise BadInput(f"--priority {a.priority}: {err}")
        spec = dataclasses.replace(spec, priority=a.priority)
    if a.dry_run:
        try:
            spec, _ = stage.with_content(spec)  # the digests submit would write, of the files here
        except stage.StageError as e:
            raise BadInput(f"{a.job}: {e}") from None
        emit_json({"job": spec.to_dict()}) if a.json else sys.stdout.write(dump_job(spec))
        try:
            check_paths(spec, a.job)
        except JobFileError as e:
            print(f"note: {e}; the pool's nodes then look for it at that path (a machine that has it serves the others)", file=sys.stderr)
        print(f"{a.job}: valid ({spec.name}: {spec.train.steps} steps, workers {spec.workers.min}-{spec.workers.max}); a dry run, nothing submitted", file=sys.stderr)
        comm_forecast(None, a, spec, dry_run=True)
        return EXIT_OK
    assert c is not None
    try:
        spec, trees = stage.with_content(spec)
        stage.bring(c, c.keys, trees, lambda line: print(line, file=sys.stderr))
    except stage.StageError as e:
        raise BadInput(f"{a.job}: {e}") from None
    comm_forecast(c, a, spec, dry_run=False)
    reply = c.call(m.Submit(job=spec.to_dict(), source=str(a.job)), m.Submitted)
    if a.json:
        sys.stdout.write(orjson.dumps({"id": reply.job_id}).decode() + "\n")
    elif sys.stdout.isatty():
        print(f"job {reply.job_id} queued ({spec.name}: {spec.train.steps} steps, workers {spec.workers.min}-{spec.workers.max})")
    else:
        print(reply.job_id)
    sys.stdout.flush()
    if a.follow:
        return follow_logs(c, reply.job_id, None, to_stderr=not a.json and not sys.stdout.isatty(), json=a.json, reached=True)
    return EXIT_OK


def cmd_convert(_c: Client | None, a: argparse.Namespace) -> int:
    """An mlx-lm config (or a job file) as the job TOML it means, to stdout or `-o FILE`."""
    spec = read_job(a.config, a.set or ())
    text = dump_job(spec)
    if a.output is None:
        sys.stdout.write(text)
    else:
        try:
            Path(a.output).write_text(text)
        except OSError as e:
            raise BadInput(f"-o {a.output}: {e.strerror or e}") from None
        print(f"wrote {a.output} ({spec.name}: {spec.train.steps} steps, training hash {spec.training_hash()})", file=sys.stderr)
    return EXIT_OK


DRY_RUN_ASK_S = 2.0  # how long --dry-run waits for the pool's links before it predicts without them


def comm_forecast(c: Client | None, a: argparse.Namespace, spec: JobSpec, *, dry_run: bool) -> None:
    """The job's predicted communication (client/comm.py), on stderr: every line with --dry-run,
    only the warning (a share above 0.5) with a submit. A pool that does not answer the dry run's
    question costs it nothing but the prediction; the submit's own call fails as it would."""

    def ask(client: Client) -> client_comm.Forecast | None:
        nodes = client.call(m.Nodes(), m.NodesReply).nodes
        slots = sum(n.slots for n in nodes if n.state not in ("lost", "draining"))
        if slots < spec.workers.min:
            # Not an error (machines may join), but not what a user who waits for it expects either.
            print(f"note: workers.min = {spec.workers.min} is more than the {slots} worker slot(s) of the pool's "
                  f"{sum(n.state not in ('lost', 'draining') for n in nodes)} serving node(s): the job waits until enough join", file=sys.stderr)
        return client_comm.forecast(spec, nodes, client.call(m.Status(), m.StatusReply).jobs)

    try:
        if c is not None:
            found = ask(c)
        else:
            keys = client_keys.load_client_keys(a.keys, DEFAULT_CONFIG)
            with Client(coordinator_address(a.coordinator), min(a.timeout, DRY_RUN_ASK_S), keys) as client:
                found = ask(client)
    except (Unreachable, RemoteError, KeysError) as e:
        if dry_run:
            print(f"note: no communication prediction: {getattr(e, 'message', e)}", file=sys.stderr)
        elif isinstance(e, Unreachable):
            raise
        return
    if found is None:
        if dry_run:
            print(
                f"note: no communication prediction: the model's trainable parameters are not known here (model.path = {spec.model.path!r} "
                "is no folder on this machine, or its config.json and weights cannot be read here; each node checks its own)", file=sys.stderr,
            )
        return
    if dry_run:
        for line in found.lines():
            print(line, file=sys.stderr)
    warning = found.warning()
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def log_text(line: LogLine, json: bool) -> str:
    return orjson.dumps(line.to_wire()).decode() if json else f"[rank {line.rank}] {line.text}"


def follow_logs(c: Client, job: str, rank: int | None, *, to_stderr: bool = False, json: bool = False, reached: bool = False) -> int:
    """Print the job's output until it ends, riding out a coordinator restart; 0 when the job
    succeeded, 1 when it failed or was cancelled."""
    out = sys.stderr if to_stderr else sys.stdout
    after = 0
    patient = RideOut(c, reached=reached)
    while True:
        reply = patient(functools.partial(c.call, m.Logs(job=job, after=after, rank=rank), m.LogsReply))
        for line in reply.lines:
            print(log_text(line, json), file=out)
        out.flush()
        after = reply.cursor
        if reply.more:
            continue
        if reply.state in TERMINAL:
            status = patient(functools.partial(c.call, m.Status(job=reply.job_id), m.StatusReply)).jobs[0]
            print(f"job {status.id} {status.state}" + (f": {status.error}" if status.error else ""), file=sys.stderr)
            return EXIT_OK if status.state == "succeeded" else EXIT_FAILED
        time.sleep(FOLLOW_POLL_S)  # polling interval of --follow


def wanted_states(given: Iterable[str] | None) -> set[str] | None:
    """`--state running,queued --state failed` (and `active`, `ended`) as a set of states."""
    if not given:
        return None
    out: set[str] = set()
    for item in given:
        if not item.strip(", "):
            raise BadInput(f"--state {item!r}: names no state; allowed: {', '.join(STATES)}, or {' / '.join(STATE_GROUPS)}")
        for word in filter(None, (w.strip() for w in item.split(","))):
            if word in STATE_GROUPS:
                out.update(STATE_GROUPS[word])
            elif word in STATES:
                out.add(word)
            else:
                raise BadInput(f"--state {word}: allowed: {', '.join(STATES)}, or {' / '.join(STATE_GROUPS)}")
    return out


def cmd_status(c: Client, a: argparse.Namespace) -> int:
    states = wanted_states(a.state)
    if states is not None and a.job:
        raise BadInput(f"--state filters the list of jobs; give it without a job ({a.job})")
    jobs = c.call(m.Status(job=a.job), m.StatusReply).jobs if a.job else all_jobs(c)
    if states is not None:
        jobs = [j for j in jobs if j.state in states]
    times = {j.id: JobTimes.of(j) for j in jobs}
    now = time.time()
    if a.json:
        emit_json(status_object(jobs[0], times[jobs[0].id], now) if a.job else [status_object(j, times[j.id], now) for j in jobs])
        return EXIT_OK
    if a.job:
        j, t = jobs[0], times[jobs[0].id]
        print(f"job        {j.id}  ({j.name})")
        print(f"state      {j.state}" + (f"  error: {j.error}" if j.error else "") + (f"   priority {j.priority}" if j.priority else ""))
        if j.waiting:
            print(f"waits for  {j.waiting}")
        print(f"step       {j.step}/{j.steps}   generation {j.generation}   world size {j.world_size}")
        print(f"loss       {num(j.loss) or '-'}   val_loss {num(j.val_loss) or '-'}   checkpoint step {j.checkpoint_step if j.checkpoint_step is not None else '-'}"
              + (f"   test_loss {num(j.test_loss)}" if j.test_loss is not None else ""))
        print(f"time       submitted {when(t.submitted, now) or '-'}   started {when(t.started, now) or '-'}   finished {when(t.finished, now) or '-'}")
        print(f"           elapsed {duration(t.elapsed_s(now)) or '-'}   ETA {duration(t.eta_s(j, now)) or '-'}")
        if j.comm is not None or j.comm_share is not None:
            print(f"comm       {comm_text(j)}")
        if j.comm is not None and j.comm.warning and j.comm_share is not None:
            print(f"warning    {j.comm.warning}")
        if j.workers:
            print()
            print(table(["RANK", "NODE", "SHARE", "TOKENS/S"], [[w.rank, w.node, w.share, f"{w.tokens_per_s:.0f}"] for w in j.workers]))
        if j.staging:
            print()
            print(table(["NODE", "FILES", "HAVE", "OF", "RATE", "ETA", "WHY"], [
                [r.node, r.state, f"{r.bytes / 1e6:.1f} MB", f"{r.total / 1e6:.1f} MB", f"{r.rate_bps / 1e6:.1f} MB/s" if r.rate_bps else "-", duration(r.eta_s) or "-", r.reason or ""]
                for r in j.staging
            ]))
        return EXIT_OK
    if not jobs:
        print("no jobs" + (f" in state {', '.join(sorted(states))}" if states else ""))
        return EXIT_OK
    rows = []
    for j in jobs:
        t = times[j.id]
        rows.append([
            j.id, j.state, f"{j.step}/{j.steps}", j.generation, j.world_size, num(j.loss), num(j.val_loss), j.checkpoint_step,
            when(t.submitted, now), when(t.started, now), when(t.finished, now), duration(t.elapsed_s(now)), duration(t.eta_s(j, now)), j.error,
        ])
    headers = ["JOB", "STATE", "STEP", "GEN", "WORKERS", "LOSS", "VAL_LOSS", "CKPT", "SUBMITTED", "STARTED", "FINISHED", "ELAPSED", "ETA", "ERROR"]
    if any(j.priority for j in jobs):  # sharing the pool: each job's priority, and what a waiting one waits for
        headers.insert(2, "PRIORITY")
        rows = [[*r[:2], j.priority or 0, *r[2:]] for r, j in zip(rows, jobs, strict=True)]
    if any(j.waiting for j in jobs):
        headers.append("WAITS FOR")
        rows = [[*r, j.waiting] for r, j in zip(rows, jobs, strict=True)]
    print(table(headers, rows))
    return EXIT_OK


def comm_text(j: Any) -> str:
    """`dpctl status JOB`'s comm line: the share of a step in all_sum, and what it rests on."""
    if j.comm_share is not None:
        share = f"{j.comm_share:.0%} of each step in all_sum"
        if j.comm is not None and j.comm.measured_share is not None:
            share += f" (measured {j.comm.measured_share:.0%})"
    else:
        share = "- (no step measured yet)" if j.state == "running" else "- (not running)"
    c = j.comm
    if c is None:
        return share if j.comm_share != 0 else "0% (one rank sums nothing)"
    every = "step" if c.every == 1 else f"{c.every} steps"
    compute = "compute not measured yet" if c.compute_s is None else f"compute {c.compute_s * 1e3:.1f} ms/step"
    link = f"{c.link[0]} <-> {c.link[1]} {c.bandwidth_bps / 1e6:.0f} Mbit/s {c.latency_s * 1e3:.2g} ms"
    return f"{share}   ({c.bytes / 1e6:.1f} MB per {every}: {c.seconds * 1e3:.1f} ms/step on {link}; {compute})"


def links_text(n: NodeRow) -> str | None:
    """`dpctl nodes`' LINKS: each measured peer, Mbit/s and latency, the slowest first (two shown)."""
    if not n.links:
        return None
    ranked = sorted(n.links, key=lambda ln: ln.bandwidth_bps)
    text = ", ".join(f"{ln.peer} {ln.bandwidth_bps / 1e6:.0f}M/{ln.latency_s * 1e3:.2g}ms" for ln in ranked[:2])
    return text + (f" +{len(ranked) - 2}" if len(ranked) > 2 else "")


def cmd_nodes(c: Client, a: argparse.Namespace) -> int:
    nodes = c.call(m.Nodes(), m.NodesReply).nodes
    if a.json:
        emit_json([n.to_wire() for n in nodes])
        return EXIT_OK
    if not nodes:
        print("no nodes")
        return EXIT_OK
    rows = []
    for n in nodes:
        job = n.job
        if job and n.ranks:
            job = f"{job}/{','.join(str(r) for r in n.ranks)}"
        # REASON says why a node is not idle or busy (drained, set aside, yielding to its owner: "on battery"), as --json's "reason"
        rows.append([n.name, n.address, n.interface, n.state, n.platform, n.chip, size(n.memory_bytes), n.mlx_version, f"{n.busy_slots}/{n.slots}", job, age(n.heartbeat_age_s), links_text(n), n.reason])
    # ADDRESS and INTERFACE: where the ring reaches the node, and over which link (bridge0: Thunderbolt);
    # LINKS: what the groups' probes measured to other nodes (Mbit/s / latency), the slowest first
    print(table(["NAME", "ADDRESS", "INTERFACE", "STATE", "PLATFORM", "CHIP", "MEMORY", "MLX", "SLOTS", "JOB/RANK", "HEARTBEAT", "LINKS", "REASON"], rows))
    return EXIT_OK


def cmd_logs(c: Client, a: argparse.Namespace) -> int:
    if a.follow:
        if a.rank is not None and (world := c.call(m.Status(job=a.job), m.StatusReply).jobs[0].world_size) and a.rank >= world:
            print(f"note: --rank {a.rank}: the job's group has ranks 0-{world - 1} now; its lines show if the job grows to {a.rank + 1} workers", file=sys.stderr)
        return follow_logs(c, a.job, a.rank, json=a.json)
    printed = False
    for reply in pages(lambda after: c.call(m.Logs(job=a.job, after=after, rank=a.rank), m.LogsReply)):
        for line in reply.lines:
            print(log_text(line, a.json))
            printed = True
    if a.rank is not None and not printed:
        job = c.call(m.Status(job=a.job), m.StatusReply).jobs[0]
        if job.world_size and a.rank >= job.world_size:
            raise BadInput(f"--rank {a.rank}: job {job.id} has no such rank (its {'last ' if job.state in TERMINAL else ''}group had ranks 0-{job.world_size - 1})")
    return EXIT_OK


def rank_arg(text: str) -> int:
    """--rank: a rank, 0 or more (argparse's type)."""
    try:
        rank = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no rank: an integer, 0 or more") from None
    if not 0 <= rank < MAX_WORLD:
        raise argparse.ArgumentTypeError(f"{rank} is no rank: an integer from 0 to {MAX_WORLD - 1}")
    return rank


def cmd_metrics(c: Client, a: argparse.Namespace) -> int:
    before = None if a.json else c.call(m.Status(job=a.job), m.StatusReply).jobs[0]  # its state before the rows: "yet" or not
    rows: list[MetricRow] = []
    for reply in pages(lambda after: c.call(m.Metrics(job=a.job, after=after), m.MetricsReply)):
        rows += reply.rows
    if a.json:
        emit_json([r.to_wire() for r in rows])
        return EXIT_OK
    out = []
    for r in rows:
        if isinstance(r, EvalRow):
            out.append([r.step, "eval", None, num(r.val_loss), None, None, None, None])
        elif isinstance(r, TestLossRow):
            out.append([r.step, "test", num(r.test_loss), None, None, None, None, None])  # LOSS: the test loss
        else:
            out.append([r.step, "train", num(r.loss), None, f"{r.lr:.2e}", f"{r.tokens_per_s:.0f}", r.world_size, r.generation])
    print(table(["STEP", "KIND", "LOSS", "VAL_LOSS", "LR", "TOKENS/S", "WORLD", "GEN"], out) if out else none_yet(before, "metrics"))
    return EXIT_OK


def none_yet(status: JobStatus | None, what: str) -> str:
    """What an empty listing says: "no metrics yet" while the job may still log some; that it
    ended without any where it had ended before the listing was read."""
    if status is not None and status.state in TERMINAL:
        return f"no {what}: job {status.id} {status.state} without any"
    return f"no {what} yet"


def cmd_events(c: Client, a: argparse.Namespace) -> int:
    events: list[EventRow] = []
    for reply in pages(lambda after: c.call(m.Events(job=a.job, after=after), m.EventsReply)):
        events += reply.events
    if a.json:
        emit_json([e.to_wire() for e in events])
        return EXIT_OK
    rows = []
    for e in events:
        rows.append([clock(e.t), e.kind, event_details(e)])
    print(table(["TIME", "EVENT", "DETAILS"], rows) if rows else "no events")
    return EXIT_OK


def cmd_samples(c: Client, a: argparse.Namespace) -> int:
    before = None if a.json else c.call(m.Status(job=a.job), m.StatusReply).jobs[0]  # its state before the rows: "yet" or not
    rows: list[SampleRow] = []
    for reply in pages(lambda after: c.call(m.Samples(job=a.job, after=after), m.SamplesReply)):
        rows += reply.rows
    if a.json:
        emit_json([r.to_wire() for r in rows])
        return EXIT_OK
    if not rows:
        print(none_yet(before, "samples"))
    for r in rows:
        print(f"--- step {r.step} ---")
        print(shown(r.text))
    return EXIT_OK


def cmd_cancel(c: Client, a: argparse.Namespace) -> int:
    reply = c.call(m.Cancel(job=a.job), m.CancelReply)
    if a.json:
        emit_json({"id": reply.job_id, "state": reply.state})
    elif reply.state == "cancelled":
        print(f"job {reply.job_id} cancelled (its checkpoints stay)")
    else:
        print(f"job {reply.job_id} already {reply.state}")
    return EXIT_OK


def cmd_rm(c: Client, a: argparse.Namespace) -> int:
    """Remove a finished job: its records, and on every node its run dirs and checkpoints."""
    reply = c.call(m.Rm(job=a.job), m.RmReply)
    rows = reply.rows
    if a.json:
        emit_json({"id": reply.job_id, "state": reply.state, "rows": rows.to_wire(), "nodes": reply.nodes, "later": reply.later})
        return EXIT_OK
    counted = ", ".join(f"{n} {what}" for what, n in (("metrics", rows.metrics), ("samples", rows.samples), ("events", rows.events), ("log lines", rows.logs)))
    print(f"removed job {reply.job_id} ({reply.state}): its records ({counted})")
    if reply.nodes:
        print(f"its run dirs and checkpoints are being deleted on {', '.join(reply.nodes)}")
    if reply.later:
        print(f"not connected now, they delete theirs when they join again: {', '.join(reply.later)}")
    return EXIT_OK


def cmd_drain(c: Client, a: argparse.Namespace) -> int:
    reply = c.call(m.Drain(node=a.node), m.DrainReply)
    if a.json:
        emit_json({"node": reply.node, "state": reply.state, "reason": reply.reason})
    elif reply.state == "draining":
        print(f"node {reply.node} draining: its workers checkpoint and leave (no step lost); it takes no new work until `dpctl undrain {reply.node}`")
    else:
        print(f"node {reply.node} drained: it takes no new work until `dpctl undrain {reply.node}`")
    return EXIT_OK


def cmd_undrain(c: Client, a: argparse.Namespace) -> int:
    reply = c.call(m.Undrain(node=a.node), m.UndrainReply)
    if a.json:
        emit_json({"node": reply.node, "state": reply.state, "reason": reply.reason})
    elif reply.state == "yielding":
        print(f"node {reply.node} undrained; it yields to its owner ({reply.reason}) and takes work again once that clears")
    else:
        print(f"node {reply.node} takes work again ({reply.state})")
    return EXIT_OK


def cmd_export(c: Client, a: argparse.Namespace) -> int:
    """Fetch a job's trained result from a node holding its checkpoint and write it to DIR: into a
    temporary folder beside DIR, every file checked against its sha256, then renamed to DIR."""
    dest = Path(a.dir).expanduser().absolute()
    if dest.exists() and not dest.is_dir():
        raise BadInput(f"{a.dir}: exists and is not a directory; give a new or empty directory")
    if dest.is_dir() and any(dest.iterdir()):
        raise BadInput(f"{a.dir}: exists and is not empty; give a new or empty directory")
    if a.step is not None and a.step < 0:
        raise BadInput(f"--step {a.step}: must be a checkpoint step >= 0")
    if a.dequantize and not a.fuse:
        raise BadInput("--dequantize: goes with --fuse (the fused model is what is dequantized)")
    job = c.call(m.Status(job=a.job), m.StatusReply).jobs[0]  # the pool answers in --timeout; an unknown job exits 2
    if not a.json and sys.stderr.isatty():
        print(f"preparing the export of job {job.id}" + (f" step {a.step}" if a.step is not None else "") + " on a node holding it ...", file=sys.stderr)
    request = m.Export(job=job.id, step=a.step, fuse=a.fuse or None, dequantize=a.dequantize or None)
    ready = c.call(request, m.ExportReply, timeout_s=m.EXPORT_PREPARE_TIMEOUT_S + 30)
    reachable = True
    try:
        files = _checked_manifest(ready)
        _fetch_into(c, ready, files, dest)
    except Unreachable:
        reachable = False
        raise
    except OSError as e:
        raise Failed(f"writing {dest}: {e}") from None
    finally:
        if reachable:  # the node deletes its copy now, not when it expires
            with contextlib.suppress(RemoteError, Unreachable):
                c.call(m.ExportClose(export_id=ready.export_id), m.ExportClosed)
    total = sum(f.bytes for f in files)
    if a.json:
        emit_json({"job": ready.job_id, "step": ready.step, "node": ready.node, "dir": str(dest), "files": [f.to_wire() for f in files], "bytes": total})
        return EXIT_OK
    print(f"exported job {ready.job_id} step {ready.step} from node {ready.node} to {dest}: {len(files)} file(s), {size(total) or '0B'}")
    print(table(["FILE", "SIZE", "SHA256"], [[f.name, size(f.bytes) or "0B", f.sha256[:16]] for f in files]))
    return EXIT_OK


def cmd_test(c: Client, a: argparse.Namespace) -> int:
    """A checkpoint's test loss: a node holding it runs the trainer's --test (through the export
    relay, as `dpctl export` does) and its one file, test.json, is fetched and printed."""
    if a.step is not None and a.step < 0:
        raise BadInput(f"--step {a.step}: must be a checkpoint step >= 0")
    job = c.call(m.Status(job=a.job), m.StatusReply).jobs[0]
    if not a.json and sys.stderr.isatty():
        print(f"computing the test loss of job {job.id}" + (f" step {a.step}" if a.step is not None else "") + " on a node holding it ...", file=sys.stderr)
    try:
        ready = c.call(m.Export(job=job.id, step=a.step, test=True), m.ExportReply, timeout_s=m.EXPORT_PREPARE_TIMEOUT_S + 30)
    except RemoteError as e:
        if e.code != m.ErrorCode.FORBIDDEN:
            raise
        # the coordinator names the request (an export run as a test), not this command
        raise Failed(f"test: a node runs the checkpoint for it, which this key may not ask for ({e.message})") from None
    reachable = True
    try:
        files = _checked_manifest(ready)
        if [f.name for f in files] != ["test.json"] or files[0].bytes > 64 * 1024:
            raise Failed(f"node {ready.node} sent {[f.name for f in files][:5]} where test.json was asked")
        with tempfile.TemporaryDirectory(prefix=".dpctl-test-") as tmp:
            _fetch_into(c, ready, files, Path(tmp) / "out")
            body = json.loads((Path(tmp) / "out" / "test.json").read_text())
    except Unreachable:
        reachable = False
        raise
    except (OSError, ValueError) as e:
        raise Failed(f"the test loss from node {ready.node}: {e}") from None
    finally:
        if reachable:
            with contextlib.suppress(RemoteError, Unreachable):
                c.call(m.ExportClose(export_id=ready.export_id), m.ExportClosed)
    loss, ppl, examples = body.get("test_loss"), body.get("test_ppl"), body.get("examples")
    if a.json:
        emit_json({"job": ready.job_id, "step": ready.step, "node": ready.node, "test_loss": loss, "test_ppl": ppl, "examples": examples})
        return EXIT_OK
    print(f"test loss {num(loss)} (ppl {num(ppl)}) of job {ready.job_id} step {ready.step} on {examples} examples")
    return EXIT_OK


def _checked_manifest(ready: m.ExportReply) -> list[ExportFile]:
    """The manifest's files, once every name is a safe relative path and every entry well formed
    (types and sizes were checked by decode); anything else is refused before a byte is written."""
    files: list[ExportFile] = []
    names: set[str] = set()
    folders: set[str] = set()
    for f in ready.files:
        name, digest = f.name, f.sha256
        problem = m.export_name_problem(name)
        if problem is None and not SHA256_RE.match(digest):
            problem = f"sha256 {str(digest)[:80]!r} of {name!r}"
        if problem is None and (name in names or name in folders):
            problem = f"file name {name!r} given twice (or also as a folder)"
        if problem is not None:
            raise Failed(f"node {ready.node} sent an unusable export manifest ({problem}); nothing was written")
        parts = name.split("/")
        prefixes = {"/".join(parts[:i]) for i in range(1, len(parts))}
        if prefixes & names:
            raise Failed(f"node {ready.node} sent an unusable export manifest ({name!r} lies inside a file); nothing was written")
        names.add(name)
        folders |= prefixes
        files.append(f)
    if not files:
        raise Failed(f"node {ready.node} sent an empty export; nothing was written")
    return files


def _fetch_into(c: Client, ready: m.ExportReply, files: list[ExportFile], dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.export-", dir=dest.parent))
    try:
        reads = (
            m.ExportRead(export_id=ready.export_id, name=f.name, offset=offset, size=m.EXPORT_CHUNK_MAX)
            for f in files
            for offset in range(0, f.bytes, m.EXPORT_CHUNK_MAX)
        )
        # The coordinator answers every read within EXPORT_FETCH_TIMEOUT_S (an error if its node is
        # slow or lost); it was reachable a moment ago, so waiting that long is not waiting forever.
        chunks = c.stream(reads, m.ExportData, window=EXPORT_WINDOW, timeout_s=max(c.timeout_s, m.EXPORT_FETCH_TIMEOUT_S + 5))
        for f in files:
            path = tmp / f.name
            path.parent.mkdir(parents=True, exist_ok=True)
            digest, got = hashlib.sha256(), 0
            with open(path, "xb") as out:
                while got < f.bytes:
                    chunk = next(chunks)
                    if chunk.name != f.name or chunk.offset != got or not chunk.data or got + len(chunk.data) > f.bytes:
                        raise Failed(f"node {ready.node} sent {len(chunk.data)} bytes of {chunk.name!r} at offset {chunk.offset} where {f.name!r} at {got} was asked")
                    out.write(chunk.data)
                    digest.update(chunk.data)
                    got += len(chunk.data)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != f.sha256:
                raise Failed(f"{f.name}: its sha256 is {digest.hexdigest()}, node {ready.node} announced {f.sha256}; nothing was written")
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; the result is an ordinary folder
        if dest.is_dir():
            dest.rmdir()  # empty (checked before anything was fetched); fails if it is not anymore
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- main --------------------------------------------------------------------------------------


def add_globals(p: argparse.ArgumentParser, *, top: bool) -> None:
    """The flags every command takes, before or after its name: on the top parser with their
    defaults, on each subcommand with none (so that a value given earlier on the line stays)."""
    keep: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("--coordinator", metavar="ADDR", help=f"control plane address (else $DPOOL_COORDINATOR, else `coordinator` or `join` in the config file, else {DEFAULT_COORDINATOR})", **keep)
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="seconds to wait for an answer (else `timeout` in the config file, else 5)", **({"default": None} if top else keep))
    p.add_argument("--keys", metavar="DIR", help="CURVE key directory (`dpctl keys init`; uses client.key_secret and coordinator.key); else $DPOOL_KEYS, else `keys` in the config file", **keep)


def subcommands(p: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every subcommand parser under `p`, nested ones (`keys init`) too, with its name."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                yield name, sp
                yield from subcommands(sp)


def completer(query: str) -> Any:
    """A completer for argcomplete: the pool's job ids and names, or node names, as the
    coordinator on the line (or the default one) knows them; nothing when it does not answer."""

    def complete(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
        try:
            keys = client_keys.load_client_keys(getattr(parsed_args, "keys", None), DEFAULT_CONFIG)
            with Client(coordinator_address(getattr(parsed_args, "coordinator", None)), 1.0, keys) as c:
                if query == "node":
                    return [n.name for n in c.call(m.Nodes(), m.NodesReply).nodes]
                jobs = c.call(m.Status(), m.StatusReply).jobs
                return list(dict.fromkeys([j.id for j in jobs] + [j.name for j in jobs]))
        except Exception:
            return []

    return complete


def cmd_dashboard(a: argparse.Namespace) -> int:
    """The read-only web dashboard of the pool at --coordinator, until Ctrl-C (dashboard/cli.py)."""
    a.timeout = timeout_s(a.timeout)  # a local command: resolved here (the others' is in main)
    return dashboard_cli.start(a, coordinator_address(a.coordinator), client_keys.configured_keys_dir(a.keys, DEFAULT_CONFIG))


def cmd_completion(a: argparse.Namespace) -> int:
    sys.stdout.write(argcomplete.shellcode(["dpctl"], shell=a.shell))
    return EXIT_OK


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpctl", description="Submit jobs to a dpool and watch them. --coordinator, --timeout, --keys and --json go anywhere on the line.")
    p.add_argument("--version", action="version", version=f"dpctl {version()}")
    add_globals(p, top=True)
    as_json = p.add_argument("--json", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="validate and queue a job; prints its id")
    s.add_argument("job", help="the job file (job.toml), or an mlx_lm lora config (config.yaml) as it is").completer = argcomplete.completers.FilesCompleter(["toml", "yaml", "yml"])  # type: ignore[attr-defined]
    s.add_argument("--follow", action="store_true", help="then stream its output until it ends (exit 1 unless it succeeds)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a value of the job file, read as TOML, at a dotted path (--set train.lr=1e-4 --set train.optimizer_config.weight_decay=0.05); repeatable")
    s.add_argument("--dry-run", dest="dry_run", action="store_true", help="print the resolved job file and check it; submit nothing")
    s.add_argument("--priority", type=int, metavar="N", help="the job's priority (overrides the file's `priority`; higher runs first, default 0)")
    s.add_argument("--json", action="store_true", help='print {"id": ...} (with --follow, then one log object a line; with --dry-run, {"job": ...})')
    s.set_defaults(fn=cmd_submit)

    s = sub.add_parser("convert", help="print the job TOML an mlx_lm lora config (YAML) means; nothing is submitted")
    s.add_argument("config", help="an mlx_lm lora config (lora_config.yaml); a job.toml is printed resolved").completer = argcomplete.completers.FilesCompleter(["yaml", "yml", "toml"])  # type: ignore[attr-defined]
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="set a value of the job made (--set workers.max=2 --set name=qwen-sql); repeatable")
    s.add_argument("-o", "--output", metavar="FILE", help="write the TOML to FILE instead of stdout")
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("status", help="all jobs (newest first), or one in detail")
    s.add_argument("job", nargs="?", help="a job id, unique id prefix or name")
    s.add_argument("--state", action="append", metavar="STATE[,STATE]", help=f"only jobs in these states ({', '.join(STATES)}; active, ended); repeatable")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("nodes", help="the pool's nodes")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_nodes)

    s = sub.add_parser("logs", help="worker output, merged and prefixed by rank")
    s.add_argument("job")
    s.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends (exit 1 unless it succeeds)")
    s.add_argument("--rank", type=rank_arg, help="only this rank")
    s.add_argument("--json", action="store_true", help='one object a line: {"seq", "t", "rank", "generation", "text"}')
    s.set_defaults(fn=cmd_logs)

    for name, fn, helptext in (
        ("metrics", cmd_metrics, "one row per logged step"),
        ("events", cmd_events, "membership and recovery events with their timings"),
        ("samples", cmd_samples, "generated text samples, by step"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("job")
        s.add_argument("--json", action="store_true")
        s.set_defaults(fn=fn)

    s = sub.add_parser("export", help="write a job's trained result (from its newest checkpoint, or --step N) to DIR")
    s.add_argument("job", help="a job id, unique id prefix or name")
    s.add_argument("dir", help="where to write it: a new or empty directory")
    s.add_argument("--step", type=int, help="the checkpoint step to export (default: the newest a live node holds)")
    s.add_argument("--fuse", action="store_true", help="mlx_lm jobs: a model with the adapters fused in, as `mlx_lm fuse` writes it (mlx_lm generate loads it alone)")
    s.add_argument("--dequantize", action="store_true", help="with --fuse: a dequantized model, as `mlx_lm fuse --dequantize`")
    s.add_argument("--json", action="store_true", help='print {"job", "step", "node", "dir", "files", "bytes"}')
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("test", help="the test loss (test.jsonl) of a job's newest checkpoint, or --step N, computed on a node holding it")
    s.add_argument("job", help="a job id, unique id prefix or name")
    s.add_argument("--step", type=int, help="the checkpoint step (default: the newest a live node holds)")
    s.add_argument("--json", action="store_true", help='print {"job", "step", "node", "test_loss", "test_ppl", "examples"}')
    s.set_defaults(fn=cmd_test)

    s = sub.add_parser("cancel", help="stop a job; its checkpoints stay")
    s.add_argument("job")
    s.add_argument("--json", action="store_true", help='print {"id", "state"}')
    s.set_defaults(fn=cmd_cancel)

    s = sub.add_parser("rm", help="remove a finished job: its records, and on every node its run dirs and checkpoints")
    s.add_argument("job", help="a job id, unique id prefix or name (a job that has not finished: cancel it first)")
    s.add_argument("--json", action="store_true", help='print {"id", "state", "rows", "nodes", "later"}')
    s.set_defaults(fn=cmd_rm)

    s = sub.add_parser("drain", help="a node's workers checkpoint and leave (no step lost); it takes no new work")
    s.add_argument("node")
    s.add_argument("--json", action="store_true", help='print {"node", "state", "reason"}')
    s.set_defaults(fn=cmd_drain)

    s = sub.add_parser("undrain", help="a drained (or set aside) node takes work again")
    s.add_argument("node")
    s.add_argument("--json", action="store_true", help='print {"node", "state", "reason"}')
    s.set_defaults(fn=cmd_undrain)

    s = sub.add_parser("dashboard", help="serve a read-only web page of the pool (default http://127.0.0.1:7341/) until Ctrl-C")
    dashboard_cli.add_arguments(s, standalone=False)
    s.set_defaults(fn=None, local_fn=cmd_dashboard)

    client_plot.add_parser(sub)
    client_cache.add_parser(sub)
    client_queue.add_parser(sub)
    client_watch.add_parser(sub)
    client_demo.add_parser(sub)
    client_keys.add_parser(sub)

    s = sub.add_parser("completion", help="print the shell completion script: eval \"$(dpctl completion bash)\" (or zsh; fish: dpctl completion fish | source)")
    s.add_argument("shell", choices=("bash", "zsh", "fish"))
    s.set_defaults(fn=None, local_fn=cmd_completion)

    for name, sp in subcommands(p):
        add_globals(sp, top=False)
        for action in sp._actions:
            if action.dest == "json":
                action.default = argparse.SUPPRESS  # `dpctl --json status` keeps its --json
                sp.set_defaults(takes_json=True)
            elif action.dest in ("job", "node") and not action.option_strings and name != "submit":
                action.completer = completer(action.dest)  # type: ignore[attr-defined]
    without = [name for name, sp in sub.choices.items() if not any(s.get_default("takes_json") for _, s in [(name, sp), *subcommands(sp)])]
    as_json.help = f"JSON on stdout (every command but {', '.join(without)})"
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argcomplete.autocomplete(p)  # answers the shell's completion request, if this is one, and exits
    args = p.parse_args(argv)
    if args.json and not getattr(args, "takes_json", False):
        print(f"dpctl {args.command}: --json does not apply here", file=sys.stderr)
        return EXIT_BAD_INPUT
    if isinstance(job := getattr(args, "job", None), str) and not job.strip():
        said = "the job file's path is empty" if args.command in ("submit", "convert") else "JOB is empty; give a job id or name (`dpctl status` lists them)"
        print(f"dpctl {args.command}: {said}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if getattr(args, "local_fn", None):
        return _handled(lambda: args.local_fn(args))  # needs no pool (keys, demo, completion; dashboard: its own)
    try:
        args.timeout = timeout_s(args.timeout)
        if (args.command == "submit" and args.dry_run) or args.command == "convert":
            return _handled(lambda: args.fn(None, args))
        addr = coordinator_address(args.coordinator)
        keys = client_keys.load_client_keys(args.keys, DEFAULT_CONFIG)
    except BadInput as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeysError as e:
        given = "--keys" if args.keys else "$DPOOL_KEYS" if os.environ.get("DPOOL_KEYS") else f"keys in {DEFAULT_CONFIG}"
        print(f"dpctl: {e}" if isinstance(e, client_keys.ConfigKeysError) else f"dpctl: {given}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    def run() -> int:
        with Client(addr, args.timeout, keys) as client:
            return int(args.fn(client, args))

    return _handled(run)


def _handled(run: Any) -> int:
    """`run()`'s exit code, or the one its failure means (INTERFACE.md), with the message on stderr."""
    try:
        return int(run())
    except BadInput as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Unreachable as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RemoteError as e:
        print(f"dpctl: {e.message}", file=sys.stderr)
        return EXIT_BAD_INPUT if e.code in (m.ErrorCode.BAD_JOB, m.ErrorCode.NOT_FOUND, m.ErrorCode.BAD_REQUEST) else EXIT_FAILED
    except Failed as e:
        print(f"dpctl: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
