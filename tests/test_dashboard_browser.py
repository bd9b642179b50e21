"""The dashboard in a real browser (headless Chromium, Debian's `chromium` and `chromium-driver`,
driven by selenium through the system's chromedriver; nothing is downloaded), against a real pool
of dpds training a small GPT job: the pool page lists the nodes; the job's page draws its loss
curve; the step advances on screen without a reload; after a trainer is killed a restart marker
appears (still without a reload); the pages ask nothing of any other host; /metrics counts the
restart. The three pages are saved as screenshots under the test's folder (and copied to
$DPOOL_SCREENSHOTS, when set, as the README's docs/dashboard-*.png are made). No page is wider than
a phone's screen or a desktop's window, whatever a job's error says."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import LocalPool, Processes, wait_for
from dashboard_harness import get, start_dashboard
from fakenode import FakeRank0
from jobs import write_job
from peers import Running

from dpool.protocol import messages as m
from dpool.protocol.jobspec import parse_job

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
WINDOW = (1280, 900)


@pytest.fixture
def browser(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Its profile and log outside the pool's folder: the pool's clean-up ends every process that
    names a path under that folder."""
    tmp_path = tmp_path_factory.mktemp("chromium")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER, log_output=str(tmp_path / "chromedriver.log")), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver, path: Path, height: int) -> Path:  # type: ignore[no-untyped-def]
    driver.set_window_size(WINDOW[0], height)
    driver.save_screenshot(str(path))
    driver.set_window_size(*WINDOW)
    return path


