"""Which nodes can serve which job, and where each job's content is: the coordinator's side of
staging. Pure: no socket, no file, no clock of its own; the pool asks it and carries out what it
returns (`Send`, `Record`).

A job that names files (a data path, an mlx_lm model) is served only by nodes that said so: the
pool sends each live node `job.stage`; the node checks its copy at the job's paths, or fetches the
content into its cache from the nodes that hold it, and answers `node.staged` ("checking",
"staging" with its progress, "ready", or "unfit" with why). Only ready nodes get ranks of it. A
job of the built-in corpus ('stdlib') needs no files: every node serves it until a rank of it
fails there with bad input (`unfit`: the trainer's exit 2).

A node that cannot serve a job sits that job out (`node.unfit`, once per reason); it is asked
again after RECHECK_S (its files may have appeared), whenever it registers again, and, if its
fetch of the job's content failed, as soon as another node comes to hold that content. The job
fails at once when every live node is unfit for it (`hopeless`): a deterministic error never
loops through restarts.

Sources: each `job.stage` names the nodes that hold the job's content, complete first, then the
nodes fetching it that started before the asking node (a chain: each fetcher reads from the one
ahead of it while that one fetches, so N nodes stage in about the time of one), and is sent again
to the nodes still fetching whenever a holder appears or goes.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dpool.daemon.records import Record, Send
from dpool.protocol.jobspec import JobSpec
from dpool.protocol.messages import JobDoc
from dpool.protocol.payloads import StageRow
from dpool.protocol.stage_messages import (
    SOURCES_MAX,
    CacheRow,
    JobStage,
    NodeStaged,
    StageOfferReply,
    StagePeers,
    StageSource,
)

TRAINING_RATE_BPS = 10e6  # a fetch whose sources train is paced to this by default (bench/staging.py: 10 MB/s kept a 3-rank group within 1.1x of its step time on 2 cores; 25 MB/s did not)
DIGITS = re.compile(r"(?<![\w./-])\d+(?![\w./-])")  # the figures of an unfit reason (not the digits in a name), left out when two are compared
RECHECK_S = 30.0  # an unfit node is asked again this long after it said so (its files may have appeared)
CHECK_WAIT_S = 10.0  # a job's first group waits this long at most for nodes still checking their files
ASK_TIMEOUT_S = 30.0  # a node that has not answered job.stage at all by then is asked again


class FitState(enum.StrEnum):
    ASKED = "asked"  # job.stage sent, no answer yet
    CHECKING = "checking"
    STAGING = "staging"
    READY = "ready"
    UNFIT = "unfit"


@dataclass(slots=True)
class Fit:
    state: FitState
    since: float  # when it entered this state (ASKED: when asked)
    reason: str | None = None
    done: int = 0
    total: int = 0
    rate: float = 0.0
    started: float = 0.0  # when it began fetching (its place in the chain)
    fetch_failed: bool = False  # UNFIT from STAGING: its fetch failed; asked again when the content's holders change
    told: bool = False  # STAGING: its `node.staging` event is recorded (once the bytes to fetch are known)
    unsaid: bool = False  # UNFIT, its `node.unfit` held back: another node's answer may yet name the content it lacks
    said: str | None = None  # the reason of the last `node.unfit` said for it since it was last ready (said once)


@dataclass(slots=True)
class Channel:
    endpoint: str
    key: str = ""
    holds: set[str] = field(default_factory=set)
    cached: list[CacheRow] = field(default_factory=list)  # its cache, as it said last


@dataclass(frozen=True, slots=True)
class Found:
    """A node found the files of a job that names no content (it was submitted from a machine
    without them): the pool may name the job's content by them, so the nodes lacking them fetch."""

    job: str
    node: str
    data: str | None
    model: str | None


def needs_files(spec: JobSpec) -> bool:
    """Whether a node must check files before it serves the job (the built-in corpus needs none)."""
    return spec.model.kind == "mlx_lm" or spec.data.source != "stdlib"


def same_reason(a: str | None, b: str | None) -> bool:
    """Whether two unfit reasons say the same thing: equal but for their figures (a cache without
    room says how many bytes each time it is asked; it is still the one reason, said once)."""
    return a == b or (a is not None and b is not None and DIGITS.sub("#", a) == DIGITS.sub("#", b))


