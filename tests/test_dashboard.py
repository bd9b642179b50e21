"""The read-only dashboard (issue 21): its pages against a real pool of dpds, the job list's pages
over a long history, viewer tokens, GET only, a sub-path behind a reverse proxy, `dpd run
--dashboard`, and the poller's promise that many open pages cost the coordinator what one does.
The browser's view of it is tests/test_dashboard_browser.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import orjson
import psutil
import pytest
from conftest import LocalPool, Processes, alive, free_port, wait_for
from dashboard_harness import SubPathProxy, get, hrefs, sse_events, start_dashboard, wait_page
from fakenode import FakeRank0
from jobs import write_job
from peers import Running

from dpool.client.keys import add_viewer, init_keys
from dpool.client.rpc import Client, RemoteError
from dpool.daemon import statuspage
from dpool.dashboard import chart, options, views
from dpool.dashboard.auth import Tokens
from dpool.dashboard.follow import JobFollow, Thinned
from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job
from dpool.protocol.payloads import EventRow, JobStatus, LogLine, SampleRow, TrainRow
from dpool.protocol.security import client_keys

QUEUED = parse_job({"name": "waits", "workers": {"min": 64, "max": 64}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()


# -- pure parts ------------------------------------------------------------------------------------


def train(step: int, loss: float = 1.0) -> TrainRow:
    return TrainRow(kind="train", step=step, loss=loss, lr=1e-3, tokens=100, tokens_per_s=1000.0, world_size=2, generation=1)


def test_a_long_series_is_thinned_to_its_bound_evenly_and_keeps_its_newest_rows() -> None:
    s = Thinned(cap=100)
    for step in range(1, 100_001):
        s.add(train(step))
    assert len(s) <= 101
    gaps = {b - a for a, b in zip(s.steps, s.steps[1:], strict=False)}
    assert len(gaps - {s.stride}) <= 1, gaps  # evenly spread (the newest row may sit closer)
    assert s.steps[-1] >= 100_000 - s.stride


def test_a_recomputed_step_replaces_its_row_and_a_thinned_step_changes_nothing() -> None:
    s = Thinned(cap=4)
    for step in range(1, 10):
        s.add(train(step))
    kept = s.steps[0]
    assert s.add(train(kept, loss=9.0)) and s.rows[0].loss == 9.0
    assert not s.add(train(kept + 1, loss=9.0)) or kept + 1 in s.steps


def js(i: int, t: float) -> JobStatus:
    return JobStatus(id=f"j-{i:04d}", name="j", state="succeeded", step=1, steps=1, generation=1, world_size=1, workers=[], checkpoint_step=None, loss=None, val_loss=None, error=None, submitted=t)


def test_status_pages_list_every_job_once_newest_first_with_fresh_rows_from_memory() -> None:
    every = [js(i, 1000.0 + i // 3) for i in range(200)]  # three jobs share each submission second
    memory = [j for j in every if j.id.endswith(("0", "7"))]
    stored_rows = sorted(every, key=statuspage.key, reverse=True)

    def stored(before: statuspage.Key, n: int, skip: set[str]) -> list[JobStatus]:
        return [j for j in stored_rows if statuspage.key(j) < before and j.id not in skip][:n]

    seen, before, more = [], None, True
    while more:
        page, more = statuspage.page(memory, stored, before, 23)
        seen += page
        before = statuspage.key(page[-1]) if page else None
    assert [j.id for j in seen] == [j.id for j in stored_rows]


def test_a_page_of_the_list_numbers_its_jobs_whatever_the_url_says() -> None:
    """`?n=` comes from the link to an older page, or from a hand-made URL: the last page's place
    is known from the total, another's is kept within what leaves the rest room."""
    from dpool.dashboard.poller import ListPage
    from dpool.dashboard.views import jobs_view

    def heading(page: ListPage, n: int) -> str:
        return re.sub(r"<[^>]+>", "", jobs_view(page, n, _conn()).fragments["jobs"].split("</p>")[0])  # type: ignore[arg-type]

    last = ListPage("j-0010", jobs=[js(i, 1.0) for i in range(10)], more=False, total=60)
    for n in (0, 5, 50, 10**9):
        assert heading(last, n).startswith("jobs 51–60 of 60"), n
    middle = ListPage("j-0050", jobs=[js(i, 1.0) for i in range(50)], more=True, total=160)
    assert heading(middle, 50).startswith("jobs 51–100 of 160")
    assert heading(middle, 10**9).startswith("jobs 110–159 of 160")  # at most: one older job follows
    empty = ListPage("j-0000", jobs=[], more=False, total=60)
    assert heading(empty, 7).startswith("no jobs here (60 in all)") and "no older jobs" in jobs_view(empty, 7, _conn()).fragments["jobs"]  # type: ignore[arg-type]


