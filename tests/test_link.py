"""Knowing the link: a group's start-up probe, the pool's table of measured links, and each job's
predicted share of a step spent in all_sum (README "Communication").

The pure parts (the prediction, the warning, where the figures go) are tested as functions; the
probe on real ring groups of local processes; the whole path (trainer -> dpd -> coordinator ->
dpctl) with real daemons. No test asserts a speed: loopback's figures are whatever the machine
gives; the tests check they are there, positive and used.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ring
from conftest import LocalPool, Processes
from jobs import write_job

from dpool.client import comm as client_comm
from dpool.daemon.jobstate import JobMachine, JobState
from dpool.daemon.links import Links, neighbours
from dpool.daemon.plan import GroupPlan, Slot
from dpool.daemon.records import Job, Record
from dpool.protocol import messages as m
from dpool.protocol.commmodel import (
    COMM_BOUND,
    Link,
    bound_warning,
    gpt_params,
    measured_compute,
    ring_seconds,
    step_comm,
)
from dpool.protocol.jobspec import parse_job
from dpool.protocol.link_messages import NodeLink, RingProbe, WorkerLink
from dpool.protocol.payloads import CommRow, JobStatus, LinkRow, NodeRow

GBIT = 1e9


def spec(name: str = "j", **sections: dict) -> object:
    return parse_job({"name": name, **sections}, source="test")


# -- the model: what a step sends, and when it is too much ------------------------------------------


def test_a_step_sends_its_parameters_in_the_sync_dtype_every_step_or_once_per_inner_steps() -> None:
    link = Link(GBIT, 1e-4)
    sync = step_comm(1_000_000, 3, link)
    assert sync.nbytes == 4_000_000 and sync.every == 1
    assert sync.seconds == pytest.approx(ring_seconds(4_000_000, 3, link, 32 << 20))
    half = step_comm(1_000_000, 3, link, dtype="bfloat16")
    assert half.nbytes == 2_000_000 and half.seconds < sync.seconds
    diloco = step_comm(1_000_000, 3, link, mode="diloco", inner_steps=50)
    assert diloco.every == 50 and diloco.seconds == pytest.approx(sync.seconds / 50)


def test_compute_is_the_median_step_less_its_all_sum_in_sync_mode_and_the_whole_inner_step_in_diloco() -> None:
    link = Link(GBIT, 0.0)
    sync = step_comm(1_000_000, 2, link)
    assert measured_compute(1.0, sync) == pytest.approx(1.0 - sync.seconds)
    assert measured_compute(sync.seconds / 2, sync) == 0.0  # never negative
    diloco = step_comm(1_000_000, 2, link, mode="diloco", inner_steps=10)
    assert measured_compute(1.0, diloco) == 1.0


def test_the_warning_names_the_link_and_what_to_do_only_above_half() -> None:
    assert bound_warning(COMM_BOUND, "n1 <-> n2") is None
    text = bound_warning(0.72, "n1 <-> n2 (94 Mbit/s, 1.2 ms)")
    assert text is not None and "72%" in text and "n1 <-> n2 (94 Mbit/s, 1.2 ms)" in text
    for advice in ("LoRA", "global_batch", "Thunderbolt", 'mode = "diloco"'):
        assert advice in text


def test_the_gpt_parameter_count_is_the_models_own() -> None:
    from mlx.utils import tree_flatten

    from dpool.trainer.data import VOCAB_SIZE
    from dpool.trainer.model import build_model

    assert client_comm.GPT_VOCAB == VOCAB_SIZE
    for model in ({"layers": 2, "dim": 64, "heads": 4, "context": 64}, {"layers": 1, "dim": 32, "heads": 2, "context": 32, "positions": "learned"}):
        s = parse_job({"name": "g", "model": model}, source="test")
        built = build_model(s.model, VOCAB_SIZE, 0)
        real = sum(v.size for _, v in tree_flatten(built.trainable_parameters()))
        assert client_comm.trainable_params(s) == real
        assert gpt_params(s.model.layers, s.model.dim, VOCAB_SIZE, s.model.context, s.model.positions == "learned") == real


def test_lora_parameters_come_from_the_weights_or_from_config_json(tmp_path: Path) -> None:
    import mlx.core as mx

    config = {"hidden_size": 16, "num_hidden_layers": 3, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = {"source": str(tmp_path)}
    s = parse_job({"name": "l", "data": data, "model": {"kind": "mlx_lm", "path": str(tmp_path), "lora_rank": 4, "lora_layers": 2}}, source="test")
    # From config.json (llama-style): q 16->16, k and v 16->8, o 16->16, gate and up 16->32, down 32->16.
    per_block = 4 * ((16 + 16) + 2 * (16 + 8) + (16 + 16) + 2 * (16 + 32) + (32 + 16))
    assert client_comm.trainable_params(s) == 2 * per_block
    # From the weights' shapes, when there are any: these name two linear layers per block.
    weights = {}
    for i in range(3):
        weights[f"model.layers.{i}.self_attn.q_proj.weight"] = mx.zeros((16, 16))
        weights[f"model.layers.{i}.mlp.down_proj.weight"] = mx.zeros((16, 32))
        weights[f"model.layers.{i}.input_layernorm.weight"] = mx.zeros((16,))
    weights["model.embed_tokens.weight"] = mx.zeros((100, 16))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    assert client_comm.trainable_params(s) == 2 * 4 * ((16 + 16) + (32 + 16))
    full = parse_job({"name": "f", "data": data, "model": {"kind": "mlx_lm", "path": str(tmp_path), "fine_tune": "full"}}, source="test")
    assert client_comm.trainable_params(full) == 3 * (256 + 512 + 16) + 1600
    missing = parse_job({"name": "x", "data": data, "model": {"kind": "mlx_lm", "path": str(tmp_path / "nowhere")}}, source="test")
    assert client_comm.trainable_params(missing) is None


# -- the pool's table and a running job's prediction (pure) ----------------------------------------


def job_on(nodes: tuple[str, ...], name: str = "j", generation: int = 1, **sections: dict) -> Job:
    j = Job(id=f"{name}-abcdef", name=name, spec=parse_job({"name": name, **sections}, source="test"), submitted_at=0.0,
            machine=JobMachine(state=JobState.RUNNING))
    j.plan = GroupPlan(job=j.id, generation=generation, ranks=tuple(Slot(n, 0) for n in nodes), shares=(1,) * len(nodes), hostfile=())
    return j


def probe(mbit: float, ms: float) -> RingProbe:
    return RingProbe(bandwidth_bps=mbit * 1e6, latency_s=ms / 1e3, bytes=4 << 20, seconds=0.02)


def test_a_ring_figure_goes_to_each_pair_of_neighbouring_nodes_once_and_the_newest_wins() -> None:
    assert neighbours(("a", "b", "c")) == [("a", "b"), ("b", "c"), ("a", "c")]
    assert neighbours(("a", "a", "b")) == [("a", "b")]  # ranks that share a node are no link
    assert neighbours(("a", "a")) == []
    links = Links()
    three = job_on(("a", "b", "c"))
    events = links.observe(10.0, three, NodeLink(job=three.id, generation=1, rank=0, ring=probe(900, 0.2), params=1000))
    assert [e.kind for e in events] == ["group.link"]
    rows = links.rows("b", now=12.0)
    assert [(r.peer, r.bandwidth_bps, r.age_s, r.source) for r in rows] == [("a", 900e6, 2.0, "ring"), ("c", 900e6, 2.0, "ring")]
    two = job_on(("a", "b"), name="k")
    links.observe(20.0, two, NodeLink(job=two.id, generation=1, rank=0, ring=probe(90, 2.0), params=1000))
    assert {r.peer: r.bandwidth_bps for r in links.rows("a", now=21.0)} == {"b": 90e6, "c": 900e6}
    # The link named as a ring's pace is its slowest known pair.
    assert links.pace(("a", "b", "c")) == ("a", "b")


def test_only_rank_0_of_the_current_generation_reports_the_ring() -> None:
    links = Links()
    j = job_on(("a", "b"), generation=3)
    assert links.observe(1.0, j, NodeLink(job=j.id, generation=2, rank=0, ring=probe(900, 0.2), params=10)) == []
    assert links.observe(1.0, j, NodeLink(job=j.id, generation=3, rank=1, ring=probe(900, 0.2), params=10)) == []
    assert links.pairs == {}


def share_of(links: Links, j: Job, steps: list[float], gen: int = 1) -> list[Record]:
    """Rank 0's next steps took `steps` seconds each (j.step moves as the pool moves it)."""
    events: list[Record] = []
    for s in steps:
        j.step += 1
        events += links.step(100.0, j, gen, j.step, s)
    return events


