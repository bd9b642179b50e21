"""Ranks that share a machine (trainer/colocate.py): who shares, how many BLAS threads each gets,
the barrier before the step's all_sum (and that it leaves the loss curve bit for bit as it was),
and the quiet ring of a group on one machine (exact sums in one-way pieces, a dead rank still
fails the others)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import ring
from jobs import SMALL, write_job

from dpool.trainer.blas import MARK, find_openblas
from dpool.trainer.colocate import (
    LocalBarrier,
    barrier_address,
    colocated,
    host_of,
    split_blas_threads,
    split_threads,
    usable_cores,
)
from dpool.trainer.dist import Group
from dpool.trainer.listening import is_listening, last_rank_apart, wait_for_listeners

HOSTS = [["127.0.0.1:5000"], ["10.0.0.2:5001"], ["127.0.0.1:5002"], ["[::1]:5003"], ["10.0.0.2:5004", "10.0.0.2:5005"]]


def test_ranks_whose_host_is_the_same_share_a_machine():
    assert colocated(HOSTS, 0) == [0, 2] and colocated(HOSTS, 2) == [0, 2]
    assert colocated(HOSTS, 1) == [1, 4] and colocated(HOSTS, 4) == [1, 4]
    assert colocated(HOSTS, 3) == [3]
    assert host_of("[::1]:5003") == "[::1]"
    with pytest.raises(ValueError, match="expected host:port"):
        host_of("10.0.0.2")


def test_each_rank_gets_its_share_of_the_cores_and_never_none():
    assert split_threads(2, 3) == 1
    assert split_threads(8, 3) == 2
    assert split_threads(8, 2) == 4
    assert split_threads(1, 1) == 1


def test_an_explicit_thread_count_wins_and_a_rank_alone_keeps_the_default():
    assert split_blas_threads(3, {"OPENBLAS_NUM_THREADS": "2"}) == {"blas_threads": "2", "blas_threads_from": "OPENBLAS_NUM_THREADS"}
    assert split_blas_threads(1, {})["blas_threads"] is None
    assert "ignored" in split_blas_threads(3, {"DPOOL_BLAS_THREADS": "lots"})["blas_threads_from"]


def test_the_blas_named_is_the_one_preloaded_by_the_user_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's own LD_PRELOAD of OpenBLAS: the trainer skips its re-exec, and said 'bundled'."""
    from dpool.trainer.blas import active_blas

    monkeypatch.delenv(MARK, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libfoo.so:/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
    assert active_blas() == "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libfoo.so")
    assert active_blas() == "bundled"
    monkeypatch.setenv(MARK, "/opt/libopenblas.so")
    assert active_blas() == "/opt/libopenblas.so"


def blas_threads_in_child(env: dict[str, str], ranks_here: int) -> dict:
    """What split_blas_threads chooses in a fresh process that has MLX (and its BLAS) loaded."""
    code = (
        "import json, mlx.core as mx\n"
        "from dpool.trainer.colocate import split_blas_threads, set_blas_threads\n"
        f"print(json.dumps(split_blas_threads({ranks_here})))\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "DPOOL_BLAS_THREADS", "LD_PRELOAD", MARK)}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux" or find_openblas() is None, reason="needs Linux with OpenBLAS")
