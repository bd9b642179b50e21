"""An mlx-lm fine-tune on a real local pool: a killed worker, an export over the control plane, and
a worker that lacks the model.

Each daemon runs with its own HOME, so `~/models/...` in the job names a different folder on each
"machine", as it would across Macs: paths are resolved where the training runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HomesPool, Processes
from jobs import write_job

from dpool.trainer import tinylm

pytestmark = pytest.mark.slow

STEPS = 18
TOL = 1e-3
LORA = {  # LoRA on the tiny llama at ~/models/tiny, chat data at ~/data/chat: paths of each node's HOME
    "workers": {"min": 1, "max": 3},
    "model": {"kind": "mlx_lm", "path": "~/models/tiny", "fine_tune": "lora", "lora_rank": 4, "lora_layers": 8, "context": 160},
    "data": {"source": "~/data/chat", "mask_prompt": True},
    "train": {"steps": STEPS, "global_batch": 12, "micro_batch": 4, "lr": 1e-2, "warmup_steps": 1, "log_every_steps": 1},
    "checkpoint": {"every_steps": 3},
    "eval": {"every_steps": STEPS, "batches": 1, "sample_every_steps": STEPS, "sample_tokens": 8},
}


class HomePool(HomesPool):
    """One-slot daemons, each with its own HOME (its own `~`)."""

    def give(self, name: str, assets: Path, *, model: bool = True) -> None:
        home = self.home(name)
        (home / "data").mkdir(parents=True, exist_ok=True)
        shutil.copytree(assets / "chat", home / "data" / "chat", dirs_exist_ok=True)
        if model:
            (home / "models").mkdir(exist_ok=True)
            shutil.copytree(assets / "model", home / "models" / "tiny", dirs_exist_ok=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm-pool")
    tinylm.make_model(root / "model", arch="llama", seed=5)
    tinylm.make_chat_data(root / "chat", train=48, valid=12, seed=6, fmt="chat")
    return root


@pytest.fixture
def pool(processes: Processes, tmp_path: Path) -> HomePool:
    return HomePool(processes, tmp_path, warm=True)  # a killed worker: mlx-lm trainers kept warm too


def reference_curve(assets: Path, tmp_path: Path) -> dict[int, float]:
    """The fault-free curve: the same job trained by one trainer process alone."""
    home = tmp_path / "home-reference"
    (home / "models").mkdir(parents=True)
    shutil.copytree(assets / "model", home / "models" / "tiny")
    shutil.copytree(assets / "chat", home / "data" / "chat")
    job = write_job(tmp_path, "reference", base=LORA)
    done = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(job), "--run-dir", str(tmp_path / "reference")],
        env={**os.environ, "HOME": str(home)}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_lora_on_three_workers_survives_a_killed_worker_and_exports(pool: HomePool, assets: Path, tmp_path: Path) -> None:
    for name in ("n0", "n1", "n2"):
        pool.give(name, assets)
    pool.start(1, 1, 1)
    job = pool.submit(write_job(tmp_path, "lora", base=LORA))
    pool.wait_status(job, "the job mid-run on 3 workers", lambda s: s.state == "running" and s.step >= 5 and s.world_size == 3, 180, every=0.05)
    (victim,) = pool.trainer_pids("n1", job)
    os.kill(victim, signal.SIGKILL)
    final = pool.wait_end(job, timeout=300)
    events = pool.dpctl_json("events", job)
    assert final.state == "succeeded", (final, events)
    assert any(e["kind"] == "group.resumed" and e["cause"] == "failure" for e in events), events
    rows = [r for r in pool.dpctl_json("metrics", job) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ref = reference_curve(assets, tmp_path)
    worst = max(abs(r["loss"] - ref[r["step"]]) for r in rows)
    assert worst < TOL, [(r["step"], r["loss"], ref[r["step"]], r["generation"]) for r in rows]

    # dpctl export fetches the newest checkpoint over the control plane; mlx-lm loads it.
    out = tmp_path / "adapters"
    r = pool.dpctl("export", job, str(out), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
    from mlx_lm import load

    model, _ = load(str(assets / "model"), adapter_path=str(out))
    assert model is not None


def test_a_worker_without_the_model_fetches_it_from_the_one_that_has_it(pool: HomePool, assets: Path, tmp_path: Path) -> None:
    """Submitted from a machine without the files: n0 has the model and n1 does not. n0 names the
    job's content, n1 fetches the model from it, and both train."""
    pool.give("n0", assets)
    pool.give("n1", assets, model=False)  # the data, but no ~/models/tiny on this machine
    pool.start(1, 1)
    job = pool.submit(write_job(tmp_path, "missing", base=LORA, workers={"min": 2}, train={"steps": 4}))
    final = pool.wait_end(job, timeout=180)
    events = pool.dpctl_json("events", job)
    assert final.state == "succeeded" and final.world_size == 2, (final, events)
    named = [e for e in events if e["kind"] == "job.content"]  # one event, or two if n1 named the data first
    assert {"data", "model"} <= {k for e in named for k in e} and [e["node"] for e in named if "model" in e] == ["n0"], named
    assert [e["node"] for e in events if e["kind"] == "node.staged"] == ["n1"], events
    assert not [e for e in events if e["kind"] in ("worker.failed", "group.resumed")], events