def test_a_dashboard_beyond_loopback_needs_tokens_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(options.OptionsError, match="viewer tokens"):
        options.check("0.0.0.0:7341", "tcp://127.0.0.1:7340", keys=None, tokens=None, insecure=False)
    assert options.check("0.0.0.0:7341", "tcp://x:1", keys=None, tokens=None, insecure=True).tokens is None
    assert options.check("[::1]:7341", "tcp://x:1", keys=None, tokens=None, insecure=False).listen.loopback
    assert options.check("7341", "tcp://x:1", keys=None, tokens=None, insecure=False).listen == options.Listen("127.0.0.1", 7341)
    keys = tmp_path / "keys"
    init_keys(keys, nodes=["n0"])
    got = options.check("0.0.0.0:7341", "tcp://x:1", keys=keys, tokens=None, insecure=False)
    assert got.tokens == keys / "allowed" / "viewers"
    for bad in ("host", "1.2.3.4:99999", "[::1]7341", "a b:1"):
        with pytest.raises(options.OptionsError, match="--listen"):
            options.parse_listen(bad)
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "dashboard", "--listen", "0.0.0.0:7341"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--insecure" in r.stderr and "dpctl keys add-viewer" in r.stderr, r.stderr


def test_dpd_refusing_a_dashboard_beyond_loopback_names_only_flags_dpd_takes(tmp_path: Path) -> None:
    """dpd run has --keys and --insecure, not dpctl dashboard's --tokens: its refusal says so."""
    config = tmp_path / "config.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPOOL_")}
    r = subprocess.run(
        [sys.executable, "-m", "dpool.daemon.boot", "run", "--config", str(config), "--serve", f"tcp://127.0.0.1:{free_port()}", "--name", "n1",
         "--state-dir", str(tmp_path / "state"), "--dashboard", "0.0.0.0:7453"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "--dashboard 0.0.0.0:7453" in r.stderr and "--keys DIR" in r.stderr and "--insecure" in r.stderr, r.stderr
    assert "--tokens" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "dpool.client.cli", "dashboard", "--listen", "0.0.0.0:7341"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tokens DIR" in r.stderr, r.stderr  # dpctl dashboard has it


def test_a_viewer_token_holds_until_its_viewer_key_or_token_file_is_removed(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    init_keys(keys, nodes=["n0"])
    add_viewer(keys, "alice")
    add_viewer(keys, "bob")
    alice = (keys / "bundles" / "alice" / "viewer.token").read_text().strip()
    bob = (keys / "viewer-bob.token").read_text().strip()
    assert (keys / "bundles" / "alice" / "viewer.token").stat().st_mode & 0o077 == 0
    tokens = Tokens(keys / "allowed" / "viewers")
    assert tokens.viewer(alice) == "alice" and tokens.viewer(bob) == "bob"
    assert tokens.viewer(alice[:-1] + ("A" if alice[-1] != "A" else "B")) is None
    assert tokens.viewer(alice.replace(".alice.", ".bob.")) is None  # a token names its viewer
    assert tokens.viewer("") is None and tokens.viewer("x" * 10_000) is None
    (keys / "allowed" / "viewers" / "alice.key").unlink()  # revoke alice, as any key is revoked
    assert tokens.viewer(alice) is None and tokens.viewer(bob) == "bob"
    (keys / "allowed" / "viewers" / "bob.token").unlink()
    assert tokens.viewer(bob) is None
    client_keys(keys / "bundles" / "bob", "client")  # the bundle is a working read-only client too
    add_viewer(keys, "ops.team_1")  # any name `dpctl keys` takes makes a token that works
    assert tokens.viewer((keys / "viewer-ops.team_1.token").read_text().strip()) == "ops.team_1"


def test_the_chart_marks_each_restart_and_shades_what_was_recomputed() -> None:
    svg = chart.svg(
        steps=100,
        train=[(s, 5.0 - s / 50, 1000.0) for s in range(1, 80)],
        evals=[(50, 4.0)],
        restarts=[{"generation": 2, "from_step": 30, "steps_recomputed": 6, "seconds": 2.5}, {"generation": 3, "from_step": 60, "steps_recomputed": 0, "seconds": None}],
    )
    assert svg.count('class="restart"') == 2 and svg.count('class="recomputed"') == 1
    assert "6 steps recomputed" in svg and "2.5 s after the failure" in svg
    assert 'class="train-loss"' in svg and 'class="val-loss"' in svg and 'class="tokens-per-s"' in svg
    long = chart.svg(steps=10**6, train=[(s, 1.0, 1.0) for s in range(1, 10**5)], evals=[], restarts=[])
    assert len(long) < 60_000  # a line keeps at most POINTS_MAX points


def test_what_the_pool_says_is_escaped_on_the_page() -> None:
    f = JobFollow("j-1")
    f.saw_status(JobStatus(id="j-1", name="j", state="failed", step=1, steps=2, generation=1, world_size=1, workers=[], checkpoint_step=None, loss=None, val_loss=None, error="<script>alert(1)</script>"))
    f.saw_events([EventRow(t=1.0, kind="worker.failed", fields={"reason": "<img src=x onerror=alert(1)>"})], 1)
    page = views.page("job:j-1", views.job_view(f, _conn()))
    assert "<script>alert" not in page and "<img src=x" not in page and "&lt;script&gt;" in page


def test_a_time_not_of_today_shows_its_date_and_every_time_its_zone() -> None:
    t = time.mktime((2026, 12, 4, 13, 45, 57, 0, 0, -1))
    zone = time.strftime("%Z", time.localtime(t))
    assert views.moment(t, t + 60).endswith(f">13:45:57 {zone}</time>")
    assert views.moment(t, t + 3 * 86400).endswith(f">2026-12-04 13:45:57 {zone}</time>")
    assert views.moment(t + 0.25, t + 86400, ms=True).endswith(f">2026-12-04 13:45:57.250 {zone}</time>")
    assert re.match(r'<time datetime="2026-12-04T13:45:57[+-]\d\d:\d\d">', views.moment(t, t))  # the instant, whatever the zone
    assert views.moment(None, t) == "-"


def test_a_job_page_is_bounded_however_much_the_job_says() -> None:
    f = JobFollow("j-1")
    f.saw_status(JobStatus(id="j-1", name="j", state="running", step=10**6, steps=10**6, generation=9, world_size=1000, workers=[], checkpoint_step=None, loss=1.0, val_loss=None, error=None))
    for step in range(1, 200_001):
        f.saw_metrics([train(step)], step)
    f.saw_events([EventRow(t=1.0 + i, kind="group.resumed", fields={"from_step": i, "generation": i, "steps_recomputed": 3, "seconds_since_failure": 1.5, "cause": "failure", "pad": "x" * 256}) for i in range(5000)], 5000)
    f.saw_logs([LogLine(seq=i, t=1.0, rank=i % 1000, generation=1, text="y" * 8000) for i in range(20_000)], 20_000)
    f.saw_samples([SampleRow(step=i, text="z" * 100_000) for i in range(50)], 50)
    page = views.page("job:j-1", views.job_view(f, _conn()))
    assert len(page) < 400_000, len(page)
    assert len(f.train) <= 2001 and len(f.events) <= 300 and len(f.logs) <= 16


def test_a_round_that_fails_says_so_and_the_next_one_is_tried() -> None:
    from dpool.dashboard.poller import Poller

    p = Poller("tcp://127.0.0.1:9", None, lambda v, r: None, poll_s=1.0, timeout_s=0.2)

    def broken(request: object, expect: object) -> object:
        raise ValueError("a reply this version cannot use")

    p.call = broken  # type: ignore[method-assign]
    p.round(["pool"])
    assert not p.conn.ok and "cannot use" in (p.conn.error or "")


def _conn() -> object:
    from dpool.dashboard.poller import Conn

    return Conn(True, None, 1.0, 1.0)


# -- starting and stopping -------------------------------------------------------------------------


def test_a_dashboard_that_cannot_listen_says_so_alone_and_exits_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "dpool.client.cli", "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--timeout", "5", "dashboard", "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"dashboard: cannot listen on 127.0.0.1:{port}: ") and "address already in use" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # that line alone: no round of the poller, cut short, reported as failed


def test_a_dashboard_stopped_while_its_coordinator_is_silent_exits_quietly(tmp_path: Path, processes: Processes) -> None:
    """Its poller waits on a coordinator that does not answer (a 5 s timeout) when SIGTERM comes:
    the request cut short by the exit is no failure to report."""
    with socket.socket() as silent:  # a "coordinator" that takes the connection and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(30)
        d = start_dashboard(processes, tmp_path, f"tcp://127.0.0.1:{silent.getsockname()[1]}", "--timeout", "5", name="dash-stop")
        conn, _ = silent.accept()  # its first round is in flight
        with conn:
            d.proc.send_signal(signal.SIGTERM)
            assert d.proc.wait(10) == 0
    said = d.log.read_text()
    assert "round failed" not in said and said.count("\n") == 1, said  # its address, nothing else


# -- against a real pool -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPool, str, Path, Processes]]:
    """A pool of two dpds (no keys) with one finished job and 130 jobs that never ran (queued,
    then cancelled: most of them are in the coordinator's database only)."""
    root = tmp_path_factory.mktemp("plain")
    procs = Processes(root)
    pool = LocalPool(procs, root)
    try:
        pool.start(1, 1)
        job = pool.submit(write_job(root, "done", train={"steps": 12}))
        pool.wait_end(job)
        with Client(pool.addr, 10) as c:
            for _ in range(130):
                queued = c.call(m.Submit(job=QUEUED, source="test"), m.Submitted).job_id
                c.call(m.Cancel(job=queued), m.CancelReply)
        yield pool, job, root, procs
    finally:
        procs.stop_all()


def test_the_coordinator_pages_its_whole_history_newest_first(plain: tuple[LocalPool, str, Path, Processes]) -> None:
    pool, job, _, _ = plain
    with Client(pool.addr, 10) as c:
        everything = c.call(m.Status(), m.StatusReply).jobs
        seen, before, more, total = [], None, True, None
        while more:
            reply = c.call(m.Status(limit=40, before=before), m.StatusReply)
            seen += reply.jobs
            total, more = reply.total, bool(reply.more)
            before = reply.jobs[-1].id if reply.jobs else None
        assert len(seen) == total == 131 and len({j.id for j in seen}) == 131
        assert [j.id for j in seen] == [j.id for j in everything]
        assert seen[-1].id == job
        with pytest.raises(RemoteError) as e:
            c.call(m.Status(limit=10, before="no-such-job-000000"), m.StatusReply)
        assert e.value.code == "not_found"


def test_the_pages_show_the_nodes_the_job_list_and_a_job(plain: tuple[LocalPool, str, Path, Processes]) -> None:
    pool, job, root, procs = plain
    d = start_dashboard(procs, root, pool.addr, name="dash-pages")
    status, headers, body = get(d.url)
    assert status == 200 and "text/html" in headers["Content-Type"]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert all(f'<span class="node-name">{n}</span>' in body for n in ("n0", "n1"))
    status, _, body = get(d.url + "jobs")
    assert status == 200 and "of 131" in body and 'class="older"' in body
    older = re.search(r'class="older" href="([^"]+)"', body)
    assert older is not None
    status, _, body2 = get(d.url + older.group(1).replace("&amp;", "&"))
    assert status == 200 and "jobs <b>51–100</b> of 131" in body2
    body = wait_page(d.url + f"jobs/{job}", ['class="train-loss"', "succeeded", "rank 0"])
    assert '<b id="step">12</b>' in body and "job.succeeded" in body
    assert get(d.url + "jobs/no-such-job")[0] == 404
    assert get(d.url + "jobs?before=nope-000000")[0] == 404
    for path in ("static/dash.js", "static/dash.css"):
        assert get(d.url + path)[0] == 200
    assert get(d.url + "static/../cli.py")[0] == 404


def test_nothing_but_get_and_head_is_answered(plain: tuple[LocalPool, str, Path, Processes]) -> None:
    """A read-only server: every other method is 405. HEAD (which RFC 9110 asks of every
    general-purpose server, and uptime checks and `curl -I` send) answers what GET would, without
    the body, and does not open a stream."""
    pool, job, root, procs = plain
    d = start_dashboard(procs, root, pool.addr, name="dash-methods")
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        for path in ("", "jobs", f"jobs/{job}", "stream?view=pool", "metrics"):
            status, headers, _ = get(d.url + path, method=method)
            assert status == 405 and headers.get("Allow") == "GET, HEAD", (method, path, status)
    for path, kind in (("", "text/html"), ("jobs", "text/html"), (f"jobs/{job}", "text/html"), ("metrics", "text/plain"), ("static/dash.css", "text/css"), ("stream?view=pool", "text/event-stream"), ("jobs/no-such-job", "text/html")):
        status, headers, body = get(d.url + path, method="HEAD")
        want = 404 if "no-such" in path else 200
        assert (status, body) == (want, "") and headers["Content-Type"].startswith(kind), (path, status, headers)
    assert pool.status(job) is not None and pool.status(job).state == "succeeded"  # type: ignore[union-attr]


def test_under_a_sub_path_behind_a_proxy_every_link_and_the_live_stream_work(plain: tuple[LocalPool, str, Path, Processes]) -> None:
    pool, job, root, procs = plain
    d = start_dashboard(procs, root, pool.addr, name="dash-proxy")
    proxy = SubPathProxy(procs, root, d.url)
    streams = []
    for page in (proxy.url, proxy.url + "jobs", proxy.url + f"jobs/{job}"):
        status, _, body = get(page)
        assert status == 200, page
        links = [h.replace("&amp;", "&") for h in hrefs(body)]
        assert links and all(not h.startswith(("/", "http")) for h in links), links  # relative only
        for h in links:
            target = urljoin(page, h)
            assert target.startswith(proxy.url), (page, h)
            if "stream?" in h:
                streams.append(target)
            else:
                assert get(target)[0] == 200, target
    assert len(streams) == 3  # each page's own live stream, through the proxy too
    events = sse_events("127.0.0.1", proxy.port, urlsplit(streams[-1]).path + "?" + urlsplit(streams[-1]).query)
    _kind, data = next(e for e in events if e[0] == "update")
    assert f"<h1>{job}</h1>" in orjson.loads(data)["f"]["summary"]


def test_metrics_are_served_in_prometheus_text_format(plain: tuple[LocalPool, str, Path, Processes]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    pool, _job, root, procs = plain
    d = start_dashboard(procs, root, pool.addr, name="dash-metrics")
    status, headers, body = get(d.url + "metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    nodes = {s.labels["state"]: s.value for s in families["dpool_nodes"].samples}
    jobs = {s.labels["state"]: s.value for s in families["dpool_jobs"].samples}
    assert nodes["idle"] == 2 and jobs["cancelled"] == 130 and jobs["succeeded"] == 1, (nodes, jobs)
    # the jobs shown all ended: none has a group, so none a world size (not a 0 that reads as known)
    assert families["dpool_job_step"].samples and not families["dpool_job_world_size"].samples, families["dpool_job_world_size"].samples


def test_many_open_pages_cost_the_coordinator_what_one_does(plain: tuple[LocalPool, str, Path, Processes]) -> None:
    """The poller and its server in a process of their own (dashboard_harness.py cost): the
    requests a round sends with one stream of each page open, then with eight of each."""
    pool, job, _, _ = plain
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "dashboard_harness.py"), "cost", pool.addr, job], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = orjson.loads(r.stdout.strip().splitlines()[-1])
    assert got["one"] > 0 and got["eight"] == got["one"], got


# -- what a job says, as the pages show it ------------------------------------------------------------

ODD_SAMPLE = 'a\x00b\x07c\x1b[31m<red> & "q" \'s\'\tend\nline 2'  # NUL, BEL, ESC: a generated sample may hold any
ODD_LOG = "log\x00line \x1b[0mdone"
DAYS_BEHIND = 3


@pytest.fixture(scope="module")
def told(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, str, str]]:
    """A real coordinator whose wall clock runs DAYS_BEHIND days behind (none of its times is
    today's), a node of the test's own speaking the real protocol whose one-rank job prints
    ODD_LOG, samples ODD_SAMPLE and succeeds at step 3, and `dpctl dashboard` on it:
    (coordinator, job, the dashboard's URL)."""
    root = tmp_path_factory.mktemp("told")
    procs = Processes(root)
    coordinator = Running(root / "coordinator", wall=lambda: time.time() - DAYS_BEHIND * 86400)
    node = None
    try:
        node = FakeRank0(coordinator.addr)
        spec = parse_job({"name": "odd", "workers": {"min": 1, "max": 1}, "train": {"steps": 3, "warmup_steps": 1}}).to_dict()
        job = coordinator.call(m.Submit(job=spec, source="odd.toml"), m.Submitted).job_id
        generation = node.take(job)
        node.report(m.NodeLogs(job=job, generation=generation, rank=0, lines=[ODD_LOG]))
        node.report(m.NodeSample(job=job, generation=generation, row=SampleRow(step=3, text=ODD_SAMPLE)))
        for step in (1, 2, 3):
            node.progress(step)
        node.report(m.NodeCheckpoint(job=job, generation=generation, rank=0, slot=node.slot, step=3, seconds=0.01))
        node.running = False
        node.report(m.NodeWorkerExited(job=job, generation=generation, rank=0, slot=node.slot, code=0, stopped=False))
        wait_for("the job to succeed", lambda: coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].state == "succeeded", 20, every=0.05)
        d = start_dashboard(procs, root, coordinator.addr, poll=0.2, name="dash-told")
        yield coordinator, job, d.url
    finally:
        procs.stop_all()
        if node is not None:
            node.close()
        coordinator.stop()


def test_control_characters_of_output_and_samples_are_written_as_dpctl_samples_writes_them(told: tuple[Running, str, str]) -> None:
    coordinator, job, url = told
    body = wait_page(url + f"jobs/{job}", ["step 3</h3>", "rank 0</h3>"])
    assert "<pre>a\\x00b\\x07c\\x1b[31m&lt;red&gt; &amp; &quot;q&quot; &#x27;s&#x27;\tend\nline 2</pre>" in body, body
    assert "<pre>log\\x00line \\x1b[0mdone</pre>" in body
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", body)  # nothing an HTML parser rejects or a terminal would obey
    assert "a\\x00b\\x07c\\x1b[31m" in coordinator.dpctl("samples", job).stdout  # as dpctl shows it
    _kind, data = next(e for e in sse_events("127.0.0.1", int(urlsplit(url).port or 0), f"/stream?view=job:{job}") if e[0] == "update")
    fragments = orjson.loads(data)["f"]
    assert "a\\x00b\\x07c\\x1b[31m&lt;red&gt;" in fragments["samples"] and "log\\x00line" in fragments["logs"]
    assert not any(re.search(r"[\x00-\x08\x0b-\x1f\x7f]", v) for v in fragments.values())


def test_an_events_lists_read_as_their_items(told: tuple[Running, str, str]) -> None:
    _coordinator, job, url = told
    body = wait_page(url + f"jobs/{job}", ["job.succeeded"])
    assert "nodes=fake ranks=fake shares=64" in body, re.findall(r"group\.starting.{0,300}", body)
    assert "[&#x27;" not in body and "[64]" not in body  # no Python repr of a list
    f = JobFollow("j-1")  # and a list of several, a null and a bool, as on any page
    f.saw_events([EventRow(t=1.0, kind="group.starting", fields={"nodes": ["n1"], "ranks": ["n1", "n1"], "shares": [4, 2], "cause": None, "warm": True})], 1)
    assert "nodes=n1 ranks=n1, n1 shares=4, 2 cause=- warm=true" in views.events_html(f, 1.0)


def test_times_not_of_today_show_their_date_and_every_time_its_zone(told: tuple[Running, str, str]) -> None:
    coordinator, job, url = told
    submitted = coordinator.call(m.Status(job=job), m.StatusReply).jobs[0].submitted
    day, zone = time.strftime("%Y-%m-%d", time.localtime(submitted)), time.strftime("%Z", time.localtime(submitted))
    moment = r'<time datetime="(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{3})?[+-]\d\d:\d\d)">(\S+) (\d\d:\d\d:\d\d(?:\.\d{3})?) (\S+)</time>'
    for page, least in ((url + "jobs", 1), (url + f"jobs/{job}", 6)):  # the job page: submitted, started, finished, events
        times = re.findall(moment, wait_page(page, ["job.succeeded"] if "/jobs/" in page else [job]))
        assert len(times) >= least, (page, times)
        assert all(shown_day == day and shown_zone == zone for _iso, shown_day, _clock, shown_zone in times), (page, times)
        assert times[0][0].startswith(day + "T") and times[0][2] in times[0][0], times[0]


def test_an_ended_job_has_no_world_size_in_metrics(told: tuple[Running, str, str]) -> None:
    """status --json keeps the last group's size; the gauge of the group's workers has no sample."""
    from prometheus_client.parser import text_string_to_metric_families

    coordinator, job, url = told
    assert orjson.loads(coordinator.dpctl("status", job, "--json").stdout)["world_size"] == 1
    got = wait_for("the job in /metrics", lambda: (b := get(url + "metrics")[2]) and f'dpool_job_step{{job="{job}"}}' in b and b, 20)
    families = {f.name: f for f in text_string_to_metric_families(got)}
    assert [s.value for s in families["dpool_job_step"].samples if s.labels["job"] == job] == [3]
    assert not [s for s in families["dpool_job_world_size"].samples if s.labels["job"] == job], got


def test_a_removed_job_leaves_its_page_and_metrics_within_a_poll_or_two(tmp_path: Path, processes: Processes) -> None:
    """A job's page seen while it was there, then `dpctl rm JOB`: the page answers 404 and
    /metrics no longer counts the job nor gives it a series, as `dpctl status` no longer lists it."""
    from prometheus_client.parser import text_string_to_metric_families

    coordinator = Running(tmp_path / "coordinator")
    try:
        gone, kept = (coordinator.call(m.Submit(job=QUEUED, source="test"), m.Submitted).job_id for _ in range(2))
        for job in (gone, kept):
            coordinator.call(m.Cancel(job=job), m.CancelReply)
        d = start_dashboard(processes, tmp_path, coordinator.addr, poll=0.2)

        def scraped() -> tuple[float, set[str]]:
            families = {f.name: f for f in text_string_to_metric_families(get(d.url + "metrics")[2])}
            cancelled = next(s.value for s in families["dpool_jobs"].samples if s.labels["state"] == "cancelled")
            return cancelled, {s.labels["job"] for s in families["dpool_job_step"].samples}

        wait_page(d.url + f"jobs/{gone}", [f"<h1>{gone}</h1>", "cancelled"])  # ended, and read whole: nothing else of it will change
        assert wait_for("both jobs in /metrics", lambda: (got := scraped()) == (2, {gone, kept}) and got, 30)
        coordinator.call(m.Rm(job=gone), m.RmReply)
        assert [j.id for j in coordinator.call(m.Status(), m.StatusReply).jobs] == [kept]
        wait_for("the removed job's page to answer 404", lambda: get(d.url + f"jobs/{gone}")[0] == 404, 10)
        assert wait_for("the removed job gone from /metrics", lambda: (got := scraped()) == (1, {kept}) and got, 30)  # the whole list is read every 15 s
        assert get(d.url + f"jobs/{kept}")[0] == 200
    finally:
        coordinator.stop()


# -- keys and tokens ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPool, Path, Path, Processes]]:
    """A pool with CURVE keys (node n0) and viewers alice and bob."""
    root = tmp_path_factory.mktemp("keyed")
    keys = root / "keys"
    init_keys(keys, nodes=["n0"])
    add_viewer(keys, "alice")
    add_viewer(keys, "bob")
    procs = Processes(root)
    pool = LocalPool(procs, root)
    try:
        pool.start_daemon("n0", serve=True, args=["--keys", str(keys)])
        with Client(pool.addr, 60, client_keys(keys, "client")) as c:
            wait_for("n0 registered", lambda: c.call(m.Nodes(), m.NodesReply).nodes, 60)
        yield pool, keys, root, procs
    finally:
        procs.stop_all()


def test_off_loopback_every_request_needs_a_viewer_token_and_a_revoked_one_is_refused(keyed: tuple[LocalPool, Path, Path, Processes]) -> None:
    pool, keys, root, procs = keyed
    port = free_port()
    d = start_dashboard(procs, root, pool.addr, "--keys", str(keys), listen=f"0.0.0.0:{port}", name="dash-tokens")
    alice = (keys / "bundles" / "alice" / "viewer.token").read_text().strip()
    bob = (keys / "bundles" / "bob" / "viewer.token").read_text().strip()
    for path in ("", "jobs", "stream?view=pool", "metrics", "static/dash.js"):
        status, headers, body = get(d.url + path)
        assert status == 401 and "add-viewer" in body and headers["WWW-Authenticate"].startswith("Bearer"), path
        assert get(d.url + path, headers={"Authorization": "Bearer " + alice[:-2] + "xx"})[0] == 401
    # the dashboard reads the pool with its own read-only key: the page lists the node
    body = wait_page(d.url, ['<span class="node-name">n0</span>'], headers={"Authorization": f"Bearer {alice}"})
    assert "n0" in body
    with Client(pool.addr, 10, client_keys(keys / "bundles" / "dashboard", "client")) as c:
        with pytest.raises(RemoteError) as e:
            c.call(m.Drain(node="n0"), m.DrainReply)
        assert e.value.code == "forbidden"  # the dashboard's key can change nothing
    # ?token= is exchanged for an HttpOnly cookie, and the token leaves the address
    status, headers, _ = get(d.url + f"jobs?token={alice}")
    assert status == 303 and headers["Location"] == "jobs"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Lax" in cookie
    jar = {"Cookie": cookie.split(";", 1)[0]}
    assert get(d.url + "jobs", headers=jar)[0] == 200
    assert get(d.url + "?token=dpv1.alice.wrong")[0] == 401
    # revoked: alice's key file removed from the allow-list (while her page streams)
    stream = sse_events("127.0.0.1", port, "/stream?view=pool", headers=jar)
    assert next(stream)[0] == "update"
    (keys / "allowed" / "viewers" / "alice.key").unlink()
    list(stream)  # it ends by itself, at its next update (30 s without an end fails the test: a socket timeout)
    assert get(d.url, headers={"Authorization": f"Bearer {alice}"})[0] == 401
    assert get(d.url, headers=jar)[0] == 401
    assert get(d.url, headers={"Authorization": f"Bearer {bob}"})[0] == 200


# -- dpd run --dashboard ----------------------------------------------------------------------------------


def test_dpd_serves_its_dashboard_in_a_process_of_its_own_and_takes_it_along_when_it_ends(tmp_path: Path, processes: Processes) -> None:
    pool = LocalPool(processes, tmp_path)
    port = free_port()
    d0 = pool.start_daemon("n0", serve=True, args=["--dashboard", f"127.0.0.1:{port}"])
    pool.wait_registered(1)
    body = wait_page(f"http://127.0.0.1:{port}/", ['<span class="node-name">n0</span>'])
    assert "n0" in body

    def dashboard_pid() -> int | None:
        kids = [p for p in psutil.Process(d0.pid).children() if "dpool.dashboard" in " ".join(p.cmdline())]
        return kids[0].pid if kids else None

    child = wait_for("the dashboard's process", dashboard_pid, 10)
    assert child != d0.pid
    os.kill(d0.pid, signal.SIGKILL)  # dpd dies without stopping it
    wait_for("the dashboard to end with its dpd", lambda: not alive(child), 15)

    second = LocalPool(processes, tmp_path / "second")
    port2 = free_port()
    d1 = second.start_daemon("n1", serve=True, args=["--dashboard", f"127.0.0.1:{port2}"])
    wait_page(f"http://127.0.0.1:{port2}/", ['<span class="node-name">n1</span>'])
    child = wait_for("the dashboard's process", lambda: [p.pid for p in psutil.Process(d1.pid).children() if "dpool.dashboard" in " ".join(p.cmdline())], 10)[0]
    os.kill(d1.pid, signal.SIGTERM)
    assert d1.proc.wait(30) == 0
    assert not alive(child)