def test_a_browser_sees_the_pool_a_job_live_and_its_restart(browser, tmp_path: Path, processes: Processes) -> None:  # type: ignore[no-untyped-def]
    def text(css: str) -> str:
        """The text of the element `css` selects now ("" when none): read in the page, since a live
        update replaces elements under a reference held here."""
        return str(browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : '';", css))

    def count(css: str) -> int:
        return int(browser.execute_script("return document.querySelectorAll(arguments[0]).length;", css))

    pool = LocalPool(processes, tmp_path)
    pool.start(1, 1)
    job = pool.submit(write_job(
        tmp_path, "live", train={"steps": 600, "log_every_steps": 1}, checkpoint={"every_steps": 10}, eval={"every_steps": 40, "batches": 1, "sample_every_steps": 200, "sample_tokens": 40},
    ))
    pool.wait_status(job, "the job running on both nodes", lambda s: s.state == "running" and s.world_size == 2 and s.step >= 5, 120)
    d = start_dashboard(processes, tmp_path, pool.addr, poll=0.5)
    origin = d.url.rstrip("/")
    shots: dict[str, Path] = {}

    # the pool page lists the nodes
    browser.get(d.url)
    wait_for("both nodes on the pool page", lambda: browser.execute_script("return [...document.querySelectorAll('.node-name')].map(e => e.textContent).sort().join(',')") == "n0,n1", 30)
    shots["pool"] = shot(browser, tmp_path / "dashboard-pool.png", 700)

    # the job's page draws its loss curve, and its step advances without a reload
    browser.get(d.url + f"jobs/{job}")
    browser.execute_script("window.__stillHere = 'this page was not reloaded';")

    def curve_points() -> int:
        return int(browser.execute_script("const e = document.querySelector('svg.chart polyline.train-loss'); return e ? e.getAttribute('points').trim().split(/\\s+/).length : 0;"))

    wait_for("the loss curve drawn", lambda: curve_points() >= 3, 30)
    first = int(text("#step"))
    later = wait_for("the step to advance on screen", lambda: (s := int(text("#step"))) > first and s, 60)
    assert later > first and curve_points() >= 3
    assert browser.execute_script("return window.__stillHere") == "this page was not reloaded"
    assert count("svg.chart line.restart") == 0

    # a trainer killed: the page marks the restart, still without a reload
    pool.wait_status(job, "a checkpoint to resume from", lambda s: s.checkpoint_step is not None and s.checkpoint_step >= 10, 60)
    (victim,) = pool.trainer_pids("n1", job)
    os.kill(victim, signal.SIGKILL)
    wait_for("a restart marker on the job's page", lambda: count("svg.chart line.restart") >= 1, 120)
    assert browser.execute_script("return window.__stillHere") == "this page was not reloaded"
    wait_for("the resumed job stepping", lambda: int(text("#step")) > later, 60)
    wait_for("the restart's cost in the events", lambda: "recomputed" in text("#events"), 30)
    shots["job"] = shot(browser, tmp_path / "dashboard-job.png", 1500)

    browser.get(d.url + "jobs")
    wait_for("the job in the list", lambda: job in text("#jobs"), 30)
    shots["jobs"] = shot(browser, tmp_path / "dashboard-jobs.png", 500)

    # nothing was asked of another host: the resource timings, and every request the browser sent
    import json

    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    sent = [json.loads(e["message"])["message"] for e in browser.get_log("performance")]
    requests = [m["params"] for m in sent if m.get("method") == "Network.requestWillBeSent"]
    ours = [r["request"]["url"] for r in requests if r.get("documentURL", "").startswith(origin + "/")]
    network = [r["request"]["url"] for r in requests if urlsplit(r["request"]["url"]).scheme in ("http", "https", "ws", "wss")]
    assert ours and any("/stream?" in u for u in ours) and any(u.endswith("/static/dash.js") for u in ours), ours
    elsewhere = [u for u in resources + ours + network if not u.startswith(origin + "/") and urlsplit(u).scheme != "data"]
    assert not elsewhere, elsewhere  # the browser's own pages (chrome://) are not requests of the network

    # /metrics counts the restart (a Prometheus scrape, parsed by prometheus_client)
    from prometheus_client.parser import text_string_to_metric_families

    def restarts() -> float:
        status, _, body = get(d.url + "metrics")
        assert status == 200
        fam = {f.name: f for f in text_string_to_metric_families(body)}
        return sum(s.value for s in fam["dpool_job_restarts"].samples if s.labels.get("job") == job and s.name.endswith("_total"))

    wait_for("the restart counted in /metrics", lambda: restarts() >= 1, 30)

    for name, path in shots.items():
        assert path.stat().st_size > 10_000, (name, path.stat().st_size)
    if os.environ.get("DPOOL_SCREENSHOTS"):
        out = Path(os.environ["DPOOL_SCREENSHOTS"])
        out.mkdir(parents=True, exist_ok=True)
        for path in shots.values():
            shutil.copyfile(path, out / path.name)


def test_a_page_rides_out_a_restart_of_the_coordinator_and_of_the_dashboard(browser, tmp_path: Path, processes: Processes) -> None:  # type: ignore[no-untyped-def]
    """The coordinator's dpd killed and started again, then the dashboard stopped and started
    again on its port: the open page says so each time and carries on by itself, never reloaded."""

    def js(script: str) -> str:
        return str(browser.execute_script(script))

    pool = LocalPool(processes, tmp_path)
    pool.start(1)
    d = start_dashboard(processes, tmp_path, pool.addr, poll=0.5)
    browser.get(d.url)
    wait_for("the node listed", lambda: "n0" in js("return document.getElementById('nodes').textContent"), 30)
    browser.execute_script("window.__stillHere = 'not reloaded';")

    # the coordinator goes away and comes back (same state, same address)
    n0 = pool.daemons["n0"]
    os.kill(n0.pid, signal.SIGKILL)
    n0.proc.wait()
    wait_for("the page to say the coordinator is silent", lambda: "not answering" in js("return document.getElementById('conn').textContent"), 30)
    pool.start_daemon("n0", serve=True)
    wait_for("the page live again", lambda: js("return document.getElementById('conn').textContent").strip() == "live", 60)

    # the dashboard goes away and comes back on its port
    d.proc.terminate()
    d.proc.wait(15)
    wait_for("the page to notice its stream ended", lambda: js("return document.body.getAttribute('data-live') || ''") == "reconnecting", 30)
    seen = js("return document.body.getAttribute('data-updated') || ''")  # the old dashboard's last word
    start_dashboard(processes, tmp_path, pool.addr, listen=f"127.0.0.1:{d.port}", poll=0.5, name="dashboard-again")
    wait_for("the page streaming again", lambda: js("return document.body.getAttribute('data-live') || ''") == "live", 60)
    wait_for("an update from the new dashboard", lambda: js("return document.body.getAttribute('data-updated') || ''") != seen, 30)
    assert js("return window.__stillHere") == "not reloaded"


# the last line a trainer printed, as long as a node carries one (ERROR_LINE_MAX): a path with no
# space to break it at, then words
LONG_ERROR = (
    "FileNotFoundError: /srv/datasets/" + "/".join(f"corpus-shard-{i:04d}" for i in range(9))
    + "/train.jsonl is not on this machine; " + " ".join(["copy the data folder to every node or name a folder they share"] * 3)
)[:400]


def test_no_page_is_wider_than_a_phone_or_a_desktop_window_and_a_long_error_can_be_read_whole(browser, tmp_path: Path, processes: Processes) -> None:  # type: ignore[no-untyped-def]
    """A job failed with a long error, jobs queued behind it, a node: at 400 px (a phone) and at
    1400 px, no page scrolls sideways; a table wider than the screen scrolls in its own box, where
    its last column can be reached; the list cuts a long error with an ellipsis and holds the whole
    of it in a tooltip. A real coordinator, its node a test's own (tests/fakenode.py)."""
    coordinator = Running(tmp_path / "coordinator")
    node = None
    try:
        node = FakeRank0(coordinator.addr, name="node-with-a-rather-long-name-0001")
        spec = parse_job({"name": "fails", "workers": {"min": 1, "max": 1}, "train": {"steps": 5, "warmup_steps": 1}, "recovery": {"max_restarts": 0}}).to_dict()
        failed = coordinator.call(m.Submit(job=spec, source="fails.toml"), m.Submitted).job_id
        generation = node.take(failed)
        node.report(m.NodeWorkerExited(job=failed, generation=generation, rank=0, slot=node.slot, code=3, stopped=False, error=LONG_ERROR))
        error = wait_for("the job failed", lambda: (s := coordinator.call(m.Status(job=failed), m.StatusReply).jobs[0]).state == "failed" and s.error, 20)
        assert LONG_ERROR in error
        queued = parse_job({"name": "waits", "workers": {"min": 64, "max": 64}, "train": {"steps": 5, "warmup_steps": 1}}).to_dict()
        for _ in range(3):
            coordinator.call(m.Submit(job=queued, source="waits.toml"), m.Submitted)
        d = start_dashboard(processes, tmp_path, coordinator.addr, poll=0.2)
        pages = {  # each page, and what it shows once it read the pool
            d.url: ("#nodes .node-name", "#active .state-queued"),
            d.url + "jobs": ("#jobs .state-failed",),
            d.url + f"jobs/{failed}": ("#events .failure", "#summary .error"),
        }

        def js(script: str, *args: object) -> Any:
            return browser.execute_script(script, *args)

        for width in (400, 1400):
            browser.set_window_size(width, 900)
            assert js("return window.innerWidth") == width
            for url, shown in pages.items():
                browser.get(url)
                wait_for(f"{url} drawn", lambda: all(js("return !!document.querySelector(arguments[0])", css) for css in shown), 30)  # noqa: B023
                wide, window = js("return [document.documentElement.scrollWidth, window.innerWidth]")
                assert wide <= window, (url, width, wide)
                # every table's last column can be brought on screen: the box around it scrolls
                cut = js("""
                    const out = [];
                    for (const table of document.querySelectorAll('main table')) {
                      let box = table.parentElement;
                      while (box && box !== document.body && !['auto', 'scroll'].includes(getComputedStyle(box).overflowX)) box = box.parentElement;
                      if (box && box !== document.body) box.scrollLeft = box.scrollWidth;
                      const last = table.querySelector('tr > :last-child').getBoundingClientRect();
                      if (last.right > window.innerWidth + 1) out.push([table.className, last.right]);
                    }
                    return out;""")
                assert cut == [], (url, width, cut)
        # the list's error column: cut with an ellipsis, the whole error in its tooltip
        browser.get(d.url + "jobs")
        wait_for("the list drawn", lambda: js("return !!document.querySelector('#jobs .state-failed')"), 30)
        text, title = js("const td = [...document.querySelectorAll('#jobs tr')].find(r => r.textContent.includes(arguments[0])).lastElementChild;"
                         "const t = td.querySelector('[title]'); return [td.textContent, t ? t.getAttribute('title') : null];", failed)
        assert title == error, (text, title)
        head = text.removesuffix("…").rstrip()
        assert text.endswith("…") and error.startswith(head) and len(head) < len(error), text
        assert error[len(head)].isspace(), text  # cut between two words, not in one
    finally:
        if node is not None:
            node.close()
        coordinator.stop()
