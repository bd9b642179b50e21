"""bench/comm.py in its smallest form, so that it cannot rot: a one-layer GPT of width 32 on three
ranks in network namespaces, every link shaped in turn, every figure measured, and nothing left
behind (namespaces, links). With `--pin`, so that each rank's core is checked too. Needs Linux, root, iproute2 and tc (skipped otherwise). Timings are the
bench's to judge, not the test's: only that each was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_shaped_links

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "bench" / "comm.py"
LINKS = {"unlimited", "1gbit", "300mbit"}
METHODS = {"bucketed fp32", "bucketed bf16", "fused fp32 (before)", "mlx-lm average_gradients"}
STEPS, H = 8, 2


@pytest.mark.long
def test_the_smallest_form_measures_every_figure_and_removes_its_links(tmp_path: Path) -> None:
    require_shaped_links("dpcmprobe")
    out = tmp_path / "comm.json"
    cmd = [sys.executable, str(BENCH), "--steps", str(STEPS), "--quick-steps", "5", "--reps", "1", "--inner-steps", f"{H},{H}:bf16",
           "--layers", "1", "--dim", "32", "--global-batch", "6", "--eval-batches", "1", "--large-layers", "0",
           "--pin", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert doc["ok"]
    measured, figures = doc["measured"], doc["figures"]
    # --pin: rank i ran on core i mod the machine's cores, and on no other
    assert measured["hosts"] == ["r0", "r1", "r2"]
    assert measured["affinity"] == [[r % os.cpu_count()] for r in range(3)]

    # 1. every method measured on every link; each call sent bytes
    assert set(measured["allsum"]) == LINKS
    for link, cases in measured["allsum"].items():
        assert set(cases) == {"train"}  # (the larger GPT of figure 1 is off: --large-layers 0)
        for case in cases.values():
            assert case["bytes"] > 0 and set(case["methods"]) == METHODS
            for m in case["methods"].values():
                assert m["median_s"] > 0 and m["wire_bytes_per_call"] > 0 and m["peak_extra_bytes"] > 0
            # bfloat16 halves what the gradients send
            assert case["methods"]["bucketed bf16"]["wire_bytes_per_call"] < case["methods"]["bucketed fp32"]["wire_bytes_per_call"]
        assert all("predicted_s" in c for c in cases.values()) == (link != "unlimited")
    assert set(figures["allsum"]) == {f"{link}/train" for link in LINKS}

    # 2. the share, measured on every link and predicted on the shaped ones
    assert set(figures["share"]) == LINKS
    for link, row in figures["share"].items():
        assert row["step_s"] > 0 and row["allsum_s"] > 0 and row["measured"] > 0
        if link != "unlimited":
            assert 0 < row["predicted"] <= 1 and row["error"] >= 0 and isinstance(row["met"], bool)

    # 3. the runs on the slow link, each with its tokens, bytes and final validation loss
    train = measured["train"]
    assert {f"sync-{link}" for link in LINKS} <= set(train)
    for run in train.values():
        assert run["tokens_total"] > 0 and run["seconds_per_token"] > 0 and run["val_loss"] > 0
        assert all(n > 0 for n in run["sent_bytes"].values())
    if isinstance(measured.get("diloco"), str):  # a trainer without DiLoCo: said, not measured
        assert figures["diloco"] == {}
    else:
        assert set(figures["diloco"]) == {f"H={H}", f"H={H} bf16"}
        for d in figures["diloco"].values():
            assert d["bytes_per_token_measured"]["ratio"] > 0 and d["seconds_per_token"]["speedup"] > 0 and d["val_loss"]["step"] == STEPS
        # the model's count: one all_sum per H steps, of half the bytes in bfloat16
        assert figures["diloco"][f"H={H}"]["bytes_per_token_model"]["ratio"] == H
        assert figures["diloco"][f"H={H} bf16"]["bytes_per_token_model"]["ratio"] == 2 * H
        assert train[f"diloco-h{H}-300mbit"]["steps"] == train[f"diloco-h{H}-bf16-300mbit"]["steps"] == STEPS

    # nothing left: the namespaces and the links are gone
    tag = doc["tag"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"dpcm{tag}-" not in namespaces and f"dpcm{tag}" not in links and f"cm{tag}h" not in links
    assert not Path(doc["root"]).exists()