def test_a_running_jobs_share_uses_its_probe_its_parameters_and_its_measured_steps() -> None:
    links = Links()
    j = job_on(("a", "b"))
    assert links.share(j) == (None, None)  # nothing reported yet
    links.observe(1.0, j, NodeLink(job=j.id, generation=1, rank=0, ring=probe(1000, 0.1), params=2_500_000))
    share, comm = links.share(j)
    assert share is None and comm is not None and comm.compute_s is None  # no step measured yet
    expected = step_comm(2_500_000, 2, Link(1000e6, 1e-4))
    assert comm.bytes == 10_000_000 and comm.seconds == pytest.approx(expected.seconds, rel=1e-4)
    share_of(links, j, [0.5, 0.5, 0.5])
    share, comm = links.share(j)
    compute = 0.5 - expected.seconds
    assert share == pytest.approx(expected.seconds / (expected.seconds + compute), rel=1e-3)
    assert comm.link == ["a", "b"] and comm.ranks == 2 and comm.warning is None
    # A group of one sums nothing.
    alone = job_on(("a",), name="one")
    assert links.share(alone) == (0.0, None)
    # Not running: no share, the last group's figures stay to read.
    j.machine = JobMachine(state=JobState.SUCCEEDED)
    share, comm = links.share(j)
    assert share is None and comm is not None and comm.compute_s is not None