def unnamed(spec: JobSpec) -> bool:
    """Whether the job's content may yet be named by a node's answer: it was submitted from a
    machine without its files (no digest for a tree it uses)."""
    return (spec.data.source != "stdlib" and spec.content.data is None) or (spec.model.kind == "mlx_lm" and spec.content.model is None)


def digests(spec: JobSpec) -> list[str]:
    return [d for d in (spec.content.data, spec.content.model, spec.content.adapters) if d is not None]


class Fitness:
    def __init__(self, training_rate_bps: float = TRAINING_RATE_BPS) -> None:
        self.training_rate_bps = training_rate_bps  # 0: never paced
        self.busy: set[str] = set()  # nodes running a group now (the pool sets it before it asks)
        self.fits: dict[str, dict[str, Fit]] = {}  # job id -> node -> where it stands
        self.channels: dict[str, Channel] = {}  # node -> its data channel and what it holds
        self.jobs: dict[str, tuple[set[str], JobSpec, JobDoc]] = {}
        self.keys_sent: list[str] = []  # the node keys last sent in stage.peers  # live job -> its content digests, spec, doc

    # -- questions the pool asks -------------------------------------------------------------

    def eligible(self, job_id: str, spec: JobSpec, node: str) -> bool:
        fit = self.fits.get(job_id, {}).get(node)
        if not needs_files(spec):
            return fit is None or fit.state is not FitState.UNFIT
        return fit is not None and fit.state is FitState.READY

    def unfit_reason(self, job_id: str, node: str) -> str | None:
        fit = self.fits.get(job_id, {}).get(node)
        return fit.reason if fit is not None and fit.state is FitState.UNFIT else None

    def checking(self, job_id: str, nodes: list[str], now: float) -> bool:
        """Whether some of `nodes` are still checking their files for the job (asked, or hashing
        what they have), for less than CHECK_WAIT_S: a job starts with every node that is about
        to be ready rather than start small and restart to grow a second later. A node fetching
        is not waited for (that takes as long as the bytes take)."""
        fits = self.fits.get(job_id, {})
        return any(f.state in (FitState.ASKED, FitState.CHECKING) and now - f.since < CHECK_WAIT_S for n in nodes if (f := fits.get(n)) is not None)

    def hopeless(self, job_id: str, nodes: list[str]) -> str | None:
        """One line naming why no node can serve the job, when every one of `nodes` (the live,
        usable ones) is unfit for it; else None (some node can, or may yet)."""
        fits = self.fits.get(job_id, {})
        if not nodes or any(n not in fits or fits[n].state is not FitState.UNFIT for n in nodes):
            return None
        return "no node can serve this job: " + "; ".join(f"{n}: {fits[n].reason}" for n in sorted(nodes))

    def rows(self, job_id: str, now: float) -> list[StageRow]:
        """`status JOB --json`'s "staging": nodes not (yet) ready for the job."""
        out = []
        for node, fit in sorted(self.fits.get(job_id, {}).items()):
            if fit.state is FitState.READY and fit.total == 0:
                continue  # ready without fetching anything: nothing to show
            state = "checking" if fit.state in (FitState.ASKED, FitState.CHECKING) else str(fit.state)
            left = max(0, fit.total - fit.done)
            eta = round(min(left / fit.rate, 1e11), 3) if fit.state is FitState.STAGING and fit.rate > 0 else None
            out.append(StageRow(node=node, state=state, bytes=fit.done, total=fit.total, rate_bps=round(fit.rate, 1), eta_s=eta, reason=fit.reason))
        return out

    def node_reasons(self, node: str) -> list[str]:
        return [f"unfit for {job}: {fits[node].reason}" for job, fits in self.fits.items() if node in fits and fits[node].state is FitState.UNFIT]

    # -- events ------------------------------------------------------------------------------

    def ask(self, now: float, job_id: str, spec: JobSpec, doc: JobDoc, nodes: list[str]) -> list[Send]:
        """job.stage to each of `nodes` (live, usable) that has not been asked, whose answer is
        overdue, or that has been unfit for RECHECK_S."""
        if not needs_files(spec):
            return []
        fits = self.fits.setdefault(job_id, {})
        out = []
        for node in nodes:
            fit = fits.get(node)
            due = (
                fit is None
                or (fit.state is FitState.UNFIT and now - fit.since >= RECHECK_S)
                or (fit.state is FitState.ASKED and now - fit.since >= ASK_TIMEOUT_S)
            )
            if not due:
                continue
            if fit is None or fit.state is not FitState.UNFIT:
                fits[node] = Fit(FitState.ASKED, now)
            else:
                fit.since = now  # stays unfit (and out of the plan) until it answers otherwise
            out.append(Send(node, self._stage_msg(job_id, spec, doc, node)))
        return out

    def _stage_msg(self, job_id: str, spec: JobSpec, doc: JobDoc, node: str) -> JobStage:
        """job.stage for `node`: its sources, paced while any of them trains (their links carry a
        ring's gradients: staging beside it must not slow its steps), and the keys of the pool's
        nodes, which may read its own data channel."""
        sources = self._sources(job_id, spec, node)
        rate = self.training_rate_bps if any(s.node in self.busy for s in sources) else 0.0
        return JobStage(job=job_id, spec=doc, sources=sources, rate_bps=rate)

    def _peers(self) -> list[Send]:
        """stage.peers to every node with a data channel, when the pool's node keys changed."""
        keys = sorted({ch.key for ch in self.channels.values() if ch.key})
        if keys == self.keys_sent:
            return []
        self.keys_sent = keys
        return [Send(n, StagePeers(peers=keys)) for n in sorted(self.channels)]

    def staged(self, now: float, node: str, msg: NodeStaged, spec: JobSpec | None, doc: JobDoc | None) -> list[Record | Send | Found]:
        """A node's answer. Its data channel and holdings are kept whatever the job; the job's
        part only while the job is live (`spec` not None)."""
        actions: list[Record | Send | Found] = []
        if msg.endpoint:
            ch = self.channels.setdefault(node, Channel(msg.endpoint, msg.key))
            ch.endpoint, ch.key = msg.endpoint, msg.key
            gained = set(msg.holds) - ch.holds
            ch.holds |= set(msg.holds)
            if msg.cached is not None:  # the whole listing: what it no longer holds goes too
                ch.cached = msg.cached
                ch.holds = {r.digest for r in msg.cached if r.complete}
            if gained:
                actions += self._resend(gained, exclude=node, failed_too=True)
            actions += self._peers()  # a new node's key: every node learns it may read from it
        if spec is None or doc is None:
            return actions
        fits = self.fits.setdefault(msg.job, {})
        old = fits.get(node)
        state = FitState(msg.state)
        older = msg.asked is not None and msg.asked != sorted(digests(spec))
        stale = older or (msg.found_data is not None and spec.content.data not in (None, msg.found_data)) or (
            msg.found_model is not None and spec.content.model not in (None, msg.found_model)
        )
        if stale:
            # An answer about the job before it named its content (another node found it
            # meanwhile): "unfit" for lacking files it can now fetch, or other files than those
            # the job names now. It does not count. A final one is answered with the question
            # as it is now (the node may have dropped it while it checked the old one, an older
            # dpd does), and that answer counts; progress of the old check is ignored.
            if state in (FitState.READY, FitState.UNFIT):
                fits[node] = Fit(FitState.ASKED, now)
                actions.append(Send(node, self._stage_msg(msg.job, spec, doc, node)))
            return actions
        if old is not None and old.state is FitState.UNFIT and state is FitState.CHECKING:
            # An unfit node asked again (RECHECK_S) checks its files: no verdict yet. It stays
            # out, and a check that ends as the last did (the same reason) says nothing new.
            return actions
        fit = Fit(state, now if old is None or old.state is not state else old.since, msg.reason, msg.done_bytes, msg.total_bytes, msg.rate_bps)
        fit.started = old.started if old is not None and old.started else (now if state is FitState.STAGING else 0.0)
        fit.told = state is FitState.STAGING and old is not None and old.state is FitState.STAGING and old.told
        fit.fetch_failed = state is FitState.UNFIT and old is not None and old.state is FitState.STAGING
        fit.unsaid = state is FitState.UNFIT and old is not None and old.unsaid and same_reason(old.reason, msg.reason)  # still to be said
        fit.said = None if state is FitState.READY or old is None else old.said  # a fetch tried again between two refusals keeps it
        if state is FitState.READY and old is not None and old.state is FitState.STAGING and not fit.rate and now > fit.started > 0:
            fit.rate = msg.total_bytes / (now - fit.started)  # a fetch done: its row shows the pace it kept, not 0
        fits[node] = fit
        data = msg.found_data if spec.content.data is None else None
        model = msg.found_model if spec.content.model is None and spec.model.kind == "mlx_lm" else None
        if state is FitState.READY and (data or model):
            actions.append(Found(msg.job, node, data, model))
        if old is not None and old.state is FitState.STAGING and state is FitState.UNFIT:
            actions += self._resend(set(digests(spec)), exclude=node)  # the fetchers behind it read elsewhere now
        if state is FitState.UNFIT and not fit.unsaid and not same_reason(fit.said, msg.reason):
            # -> UNFIT: the node sits this job out, and says why (once per reason). Not yet where
            # the job names no content and other nodes still check theirs: one of them may find
            # the files, and then this node fetches them instead (it said node.unfit, then
            # node.staged, and trained).
            if unnamed(spec):
                fit.unsaid = True  # said below, once no other node may name the content
            else:
                fit.said = msg.reason
                actions.append(Record(msg.job, "node.unfit", now, {"node": node, "reason": msg.reason or "unfit"}))
        elif state is FitState.READY and old is not None and old.state is FitState.STAGING:
            # STAGING -> READY: it fetched what it lacked (`total_bytes`: how much)
            if not old.told:  # done before it reported a size
                # at `now`, not when it began: the job's events stay in time order (node.staged's
                # `seconds` says how long the fetch took)
                actions.append(Record(msg.job, "node.staging", now, {"node": node, "bytes": msg.total_bytes}))
            actions.append(Record(msg.job, "node.staged", now, {"node": node, "bytes": msg.total_bytes, "seconds": round(now - old.started, 3) if old.started else None}))
        elif state is FitState.STAGING and (old is None or old.state is not FitState.STAGING):
            # its place in the chain is known now: it (and any fetcher behind it) gets its sources
            actions += self._resend(set(digests(spec)), exclude="")
        if state is FitState.STAGING and not fit.told and msg.total_bytes > 0:
            # Said once the fetch knows its size (its first answer comes before the manifest: 0 bytes).
            fit.told = True
            actions.append(Record(msg.job, "node.staging", now, {"node": node, "bytes": msg.total_bytes - msg.done_bytes}))
        named = any(isinstance(a, Found) for a in actions)  # every node is asked again, against it
        if state in (FitState.READY, FitState.UNFIT) and not named:
            actions += self._say_unfit(msg.job, now)  # every node has answered and none named the content
        return actions

    def _others_checking(self, job_id: str, node: str) -> bool:
        return any(f.state in (FitState.ASKED, FitState.CHECKING) for n, f in self.fits.get(job_id, {}).items() if n != node)

    def unfit(self, now: float, job_id: str, node: str, reason: str) -> list[Record]:
        """A rank of the job refused its input on `node` (exit 2): that node sits the job out."""
        fits = self.fits.setdefault(job_id, {})
        old = fits.get(node)
        fit = fits[node] = Fit(FitState.UNFIT, now, reason, said=reason)
        if old is not None and ((old.state is FitState.UNFIT and same_reason(old.reason, reason)) or same_reason(old.said, reason)):
            fit.said = old.said
            return []
        return [Record(job_id, "node.unfit", now, {"node": node, "reason": reason})]

    def node_gone(self, node: str, now: float) -> list[Record | Send]:
        """A node lost or stopped: it serves nothing now, and is asked afresh when it is back. An
        unfit held back for its answer is said now."""
        ch = self.channels.pop(node, None)
        said: list[Record | Send] = []
        for job_id, fits in self.fits.items():
            if fits.pop(node, None) is not None:
                said += self._say_unfit(job_id, now)
        out = self._resend(ch.holds, exclude=node) if ch is not None and ch.holds else []
        return said + out + (self._peers() if ch is not None and ch.key else [])

    def _say_unfit(self, job_id: str, now: float) -> list[Record | Send]:
        """Once no node checks its files any more and none named the content: the node.unfit of
        each node held back for that (`unsaid`)."""
        if self._others_checking(job_id, ""):
            return []
        out: list[Record | Send] = []
        for name, held in sorted(self.fits.get(job_id, {}).items()):
            if held.unsaid and held.state is FitState.UNFIT:
                held.unsaid, held.said = False, held.reason
                out.append(Record(job_id, "node.unfit", now, {"node": name, "reason": held.reason or "unfit"}))
        return out

    def track(self, job_id: str, spec: JobSpec, doc: JobDoc) -> None:
        """A live job that names files: a new holder of its content is sent to its fetchers."""
        if needs_files(spec):
            self.jobs[job_id] = (set(digests(spec)), spec, doc)

    def ask_again(self, job_id: str) -> None:
        """Every node is asked about the job afresh (its content was named meanwhile)."""
        self.fits.pop(job_id, None)

    def forget(self, job_id: str) -> None:
        self.fits.pop(job_id, None)
        self.jobs.pop(job_id, None)

    # -- sources -----------------------------------------------------------------------------

    def offer(self, wanted: list[str], live: list[str], exclude: Sequence[str] = ()) -> StageOfferReply:
        """dpctl is about to submit content `wanted`: what the pool holds already, and the node
        that takes an upload of the rest (the live node with a data channel holding the most of
        it, else the first by name: one copy in; the nodes then fetch it from each other)."""
        held = [d for d in wanted if any(n in live for n in self.holders(d))]
        open_ = sorted((n for n in live if n in self.channels and n not in exclude), key=lambda n: (-len(self.channels[n].holds & set(wanted)), n))
        if len(held) == len(wanted) or not open_:
            return StageOfferReply(held=held)
        ch = self.channels[open_[0]]
        return StageOfferReply(held=held, target=open_[0], endpoint=ch.endpoint, key=ch.key)

    def cache_rows(self, node: str | None) -> list[CacheRow]:
        """`dpctl cache`: each node's trees, as the nodes said last."""
        return [dataclasses.replace(r, node=n) for n, ch in sorted(self.channels.items()) if node in (None, n) for r in ch.cached]

    def holders(self, digest: str) -> list[str]:
        return sorted(n for n, ch in self.channels.items() if digest in ch.holds)

    def _sources(self, job_id: str, spec: JobSpec, asking: str) -> list[StageSource]:
        """Where `asking` reads each digest from: the fetcher just ahead of it in the chain (the
        fetchers of the job in the order they began, names breaking ties), else, first in line or
        not fetching yet, the nodes that hold it all. One source per fetcher in a chain: each
        node's uplink carries the bytes once, so N fetchers take about the time of one."""
        fits = self.fits.get(job_id, {})
        me = fits.get(asking)
        mine = (me.started, asking) if me is not None and me.state is FitState.STAGING and me.started else (float("inf"), asking)
        out: list[StageSource] = []
        for digest in digests(spec):
            complete = [n for n in self.holders(digest) if n != asking]
            ahead = [
                (f.started, n) for n, f in fits.items()
                if n not in complete and f.state is FitState.STAGING and f.started and (f.started, n) < mine and n in self.channels
            ]
            if ahead:
                n = max(ahead)[1]
                ch = self.channels[n]
                out.append(StageSource(digest=digest, node=n, endpoint=ch.endpoint, key=ch.key, partial=True))
                continue
            for n in complete[:SOURCES_MAX]:
                ch = self.channels[n]
                out.append(StageSource(digest=digest, node=n, endpoint=ch.endpoint, key=ch.key))
        return out

    def _resend(self, changed: set[str], exclude: str, failed_too: bool = False) -> list[Send]:
        """job.stage again to each node still fetching content in `changed` (its sources changed);
        with `failed_too` (a node came to hold it whole) also to each whose fetch of it failed (a
        source that went away, a peer that timed out on a busy machine): it may fetch from the new
        holder now rather than sit the job out for RECHECK_S. Once: it is asked again on another
        new holder only if it fails again; never because another node failed or began to fetch
        (two nodes whose fetches fail would ask each other again without end)."""
        out: list[Send] = []
        for job_id, fits in self.fits.items():
            tracked = self.jobs.get(job_id)
            if tracked is None or not (tracked[0] & changed):
                continue
            _, spec, doc = tracked
            for node, fit in fits.items():
                if node == exclude:
                    continue
                if fit.state in (FitState.STAGING, FitState.CHECKING, FitState.ASKED) or (failed_too and fit.fetch_failed):
                    fit.fetch_failed = False
                    out.append(Send(node, self._stage_msg(job_id, spec, doc, node)))
        return out
