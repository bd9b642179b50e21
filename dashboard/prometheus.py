"""The pool in Prometheus' exposition format: `/metrics` of the dashboard's server.

    body, content_type = render(nodes, jobs, events)

`nodes`, `jobs` and `events` are what `dpctl nodes --json`, `dpctl status --json` and
`dpctl events JOB --json` print (INTERFACE.md), `events` keyed by job id. The figures are read from
that snapshot by a collector of our own, in a registry made for the one render (never the process's
global one), and written by prometheus_client, which owns the format (text, or OpenMetrics when the
scraper asks for it).

Names carry the `dpool_` prefix and base units (seconds, bytes). Labels stay of low cardinality:
`state` and `cause` take a handful of values, `node` one per machine, and `job` only the jobs of
`series_jobs`: those not ended (at most MAX_ACTIVE) and the MAX_ENDED that ended last. A pool with
3,000 past jobs exposes a few dozen job series, not 3,000. The server fetches events for those jobs
alone.

Counters and the histogram are computed from the events each render: a job's restarts can only
grow while it is shown, and when it leaves the set its series go (Prometheus reads a series that
ends as ended, not as a reset). That is why the recovery histogram has a `job` label: summed over
jobs in a query (`sum by (le) (rate(dpool_recovery_seconds_bucket[1h]))`) it stays right as old
jobs drop out, where one histogram for the whole pool would shrink and read as a reset.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

NODE_STATES = ("idle", "busy", "draining", "lost", "yielding")  # always exposed, 0 when none: a series that exists
JOB_STATES = ("queued", "starting", "running", "recovering", "succeeded", "failed", "cancelled")
ENDED = frozenset({"succeeded", "failed", "cancelled"})
WITH_GROUP = frozenset({"starting", "running", "recovering"})  # the states in which a job has a group of workers
CAUSES = ("failure", "membership")  # group.resumed's cause (daemon/jobstate.py Cause); absent: failure
MAX_ACTIVE = 100  # jobs not ended that get series of their own (running ones first)
MAX_ENDED = 10  # and the jobs that ended last
# Seconds from a group's interruption to its next generation's first step: a killed worker is
# seconds, a lost node tens of seconds, a queue wait for capacity minutes.
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
ACTIVE_ORDER = {"running": 0, "recovering": 1, "starting": 2, "queued": 3}


def render(
    nodes: Sequence[Mapping[str, Any]], jobs: Sequence[Mapping[str, Any]], events: Mapping[str, Sequence[Mapping[str, Any]]],
    accept: str = "", *, up: bool = True, answered_at: float | None = None, known: bool = True,
) -> tuple[bytes, str]:
    """The exposition body of the snapshot and its content type (`accept`: the scraper's Accept
    header; OpenMetrics when it asks for it, else Prometheus' text format). `up`: whether the
    coordinator answered the dashboard's newest poll; `answered_at`: the unix time it last did;
    `known`: whether there is a snapshot at all (False before the coordinator first answered:
    then only dpool_up is said, not a pool of 0 nodes and 0 jobs)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(nodes, jobs, events, up=up, answered_at=answered_at, known=known))
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type