def test_a_sync_jobs_timed_all_sums_give_the_measured_share_and_the_compute_the_prediction_rests_on() -> None:
    """Rank 0's rows time each step's all_sum (metrics' all_sum_s): the share they measure stands
    beside the prediction, and a step's compute is what it spent outside its all_sum, whatever the
    probe says of the link (a probe that read the link 3x too slow would otherwise have left the
    compute at 0 and the share at 100%)."""
    links = Links()
    j = job_on(("a", "b"))
    links.observe(1.0, j, NodeLink(job=j.id, generation=1, rank=0, ring=probe(100, 0.1), params=2_500_000))
    predicted = step_comm(2_500_000, 2, Link(100e6, 1e-4)).seconds  # 0.89 s
    share_of(links, j, [0.5] * 5)  # steps of 0.5 s: less than the predicted all_sum alone
    assert links.share(j)[0] == 1.0 and links.share(j)[1].measured_share is None
    links.timed(j, 1, 9.0, 8.9)  # the generation's first row compiles: not kept
    for seconds, all_sum in [(0.5, 0.3), (0.6, 0.35), (0.5, 0.28)]:
        links.timed(j, 1, seconds, all_sum)
    share, comm = links.share(j)
    assert comm is not None and comm.measured_share == pytest.approx(0.583, abs=1e-3)  # median of 0.6, 0.583, 0.56
    assert comm.compute_s == pytest.approx(0.22)  # median of 0.2, 0.25, 0.22
    assert share == pytest.approx(predicted / (predicted + 0.22), rel=1e-3)
    # Rows of another generation, or that no step could hold (a hostile node's), are not taken.
    for row in [(2, 0.5, 0.1), (1, 0.5, 0.9), (1, 0.0, 0.0), (1, 0.0, 0.0), (1, 1e9, 1.0), (1, -1.0, 0.0)]:
        links.timed(j, *row)
    assert links.share(j)[1].measured_share == comm.measured_share


def test_a_rows_communicating_time_is_its_all_sum_less_rank_0s_wait_for_the_slowest_rank() -> None:
    """Rank 0 computes its share in 0.2 s, rank 1 its twice larger one in 0.4 s: rank 0 waits 0.2 s
    of its 0.3 s in the all_sum for rank 1, and the step communicated for 0.1 s."""
    from dpool.protocol.commmodel import timed_comm

    assert timed_comm(0.3, 600, [1, 2], [1000.0, 1000.0]) == pytest.approx(0.1)
    assert timed_comm(0.3, 600, [2, 1], [1000.0, 1000.0]) == pytest.approx(0.3)  # rank 0 the slowest: no wait
    assert timed_comm(0.3, 600, None, None) == 0.3  # a row without the ranks' speeds: all of it
    assert timed_comm(0.1, 600, [1, 2], [1000.0, 1.0]) == 0.0  # never below 0
    assert timed_comm(0.3, 600, [1], [1000.0, 1000.0]) == pytest.approx(0.3)  # shares that do not fit: equal ones


def test_a_comm_bound_job_gets_one_event_naming_the_slow_link() -> None:
    links = Links()
    j = job_on(("a", "b", "c"), sync={"dtype": "float32"})
    links.observe(1.0, j, NodeLink(job=j.id, generation=1, rank=0, ring=probe(10, 5.0), params=5_000_000))
    comm_s = step_comm(5_000_000, 3, Link(10e6, 5e-3)).seconds
    events = share_of(links, j, [comm_s * 1.2] * 40)  # compute is a fifth of the all_sum
    assert [e.kind for e in events] == ["job.comm_bound"]
    e = events[0]
    assert e.fields["share"] > 0.5 and e.fields["bandwidth_bps"] == 10_000_000 and " <-> " in e.fields["link"]
    assert "diloco" in e.fields["warning"]
    share, comm = links.share(j)
    assert share is not None and share > 0.5 and comm is not None and comm.warning
    # Diloco on the same link: one all_sum per 100 steps is no longer comm-bound.
    d = job_on(("a", "b", "c"), name="d", sync={"mode": "diloco", "inner_steps": 100, "replicas": 3})
    links.observe(1.0, d, NodeLink(job=d.id, generation=1, rank=0, ring=probe(10, 5.0), params=5_000_000))
    assert share_of(links, d, [comm_s * 0.2] * 40) == []


