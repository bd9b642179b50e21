"""The wire contract: every message round-trips; every malformed frame is a ProtocolError with the
right code (never another exception); WorkerLink speaks it without ever blocking."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import msgpack
import pytest
import zmq
from wire_samples import sample

from dpool.protocol import messages as m
from dpool.protocol.messages import ErrorCode, ProtocolError
from dpool.protocol.payloads import NodeInfo, RankSlot, SampleRow, TrainRow
from dpool.protocol.worker_link import WorkerLink

TRAIN_ROW = {"kind": "train", "step": 11, "loss": 2.5, "lr": 3e-4, "tokens": 192, "tokens_per_s": 3840.0, "world_size": 3, "generation": 2}


def test_every_type_has_exactly_one_message_class() -> None:
    assert set(m.REGISTRY) == set(m.MsgType)
    assert all(cls.TYPE is t for t, cls in m.REGISTRY.items())


@pytest.mark.parametrize("msg_type", list(m.MsgType), ids=str)
def test_round_trip(msg_type: m.MsgType) -> None:
    cls = m.REGISTRY[msg_type]
    msg = sample(cls, random.Random(str(msg_type)))
    frames = msg.to_frames(12345)
    assert len(frames) == 2
    back, msg_id = m.decode(frames)
    assert back == msg and msg_id == 12345 and type(back) is cls
    for f in dataclasses.fields(cls)[:1]:  # frozen: a message is never edited after it is made
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, f.name, None)


def test_defaults_fill_missing_optional_fields() -> None:
    header = msgpack.packb(["dpool", 1, "status", 9])
    msg, _ = m.decode([header, msgpack.packb({})])
    assert msg == m.Status(job=None)


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([msgpack.packb(["dpool", 2, "status", 5]), b"\x80"], ErrorCode.BAD_VERSION),
        ([msgpack.packb(["zmtp", 1, "status", 5]), b"\x80"], ErrorCode.BAD_VERSION),
        ([msgpack.packb(["dpool", 1, "reboot", 5]), b"\x80"], ErrorCode.UNKNOWN_TYPE),
        ([msgpack.packb(["dpool", 1, "status"]), b"\x80"], ErrorCode.BAD_FRAME),
        ([msgpack.packb(["dpool", 1, "status", -1]), b"\x80"], ErrorCode.BAD_FRAME),
        ([b"\xc1", b"\x80"], ErrorCode.BAD_FRAME),
        ([msgpack.packb(["dpool", 1, "status", 5])], ErrorCode.BAD_FRAME),
        ([msgpack.packb(["dpool", 1, "status", 5]), b"\x80", b"\x80"], ErrorCode.BAD_FRAME),
        ([msgpack.packb(["dpool", 1, "status", 5]), b"\x92\x01"], ErrorCode.BAD_FRAME),  # truncated
        ([msgpack.packb(["dpool", 1, "status", 5]), msgpack.packb([1])], ErrorCode.BAD_BODY),
        ([msgpack.packb(["dpool", 1, "status", 5]), msgpack.packb({1: "x"})], ErrorCode.BAD_FRAME),  # strict_map_key
        ([msgpack.packb(["dpool", 1, "status", 5]), msgpack.packb({"job": 7})], ErrorCode.BAD_BODY),
        ([msgpack.packb(["dpool", 1, "status", 5]), msgpack.packb({"jobb": "x"})], ErrorCode.BAD_BODY),
        ([msgpack.packb(["dpool", 1, "cancel", 5]), msgpack.packb({})], ErrorCode.BAD_BODY),
        ([msgpack.packb(["dpool", 1, "node.progress", 5]), msgpack.packb({"job": "j", "generation": True, "rank": 0, "step": 1, "loss": 1.0, "tokens": 1, "seconds": 1.0})], ErrorCode.BAD_BODY),
        ([b"\x00" * (m.MAX_HEADER_BYTES + 1), b"\x80"], ErrorCode.TOO_LARGE),
        ([msgpack.packb(["dpool", 1, "status", 5]), b"\x80" * (m.MAX_BODY_BYTES + 1)], ErrorCode.TOO_LARGE),
    ],
)
def test_malformed_frames_are_protocol_errors(frames: list[bytes], code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as e:
        m.decode(frames)
    assert e.value.code == code
    if code is not ErrorCode.TOO_LARGE and code is not ErrorCode.BAD_FRAME:
        assert e.value.msg_id == 5  # the error reply can name the request it answers
    reply, reply_id = m.decode(m.error_frames(e.value))
    assert isinstance(reply, m.Error) and reply.code == code and reply_id == e.value.msg_id


def test_ints_are_not_bools_and_floats_accept_ints() -> None:
    frames = [msgpack.packb(["dpool", 1, "worker.progress", 1]), msgpack.packb({"step": 3, "loss": 2, "tokens": 10, "seconds": 1})]
    msg, _ = m.decode(frames)
    assert msg == m.WorkerProgress(step=3, loss=2.0, tokens=10, seconds=1.0) and isinstance(msg.loss, float)


def test_random_bytes_never_raise_anything_but_protocol_errors() -> None:
    rng = random.Random(1)
    good = m.NodeRegister(name="a", incarnation="x", info=NodeInfo(slots=1)).to_frames(3)
    codes: dict[str, int] = {}
    decoded = 0
    for _ in range(3000):
        frames = [rng.randbytes(rng.randrange(40)) for _ in range(rng.randrange(0, 4))]
        if rng.random() < 0.5:
            frames = [good[0], good[1][: rng.randrange(len(good[1]) + 1)]]
        try:  # anything but a ProtocolError escaping here fails the test
            m.decode(frames)
            decoded += 1
        except ProtocolError as e:
            codes[e.code] = codes.get(e.code, 0) + 1
    assert decoded < 50 and codes.get("bad_frame", 0) > 1000


def test_oversized_message_is_refused_when_encoding() -> None:
    with pytest.raises(ProtocolError) as e:
        m.NodeLogs(job="j", generation=1, rank=0, lines=["x" * 1024] * (m.MAX_BODY_BYTES // 1024 + 1)).to_frames()
    assert e.value.code == ErrorCode.TOO_LARGE


def test_worker_link_reports_and_receives_stop(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/w.sock"
    router.bind(addr)
    monkeypatch.delenv("DPOOL_WORKER_ADDR", raising=False)
    assert WorkerLink.from_env() is None
    monkeypatch.setenv("DPOOL_WORKER_ADDR", addr)
    link = WorkerLink.from_env()
    assert link is not None
    try:
        link.hello(rank=1, world_size=3, generation=2, pid=4242, resume_step=10)
        link.waiting(11)
        link.progress(step=11, loss=2.5, tokens=192, seconds=0.05)
        link.metric({"kind": "train", "step": 11})  # not a metrics row: dropped and counted, never raised
        link.metric(dict(TRAIN_ROW, loss=float("nan")))  # a diverged step: its loss travels as null
        link.sample({"step": 11, "text": "def f():"})
        link.checkpoint(step=15, seconds=0.2)
        got = []
        for _ in range(6):
            assert router.poll(5000)
            frames = router.recv_multipart()
            got.append(m.decode(frames[1:])[0])
        peer = frames[0]
        assert got == [
            m.WorkerHello(rank=1, world_size=3, generation=2, pid=4242, resume_step=10),
            m.WorkerWaiting(step=11),
            m.WorkerProgress(step=11, loss=2.5, tokens=192, seconds=0.05),
            m.WorkerMetric(row=TrainRow.from_wire({**TRAIN_ROW, "loss": None})),
            m.WorkerSample(row=SampleRow(step=11, text="def f():")),
            m.WorkerCheckpoint(step=15, seconds=0.2),
        ]
        assert link.dropped == 1  # the row that was not a metrics row
        assert link.stop_requested() is False
        router.send_multipart([peer, b"garbage"])  # ignored, never raised into the training loop
        router.send_multipart([peer, *m.WorkerStop().to_frames()])
        deadline = 200
        while not link.stop_requested() and deadline:
            router.poll(10)
            deadline -= 1
        assert link.stop_requested() is True
    finally:
        link.close()
        router.close()
        ctx.term()


def test_worker_link_never_blocks_without_a_daemon(tmp_path: Any) -> None:
    link = WorkerLink(f"ipc://{tmp_path}/nobody.sock")
    try:
        for i in range(20_000):  # more than the send queue holds
            link.progress(step=i, loss=1.0, tokens=1, seconds=0.01)
        assert link.dropped > 0
        assert link.stop_requested() is False
    finally:
        link.close()


def test_group_start_packs_its_shared_fields_once_and_as_a_plain_map() -> None:
    """group.start to each node of a group shares the job file and the hostfile: packed once, the
    body is byte for byte what packing the whole map writes, and decodes to the same message."""
    hostfile = [[f"10.0.0.{i}:5000"] for i in range(50)]
    spec = {"name": "j", "train": {"steps": 3}}
    starts = [
        m.GroupStart(job="j-1", generation=1, spec=spec, ranks=[RankSlot(slot=0, rank=r)], shares=[1] * 50, hostfile=hostfile)
        for r in range(3)
    ]
    for msg in starts:
        header, body = msg.to_frames(7)
        assert body == msgpack.packb(msg.to_body(), use_bin_type=True, default=lambda v: v.to_wire())
        assert m.decode([header, body], {m.MsgType.GROUP_START}) == (msg, 7)
    # A new hostfile (a new launch) is packed anew, not taken from the cache.
    other = [[f"10.0.1.{i}:6000"] for i in range(50)]
    moved = m.GroupStart(job="j-1", generation=2, spec=spec, ranks=[RankSlot(slot=0, rank=0)], shares=[1] * 50, hostfile=other)
    assert m.decode(moved.to_frames(), {m.MsgType.GROUP_START})[0].hostfile == other
