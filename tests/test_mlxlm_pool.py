"""mlx-lm's own example config, submitted as it is to a pool of two dpds.

The config is mlx-lm's `examples/lora_config.yaml` (tests/test_mlxlm_config.py holds it) with a tiny
model and chat data made offline in place of its paths, and fewer iterations. Its paths are relative,
as mlx-lm users write them: dpctl takes them from its current folder (mlx-lm's rule), sends the files
into the pool (no node has them), and the job trains on both nodes on the curve of the hand-written
TOML of the same meaning, trained by one trainer process alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalPool, Processes
from test_mlxlm_config import EXAMPLE, HAND_WRITTEN

from dpool.client import stage
from dpool.protocol.jobspec import load_job, parse_job
from dpool.trainer import tinylm

pytestmark = pytest.mark.slow

ITERS = 12  # mlx-lm's example trains 1,000 iterations; the tiny model needs a dozen to show a curve


def shorten(text: str) -> str:
    """The example with a short run: fewer iterations, and evaluations and saves that fall in it."""
    for key, value in (("iters", ITERS), ("steps_per_eval", 6), ("save_every", 4), ("steps_per_report", 1), ("val_batches", 2)):
        lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line for line in text.splitlines()]
        text = "\n".join(lines) + "\n"
    return text


def test_mlx_lms_example_config_trains_on_two_dpds_as_its_hand_written_job(processes: Processes, tmp_path: Path) -> None:
    pool = LocalPool(processes, tmp_path / "pool")
    work = pool.root  # dpctl's current folder: the config's relative paths are taken from here
    work.mkdir(parents=True, exist_ok=True)
    tinylm.make_model(work / "mlx_model", arch="llama", seed=7)
    tinylm.make_chat_data(work / "data", train=40, valid=8, seed=8, fmt="chat")
    (work / "lora_config.yaml").write_text(shorten(EXAMPLE.format(model="mlx_model", data="data")))

    # The same job by hand (for its hash); the config trained by one trainer process alone, as
    # `python -m dpool.trainer lora_config.yaml` (the reference curve).
    hand = tmp_path / "hand.toml"
    text = HAND_WRITTEN.format(model=str(work / "mlx_model"), data=str(work / "data"))
    hand.write_text(shorten_toml(text))
    spec = load_job(hand)
    ref_dir = tmp_path / "reference"
    done = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", "lora_config.yaml", "--run-dir", str(ref_dir)], cwd=work,
        capture_output=True, text=True, timeout=300, env={**os.environ, "DPOOL_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = {r["step"]: r["loss"] for r in map(json.loads, (ref_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"}

    shown = pool.dpctl("submit", "--dry-run", "--json", "lora_config.yaml")
    assert shown.returncode == 0, shown.stderr
    pool.start(1, 1)
    job = pool.submit(Path("lora_config.yaml"))
    final = pool.wait_end(job, timeout=300)
    events = pool.dpctl_json("events", job)
    assert final.state == "succeeded" and final.world_size == 2, (final, events)
    rows = [r for r in pool.dpctl_json("metrics", job) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1))
    worst = max(abs(r["loss"] - reference[r["step"]]) for r in rows)
    assert worst < 1e-3, [(r["step"], r["loss"], reference[r["step"]]) for r in rows]
    status = pool.dpctl_json("status", job)
    assert status["name"] == "lora-config"
    # What submit sends names the files by content; so does the hand-written job's, made the same way.
    submitted = parse_job(json.loads(shown.stdout)["job"], source="dry-run")
    assert submitted.training_hash() == stage.with_content(spec)[0].training_hash()


def shorten_toml(text: str) -> str:
    swaps = {"steps = 1000": f"steps = {ITERS}", "every_steps = 100": "every_steps = 4", "every_steps = 200": "every_steps = 6",
             "log_every_steps = 10": "log_every_steps = 1", "batches = 25": "batches = 2"}
    for old, new in swaps.items():
        text = text.replace(old, new)
    return text


# LORA.md's list of Hugging Face datasets, as it is but for the paths (local folders of JSON lines
# that `datasets.load_dataset` reads offline, in place of the Hub ids) and a short run.
LORA_MD_HF = """\
model: "mlx_model"
train: true
iters: 6
batch_size: 4
steps_per_report: 1
steps_per_eval: 6
save_every: 3
val_batches: 1
hf_dataset:
  - path: "orca"
    train_split: "train[:90%]"
    valid_split: "train[-10%:]"
    prompt_feature: "question"
    completion_feature: "response"
  - path: "ultrafeedback"
    train_split: "train[:90%]"
    valid_split: "train[-10%:]"
    chat_feature: "chosen"
"""


def test_lora_mds_list_of_hugging_face_datasets_trains_on_two_dpds(processes: Processes, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("datasets")
    import random

    offline = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    for k, v in offline.items():
        monkeypatch.setenv(k, v)  # the dpds and their trainers inherit it
    pool = LocalPool(processes, tmp_path / "pool")
    work = pool.root
    work.mkdir(parents=True, exist_ok=True)
    tinylm.make_model(work / "mlx_model", arch="llama", seed=7)
    rng = random.Random(9)
    (work / "orca").mkdir()
    (work / "orca" / "train.jsonl").write_text("".join(
        json.dumps({"question": r["prompt"], "response": r["completion"]}) + "\n" for r in tinylm.examples("completions", 40, rng)))
    (work / "ultrafeedback").mkdir()
    (work / "ultrafeedback" / "train.jsonl").write_text("".join(
        json.dumps({"chosen": r["messages"], "rejected": r["messages"][:1]}) + "\n" for r in tinylm.examples("chat", 30, rng)))
    (work / "hf.yaml").write_text(LORA_MD_HF)
    pool.start(1, 1)
    job = pool.submit(Path("hf.yaml"))
    final = pool.wait_end(job, timeout=300)
    events = pool.dpctl_json("events", job)
    assert final.state == "succeeded" and final.world_size == 2, (final, events)
    rows = pool.dpctl_json("metrics", job)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7)), train
    assert [r for r in rows if r["kind"] == "eval"], rows
    # Both datasets, concatenated as mlx-lm does: 90% of 40 and of 30 train, 10% of each held out.
    logs = pool.dpctl("logs", job)
    assert '"examples":[63,7]' in logs.stdout.replace(" ", ""), logs.stdout[-2000:]