def test_a_job_whose_timed_all_sums_take_most_of_its_steps_is_warned_whatever_the_probe_predicted() -> None:
    """The probe read the link fast (a 30% share predicted); the steps' own timings say 58%: the job
    spends most of its time in all_sum, and got no warning nor job.comm_bound."""
    links = Links()
    j = job_on(("a", "b"))
    links.observe(1.0, j, NodeLink(job=j.id, generation=1, rank=0, ring=probe(1000, 0.1), params=2_500_000))
    links.timed(j, 1, 9.0, 8.9)  # the first row compiles: not kept
    for seconds, all_sum in [(0.5, 0.3), (0.6, 0.35), (0.5, 0.28)] * 3:
        links.timed(j, 1, seconds, all_sum)
    events = share_of(links, j, [0.5] * 8)
    share, comm = links.share(j)
    assert share is not None and share < 0.5 and comm is not None and comm.measured_share is not None and comm.measured_share > 0.5
    assert comm.warning and [e.kind for e in events] == ["job.comm_bound"] and events[0].fields["share"] == pytest.approx(comm.measured_share, abs=1e-3)
    assert comm.warning.startswith("the steps' timed all_sums took about 58% of each step")  # not "would be", by the probe
    assert events[0].fields["predicted_share"] == pytest.approx(share, abs=1e-3) and events[0].fields["measured_share"] == pytest.approx(0.583, abs=1e-3)


def test_a_diloco_warm_up_shows_its_own_share_and_is_not_what_the_comm_bound_check_reads() -> None:
    """The first warmup_steps of a diloco job all_sum every step: while it runs them its share is
    theirs, their all_sum is not taken for compute, and the comm_bound check is about the steps
    after (an all_sum per inner_steps), which is what the job chose."""
    links = Links()
    d = job_on(("a", "b", "c"), name="w", sync={"mode": "diloco", "inner_steps": 100, "replicas": 3, "warmup_steps": 30})
    links.observe(1.0, d, NodeLink(job=d.id, generation=1, rank=0, ring=probe(10, 5.0), params=5_000_000))
    each = step_comm(5_000_000, 3, Link(10e6, 5e-3)).seconds
    compute = each * 0.2  # a warm-up step is five sixths all_sum
    assert share_of(links, d, [compute + each] * 10) == []  # the check at step 8 reads the steps after the warm-up
    share, comm = links.share(d)
    assert comm is not None and comm.every == 1 and comm.compute_s == pytest.approx(compute, rel=1e-3)
    assert share == pytest.approx(each / (each + compute), rel=1e-3) and comm.warning is None  # comm-bound, by the job's choice
    share_of(links, d, [compute + each] * 20 + [compute] * 5)  # step 30 ends the warm-up
    share, comm = links.share(d)
    assert comm is not None and comm.every == 100 and comm.compute_s == pytest.approx(compute, rel=1e-3)
    assert share == pytest.approx(each / 100 / (each / 100 + compute), rel=1e-3) and comm.warning is None
    # The same job without the warm-up's all_sums subtracted would have read 6x the compute.
    assert links.jobs[d.id].steps[0] == (pytest.approx(compute + each), True) and links.jobs[d.id].steps[-1][1] is False


