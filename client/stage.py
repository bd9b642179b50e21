"""`dpctl submit`'s side of staging: name the job's files by content, and make sure the pool holds
them before the job is queued.

Where `data.source` (and an mlx_lm `model.path` and `model.adapters`) exist on the machine dpctl runs on, their trees
are hashed (protocol/content.py says which files; a hash cache in ~/.cache/dpool spares a second
hashing of unchanged files) and their digests written into the job's `[content]`. The coordinator
is then asked which of them some node holds (`stage.offer`); the rest are sent once, into one
node's cache (its data channel; the other nodes fetch from it and from each other), and submit
returns when that node holds a verified copy: the laptop may leave. A second submit of the same
files sends nothing. Where a path does not exist here, the job goes as it is and the nodes look
for it at that path (it may be on one of them).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_random_exponential

from dpool.client.rpc import Client
from dpool.client.tables import size
from dpool.protocol.content import TREES, source_root
from dpool.protocol.jobspec import JobSpec, data_files, data_location, model_location, not_here
from dpool.protocol.modeldir import model_dir_problem
from dpool.protocol.security import ClientKeys
from dpool.protocol.stage_messages import StageOffer, StageOfferReply
from dpool.staging.manifest import HashCache, Manifest, ManifestError, scan

ACCEPT_WAIT_S = 10.0


class StageError(Exception):
    """The job's files could not be named or brought into the pool; the message says why."""


def _has_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def hash_cache() -> HashCache:
    base = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "dpool"
    base.mkdir(parents=True, exist_ok=True)
    return HashCache(base / "hashes.sqlite")


def with_content(spec: JobSpec) -> tuple[JobSpec, list[tuple[Path, Manifest]]]:
    """The job with `[content]` filled for each tree that exists here, and those trees."""
    if (problem := _problem_here(spec)) is not None:
        raise StageError(problem)
    hashes = hash_cache()
    trees: list[tuple[Path, Manifest]] = []
    content = spec.content
    for what, key, tree_of in TREES:
        tree = tree_of(spec)
        if tree is None or getattr(content, what) is not None:
            continue
        root, files = tree
        try:
            manifest = scan(root, files, hashes=hashes)
        except (ManifestError, OSError) as e:
            raise StageError(f"{key}: cannot read the files at {root}: {e}") from None
        content = dataclasses.replace(content, **{what: manifest.digest})
        trees.append((root, manifest))
    return dataclasses.replace(spec, content=content), trees


def _upload(source: Any, root: Path, manifest: Manifest, keys: ClientKeys | None, progress: Callable[[int, int], None]) -> int:
    """One tree into the target. With keys, the target learns from the coordinator that it may
    take this client's upload (stage.accept) while dpctl is told where to send it: a refusal at
    first is retried, with backoff, for ACCEPT_WAIT_S."""
    from dpool.staging.channel import UploadError, upload

    try:
        for attempt in Retrying(stop=stop_after_delay(ACCEPT_WAIT_S), wait=wait_random_exponential(0.05, 1.0), retry=retry_if_exception(_refused), reraise=True):
            with attempt:
                return int(upload(source, root, manifest, keys=keys, progress=progress))
    except UploadError as e:  # the channel's errors name the node and what failed
        raise StageError(f"could not send the job's files to node {source.name}: {e}") from None
    raise AssertionError("unreachable: Retrying returns or raises")


def _refused(e: BaseException) -> bool:
    return getattr(e, "code", "") == "refused"


def bring(c: Client, keys: ClientKeys | None, trees: list[tuple[Path, Manifest]], say: Callable[[str], None]) -> int:
    """Make sure the pool holds every tree: bytes sent (0 when it held them all)."""
    if not trees:
        return 0

    excluded: list[str] = []
    failures: list[str] = []
    while True:
        reply = c.call(StageOffer(digests=[m.digest for _, m in trees], exclude=excluded), StageOfferReply)
        todo = [(root, m) for root, m in trees if m.digest not in reply.held]
        if not todo:
            return 0
        if not reply.target:
            if failures:  # every node that could take it refused or failed
                raise StageError("no node could take the job's files: " + "; ".join(failures))
            say("note: no node's data channel is known yet; the nodes look for the files at the job's paths")
            return 0
        try:
            return _send_all(reply, todo, keys, say)
        except StageError as e:  # that node cannot take them (its cache is full, it went away): another may
            failures.append(str(e))
            excluded.append(reply.target)


def _send_all(reply: StageOfferReply, todo: list[tuple[Path, Manifest]], keys: ClientKeys | None, say: Callable[[str], None]) -> int:
    from dpool.staging.channel import Source

    total = sum(m.total_bytes for _, m in todo)
    say(f"sending {size(total) or '0B'} of the job's files to node {reply.target} (once; the pool copies them on)")
    sent = 0
    source = Source(reply.endpoint, reply.key.encode() if reply.key else None, reply.target)
    for root, manifest in todo:
        def progress(done: int, of: int, _base: int = sent) -> None:
            if sys.stderr.isatty():
                print(f"\r  {(_base + done) / 1e6:9.1f} / {total / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)

        sent += _upload(source, root, manifest, keys, progress)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return sent


def _problem_here(spec: JobSpec) -> str | None:
    """What is wrong with the job's files that are here, which every node would find too once the
    job was queued: a data folder that holds no data ("no node can serve this job"), a model
    folder that is no model (mlx-lm could not load it), a relative path found under the current
    folder and not under the job file's (`not_here`). A path that does not exist here is no
    error: a node may hold it."""
    if (shadowed := not_here(spec)) is not None:
        return f"{shadowed[0]} = {shadowed[1]!r}: {shadowed[2]}"
    if spec.model.kind == "mlx_lm":
        where, path = model_location(spec)
        if where == "dir" and os.path.isdir(path) and (problem := model_dir_problem(Path(path))) is not None:
            return f"model.path = {spec.model.path!r}: {problem}"
    if spec.data.source == "stdlib" or spec.data.hf_dataset is not None:
        return None
    if spec.model.kind == "mlx_lm":
        kind, folder = data_location(spec)
        train = Path(folder) / "train.jsonl"
        if kind == "dir" and os.path.isdir(folder) and not train.is_file():
            return f"data.source = {spec.data.source!r}: the folder {folder} holds no train.jsonl"
        if kind == "dir" and train.is_file() and not _has_a_line(train):
            return f"data.source = {spec.data.source!r}: {train} holds no examples (no line that is not blank)"
        return None
    root = source_root(spec.resolved_source())
    if root.is_dir() and not data_files(spec):
        return f"data.source = {spec.data.source!r}: no .txt or .jsonl files match it in {root}"
    return None