def test_a_model_and_data_only_on_the_submitting_machine_train_on_three_nodes_and_export(pool: HomePool, assets: Path, tmp_path: Path) -> None:
    """The laptop case: dpctl's machine holds the model and the data; no node does. Submit sends
    them once into the pool, the nodes fetch them from each other, and the job trains on all three
    on the fault-free curve; a second submit of the same files sends nothing."""
    laptop = tmp_path / "home-laptop"
    (laptop / "models").mkdir(parents=True)
    shutil.copytree(assets / "model", laptop / "models" / "tiny")
    shutil.copytree(assets / "chat", laptop / "data" / "chat")
    pool.start(1, 1, 1)
    path = write_job(tmp_path, "laptop", base=LORA, workers={"min": 3, "max": 3})
    env = {**os.environ, "HOME": str(laptop)}
    cmd = [sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "submit", str(path)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0 and "sending" in first.stderr, first.stderr
    job = first.stdout.strip()
    final = pool.wait_end(job, timeout=300)
    events = pool.dpctl_json("events", job)
    assert final.state == "succeeded" and final.world_size == 3 and final.generation == 1, (final, events)
    staged = sorted(e["node"] for e in events if e["kind"] == "node.staged")
    assert len(staged) == 2, events  # the node that took the upload held it already; the others fetched it
    rows = [r for r in pool.dpctl_json("metrics", job) if r["kind"] == "train"]
    ref = reference_curve(assets, tmp_path)
    assert max(abs(r["loss"] - ref[r["step"]]) for r in rows) < TOL
    out = tmp_path / "adapters"
    r = pool.dpctl("export", job, str(out), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    # the base as the job named it, not the exporting node's staged copy in its cache
    assert json.loads((out / "adapter_config.json").read_text())["model"] == "~/models/tiny"
    from mlx_lm import load

    model, _ = load(str(assets / "model"), adapter_path=str(out))
    assert model is not None
    again = subprocess.run([*cmd, "--set", "name=laptop-again"], capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0 and "sending" not in again.stderr, again.stderr
    pool.dpctl("cancel", again.stdout.strip())


@pytest.mark.long
def test_adapters_to_start_from_travel_with_the_job_like_the_model(pool: HomePool, assets: Path, tmp_path: Path) -> None:
    """`model.adapters` on the submitting machine only: the nodes fetch them with the model and the
    data, and the job starts from them (its first step is the one a trainer beside the files takes)."""
    laptop = tmp_path / "home-laptop"
    (laptop / "models").mkdir(parents=True)
    shutil.copytree(assets / "model", laptop / "models" / "tiny")
    shutil.copytree(assets / "chat", laptop / "data" / "chat")
    env = {**os.environ, "HOME": str(laptop)}
    # Adapters worth starting from: 3 steps of the job, exported.
    first = write_job(tmp_path, "first", base=LORA, train={"steps": 3})
    run = subprocess.run([sys.executable, "-m", "dpool.trainer", str(first), "--run-dir", str(tmp_path / "first")], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = subprocess.run([sys.executable, "-m", "dpool.trainer", str(first), "--run-dir", str(tmp_path / "first"), "--export", str(laptop / "adapters")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = write_job(tmp_path, "from-adapters", base=LORA, model={"adapters": "~/adapters"}, workers={"min": 2, "max": 2}, train={"steps": 2})
    alone = subprocess.run([sys.executable, "-m", "dpool.trainer", str(resumed), "--run-dir", str(tmp_path / "alone")], env=env, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    reference = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "alone" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"}

    pool.start(1, 1)  # no node holds the model, the data or the adapters
    sub = subprocess.run([sys.executable, "-m", "dpool.client.cli", "--coordinator", pool.addr, "submit", str(resumed)], capture_output=True, text=True, timeout=120, env=env)
    assert sub.returncode == 0 and "sending" in sub.stderr, sub.stderr
    job = sub.stdout.strip()
    final = pool.wait_end(job, timeout=300)
    events = pool.dpctl_json("events", job)
    assert final.state == "succeeded" and final.world_size == 2, (final, events)
    rows = {r["step"]: r["loss"] for r in pool.dpctl_json("metrics", job) if r["kind"] == "train"}
    assert max(abs(rows[s] - reference[s]) for s in reference) < TOL, (rows, reference)
    fresh = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"}
    assert abs(rows[1] - fresh[1]) > 10 * TOL, "the job started from the adapters, not from fresh ones"