def test_dry_run_forecast_uses_the_slowest_link_between_the_nodes_it_would_use_and_a_measured_step() -> None:
    def node(name: str, links: list[tuple[str, float]]) -> NodeRow:
        return NodeRow(
            name=name, address="", state="idle", platform="", chip="", memory_bytes=0, mlx_version="", backend="", slots=1,
            busy_slots=0, job=None, ranks=[], heartbeat_age_s=0.0, reason=None,
            links=[LinkRow(peer=p, bandwidth_bps=b, latency_s=1e-3, age_s=1.0) for p, b in links],
        )

    nodes = [node("a", [("b", 1e9), ("c", 5e7)]), node("b", [("a", 1e9)]), node("c", [("a", 5e7)])]
    s = parse_job({"name": "big", "workers": {"max": 2}, "model": {"layers": 4, "dim": 256, "heads": 4}}, source="test")
    f = client_comm.forecast(s, nodes, [])
    assert f is not None and f.nodes == ["a", "b"] and f.ranks == 2 and f.pace == ("a", "b")  # c is not used
    assert f.measured_pairs == 1 and f.seconds is not None and f.share is None
    assert any("needs a measured step" in line for line in f.lines()) and f.warning() is None
    s3 = parse_job({"name": "big", "workers": {"max": 3}, "model": {"layers": 4, "dim": 256, "heads": 4}}, source="test")
    f3 = client_comm.forecast(s3, nodes, [])
    assert f3 is not None and f3.pace == ("a", "c") and f3.measured_pairs == 2 and f3.pairs == 3
    assert client_comm.forecast(parse_job({"name": "one", "workers": {"max": 1}}, source="test"), nodes, []).share == 0.0
    # Diloco: one worker per replica at most, one all_sum per inner_steps.
    d = parse_job({"name": "d", "workers": {"max": 3}, "sync": {"mode": "diloco", "replicas": 2, "inner_steps": 10}}, source="test")
    fd = client_comm.forecast(d, nodes, [])
    assert fd is not None and fd.ranks == 2 and fd.every == 10 and any("every 10 steps" in line for line in fd.lines())
    assert not any("warmup_steps" in line for line in fd.lines())
    w = parse_job({"name": "d", "workers": {"max": 3}, "sync": {"mode": "diloco", "replicas": 2, "inner_steps": 10, "warmup_steps": 40}}, source="test")
    fw = client_comm.forecast(w, nodes, [])
    assert fw is not None and fw.warmup == 40 and any("each of the first 40 steps" in line for line in fw.lines()), fw.lines()
    # A job of the same name and size measured its step in float32: the bfloat16 run of it (half
    # the bytes on the wire, the same compute) rests on that step too.
    measured = JobStatus(
        id="big-000001", name="big", state="succeeded", step=10, steps=10, generation=1, world_size=2, workers=[], checkpoint_step=10, loss=None, val_loss=None, error=None,
        submitted=1.0, comm=CommRow(bytes=f.nbytes, every=1, ranks=2, global_batch=16, seconds=0.0, compute_s=0.2, link=["a", "b"], bandwidth_bps=1e9, latency_s=0.0, params=f.params),
    )
    half = parse_job({"name": "big", "workers": {"max": 2}, "model": {"layers": 4, "dim": 256, "heads": 4}, "sync": {"dtype": "bfloat16"}}, source="test")
    fh = client_comm.forecast(half, nodes, [measured])
    assert fh is not None and fh.nbytes == f.nbytes // 2 and fh.compute_s == pytest.approx(0.2 * half.train.global_batch / 16) and fh.compute_from == "job big-000001" and fh.share is not None, fh.lines()
    # a job of that name twice the size, summed in bfloat16 (the same bytes): not this one's step
    other = dataclasses.replace(measured, comm=dataclasses.replace(measured.comm, params=2 * f.params))
    assert client_comm.forecast(half, nodes, [other]).compute_s is None


# -- the wire ------------------------------------------------------------------------------------


def test_link_messages_round_trip_and_out_of_bound_figures_are_refused() -> None:
    msg = NodeLink(job="j-abcdef", generation=2, rank=0, ring=probe(940, 0.25), params=123)
    back, _ = m.decode(msg.to_frames(7))
    assert back == msg
    assert m.decode(WorkerLink(ring=None, params=0).to_frames())[0] == WorkerLink(ring=None, params=0)
    body = {"job": "j-abcdef", "generation": 2, "rank": 0, "params": 1, "ring": {"bandwidth_bps": 0.0, "latency_s": 1e-3, "bytes": 1, "seconds": 0.1}}
    header = m.Message.to_frames(NodeLink(job="j-abcdef", generation=2, rank=0, ring=None, params=1))[0]
    import msgpack

    for bad in ({"bandwidth_bps": 0.0}, {"latency_s": 1e9}, {"bandwidth_bps": float("inf")}):
        frames = [header, msgpack.packb({**body, "ring": {**body["ring"], **bad}})]
        with pytest.raises(m.ProtocolError) as e:
            m.decode(frames)
        assert e.value.code in (m.ErrorCode.BAD_REQUEST, m.ErrorCode.BAD_BODY)


# -- the probe's plan, on a ring whose clock the model drives -------------------------------------


def modelled_probe(mbit: float, ms: float, ranks: int = 3, stalls: dict[int, float] | None = None) -> object:
    """The probe of rank 0 on a ring that takes exactly `ring_seconds` (90% of `mbit`, `ms` one
    way) for each all_sum, plus `stalls[nbytes]` seconds for the first all_sum of that size: the
    schedule of samples it chooses, not MLX, is what is under test."""
    from dpool.trainer.linkprobe import probe

    link, now, stalls = Link(mbit * 1e6, ms / 1e3), [0.0], dict(stalls or {})

    def all_sum(x: object) -> object:
        now[0] += ring_seconds(x.nbytes, ranks, link) + stalls.pop(x.nbytes, 0.0)
        return x  # rank 0's integers are every rank's when the others give 0

    return probe(all_sum, 0, ranks, clock=lambda: now[0])


