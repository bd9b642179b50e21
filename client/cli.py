"""`dpctl`: submit jobs to a dpool and look at them.

Exit codes (INTERFACE.md): 0 ok; 1 the job or command failed; 2 bad input (the message names the
file, the field, what was given and what is allowed); 3 the control plane did not answer in time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import orjson

from dpool.client import demo as client_demo
from dpool.client import keys as client_keys
from dpool.client import plot as client_plot
from dpool.client import watch as client_watch
from dpool.client.rpc import Client, RemoteError, Unreachable, pages
from dpool.client.tables import age, clock, event_details, num, size, table
from dpool.protocol import messages as m
from dpool.protocol.jobspec import JobFileError, load_job
from dpool.protocol.payloads import EvalRow, EventRow, ExportFile, MetricRow, SampleRow
from dpool.protocol.security import KeysError

DEFAULT_COORDINATOR = "tcp://127.0.0.1:7340"
DEFAULT_CONFIG = Path("~/.config/dpool/config.toml").expanduser()
TERMINAL = {"succeeded", "failed", "cancelled"}
FOLLOW_POLL_S = 0.5
EXPORT_WINDOW = 4  # reads in flight during an export: the link stays busy while a chunk is relayed
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3


class Failed(Exception):
    """The command ran but what it asked for failed (exit 1)."""


class BadInput(Exception):
    """Exit 2: the message names what was wrong."""


def coordinator_address(flag: str | None) -> str:
    if flag:
        return flag
    if os.environ.get("DPOOL_COORDINATOR"):
        return os.environ["DPOOL_COORDINATOR"]
    try:
        with open(DEFAULT_CONFIG, "rb") as f:
            cfg = tomllib.load(f)
        addr = cfg.get("join") or cfg.get("serve")
        if isinstance(addr, str):
            return addr
    except (OSError, tomllib.TOMLDecodeError):
        pass
    return DEFAULT_COORDINATOR


def emit_json(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")


# -- commands ----------------------------------------------------------------------------------


def cmd_submit(c: Client, a: argparse.Namespace) -> int:
    try:
        spec = load_job(a.job)
    except JobFileError as e:
        raise BadInput(str(e)) from None
    reply = c.call(m.Submit(job=spec.to_dict(), source=str(a.job)), m.Submitted)
    if sys.stdout.isatty():
        print(f"job {reply.job_id} queued ({spec.name}: {spec.train.steps} steps, workers {spec.workers.min}-{spec.workers.max})")
    else:
        print(reply.job_id)
    sys.stdout.flush()
    if a.follow:
        return follow_logs(c, reply.job_id, None, to_stderr=not sys.stdout.isatty())
    return EXIT_OK


def follow_logs(c: Client, job: str, rank: int | None, *, to_stderr: bool = False) -> int:
    out = sys.stderr if to_stderr else sys.stdout
    after = 0
    while True:
        reply = c.call(m.Logs(job=job, after=after, rank=rank), m.LogsReply)
        for line in reply.lines:
            print(f"[rank {line.rank}] {line.text}", file=out)
        out.flush()
        after = reply.cursor
        if reply.more:
            continue
        if reply.state in TERMINAL:
            status = c.call(m.Status(job=job), m.StatusReply).jobs[0]
            print(f"job {status.id} {status.state}" + (f": {status.error}" if status.error else ""), file=sys.stderr)
            return EXIT_OK if status.state == "succeeded" else EXIT_FAILED
        time.sleep(FOLLOW_POLL_S)  # polling interval of --follow


def cmd_status(c: Client, a: argparse.Namespace) -> int:
    jobs = c.call(m.Status(job=a.job), m.StatusReply).jobs
    if a.json:
        emit_json(jobs[0].to_wire() if a.job else [j.to_wire() for j in jobs])
        return EXIT_OK
    if a.job:
        j = jobs[0]
        print(f"job        {j.id}  ({j.name})")
        print(f"state      {j.state}" + (f"  error: {j.error}" if j.error else ""))
        print(f"step       {j.step}/{j.steps}   generation {j.generation}   world size {j.world_size}")
        print(f"loss       {num(j.loss) or '-'}   val_loss {num(j.val_loss) or '-'}   checkpoint step {j.checkpoint_step if j.checkpoint_step is not None else '-'}")
        if j.workers:
            print()
            print(table(["RANK", "NODE", "SHARE", "TOKENS/S"], [[w.rank, w.node, w.share, f"{w.tokens_per_s:.0f}"] for w in j.workers]))
        return EXIT_OK
    if not jobs:
        print("no jobs")
        return EXIT_OK
    rows = [[j.id, j.state, f"{j.step}/{j.steps}", j.generation, j.world_size, num(j.loss), num(j.val_loss), j.checkpoint_step, j.error] for j in jobs]
    print(table(["JOB", "STATE", "STEP", "GEN", "WORKERS", "LOSS", "VAL_LOSS", "CKPT", "ERROR"], rows))
    return EXIT_OK


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
        rows.append([n.name, n.address, n.state, n.platform, n.chip, size(n.memory_bytes), n.mlx_version, f"{n.busy_slots}/{n.slots}", job, age(n.heartbeat_age_s), n.reason])
    print(table(["NAME", "ADDRESS", "STATE", "PLATFORM", "CHIP", "MEMORY", "MLX", "SLOTS", "JOB/RANK", "HEARTBEAT", "REASON"], rows))
    return EXIT_OK


def cmd_logs(c: Client, a: argparse.Namespace) -> int:
    if a.follow:
        follow_logs(c, a.job, a.rank)
        return EXIT_OK
    for reply in pages(lambda after: c.call(m.Logs(job=a.job, after=after, rank=a.rank), m.LogsReply)):
        for line in reply.lines:
            print(f"[rank {line.rank}] {line.text}")
    return EXIT_OK


def cmd_metrics(c: Client, a: argparse.Namespace) -> int:
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
        else:
            out.append([r.step, "train", num(r.loss), None, f"{r.lr:.2e}", f"{r.tokens_per_s:.0f}", r.world_size, r.generation])
    print(table(["STEP", "KIND", "LOSS", "VAL_LOSS", "LR", "TOKENS/S", "WORLD", "GEN"], out) if out else "no metrics yet")
    return EXIT_OK


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
    rows: list[SampleRow] = []
    for reply in pages(lambda after: c.call(m.Samples(job=a.job, after=after), m.SamplesReply)):
        rows += reply.rows
    if a.json:
        emit_json([r.to_wire() for r in rows])
        return EXIT_OK
    if not rows:
        print("no samples yet")
    for r in rows:
        print(f"--- step {r.step} ---")
        print(r.text)
    return EXIT_OK


def cmd_cancel(c: Client, a: argparse.Namespace) -> int:
    reply = c.call(m.Cancel(job=a.job), m.CancelReply)
    if reply.state == "cancelled":
        print(f"job {reply.job_id} cancelled (its checkpoints stay)")
    else:
        print(f"job {reply.job_id} already {reply.state}")
    return EXIT_OK


def cmd_drain(c: Client, a: argparse.Namespace) -> int:
    reply = c.call(m.Drain(node=a.node), m.DrainReply)
    if reply.state == "draining":
        print(f"node {reply.node} draining: its workers checkpoint and leave (no step lost); it takes no new work until `dpctl undrain {reply.node}`")
    else:
        print(f"node {reply.node} drained: it takes no new work until `dpctl undrain {reply.node}`")
    return EXIT_OK


def cmd_undrain(c: Client, a: argparse.Namespace) -> int:
    reply = c.call(m.Undrain(node=a.node), m.UndrainReply)
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
    job = c.call(m.Status(job=a.job), m.StatusReply).jobs[0]  # the pool answers in --timeout; an unknown job exits 2
    if not a.json and sys.stderr.isatty():
        print(f"preparing the export of job {job.id}" + (f" step {a.step}" if a.step is not None else "") + " on a node holding it ...", file=sys.stderr)
    ready = c.call(m.Export(job=job.id, step=a.step), m.ExportReply, timeout_s=m.EXPORT_PREPARE_TIMEOUT_S + 30)
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpctl", description="Submit jobs to a dpool and watch them.")
    p.add_argument("--coordinator", help=f"control plane address (else $DPOOL_COORDINATOR, else the config file, else {DEFAULT_COORDINATOR})")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    p.add_argument("--keys", help="CURVE key directory (`dpctl keys init`; uses client.key_secret and coordinator.key); else $DPOOL_KEYS, else `keys` in the config file")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="validate and queue a job; prints its id")
    s.add_argument("job", help="the job file (job.toml)")
    s.add_argument("--follow", action="store_true", help="then stream its output until it ends (exit 1 unless it succeeds)")
    s.set_defaults(fn=cmd_submit)

    s = sub.add_parser("status", help="all jobs, or one in detail")
    s.add_argument("job", nargs="?", help="a job id, unique id prefix or name")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("nodes", help="the pool's nodes")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_nodes)

    s = sub.add_parser("logs", help="worker output, merged and prefixed by rank")
    s.add_argument("job")
    s.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    s.add_argument("--rank", type=int, help="only this rank")
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
    s.add_argument("--json", action="store_true", help='print {"job", "step", "node", "dir", "files", "bytes"}')
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("cancel", help="stop a job; its checkpoints stay")
    s.add_argument("job")
    s.set_defaults(fn=cmd_cancel)

    s = sub.add_parser("drain", help="a node's workers checkpoint and leave (no step lost); it takes no new work")
    s.add_argument("node")
    s.set_defaults(fn=cmd_drain)

    s = sub.add_parser("undrain", help="a drained (or set aside) node takes work again")
    s.add_argument("node")
    s.set_defaults(fn=cmd_undrain)

    client_plot.add_parser(sub)
    client_watch.add_parser(sub)
    client_demo.add_parser(sub)
    client_keys.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.timeout <= 0:
        print(f"dpctl: --timeout {args.timeout}: must be > 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    if getattr(args, "local_fn", None):
        return int(args.local_fn(args))  # needs no coordinator (keys init)
    addr = coordinator_address(args.coordinator)
    try:
        keys = client_keys.load_client_keys(args.keys, DEFAULT_CONFIG)
    except KeysError as e:
        print(f"dpctl: --keys: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with Client(addr, args.timeout, keys) as client:
            return int(args.fn(client, args))
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