def series_jobs(jobs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ids of the jobs that get series of their own: the jobs not ended (running first, then
    recovering, starting, queued; newest first within each), at most MAX_ACTIVE, and the MAX_ENDED
    that ended last."""
    active = [j for j in jobs if j.get("state") not in ENDED]
    active.sort(key=lambda j: (ACTIVE_ORDER.get(j.get("state"), 9), -_num(j.get("submitted"), 0.0)))
    ended = [j for j in jobs if j.get("state") in ENDED]
    ended.sort(key=lambda j: -_num(j.get("finished") or j.get("submitted"), 0.0))
    return [str(j["id"]) for j in active[:MAX_ACTIVE] + ended[:MAX_ENDED] if isinstance(j.get("id"), str)]


class PoolCollector(Collector):
    """The metric families of one snapshot of the pool."""

    def __init__(self, nodes: Sequence[Mapping[str, Any]], jobs: Sequence[Mapping[str, Any]], events: Mapping[str, Sequence[Mapping[str, Any]]],
                 *, up: bool = True, answered_at: float | None = None, known: bool = True) -> None:
        self.nodes, self.jobs, self.events = nodes, jobs, events
        self.up, self.answered_at, self.known = up, answered_at, known

    def collect(self) -> Iterator[Metric]:
        # Whether the rest is the pool as it is: a dashboard that lost its coordinator serves the
        # last snapshot it had (or none), which alone reads as a pool that went quiet.
        yield GaugeMetricFamily("dpool_up", "1 when the coordinator answered the dashboard's newest poll, else 0 (the rest is then its last snapshot).", value=1 if self.up else 0)
        answered = GaugeMetricFamily("dpool_coordinator_answered_timestamp_seconds", "Unix time the coordinator last answered the dashboard.", unit="seconds")
        if self.answered_at is not None:
            answered.add_metric([], self.answered_at)
        yield answered
        if not self.known:
            return  # nothing read yet: a count of 0 would be a claim about the pool, which nobody has seen
        yield from self._nodes()
        shown = set(series_jobs(self.jobs))
        yield from self._jobs([j for j in self.jobs if j.get("id") in shown])
        yield from self._recoveries([j for j in self.jobs if j.get("id") in shown])

    def _nodes(self) -> Iterator[Metric]:
        count = Counter(str(n.get("state")) for n in self.nodes)
        family = GaugeMetricFamily("dpool_nodes", "Nodes of the pool, by state.", labels=["state"])
        for state in (*NODE_STATES, *sorted(count.keys() - set(NODE_STATES))):
            family.add_metric([state], count[state])
        yield family
        memory = GaugeMetricFamily("dpool_node_memory_bytes", "A node's memory.", labels=["node"], unit="bytes")
        slots = GaugeMetricFamily("dpool_node_slots", "Worker slots a node offers.", labels=["node"])
        busy = GaugeMetricFamily("dpool_node_busy_slots", "A node's slots that run a worker.", labels=["node"])
        age = GaugeMetricFamily("dpool_node_heartbeat_age_seconds", "Seconds since the coordinator last heard from a node.", labels=["node"], unit="seconds")
        for n in self.nodes:
            name = str(n.get("name"))
            for family_, key in ((memory, "memory_bytes"), (slots, "slots"), (busy, "busy_slots"), (age, "heartbeat_age_s")):
                value = _num(n.get(key))
                if value is not None:
                    family_.add_metric([name], value)
        yield from (memory, slots, busy, age)

    def _jobs(self, shown: list[Mapping[str, Any]]) -> Iterator[Metric]:
        count = Counter(str(j.get("state")) for j in self.jobs)
        family = GaugeMetricFamily("dpool_jobs", "Jobs the coordinator knows, by state.", labels=["state"])
        for state in (*JOB_STATES, *sorted(count.keys() - set(JOB_STATES))):
            family.add_metric([state], count[state])
        yield family
        gauges = [
            (GaugeMetricFamily("dpool_job_step", "The job's newest trained step.", labels=["job"]), lambda j: j.get("step")),
            (GaugeMetricFamily("dpool_job_steps", "The steps the job trains in all.", labels=["job"]), lambda j: j.get("steps")),
            (GaugeMetricFamily("dpool_job_loss", "The job's newest training loss.", labels=["job"]), lambda j: j.get("loss")),
            (GaugeMetricFamily("dpool_job_val_loss", "The job's newest validation loss.", labels=["job"]), lambda j: j.get("val_loss")),
            (GaugeMetricFamily("dpool_job_tokens_per_second", "Tokens a second the job's workers train, together.", labels=["job"]), _tokens_per_s),
            (GaugeMetricFamily("dpool_job_world_size", "Workers in the job's group; no sample while it has none (queued, ended).", labels=["job"]), _world_size),
            (GaugeMetricFamily("dpool_job_generation", "Groups the job has started (1: never restarted).", labels=["job"]), lambda j: j.get("generation")),
            (GaugeMetricFamily("dpool_job_eta_seconds", "Seconds the running job has left at its recent pace.", labels=["job"], unit="seconds"), lambda j: j.get("eta_s")),
            (GaugeMetricFamily("dpool_job_comm_share", "Predicted share of a step the running group spends in all_sum (the ring model on its probe).",
                               labels=["job"]), lambda j: j.get("comm_share")),
            (GaugeMetricFamily("dpool_job_comm_share_measured", "Share of the job's newest group's recent sync steps spent communicating, as timed (its all_sum, less the wait for the slowest rank).",
                               labels=["job"]), lambda j: (j.get("comm") or {}).get("measured_share")),
        ]
        for j in shown:
            for family_, read in gauges:
                value = _num(read(j))
                if value is not None:
                    family_.add_metric([str(j["id"])], value)
        yield from (g for g, _ in gauges)

    def _recoveries(self, shown: list[Mapping[str, Any]]) -> Iterator[Metric]:
        restarts = CounterMetricFamily(
            "dpool_job_restarts", "Groups the job resumed after an interruption, by cause: a failure, or a membership change (a node joined or drained).",
            labels=["job", "cause"],
        )
        recovery = HistogramMetricFamily(
            "dpool_recovery_seconds", "Seconds from a group's interruption to the next group's first step.", labels=["job", "cause"], unit="seconds",
        )
        for j in shown:
            job = str(j["id"])
            seconds: dict[str, list[float]] = {cause: [] for cause in CAUSES}
            for e in _resumed(self.events.get(job, ())):
                cause = str(e.get("cause") or "failure")
                took = _num(e.get("seconds_since_failure"))
                seconds.setdefault(cause, []).append(took if took is not None and took >= 0 else math.nan)
            for cause, values in seconds.items():
                restarts.add_metric([job, cause], len(values))
                timed = [v for v in values if not math.isnan(v)]
                # every job and cause, 0 before the first: a series that appears at 1 is a
                # recovery that increase() and rate() never count
                recovery.add_metric([job, cause], _buckets(timed), sum(timed))
        yield restarts
        yield recovery


def _resumed(events: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for e in events:
        if isinstance(e, Mapping) and e.get("kind") == "group.resumed":
            yield e


def _buckets(values: list[float]) -> list[tuple[str, float]]:
    """Cumulative bucket counts, as the exposition writes them (`le`, the last one +Inf)."""
    out = [(_le(bound), float(sum(1 for v in values if v <= bound))) for bound in RECOVERY_BUCKETS]
    return [*out, ("+Inf", float(len(values)))]


def _le(bound: float) -> str:
    return repr(float(bound))


def _world_size(j: Mapping[str, Any]) -> Any:
    """The size of the job's group while it has one. A queued or ended job has none: status's
    world_size is then its last group's (or 0 before any), which as a gauge of workers would
    read either as workers still held or as a known 0; it is left out, as any unknown value is."""
    return j.get("world_size") if j.get("state") in WITH_GROUP else None


def _tokens_per_s(j: Mapping[str, Any]) -> float | None:
    """The running group's tokens a second: the sum over its workers (none while it runs none)."""
    workers = j.get("workers")
    if j.get("state") != "running" or not isinstance(workers, list) or not workers:
        return None
    rates = [_num(w.get("tokens_per_s")) if isinstance(w, Mapping) else None for w in workers]
    return sum(r for r in rates if r is not None)


def _num(value: Any, default: float | None = None) -> float | None:
    """A number of the snapshot as a float; `default` for null, a bool, text or anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)