@pytest.mark.parametrize(("mbit", "ms"), [(10_000, 0.05), (1000, 0.2), (300, 3), (100, 1), (300, 8), (1000, 10), (50, 10), (2000, 5)])
def test_the_probe_reads_a_ring_of_any_latency_within_its_budget(mbit: float, ms: float) -> None:
    """A ring 5-10 ms between hosts (Wi-Fi, a VPN between two homes) pays 20-40 ms of latency per
    all_sum of 3 ranks: the probe's budget counted it, stopped at 16 KiB, where a sample is all
    latency, and read 300 Mbit/s with 8 ms as 12 Mbit/s, 1 Gbit/s with 10 ms as 10."""
    from dpool.trainer.linkprobe import BIG_BYTES, BUDGET_S, LATENCY_SAMPLES, MAX_S

    got = modelled_probe(mbit, ms)
    assert got.bandwidth_bps == pytest.approx(mbit * 1e6, rel=1e-4)
    assert got.latency_s == pytest.approx(ms / 1e3, rel=1e-3)  # a tiny all_sum moves a few bytes too
    assert got.bytes >= min(BIG_BYTES, 256 << 10)  # never a sample that is all latency
    tiny = 4 * ms / 1e3  # 2(n - 1) hops
    assert got.seconds <= min(MAX_S, BUDGET_S * 1.3 + (LATENCY_SAMPLES + 1 + 8) * tiny)


@pytest.mark.parametrize("stalled", [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20])
def test_a_sample_that_waited_out_a_retransmission_is_taken_again(stalled: int) -> None:
    """One lost segment holds an all_sum for TCP's retransmission timeout (200 ms at least): read
    alone, a 300 Mbit/s link with 1 ms read as 25 Mbit/s (3 ranks in network namespaces, tbf).
    The stall is not charged to the budget either: the probe still grows to a buffer that goes
    both ways round the ring, as it does without one."""
    got = modelled_probe(300, 1, stalls={stalled: 0.2})
    assert got.bandwidth_bps == pytest.approx(300e6, rel=1e-4)
    assert got.bytes == modelled_probe(300, 1).bytes == 4 << 20
    assert got.seconds <= 2.0


def test_the_probe_grows_its_sample_until_it_goes_both_ways_round_the_ring() -> None:
    """300 Mbit/s with 3 ms: a 1 MiB sample takes 41 ms of transfer but goes one way round 3 ranks
    (MLX sums both ways from 3 x 512 KiB): the probe takes 4 MiB while the budget allows."""
    assert modelled_probe(300, 3).bytes == 4 << 20
    assert modelled_probe(10_000, 0.05).bytes == 4 << 20  # a fast ring: BIG_BYTES, at once
    assert modelled_probe(10_000, 0.05).seconds < 0.05


# -- the probe, on real ring groups ---------------------------------------------------------------

