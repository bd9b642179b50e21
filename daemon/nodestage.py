"""A node's side of staging: can this machine serve a job, and the files it lacks.

The coordinator asks with `job.stage` (daemon/fitness.py); `NodeStaging.stage` answers with
`node.staged`, at once ("checking"), while it fetches ("staging", with bytes and rate), and at the
end ("ready", or "unfit" with one line naming what is wrong). For each of the job's trees (the
data, an mlx_lm model, the adapters it starts from):

- the job names its content (`[content]`, written by `dpctl submit`):
  - the node's cache holds it: served from there;
  - the job's path exists here: its files are hashed (a hash cache spares a second hashing) and,
    when they are the submitted ones, served from where they are (adopted, never copied); when
    they differ, the node sits the job out naming the first file that differs;
  - else the content is fetched from the nodes that hold it (the data channel, staging/channel.py)
    into the cache;
- the job names no content (a path that did not exist where it was submitted): the path must
  exist here (the data and the model may be found on one node and named by it for the others;
  adapters are named only by the submitting machine).
Then a model must load as a config (`config.json` with a `model_type`) and fit in this machine's
memory (an estimate: its weights, four times over for full fine-tuning with Adam).

A trainer of the job reads the trees where this node has them: `localize` rewrites the job's paths
(protocol/content.py `staged`), which changes neither its training hash nor its data split.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpool.protocol.content import adapters_tree, data_tree, model_tree, staged, tree_names
from dpool.protocol.jobspec import JobFileError, JobSpec, data_location, model_location, parse_job
from dpool.protocol.messages import Message
from dpool.protocol.stage_messages import (
    ACCEPT_S,
    CACHE_ROWS_MAX,
    CacheRow,
    JobStage,
    NodeStaged,
    StageAccept,
    StageSource,
)
from dpool.staging.cache import Cache, CacheFull
from dpool.staging.channel import FetchError, Source, Stager
from dpool.staging.manifest import HashCache, ManifestError, differences, scan

PROGRESS_S = 0.5  # a fetching node reports its progress this often
LIST_EVERY_S = 5.0  # a fetching node sends its cache listing (what it holds of the tree) this often: `dpctl cache`
MANIFEST_WAIT_S = 30.0  # for a holder's manifest, to name the file of this node's copy that differs
NAMES_KEPT = 64  # jobs whose staged folders an error is translated for (an export may come after the end)
NO_JOB = "*"  # node.staged about no job: only this node's data channel and holdings
FULL_FINE_TUNE_FACTOR = 4.0  # weights, gradients and two Adam moments
ADAPTER_FACTOR = 1.2  # weights and a little for the adapters and activations
MEMORY_SHARE = 0.9  # of the machine's memory a model may be estimated to take


def asked_content(msg: JobStage) -> list[str]:
    """The content digests a job.stage's spec names (sorted), echoed in every answer to it: the
    coordinator tells an answer about the job as it was from one about the job as it is."""
    content = msg.spec.get("content")
    if not isinstance(content, dict):
        return []
    return sorted(v for k in ("data", "model", "adapters") if isinstance(v := content.get(k), str))[:3]


class Unfit(Exception):
    """This node cannot serve the job; the message says why, for `dpctl nodes` and the events."""


@dataclass(slots=True)
class Staged:
    """What this node serves a job from: its trees' folders here (None: the job's own path)."""

    data: Path | None = None
    model: Path | None = None
    adapters: Path | None = None
    digests: tuple[tuple[str, str], ...] = ()  # (the job's key, the content it names) of each tree served by content


class NodeStaging:
    def __init__(
        self, state_dir: Path, *, bind: str | None, memory_bytes: int, keys: Any = None,
        cache_max: int | None = None, log: Any,
    ) -> None:
        self.log, self.memory_bytes = log, memory_bytes
        self.cache = Cache(state_dir / "cache", max_bytes=cache_max)
        self.cache.trim()  # a budget lowered since the last run applies now, not at the next fetch
        self.hashes = HashCache(state_dir / "cache" / "hashes.sqlite")
        self.stager = Stager(self.cache, bind=bind, keys=keys, authorize=self.authorize if keys is not None else None, may_put=self.may_put, log=log)
        self.key = keys.public.decode() if keys is not None else ""
        self.endpoint = ""
        self.jobs: dict[str, Staged] = {}
        self.names: collections.OrderedDict[str, list[tuple[str, str]]] = collections.OrderedDict()  # job -> tree_names, kept past its end (exports)
        self.sources: dict[str, list[StageSource]] = {}  # digest -> holders, as the coordinator said last
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.verifying: dict[str, asyncio.Task[None]] = {}  # job -> its full check (`verify`)
        self.pruning: asyncio.Task[None] | None = None
        self.asked: dict[str, JobStage] = {}  # job -> the job.stage its running check answers
        self.next_check: dict[str, tuple[JobStage, Callable[[Message], None]]] = {}  # a newer question, asked when that check ends
        self.sources_changed = asyncio.Event()  # set when job.stage names holders
        self.fetching: dict[str, set[str]] = {}  # job -> the digests it is fetching here
        self.rates: dict[str, float | None] = {}  # job -> the pace its fetches keep (None: unpaced)
        self.peers: set[str] = set()  # the pool's node keys (z85), which may read this node's data channel
        self.uploads: dict[str, tuple[str, set[str], float]] = {}  # client key -> (its name, digests it may put, until)

    def start(self) -> str:
        self.endpoint = self.stager.start()
        return self.endpoint

    def stop(self) -> None:
        for t in [*self.tasks.values(), *self.verifying.values()]:
            t.cancel()
        if self.pruning is not None:
            self.pruning.cancel()
        self.stager.stop()

    # -- who may use this node's data channel (a pool with keys; without, everyone on the link) ------

    def authorize(self, key: str) -> str | None:
        """At each handshake and request: the pool's nodes read; a client the coordinator named
        (stage.accept) puts what it submitted; any other key is refused."""
        if key in self.peers:
            return "node:peer"
        upload = self.uploads.get(key)
        if upload is not None and time.monotonic() < upload[2]:
            return f"client:{upload[0]}"
        return None

    def may_put(self, role: str, digest: str) -> bool:
        name = role.partition(":")[2]
        now = time.monotonic()
        return any(n == name and digest in digests and now < until for n, digests, until in self.uploads.values())

    def accept(self, msg: StageAccept) -> None:
        _, digests, _ = self.uploads.get(msg.key, (msg.client, set(), 0.0))
        self.uploads[msg.key] = (msg.client, digests | set(msg.digests), time.monotonic() + ACCEPT_S)
        self.log.info("staging.upload_accepted", client=msg.client, digests=[d[:12] for d in msg.digests])

    def holds(self) -> list[str]:
        return sorted(e.digest for e in self.cache.entries(held=False) if e.complete)[:16]

    def hello(self) -> NodeStaged:
        """What this node serves and its cache holds, for the coordinator (sent after it
        registers, and after a prune)."""
        return NodeStaged(job=NO_JOB, state="ready", holds=self.holds(), endpoint=self.endpoint, key=self.key, cached=self.cached())

    def cached(self) -> list[CacheRow]:
        return [
            CacheRow(digest=e.digest, bytes=e.bytes, files=e.files, last_used=max(0.0, e.last_used), complete=e.complete, pinned=bool(e.pinned_by), adopted=e.adopted, held=e.held)
            for e in self.cache.entries()[:CACHE_ROWS_MAX]
        ]

    def announce_drops(self, send: Callable[[Message], None]) -> None:
        """When an adopted folder turns out gone or changed (a peer asked for its chunks, a job
        used it), send this node's holdings again: the pool stops naming it as a source, and a
        fetch that counted on it looks elsewhere instead of waiting on it."""
        loop = asyncio.get_running_loop()

        def dropped(digest: str) -> None:  # from the data channel's thread, or the loop's
            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is stopping
                loop.call_soon_threadsafe(lambda: send(self.hello()))

        self.cache.on_adoption_dropped(dropped)

    def on_prune(self, send: Callable[[Message], None]) -> None:
        """stage.prune, in a task: every tree no live job here uses goes (what it frees is logged),
        then the node's holdings are sent. Off the agent's loop, so a slow disk does not hold the
        node's other messages (its heartbeats go on regardless); a prune asked while one runs is
        answered by that one."""
        if self.pruning is None or self.pruning.done():
            self.pruning = asyncio.create_task(self._prune(send))

    async def _prune(self, send: Callable[[Message], None]) -> None:
        freed = await asyncio.to_thread(self.cache.prune)
        self.log.info("cache.pruned", freed_bytes=freed)
        send(self.hello())

    def localize(self, job: str, spec: JobSpec) -> JobSpec:
        got = self.jobs.get(job)
        return spec if got is None else staged(spec, got.data, got.model, got.adapters)

    async def recheck(self, job: str, send: Callable[[Message], None], *, full: bool = False) -> str | None:
        """Before a group of the job starts here: are the trees this node serves it from still the
        content the job names? A file edited, replaced or removed since it was staged (here, or in
        the user's own folder the node serves it from) shows in its stat: the cache's check. None
        when they are; else what changed, and the job is staged here again (the content fetched
        from the pool, or this node found unfit, naming the file). Without it the trainer found
        the difference only against rank 0's copy, and blamed the other nodes when rank 0's was
        the one that changed. `full`: every file hashed, whatever its stat (`verify`)."""
        got = self.jobs.get(job)
        if got is None:
            return None
        for key, digest in got.digests:
            try:
                folder, problem = await asyncio.to_thread(functools.partial(self.cache.check, digest, full=full))
            except Exception as e:  # a full or failing disk: this job on this node, never the daemon
                self.log.exception("job.recheck_failed", job=job, key=key)
                folder, problem = None, f"cannot check it: {e}"
            if folder is not None:
                continue
            why = problem or "no longer held here"
            self.log.warning("job.staged_copy_changed", job=job, key=key, digest=digest[:12], problem=why)
            self.jobs.pop(job, None)
            asked = self.asked.get(job)
            if asked is not None:
                self.on_stage(asked, send)
            return f"{key}: this node's copy changed since it was staged ({why}); the node stages the job again (fetching the job's files where its copy is the pool's, else sitting the job out where its own folder now differs)"
        return None

    def verify(self, job: str, send: Callable[[Message], None]) -> None:
        """A trainer of the job found its copy here not the job's content (its ranks compared
        theirs, trainer/sameinput.py): hash every file this node serves it from, in a task. Damage a stat cannot show (bytes changed with their times put back, a
        disk's) is found so, and the job staged here again: without it the node sat the job out
        for good, or trained on the damage where its copy was the only one."""
        if job not in self.jobs or (job in self.verifying and not self.verifying[job].done()):
            return
        self.verifying[job] = asyncio.create_task(self._verify(job, send))

    async def _verify(self, job: str, send: Callable[[Message], None]) -> None:
        started = time.monotonic()
        changed = await self.recheck(job, send, full=True)
        self.log.info("job.verified", job=job, seconds=round(time.monotonic() - started, 3), intact=changed is None, problem=changed)

    def named(self, job: str, text: str) -> str:
        """`text` (a trainer's error) with the folders this node staged the job's sources in
        replaced by the paths the user gave."""
        for folder, given in self.names.get(job, ()):
            text = text.replace(folder, given)
        return text

    def ended(self, job: str) -> bool:
        """The job is over: its trees may be evicted. Whether this node had staged it."""
        had = self.jobs.pop(job, None) is not None or job in self.tasks
        for digest in self.fetching.pop(job, set()):
            if not any(digest in ds for ds in self.fetching.values()):
                self.stager.cancel(digest)  # no live job here needs it now; its verified chunks stay
        self.cache.unpin(job)
        self.rates.pop(job, None)
        self.next_check.pop(job, None)
        self.asked.pop(job, None)
        for task in (self.tasks.pop(job, None), self.verifying.pop(job, None)):
            if task is not None:
                task.cancel()
        return had

    # -- job.stage -----------------------------------------------------------------------------

    def on_stage(self, msg: JobStage, send: Callable[[Message], None]) -> None:
        """job.stage: (re)start the check unless one runs; new sources reach a running fetch."""
        for s in msg.sources:
            self.sources.setdefault(s.digest, [])
        for digest in {s.digest for s in msg.sources}:
            self.sources[digest] = [s for s in msg.sources if s.digest == digest]
        if msg.sources:
            self.sources_changed.set()
        for digest in {s.digest for s in msg.sources}:
            self.stager.set_rate(digest, msg.rate_bps or None)  # a fetch under way follows the pace too
        self.rates[msg.job] = msg.rate_bps or None
        running = self.tasks.get(msg.job)
        if running is not None and not running.done():
            if msg.spec != self.asked[msg.job].spec:
                # The job changed while this node checked it (the pool named the content another
                # node found): that check's answer is about the old job, so this one is checked next.
                self.next_check[msg.job] = (msg, send)
            return
        self.asked[msg.job] = msg
        task = self.tasks[msg.job] = asyncio.create_task(self._stage(msg, send))
        task.add_done_callback(lambda _t, job=msg.job: self._check_ended(job))

    def _check_ended(self, job: str) -> None:
        queued = self.next_check.pop(job, None)
        if queued is not None and job in self.tasks:  # not if the job ended meanwhile
            self.on_stage(*queued)

    async def _stage(self, msg: JobStage, send: Callable[[Message], None]) -> None:
        found: dict[str, str] = {}  # a job without [content]: what this node found at its paths
        asked = asked_content(msg)

        listed = [-LIST_EVERY_S]  # when the cache listing was last sent with a fetch under way

        def say(state: str, reason: str | None = None, done: int = 0, total: int = 0, rate: float = 0.0) -> None:
            final = state in ("ready", "unfit")  # the listing changes with a fetch's end, and as it goes:
            now = time.monotonic()  # a fetch's tree is listed (partial, what is held of it) every LIST_EVERY_S
            fetching = state == "staging" and total > 0 and now - listed[0] >= LIST_EVERY_S
            if fetching:
                listed[0] = now
            send(NodeStaged(job=msg.job, state=state, reason=reason, done_bytes=done, total_bytes=total, rate_bps=rate,
                            holds=self.holds(), endpoint=self.endpoint, key=self.key, cached=self.cached() if final or fetching else None,
                            found_data=found.get("data") if final else None, found_model=found.get("model") if final else None,
                            asked=asked))

        say("checking")
        t0 = time.monotonic()
        fetched = [0]  # bytes this check fetched
        try:
            spec = parse_job(msg.spec, source=f"job {msg.job}")
            got = Staged()
            got.data = await self._tree(msg.job, spec, "data", say, fetched, found)
            got.model = await self._tree(msg.job, spec, "model", say, fetched, found)
            got.adapters = await self._adapters(msg.job, spec, say, fetched)
            self._check_model(spec, got.model)
            named = (("data.source", spec.content.data), ("model.path", spec.content.model), ("model.adapters", spec.content.adapters))
            got.digests = tuple((key, d) for key, d in named if d is not None)
        except (Unfit, JobFileError) as e:
            self.log.warning("node.unfit", job=msg.job, reason=str(e))
            say("unfit", str(e)[:4000])
            return
        except Exception as e:  # a bug costs this job on this node, never the daemon
            self.log.exception("stage.failed", job=msg.job)
            say("unfit", f"staging failed on this node: {type(e).__name__}: {e}"[:4000])
            return
        self.jobs[msg.job] = got
        names = tree_names(spec, got.data, got.model, got.adapters)
        names.sort(key=lambda n: len(n[0]), reverse=True)  # a folder inside another is replaced first
        self.names[msg.job] = names
        self.names.move_to_end(msg.job)
        while len(self.names) > NAMES_KEPT:
            self.names.popitem(last=False)
        self.log.info("job.staged", job=msg.job, data=str(got.data) if got.data else None, model=str(got.model) if got.model else None, seconds=round(time.monotonic() - t0, 3))
        say("ready", done=fetched[0], total=fetched[0])

    async def _tree(self, job: str, spec: JobSpec, what: str, say: Callable[..., None], fetched: list[int], found: dict[str, str]) -> Path | None:
        """The folder this node serves the job's `what` tree from (None: the job's own path)."""
        key = "data.source" if what == "data" else "model.path"
        given = spec.data.source if what == "data" else spec.model.path
        digest = spec.content.data if what == "data" else spec.content.model
        if what == "model" and spec.model.kind != "mlx_lm":
            return None
        if what == "data" and spec.data.source == "stdlib":
            return None
        if what == "data" and digest is None and spec.model.kind == "mlx_lm" and data_location(spec)[0] != "dir":
            return None  # a Hugging Face dataset id (no folder of that name where it was submitted): each worker loads it
        local = await asyncio.to_thread(data_tree if what == "data" else model_tree, spec)
        if digest is None:
            if local is None and not (what == "model" and model_location(spec)[0] == "repo"):
                where = spec.resolved_source() if what == "data" else model_location(spec)[1]
                raise Unfit(f"{key} = {given!r}: no such files on this machine ({where})")
            if local is not None:
                # The job was submitted from a machine without these files: this node names what
                # it found, and serves it, so the pool can bring it to the nodes that lack it.
                root, files = local
                mine = await asyncio.to_thread(scan, root, files, hashes=self.hashes)
                self.cache.put_manifest(mine.to_bytes())
                self.cache.adopt(mine.digest, root)
                found[what] = mine.digest
            return None
        return await self._serve(job, digest, key, local, say, fetched)

    async def _serve(self, job: str, digest: str, key: str, local: tuple[Path, list[Path]] | None,
                     say: Callable[..., None], fetched: list[int]) -> Path | None:
        """The folder of tree `digest` here: the cache's copy, this node's own copy at the job's
        path when it matches (None: served from where it is), or a fetch from the pool."""
        self.cache.pin(digest, job)
        held = await asyncio.to_thread(self.cache.tree, digest)  # checked intact: may hash a file whose stat moved
        if held is not None:
            return held
        if local is not None:
            root, files = local
            mine = await asyncio.to_thread(scan, root, files, hashes=self.hashes)
            if mine.digest == digest:
                self.cache.put_manifest(mine.to_bytes())
                self.cache.adopt(digest, root)
                return None  # served from where it is
            raise Unfit(f"{key}: {await self._difference(digest, root)}")
        self.fetching.setdefault(job, set()).add(digest)
        try:
            return await self._fetch(digest, key, say, fetched, self.rates.get(job))
        finally:
            self.fetching.get(job, set()).discard(digest)

    async def _adapters(self, job: str, spec: JobSpec, say: Callable[..., None], fetched: list[int]) -> Path | None:
        """The folder this node serves the adapters a job starts from (None: the job's own path).
        Named by content only where the job was submitted from a machine that holds them; else
        each node needs them at the job's path."""
        if spec.model.kind != "mlx_lm" or spec.model.adapters is None:
            return None
        local = await asyncio.to_thread(adapters_tree, spec)
        digest = spec.content.adapters
        if digest is None:
            if local is None:
                raise Unfit(f"model.adapters = {spec.model.adapters!r}: no adapters on this machine ({spec.resolve(spec.model.adapters)})")
            return None
        return await self._serve(job, digest, "model.adapters", local, say, fetched)

    async def _difference(self, digest: str, root: Path) -> str:
        """The first file of `root` that differs from the submitted tree (its manifest fetched
        from a holder when this node has none)."""
        manifest = self.cache.manifest(digest)
        deadline = time.monotonic() + MANIFEST_WAIT_S
        while manifest is None and time.monotonic() < deadline:
            if not self._sources(digest)():
                # No holder named yet (it may be checking its own copy now): the coordinator sends
                # job.stage again when one appears.
                self.sources_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.sources_changed.wait(), max(0.0, deadline - time.monotonic()))
                continue
            # A fetch gets the manifest first (into the cache); it is stopped once that is there.
            future = self.stager.fetch(digest, self._sources(digest))
            while manifest is None and not future.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # polled: the cache has no awaitable for a manifest's arrival
                manifest = self.cache.manifest(digest)
            self.stager.cancel(digest)
            manifest = manifest or self.cache.manifest(digest)
            if manifest is None and future.done():
                self.sources.pop(digest, None)  # those holders could not give it: wait for others
        if manifest is None:
            return f"the files at {root} are not the submitted ones (content {digest[:12]}), and no holder could say which differs"
        diffs = await asyncio.to_thread(differences, root, manifest, hashes=self.hashes)
        if not diffs:
            return f"the files at {root} hold extra files beside the submitted ones (content {digest[:12]})"
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        return f"{diffs[0]}{more}, at {root}; the job's files are other ones (content {digest[:12]})"

    def _sources(self, digest: str) -> Callable[[], list[Source]]:
        def current() -> list[Source]:
            return [Source(s.endpoint, s.key.encode() if s.key else None, s.node) for s in self.sources.get(digest, [])]
        return current

    async def _fetch(self, digest: str, key: str, say: Callable[..., None], fetched: list[int], rate: float | None) -> Path:
        try:
            future = self.stager.fetch(digest, self._sources(digest), rate_bps=rate)
        except CacheFull as e:
            raise Unfit(f"{key}: no room in this node's cache: {e}") from None
        wrapped = asyncio.wrap_future(future)
        say("staging")  # at once: the coordinator places this node in the chain of fetchers
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=PROGRESS_S)
            if done:
                break
            p = self.stager.progress(digest)
            if p is not None:
                say("staging", done=p.done_bytes, total=p.total_bytes, rate=p.rate_bps)
        try:
            tree = wrapped.result()
            p = self.stager.progress(digest)
            manifest = self.cache.manifest(digest)
            fetched[0] += p.done_bytes if p is not None else manifest.total_bytes if manifest is not None else 0
            return tree
        except CacheFull as e:
            raise Unfit(f"{key}: no room in this node's cache: {e}") from None
        except (FetchError, ManifestError, OSError) as e:
            raise Unfit(f"{key}: could not fetch the job's files: {e}") from None

    def _check_model(self, spec: JobSpec, staged_model: Path | None) -> None:
        """An mlx_lm model whose folder is here: its config loads, and it fits in memory."""
        if spec.model.kind != "mlx_lm":
            return
        where, path = model_location(spec)
        folder = staged_model or (Path(path) if where == "dir" else None)
        if folder is None:
            return  # a repo id mlx-lm resolves in the trainer
        try:
            config = json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            raise Unfit(f"model.path = {spec.model.path!r}: no config.json in {folder}") from None
        except (OSError, ValueError) as e:
            raise Unfit(f"model.path = {spec.model.path!r}: config.json does not load: {e}") from None
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise Unfit(f"model.path = {spec.model.path!r}: config.json names no model_type")
        weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        factor = FULL_FINE_TUNE_FACTOR if spec.model.fine_tune == "full" else ADAPTER_FACTOR
        need = weights * factor
        if self.memory_bytes and need > MEMORY_SHARE * self.memory_bytes:
            gb = 1 << 30
            raise Unfit(
                f"model.path: training it ({spec.model.fine_tune}) needs about {need / gb:.1f} GiB "
                f"(weights {weights / gb:.1f} GiB), this machine has {self.memory_bytes / gb:.1f} GiB"
            )