def test_the_preloaded_openblas_is_split_at_run_time():
    lib = find_openblas()
    assert lib is not None
    preloaded = {"LD_PRELOAD": lib, MARK: lib}
    want = max(1, usable_cores() // 3)
    assert blas_threads_in_child(preloaded, 3) == {"blas_threads": want, "blas_threads_from": f"{usable_cores()} cores / 3 ranks"}
    assert blas_threads_in_child({**preloaded, "DPOOL_BLAS_THREADS": "2"}, 3) == {"blas_threads": 2, "blas_threads_from": "DPOOL_BLAS_THREADS"}


def test_without_openblas_the_split_does_nothing():
    # The bundled reference BLAS on Linux, Accelerate on macOS: nothing to set, nothing fails.
    chosen = blas_threads_in_child({"DPOOL_BLAS": "reference"}, 3)
    assert chosen["blas_threads"] is None and chosen["blas_threads_from"].startswith("no OpenBLAS loaded")


def test_every_group_has_its_own_meeting_place():
    a = barrier_address([["127.0.0.1:5000"], ["127.0.0.1:5001"]])
    assert a == barrier_address([["127.0.0.1:5000"], ["127.0.0.1:5001"]])
    assert a != barrier_address([["127.0.0.1:5000"], ["127.0.0.1:5002"]]), "another generation's ports"
    if sys.platform == "linux":
        assert a.startswith("\0"), "an abstract socket: no file to clean up"


def fresh_address() -> str:
    return barrier_address([[f"127.0.0.1:{uuid.uuid4().int % 60000}"], [uuid.uuid4().hex + ":1"]])


def join_all(address: str, ranks: list[int], **kw) -> dict[int, LocalBarrier]:
    joined: dict[int, LocalBarrier] = {}
    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            joined[r] = LocalBarrier.join(address, r, ranks, **kw)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return joined


def test_the_barrier_releases_only_when_every_rank_has_arrived():
    barriers = join_all(fresh_address(), [3, 5, 7])
    released: dict[int, float] = {}

    def arrive(r: int, after: float) -> None:
        time.sleep(after)
        barriers[r].wait()
        released[r] = time.monotonic()

    for _round in range(3):
        start = time.monotonic()
        threads = [threading.Thread(target=arrive, args=(r, 0.3 if r == 5 else 0.0)) for r in barriers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(released) == [3, 5, 7]
        assert min(released.values()) - start >= 0.3, "a rank left before the last one arrived"
        released.clear()
    for b in barriers.values():
        b.close()


def test_a_rank_that_closes_its_connection_makes_the_others_raise():
    barriers = join_all(fresh_address(), [0, 1, 2])
    barriers[2].close()
    errors: dict[int, str] = {}

    def arrive(r: int) -> None:
        try:
            barriers[r].wait()
        except RuntimeError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=arrive, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a rank waits for a peer that is gone"
    assert "rank 2" in errors[0] and "closed" in errors[0]
    assert "rank 0" in errors[1] and "closed" in errors[1], "the leader's failure reaches the other members"


def test_a_killed_member_process_makes_the_leader_raise():
    address = fresh_address()
    code = (
        "import sys, time\n"
        "from dpool.trainer.colocate import LocalBarrier\n"
        f"b = LocalBarrier.join({address!r}, 1, [0, 1])\n"
        "print('joined', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        leader = LocalBarrier.join(address, 0, [0, 1], timeout=30)
        assert child.stdout is not None and child.stdout.readline().strip() == "joined"
        child.kill()
        child.wait()
        with pytest.raises(RuntimeError, match="rank 1 on this machine closed"):
            leader.wait()
        leader.close()
    finally:
        child.kill()
        child.wait()


def test_a_rank_that_never_comes_fails_the_join_with_its_name():
    with pytest.raises(RuntimeError, match=r"ranks \[2\] on this machine did not join"):
        LocalBarrier.join(fresh_address(), 0, [0, 2], timeout=0.3)
    with pytest.raises(RuntimeError, match="rank 0 on this machine did not listen"):
        LocalBarrier.join(fresh_address(), 2, [0, 2], timeout=0.3)


def run_three(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[dict[int, float], list[dict]]:
    job = write_job(
        tmp_path, "colocated", file="job.toml", base=SMALL, train={"steps": 6, "global_batch": 18},
        checkpoint={"every_steps": 100}, eval={"every_steps": 100, "batches": 1, "sample_every_steps": 100, "sample_tokens": 8},
        workers={"balance": False},
    )
    full = {"DPOOL_CACHE_DIR": str(tmp_path / "cache"), **env}
    g = ring.run(job, str(tmp_path / name / "r{rank}"), 3, tmp_path / "logs", env=full, shares=[6, 6, 6])
    joined = [e for r in range(3) for line in g.output(r).splitlines() if line.startswith("{")
              for e in [json.loads(line)] if e.get("event") == "group.joined"]
    return {s: r["loss"] for s, r in ring.metrics(tmp_path / name / "r0").items()}, joined


def test_three_ranks_on_one_machine_train_the_same_curve_with_and_without_the_barrier(tmp_path):
    # OPENBLAS_NUM_THREADS empty: the split chooses (tests/ring.py would otherwise set 1), in both
    # runs the same, so the barrier is the only difference.
    with_barrier, joined = run_three(tmp_path, "barrier", {"OPENBLAS_NUM_THREADS": ""})
    without, joined_off = run_three(tmp_path, "free", {"OPENBLAS_NUM_THREADS": "", "DPOOL_LOCAL_BARRIER": "0"})
    assert sorted(e["rank"] for e in joined) == [0, 1, 2]
    assert all(e["colocated_ranks"] == [0, 1, 2] and e["local_barrier"] for e in joined)
    assert all(e["quiet_ring_sockets"] == 2 for e in joined + joined_off), "each rank's left and right socket"
    assert not any(e["local_barrier"] for e in joined_off)
    if find_openblas() is not None and sys.platform == "linux":
        want = max(1, usable_cores() // 3)
        assert all(e["blas_threads"] == want for e in joined), joined
    assert [e["start_delay_ms"] > 0 for e in sorted(joined, key=lambda e: e["rank"])] == [False, False, True], "only the last rank waits"
    assert sorted(with_barrier) == list(range(1, 7))
    assert with_barrier == without, "the barrier changed the loss curve"


GROUP_SCRIPT = """
import json, os, sys, time
import mlx.core as mx
from dpool.trainer.dist import Group
g = Group()
x = mx.arange(1_000_000, dtype=mx.float32) * (g.rank + 1)  # 4 MB: more than one one-way piece
y = g.all_sum(x)
exact = bool(mx.all(y == mx.arange(1_000_000, dtype=mx.float32) * 6).item())
print(json.dumps({"rank": g.rank, "exact": exact, "one_way": g.one_way, "barrier": g.barrier is not None}), flush=True)
for _ in range(3):
    g.wait_for_colocated()  # the step's barrier: only ranks that share a machine meet there
if os.environ.get("DIE_AFTER_FIRST_SUM") == "1":
    os._exit(0)  # a rank that dies between two all_sums
t = time.monotonic()
try:
    mx.eval(g.all_sum(x))
    print(json.dumps({"rank": g.rank, "error": None}), flush=True)
except RuntimeError as e:
    print(json.dumps({"rank": g.rank, "error": str(e), "after_s": time.monotonic() - t}), flush=True)
"""


def run_group_script(tmp_path: Path, env: dict[int, dict[str, str]] | None = None, hosts: tuple[str, ...] = ("127.0.0.1",) * 3) -> list[list[dict]]:
    """Three ranks on this machine run GROUP_SCRIPT, rank r at address hosts[r] of the loopback;
    `env` adds variables per rank."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"{h}:{p}"] for h, p in zip(hosts, ring.free_ports(3), strict=True)]))
    procs = [
        subprocess.Popen([sys.executable, "-c", GROUP_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=ring.trainer_env({"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), **(env or {}).get(r, {})}))
        for r in range(3)
    ]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs]


def test_a_group_on_one_machine_sums_exactly_in_one_way_pieces_and_a_dead_rank_still_fails_it(tmp_path):
    # A peer that dies must still make the others raise (not wait forever) with the ring's sockets
    # blocking and a buffer cut into several all_sums.
    rows = run_group_script(tmp_path, env={2: {"DIE_AFTER_FIRST_SUM": "1"}})
    assert all(r[0]["exact"] and r[0]["one_way"] == 2 * 3 * 262_144 - 1 for r in rows), rows
    for rank in (0, 1):
        assert rows[rank][1]["error"] == "[ring] connection to a peer was lost", rows[rank]
        assert rows[rank][1]["after_s"] < 10


def test_one_rank_that_turns_the_quiet_ring_off_turns_it_off_for_all(tmp_path):
    # Every rank must cut its all_sums alike, whatever its own environment says.
    rows = run_group_script(tmp_path, env={1: {"DPOOL_QUIET_RING": "0"}})
    assert all(r[0]["exact"] and r[0]["one_way"] is None for r in rows), rows


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 answers on Linux's loopback only")
def test_in_a_group_across_machines_only_ranks_that_share_one_wait_for_each_other(tmp_path):
    # 127.0.0.1 and 127.0.0.2 are two machines as far as the hostfile says: ranks 0 and 1 share
    # one, rank 2 has the other to itself. The group is not on one machine: MLX's own all_sums.
    rows = run_group_script(tmp_path, hosts=("127.0.0.1", "127.0.0.1", "127.0.0.2"))
    assert [r[0]["barrier"] for r in rows] == [True, True, False], rows
    assert all(r[0]["exact"] and r[0]["one_way"] is None for r in rows), rows


# -- the ring's start-up order (trainer/listening.py, Group._start_order) --------------------------


def _free_sockets(n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as MLX binds its ring ports
        s.bind(("127.0.0.1", 0))
        out.append(s)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bind probe's meaning is Linux's")
def test_a_port_counts_as_listening_once_listen_is_called_not_when_bound():
    (s,) = _free_sockets(1)
    port = s.getsockname()[1]
    try:
        assert is_listening("127.0.0.1", port) is False
        assert wait_for_listeners([("127.0.0.1", port)], 0.05) is False
        s.listen()
        assert is_listening("127.0.0.1", port) is True
        assert wait_for_listeners([("127.0.0.1", port)], 0.05) is True
    finally:
        s.close()
    assert is_listening("127.0.0.1", port) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bind probe's meaning is Linux's")
def test_the_last_rank_calls_init_only_once_the_ranks_on_its_machine_listen():
    """Ranks 0 and 1 start listening 150 ms in: the last rank waits for both, not a fixed 20 ms;
    ranks other than the last never wait."""
    socks = _free_sockets(3)
    hosts = [[f"127.0.0.1:{s.getsockname()[1]}"] for s in socks]
    socks[2].close()  # the last rank's own port: MLX binds it
    late = threading.Timer(0.15, lambda: [s.listen() for s in socks[:2]])
    late.start()
    try:
        assert Group._start_order(hosts, 0, [0, 1, 2]) == 0.0
        waited = Group._start_order(hosts, 2, [0, 1, 2])
        assert 0.14 <= waited < 0.9, waited
        # Already listening: no wait at all; a rank elsewhere: the fixed head start as well.
        assert Group._start_order(hosts, 2, [0, 1, 2]) < 0.015
        assert Group._start_order([*hosts[:2], ["10.9.9.9:5000"], hosts[2]], 3, [0, 1, 3]) >= 0.02
    finally:
        late.cancel()
        for s in socks[:2]:
            s.close()


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2, reason="Linux affinity, 2 cores or more")
def test_during_init_the_last_rank_has_a_core_to_itself_and_every_thread_gets_all_back_after():
    allowed = os.sched_getaffinity(0)
    started: list[int] = []
    go_on = threading.Event()

    def socket_thread() -> None:  # as MLX starts one per ring socket during init
        started.append(threading.get_native_id())
        go_on.wait(10)

    with last_rank_apart(True, 3):
        assert os.sched_getaffinity(0) == {max(allowed)}
        t = threading.Thread(target=socket_thread)
        t.start()
        while not started:
            time.sleep(0.001)
        assert os.sched_getaffinity(started[0]) == {max(allowed)}, "a thread started inside inherits the mask"
    assert os.sched_getaffinity(0) == allowed and os.sched_getaffinity(started[0]) == allowed
    go_on.set()
    t.join()
    with last_rank_apart(False, 3):
        assert os.sched_getaffinity(0) == allowed - {max(allowed)}
    with last_rank_apart(False, 1):  # alone on its machine: nothing to keep apart
        assert os.sched_getaffinity(0) == allowed
    assert os.sched_getaffinity(0) == allowed