PROBE_SCRIPT = """
import json
from dpool.trainer.dist import Group
g = Group()
l = g.link
print(json.dumps(None if l is None else {"bps": l.bandwidth_bps, "lat": l.latency_s, "bytes": l.bytes, "s": l.seconds}), flush=True)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_of_a_new_group_times_the_ring_within_its_budget(tmp_path: Path, ranks: int) -> None:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring.free_ports(ranks)]))
    procs = [
        subprocess.Popen([sys.executable, "-c", PROBE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ring.trainer_env({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}))
        for r in range(ranks)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    for out, _ in outs:
        got = json.loads(out.strip().splitlines()[-1])
        assert got["bps"] > 0 and got["lat"] > 0 and got["bytes"] >= 64 << 10
        assert got["s"] < 5.0  # planned within 0.3 s; a loaded CI machine may stretch it, never by this much


# -- end to end: real daemons ----------------------------------------------------------------------


def test_a_two_worker_jobs_status_carries_its_comm_share_and_nodes_show_the_measured_link(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path).start(1, 1)
    job = write_job(tmp_path, "linked", workers={"min": 2, "max": 2}, train={"steps": 100_000})
    job_id = pool.submit(job)
    running = pool.wait_status(job_id, "a comm_share", lambda s: s.comm_share is not None or s.state not in ("queued", "starting", "running"), timeout=120)
    assert running.state == "running", running
    status = pool.dpctl_json("status", job_id)
    assert 0.0 <= status["comm_share"] <= 1.0
    assert status["comm"]["ranks"] == 2 and status["comm"]["bytes"] > 0 and sorted(status["comm"]["link"]) == ["n0", "n1"]
    nodes = {n["name"]: n for n in pool.dpctl_json("nodes")}
    for a, b in (("n0", "n1"), ("n1", "n0")):
        (link,) = nodes[a]["links"]
        assert link["peer"] == b and link["bandwidth_bps"] > 0 and link["latency_s"] > 0 and link["source"] == "ring"
    # Beside the prediction, what the steps' all_sums took them, as rank 0's metrics rows timed it.
    timed = pool.wait_status(job_id, "a measured share", lambda s: s.comm is not None and s.comm.measured_share is not None, timeout=120)
    assert 0.0 <= timed.comm.measured_share < 1.0 and timed.comm.compute_s > 0  # loopback: next to nothing, but timed
    shown = pool.dpctl("status", job_id)
    assert shown.returncode == 0 and "of each step in all_sum (measured " in shown.stdout
    table = pool.dpctl("nodes")
    assert "LINKS" in table.stdout and "Mbit" not in table.stdout  # compact: "n1 940M/0.2ms"
    kinds = [e["kind"] for e in pool.dpctl_json("events", job_id)]
    assert "group.link" in kinds
    # A dry run of the same job now knows the link and the measured step.
    dry = pool.dpctl("submit", str(job), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "communication:" in dry.stderr and "n0 <-> n1" in dry.stderr and "of each step" in dry.stderr
    assert pool.dpctl("cancel", job_id).returncode == 0


# -- a shaped link (network namespaces; needs Linux, root, iproute2 and tc's tbf) -----------------


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


@pytest.fixture
def shaped_pair() -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces joined by a veth pair, each end shaped to 100 Mbit/s with tbf (this
    machine's kernel may lack netem): (namespace, address) of each end."""
    import os
    import shutil

    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("a shaped link needs Linux, root, iproute2 and tc")
    tag = os.getpid() % 10000
    ns, ends = (f"dplk{tag}a", f"dplk{tag}b"), (f"dplk{tag}x", f"dplk{tag}y")
    net = f"10.{230 + os.getpid() % 20}.{os.getpid() // 20 % 250}"
    try:
        for n in ns:
            if _run("ip", "netns", "add", n).returncode != 0:
                pytest.skip("cannot create a network namespace here")
        _run("ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for i, (n, end) in enumerate(zip(ns, ends, strict=True)):
            _run("ip", "link", "set", end, "netns", n)
            _run("ip", "-n", n, "addr", "add", f"{net}.{i + 1}/24", "dev", end)
            _run("ip", "-n", n, "link", "set", end, "up")
            _run("ip", "-n", n, "link", "set", "lo", "up")
            shaped = _run("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", end, "root", "tbf", "rate", "100mbit", "burst", "128kb", "latency", "50ms")
            if shaped.returncode != 0:
                pytest.skip(f"tc tbf is not available here: {shaped.stderr.strip()}")
        yield ns[0], f"{net}.1", ns[1], f"{net}.2"
    finally:
        for n in ns:
            _run("ip", "netns", "delete", n)  # takes its end of the veth pair, and so the pair, with it


def test_a_100_mbit_link_is_measured_within_a_factor_of_2(shaped_pair: tuple[str, str, str, str], tmp_path: Path) -> None:
    ns_a, addr_a, ns_b, addr_b = shaped_pair
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"{addr_a}:29500"], [f"{addr_b}:29501"]]))
    procs = [
        subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", PROBE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ring.trainer_env({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}))
        for r, ns in enumerate((ns_a, ns_b))
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert 50e6 <= got["bps"] <= 200e6, got  # the ring model's figure for a 100 Mbit/s link
    assert got["bytes"] >= 1 << 20  # sized up to a buffer that goes both ways round the ring


# -- the pool as the coordinator drives it -------------------------------------------------------


def test_the_pool_takes_the_probe_from_rank_0s_node_only_and_shows_it_in_nodes_and_status() -> None:
    from test_pool_state import Driven, placed_pair

    from dpool.daemon.records import Refused

    pool = Driven()
    owner = placed_pair(pool)
    other = "b" if owner[0] == "a" else "a"
    report = NodeLink(job="j-1", generation=1, rank=0, ring=probe(940, 0.2), params=50_000)
    assert pool.from_node(1.0, other, report) == [Refused(other, "node.link", f"rank 0 of job j-1 generation 1 runs on node {owner[0]}")]
    assert all(row.links == [] for row in pool.node_rows(1.0))
    for r in (0, 1):
        pool.worker_hello(1.0, owner[r], "j-1", 1, r, 100 + r, 0)
    (event,) = pool.from_node(1.0, owner[0], report)
    assert event.kind == "group.link" and event.fields["nodes"] == ["a", "b"]
    rows = {row.name: row.links for row in pool.node_rows(3.0)}
    assert [(x.peer, x.bandwidth_bps, x.age_s) for x in rows["a"]] == [("b", 940e6, 2.0)]
    job = pool.jobs["j-1"]
    for step in range(1, 5):
        for r in (0, 1):
            pool.progress(1.0 + step, "j-1", 1, r, step, 100, 0.05)
    fields = pool.comm_fields(job)
    assert job.state is JobState.RUNNING and 0.0 <= fields["comm_share"] <= 1.0 and fields["comm"].bytes == 200_000


def test_a_hostile_report_still_gives_a_status_and_an_event_within_their_bounds() -> None:
    from dpool.protocol.payloads import JobStatus
    from dpool.protocol.schema import MAX_INT

    links = Links()
    j = job_on(("a", "b"))
    slow = RingProbe(bandwidth_bps=1.0, latency_s=60.0, bytes=0, seconds=0.0)  # the least the wire allows
    links.observe(1.0, j, NodeLink(job=j.id, generation=1, rank=0, ring=slow, params=MAX_INT))
    events = share_of(links, j, [1e7] * 8)
    share, comm = links.share(j)
    assert share is not None and 0.0 <= share <= 1.0
    status = JobStatus(
        id=j.id, name=j.name, state="running", step=0, steps=1, generation=1, world_size=2, workers=[], checkpoint_step=None,
        loss=None, val_loss=None, error=None, comm_share=share, comm=comm,
    )
    back, _ = m.decode(m.StatusReply(jobs=[status]).to_frames())  # dpctl reads it: every value within its bound
    assert back.jobs[0].comm == comm
    assert [e.kind for e in events] == ["job.comm_bound"]
    from dpool.protocol.payloads import EventRow

    EventRow.from_wire({"t": 1.0, "kind": events[0].kind, **events[0].fields})


def test_submit_warns_on_a_slow_link_once_a_job_of_the_same_name_and_size_measured_a_step() -> None:
    from dpool.protocol.payloads import CommRow, JobStatus

    def node(name: str, peer: str) -> NodeRow:
        return NodeRow(
            name=name, address="", state="idle", platform="", chip="", memory_bytes=0, mlx_version="", backend="", slots=1,
            busy_slots=0, job=None, ranks=[], heartbeat_age_s=0.0, reason=None,
            links=[LinkRow(peer=peer, bandwidth_bps=10e6, latency_s=2e-3, age_s=5.0)],
        )

    s = parse_job({"name": "wifi", "workers": {"max": 2}, "train": {"global_batch": 32}, "model": {"layers": 4, "dim": 256, "heads": 4}}, source="test")
    nodes = [node("a", "b"), node("b", "a")]
    f = client_comm.forecast(s, nodes, [])
    assert f is not None and f.share is None and f.warning() is None
    earlier = JobStatus(
        id="wifi-000001", name="wifi", state="succeeded", step=10, steps=10, generation=1, world_size=1, workers=[], checkpoint_step=None,
        loss=None, val_loss=None, error=None, submitted=1.0,
        comm=CommRow(bytes=f.nbytes, every=1, ranks=1, global_batch=16, seconds=0.0, compute_s=0.2, link=["a", "a"], bandwidth_bps=1e9, latency_s=0.0),
    )
    f = client_comm.forecast(s, nodes, [earlier])
    # 0.2 s for 16 sequences on one rank: 0.2 s for 16 per rank on two; the all_sum of ~13 MB at 10 Mbit/s is seconds.
    assert f is not None and f.compute_s == pytest.approx(0.2) and f.compute_from == "job wifi-000001"
    assert f.share is not None and f.share > 0.5
    text = f.warning()
    assert text is not None and "a <-> b (10 Mbit/s, 2 ms)" in text and "diloco" in text
    # A diloco job with a warm-up: the share of the steps after it, and the warm-up's own.
    w = parse_job({"name": "wifi", "workers": {"max": 2}, "train": {"global_batch": 32}, "model": {"layers": 4, "dim": 256, "heads": 4},
                   "sync": {"mode": "diloco", "replicas": 2, "inner_steps": 50, "warmup_steps": 20}}, source="test")
    fw = client_comm.forecast(w, nodes, [earlier])
    assert fw is not None and fw.share is not None and fw.warmup_share == pytest.approx(f.share) and fw.seconds == pytest.approx(f.seconds / 50)
    assert any(f"about {f.share:.0%} of each of the first 20 steps" in line for line in fw.lines()), fw.lines()


def test_dry_run_figures_read_as_people_write_them() -> None:
    from dpool.client.comm import _pct, _secs

    assert [_secs(x) for x in (2.5, 0.0098, 0.00004, 0.0)] == ["2.50 s", "9.8 ms", "40 µs", "0.0 ms"]
    assert [_pct(x) for x in (0.32, 0.001, 0.005, 0.0)] == ["32%", "under 1%", "under 1%", "0%"]

