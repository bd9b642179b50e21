"""`[eval] test`, `dpctl test` and `dpctl export --fuse` on a real local pool of two dpds: the test
loss reaches the metrics and `dpctl status`, a checkpoint's test loss comes back through the export
relay, and the fused model comes back as a model directory mlx-lm loads alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import HomesPool, Processes
from jobs import write_job

from dpool.trainer import tinylm

pytestmark = pytest.mark.slow

JOB = {
    "workers": {"min": 2, "max": 2},
    "model": {"kind": "mlx_lm", "path": "~/models/tiny", "lora_rank": 4, "lora_keys": ["self_attn.q_proj", "self_attn.v_proj"], "context": 512},
    "data": {"source": "~/data/chat", "mask_prompt": True},
    "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 1, "log_every_steps": 1},
    "checkpoint": {"every_steps": 2},
    "eval": {"every_steps": 4, "batches": 1, "sample_every_steps": 4, "sample_tokens": 4, "test": True},
}


def test_test_loss_in_status_dpctl_test_and_fused_export(processes: Processes, tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    tinylm.make_model(assets / "model", arch="llama", layers=2, seed=5)
    tinylm.make_chat_data(assets / "chat", train=16, valid=4, test=10, seed=6, fmt="chat")
    pool = HomesPool(processes, tmp_path)
    for name in ("n0", "n1"):
        home = pool.home(name)
        shutil.copytree(assets / "chat", home / "data" / "chat")
        shutil.copytree(assets / "model", home / "models" / "tiny")
    pool.start(1, 1)
    job = pool.submit(write_job(tmp_path, "tested", base=JOB))
    final = pool.wait_end(job, timeout=300)
    assert final.state == "succeeded", final
    status = pool.dpctl_json("status", job)
    (row,) = [r for r in pool.dpctl_json("metrics", job) if r["kind"] == "test"]
    assert row["step"] == 4 and status["test_loss"] == row["test_loss"], (row, status)

    r = pool.dpctl("test", job, "--json", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert got["step"] == 4 and got["examples"] == 8 and abs(got["test_loss"] - row["test_loss"]) <= 1e-5, (got, row)
    r = pool.dpctl("test", job, "--step", "2", timeout=180)
    assert r.returncode == 0 and f"of job {job} step 2 on 8 examples" in r.stdout, r.stdout + r.stderr

    fused = tmp_path / "fused"
    r = pool.dpctl("export", job, str(fused), "--fuse", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    from mlx_lm import generate, load

    model, tokenizer = load(str(fused))
    assert generate(model, tokenizer, "What is 2 + 3?", max_tokens=4)
    r = pool.dpctl("export", job, str(tmp_path / "x"), "--dequantize")
    assert r.returncode == 2 and "--fuse" in r.stderr, r.stderr
