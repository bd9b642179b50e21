"""`dpctl demo --lm`: the fine-tuning flow of the README, offline, on a tiny language model.

It makes a tiny model that mlx-lm loads (random weights in the Hugging Face layout, a BPE tokenizer
trained on the spot, a chat template) and a chat data set, both with `dpool.trainer.tinylm` in a
child process (dpctl itself never imports MLX). The local pool then fine-tunes LoRA adapters on it,
one worker is killed mid-way and the pool resumes; at the end `dpctl export` fetches the adapters
over the control plane and `mlx_lm generate` answers the sample prompt with them. The model and the
adapters are kept in `./dpool-demo-lm/` (model/, adapters/; the next `demo --lm` replaces them), so
the `mlx_lm generate` line the demo prints still works after it exits and its pool is gone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from dpool.protocol.jobspec import JobSpec, parse_job

PROMPT = "What is 12 + 30?"
KEEP_DIR = "dpool-demo-lm"  # in the current folder, beside demo-loss.png
KEPT = frozenset({"model", "adapters"})


class AssetsFailed(RuntimeError):
    """The tiny model or its data could not be made (the message holds the tool's output)."""


def _run(cmd: list[str], what: str, timeout: float) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise AssetsFailed(f"{what}: no answer in {timeout:.0f}s") from None
    if done.returncode != 0:
        tail = "\n".join("    " + line for line in (done.stdout + done.stderr).strip().splitlines()[-12:])
        raise AssetsFailed(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def make_assets(root: Path) -> tuple[Path, Path]:
    """A tiny llama-architecture model and a chat data set under `root` (offline, a few seconds)."""
    model, data = root / "tiny-model", root / "chat-data"
    tool = [sys.executable, "-m", "dpool.trainer.tinylm"]
    _run([*tool, "model", str(model), "--arch", "llama"], "making the tiny model", 300)
    _run([*tool, "data", str(data), "--format", "chat", "--train", "160", "--valid", "24"], "making the chat data", 120)
    return model, data


def lm_job_text() -> str:
    return resources.files("dpool.client").joinpath("demo-lm.toml").read_text(encoding="utf-8")


def with_steps(doc: dict[str, Any], steps: int | None) -> dict[str, Any]:
    """A demo job file with `--steps N`: its warm-up scaled with it (the same share of the run,
    rounded down), so that a short demo is not refused for a warm-up longer than itself."""
    if steps is not None:
        train = doc["train"]
        train["warmup_steps"] = min(train.get("warmup_steps", 0), train.get("warmup_steps", 0) * steps // max(1, train["steps"]))
        train["steps"] = steps
    return doc


def lm_spec(steps: int | None, model: Path | None = None, data: Path | None = None) -> JobSpec:
    """The demo's LoRA job; the model and data paths are filled in once they exist."""
    doc = with_steps(tomllib.loads(lm_job_text()), steps)
    if model is not None and data is not None:
        doc["model"]["path"], doc["data"]["source"] = str(model), str(data)
    return parse_job(doc, source="demo-lm.toml")


def check_keep(dest: Path) -> None:
    """`dest` is free, or what an earlier demo kept (the demo replaces it); a folder that holds
    anything else is not the demo's to delete. Checked before training and again at the end."""
    if not (dest.exists() or dest.is_symlink()):
        return
    if not dest.is_dir() or dest.is_symlink() or {p.name for p in dest.iterdir()} - KEPT:
        raise AssetsFailed(
            f"{dest} exists and is not a folder an earlier `dpctl demo --lm` kept (model/ and adapters/ only); "
            "move it away, or run the demo in another folder"
        )


def replace_kept(new: Path, dest: Path) -> None:
    """`new` becomes `dest`, replacing the folder a previous demo kept there."""
    check_keep(dest)
    if dest.exists():
        shutil.rmtree(dest)
    new.rename(dest)


def keep(addr: str, job_id: str, model: Path, dest: Path) -> str:
    """The tiny model and the adapters `dpctl export` fetches, in `dest` (model/, adapters/),
    for use after the demo's temporary folder is gone; returns what dpctl said."""
    new = dest.with_name(f".{dest.name}.new")
    shutil.rmtree(new, ignore_errors=True)
    try:
        new.mkdir(parents=True)
        shutil.copytree(model, new / "model")
        adapters = new / "adapters"
        said = _run([sys.executable, "-m", "dpool.client.cli", "--coordinator", addr, "export", job_id, str(adapters)],
                    "dpctl export", 300)
        config = adapters / "adapter_config.json"  # names the base model: the kept copy, not the one about to go
        config.write_text(json.dumps({**json.loads(config.read_text()), "model": str(dest / "model")}, indent=4) + "\n")
        replace_kept(new, dest)
    finally:
        shutil.rmtree(new, ignore_errors=True)  # gone once renamed; else what a failure left half made
    return said.replace(str(new), str(dest))  # where the adapters are now


def export_and_generate(addr: str, job_id: str, model: Path, dest: Path) -> tuple[str, str]:
    """`dpctl export` the newest checkpoint into `dest` beside a copy of the model, then
    `mlx_lm generate` with them, as the demo's last line tells the user to: (what dpctl said, the
    generated text)."""
    said = keep(addr, job_id, model, dest)
    printed = _run(
        [sys.executable, "-m", "mlx_lm", "generate", "--model", str(dest / "model"), "--adapter-path", str(dest / "adapters"),
         "--prompt", PROMPT, "--max-tokens", "24", "--temp", "0.0"],
        "mlx_lm generate", 300,
    )
    parts = printed.split("==========")
    text = parts[1].removeprefix("\n").removesuffix("\n") if len(parts) >= 3 else printed.strip()
    return said.strip().splitlines()[0] if said.strip() else "", text
