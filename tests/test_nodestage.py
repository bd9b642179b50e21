"""A node's answers to job.stage (daemon/nodestage.py), on a real NodeStaging: its cache on disk,
its data channel bound on loopback, its checks run as asyncio tasks.

A node checks a job once at a time. When the pool names the content another node found while this
node still checks the job as it was, the node's answer is about the old job; the newer question
must be checked after it, or the pool hears "unfit" for a job that has since changed and waits a
recheck (30 s) for a node that could fetch the files at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog
from jobs import job

from dpool.daemon.nodestage import NodeStaging
from dpool.protocol.jobspec import parse_job
from dpool.protocol.messages import Message
from dpool.protocol.stage_messages import JobStage, NodeStaged


def _doc(source: str) -> dict[str, Any]:
    return parse_job(job("corpus", data={"source": source})).to_dict()


def _answers(tmp_path: Path, questions: list[JobStage]) -> list[NodeStaged]:
    """The node.staged messages a fresh node sends for `questions`, asked one right after the other."""
    sent: list[NodeStaged] = []

    async def run() -> None:
        node = NodeStaging(tmp_path / "state", bind="tcp://127.0.0.1:0", memory_bytes=1 << 30, log=structlog.get_logger())
        node.start()
        try:
            def send(msg: Message) -> None:
                assert isinstance(msg, NodeStaged)
                sent.append(msg)

            for q in questions:
                node.on_stage(q, send)  # the first check has not run yet when the next question comes
            while any(not t.done() for t in node.tasks.values()) or node.next_check:
                await asyncio.wait([t for t in node.tasks.values() if not t.done()] or [asyncio.sleep(0)])
        finally:
            node.stop()

    asyncio.run(run())
    return sent


def test_a_changed_job_asked_during_a_check_is_checked_after_it(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text to train on\n" * 50)
    old = JobStage(job="j-1", spec=_doc(str(tmp_path / "missing" / "*.txt")))
    new = JobStage(job="j-1", spec=_doc(str(corpus / "*.txt")))
    sent = _answers(tmp_path, [old, new])
    finals = [(s.state, s.found_data is not None) for s in sent if s.state in ("ready", "unfit")]
    assert finals == [("unfit", False), ("ready", True)], [(s.state, s.reason) for s in sent]
    assert "no such files" in (sent[1].reason or "")


def test_the_same_question_again_during_a_check_is_not_checked_twice(tmp_path: Path) -> None:
    q = JobStage(job="j-1", spec=_doc(str(tmp_path / "missing" / "*.txt")))
    sent = _answers(tmp_path, [q, q, q])  # the pool sends job.stage again with fresh sources
    assert [s.state for s in sent] == ["checking", "unfit"]


def test_a_fetch_under_way_is_in_the_cache_listing_the_node_sends_as_it_starts(tmp_path: Path) -> None:
    """`dpctl cache NODE` said the node held nothing while it was a third into a fetch: the listing
    was sent only with a fetch's end. Now the first progress that knows the tree's size carries it,
    partial, with what is held of it."""
    from dpool.protocol.stage_messages import StageSource

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"d{i}.txt").write_text(f"document {i} " * 20_000)
    sent: dict[str, list[NodeStaged]] = {"a": [], "b": []}

    async def run() -> None:
        a = NodeStaging(tmp_path / "a", bind="tcp://127.0.0.1:0", memory_bytes=1 << 30, log=structlog.get_logger())
        b = NodeStaging(tmp_path / "b", bind="tcp://127.0.0.1:0", memory_bytes=1 << 30, log=structlog.get_logger())
        a.start()
        b.start()
        try:
            a.on_stage(JobStage(job="j-1", spec=_doc(str(corpus / "*.txt"))), sent["a"].append)
            await a.tasks["j-1"]
            (found,) = [s.found_data for s in sent["a"] if s.state == "ready"]
            assert found is not None
            spec = parse_job(job("corpus", data={"source": str(tmp_path / "elsewhere" / "*.txt")}, content={"data": found})).to_dict()
            total = sum(p.stat().st_size for p in corpus.iterdir())
            b.on_stage(JobStage(job="j-1", spec=spec, sources=[StageSource(digest=found, node="a", endpoint=a.endpoint)], rate_bps=total / 1.5), sent["b"].append)
            await b.tasks["j-1"]
        finally:
            a.stop()
            b.stop()

    asyncio.run(run())
    staging = [s for s in sent["b"] if s.state == "staging" and s.cached is not None]
    assert staging, [(s.state, s.total_bytes) for s in sent["b"]]
    (row,) = [r for r in staging[0].cached or [] if not r.complete]
    assert row.bytes > 0 and row.held is not None and row.held < row.bytes
    assert sent["b"][-1].state == "ready" and all(r.complete for r in sent["b"][-1].cached or [])
