"""bench/staging.py in its smallest form, so that it cannot rot: 8 MiB of files staged through a pool
of real dpds, every figure measured, and nothing left behind (namespaces, links, processes, files).
In network namespaces with shaped links where this runs as root (skipped otherwise); on loopback,
nothing shaped, everywhere. Timings are the bench's to judge, not the test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import require_shaped_links, shaped_links_missing

from dpool.client.localpool import processes_with

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "bench" / "staging.py"
SIZE = 8 << 20
WINDOW_STEPS = 5


def run_bench(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(BENCH), "--size", "8MiB", "--window-steps", str(WINDOW_STEPS), "--rounds", "1", "--json", str(out), *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return json.loads(out.read_text()), r.stdout


def check_figures(doc: dict[str, Any], printed: str) -> None:
    figures = doc["figures"]
    assert doc["ok"] and set(figures) == {"1", "1b", "2", "3", "4", "5"}, doc
    for key, f in figures.items():
        assert f"{key:3} {f['label']}" in printed  # each figure printed, beside its baseline
    # every fetching node got the files whole; the pool's own records say so
    assert figures["1"]["data"]["bytes"] == SIZE and figures["1"]["data"]["staged_s"] > 0
    assert figures["4"]["data"]["staged_s"] > 0  # the node whose source was killed (if it was in time) completed
    assert set(figures["2"]["data"]["each_s"]) == {"n3", "n4", "n5", "n6"}
    # a second submit of the same files sends none of them
    assert figures["3"]["data"]["second_sent"] is False and figures["3"]["met"] is True
    # the training group's steps were measured without staging, before and after a node staged beside it
    assert len(figures["5"]["data"]["without_ms"]) >= 2 * WINDOW_STEPS
    assert [(g["node"], g["bytes"]) for g in figures["5"]["data"]["staged"]] == [("n7", SIZE)]
    root = Path(doc["root"])
    assert not root.exists()  # the files and logs are gone after a run that measured everything
    assert processes_with(f"{root}{os.sep}") == []


@pytest.mark.long
def test_the_smallest_form_on_loopback_measures_every_figure_and_leaves_nothing(tmp_path: Path) -> None:
    """The form for machines without root. Where namespaces can be built, the form below runs
    instead: it measures every figure through the same code (only the hosts' addresses and link
    counters differ), and the two together took 40 s of the suite's 20 minutes."""
    if shaped_links_missing("dpsbprobe") is None:
        pytest.skip("the namespace form runs here and measures every figure (the loopback form is for machines without root)")
    doc, printed = run_bench(tmp_path, "--loopback")
    check_figures(doc, printed)
    assert doc["figures"]["3"]["data"]["second_link_bytes"] is None  # no per-host links on loopback


@pytest.mark.long
@pytest.mark.netns
def test_the_smallest_form_in_namespaces_shapes_the_links_and_removes_them(tmp_path: Path) -> None:
    require_shaped_links("dpsbprobe")
    doc, printed = run_bench(tmp_path)
    check_figures(doc, printed)
    assert "1gbit" in doc["links"], doc["links"]
    # the second submit's bytes on the laptop's link: the offer and the submit, far below one chunk
    assert 0 < doc["figures"]["3"]["data"]["second_link_bytes"] < 1 << 20
    assert doc["figures"]["3"]["data"]["first_link_bytes"] >= SIZE
    tag = doc["tag"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"dpsb{tag}-" not in namespaces and f"dpsb{tag}" not in links and f"sb{tag}h" not in links
