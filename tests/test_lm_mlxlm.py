"""The mlx-lm options of issue 20 that shape what is trained and what comes out: which layers
(`lora_keys`, `lora_layers = -1`, full on the last blocks), starting from adapters, the test loss
and the fused export. Each is compared with mlx-lm's own code on a tiny model made offline."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import ring
from jobs import write_job
from mlx.utils import tree_flatten

from dpool.protocol.jobspec import JobFileError, load_job, parse_job
from dpool.trainer import tinylm
from dpool.trainer.lm import LMTask, ModelError

LM = {
    "model": {"kind": "mlx_lm", "lora_rank": 4},
    "train": {"global_batch": 4, "warmup_steps": 1, "log_every_steps": 1, "micro_batch": 4, "lr": 1e-2},
    "checkpoint": {"keep": 3},
    "eval": {"batches": 1, "sample_tokens": 4, "every_steps": 1000, "sample_every_steps": 1000},
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lmx")
    tinylm.make_model(root / "llama", arch="llama", layers=3, seed=1)
    tinylm.make_chat_data(root / "chat", train=24, valid=8, test=10, seed=3, fmt="chat")
    return root


def lm_job(assets: Path, folder: Path, name: str = "lmx", *, model: dict | None = None, **sections) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return write_job(
        folder, name, base=LM,
        model={"path": str(assets / "llama"), "context": 512, **(model or {})},
        data={"source": str(assets / "chat"), "mask_prompt": True, **sections.pop("data", {})},
        train={"steps": 4, **sections.pop("train", {})},
        **sections,
    )


def trained_shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(model.trainable_parameters())}


def mlx_lm_trained(path: Path, fine_tune: str, num_layers: int, params: dict) -> dict[str, tuple[int, ...]]:
    """What `mlx_lm lora` trains for this config: train_model's own setup, step by step."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(path))
    model.freeze()
    if fine_tune == "full":
        for layer in model.layers[-max(num_layers, 0):]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune == "dora")
    return trained_shapes(model)


CASES = [
    ("lora", {"lora_keys": ["self_attn.q_proj", "self_attn.v_proj"]}, 16, ["self_attn.q_proj", "self_attn.v_proj"]),
    ("dora", {"lora_keys": ["mlp.down_proj"], "lora_layers": 2}, 2, ["mlp.down_proj"]),
    ("lora", {"lora_layers": -1}, -1, None),
    ("lora", {"lora_layers": 1}, 1, None),
    ("full", {"lora_layers": 2}, 2, None),
    ("full", {"lora_layers": -1}, -1, None),
]


@pytest.mark.parametrize(("fine_tune", "model", "num_layers", "keys"), CASES, ids=[f"{c[0]}-{c[2]}-{bool(c[3])}" for c in CASES])
def test_trained_parameters_are_exactly_mlx_lms(assets, tmp_path, fine_tune, model, num_layers, keys):
    spec = load_job(lm_job(assets, tmp_path, model={"fine_tune": fine_tune, **model}))
    ours = trained_shapes(LMTask(spec, tmp_path / "cache", with_data=False).model)
    params = {"rank": 4, "scale": 20.0, "dropout": 0.0} | ({"keys": keys} if keys else {})
    theirs = mlx_lm_trained(assets / "llama", fine_tune, num_layers, params)
    assert ours == theirs
    if keys:
        assert ours and all(any(f".{k}." in name for k in keys) for name in ours), sorted(ours)


def test_full_without_lora_layers_still_trains_the_whole_model_and_keeps_its_hash(assets, tmp_path):
    spec = load_job(lm_job(assets, tmp_path, model={"fine_tune": "full"}))
    task = LMTask(spec, tmp_path / "cache", with_data=False)
    assert trained_shapes(task.model) == {k: tuple(v.shape) for k, v in tree_flatten(task.model.parameters())}
    given = parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m", "fine_tune": "full", "lora_layers": 16}, "data": {"source": "d"}})
    unset = parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m", "fine_tune": "full"}, "data": {"source": "d"}})
    assert given.training_hash() != unset.training_hash()  # they train different parameters
    lora16 = parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m", "lora_layers": 16}, "data": {"source": "d"}})
    lora = parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m"}, "data": {"source": "d"}})
    assert lora16.training_hash() == lora.training_hash() == "0f65cb49bd9f06b3"  # the hash jobs had before the new keys


def test_a_key_that_names_no_linear_layer_is_refused_naming_it_and_what_exists(assets, tmp_path):
    spec = load_job(lm_job(assets, tmp_path, model={"lora_keys": ["self_attn.q_proj", "attn.qq"]}))
    with pytest.raises(ModelError, match=r"model.lora_keys: 'attn.qq' names no linear layer.*self_attn.q_proj"):
        LMTask(spec, tmp_path / "cache", with_data=False)
    with pytest.raises(JobFileError, match=r"model.lora_keys"):
        parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m", "lora_keys": []}, "data": {"source": "d"}})
    with pytest.raises(JobFileError, match=r"model.lora_layers.*-1"):
        parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m", "lora_layers": 0}, "data": {"source": "d"}})
    with pytest.raises(JobFileError, match=r"model.adapters.*'lora' or 'dora'"):
        parse_job({"name": "x", "model": {"kind": "mlx_lm", "path": "m", "fine_tune": "full", "adapters": "a"}, "data": {"source": "d"}})


@pytest.mark.parametrize(("damage", "said"), [
    (lambda d: (d / "config.json").write_text("[1]"), r"config\.json holds a list; expected a JSON object"),
    (lambda d: (d / "config.json").write_text("{not json"), r"config\.json is not readable JSON"),
    (lambda d: [os.truncate(f, 1000) for f in d.glob("*.safetensors")], r"model\.safetensors is not a safetensors file \(its header says \d+ bytes, in a file of 1000\)"),
    (lambda d: [os.truncate(f, f.stat().st_size - 10) for f in d.glob("*.safetensors")], r"model\.safetensors is cut short: its tensors end at byte \d+, the file has \d+"),
    (lambda d: [f.write_bytes(b"\x10" + bytes(7) + b"{not json at all" + bytes(64)) for f in d.glob("*.safetensors")], r"model\.safetensors is not a safetensors file \(JSONDecodeError"),
], ids=["config-a-list", "config-not-json", "weights-cut-short", "weights-lose-their-end", "weights-header-garbage"])
def test_a_damaged_model_directory_is_a_model_error_naming_what(assets, tmp_path, damage, said):
    """Not a traceback from inside mlx-lm (AttributeError, MLX's RuntimeError: exit 1, as if a peer
    were lost): ModelError, exit 2, naming the model and what is wrong with it."""
    model = tmp_path / "model"
    shutil.copytree(assets / "llama", model)
    damage(model)
    with pytest.raises(ModelError, match=said) as e:
        LMTask(load_job(lm_job(assets, tmp_path / "j", model={"path": str(model)})), tmp_path / "cache", with_data=False)
    assert "\n" not in str(e.value)


def write_adapters(folder: Path, weights: dict, config: dict | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_start_from_adapters_loads_them_as_mlx_lm_and_refuses_what_does_not_fit(assets, tmp_path):
    keys = {"lora_keys": ["self_attn.q_proj"], "lora_layers": 2}
    spec = load_job(lm_job(assets, tmp_path / "a", model=keys))
    shapes = trained_shapes(LMTask(spec, tmp_path / "cache", with_data=False).model)
    rng = np.random.default_rng(0)
    weights = {k: mx.array(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    folder = write_adapters(tmp_path / "adapters", weights, {"fine_tune_type": "lora", "lora_parameters": {"rank": 4}})

    for given in (folder, folder / "adapters.safetensors"):
        task = LMTask(load_job(lm_job(assets, tmp_path / "b", model={**keys, "adapters": str(given)})), tmp_path / "cache", with_data=False)
        loaded = dict(tree_flatten(task.model.trainable_parameters()))
        assert sorted(loaded) == sorted(weights)
        assert all(mx.array_equal(loaded[k], weights[k]).item() for k in weights)
        assert "adapters" in task.fingerprints

    # mlx-lm's resume_adapter_file on the same config ends with the same trained parameters.
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(assets / "llama"))
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]})
    model.load_weights(str(folder / "adapters.safetensors"), strict=False)
    theirs = dict(tree_flatten(model.trainable_parameters()))
    assert sorted(theirs) == sorted(loaded) and all(mx.array_equal(theirs[k], loaded[k]).item() for k in theirs)

    def refused(model: dict, match: str) -> None:
        with pytest.raises(ModelError, match=match):
            LMTask(load_job(lm_job(assets, tmp_path / "c", model=model)), tmp_path / "cache", with_data=False)

    refused({"lora_keys": ["self_attn.q_proj"], "lora_layers": 1, "adapters": str(folder)}, r"'model\.layers\.1\.self_attn\.q_proj\.lora_[ab]', which is not a trained parameter")
    refused({"fine_tune": "dora", **keys, "adapters": str(folder)}, r"fine_tune_type = 'lora'.*model.fine_tune = 'dora'")
    bad_rank = write_adapters(tmp_path / "rank8", weights, {"fine_tune_type": "lora", "lora_parameters": {"rank": 8}})
    refused({**keys, "adapters": str(bad_rank)}, r"lora_parameters.rank = 8.*model.lora_rank = 4")
    name = next(iter(weights))
    reshaped = write_adapters(tmp_path / "shape", {name: mx.zeros((3, 3))}, None)
    refused({**keys, "adapters": str(reshaped)}, rf"{re.escape(name)}' has shape \(3, 3\)")
    with pytest.raises(JobFileError, match=r"model.adapters.*no adapters.safetensors"):
        from dpool.protocol.jobspec import check_paths

        check_paths(load_job(lm_job(assets, tmp_path / "d", model={"adapters": str(tmp_path / "nowhere")})), "job")


def trainer(job_file: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(job_file), "--run-dir", str(run_dir), *args],
        env=ring.trainer_env(), capture_output=True, text=True, timeout=300,
    )


def mlx_lm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_lm", *args], env=ring.trainer_env(), capture_output=True, text=True, timeout=300)


def test_test_loss_is_mlx_lms_on_two_ranks_and_for_a_checkpoint(assets, tmp_path):
    # 10 test examples in batches of 4: mlx-lm scores the first 8, and so does dpool.
    job_file = lm_job(assets, tmp_path, eval={"test": True}, checkpoint={"every_steps": 2})
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 2, tmp_path / "logs", env={"DPOOL_CACHE_DIR": str(tmp_path / "cache")})
    reported = ring.metrics(run_dir, "test")[4]["test_loss"]

    out = tmp_path / "adapters"
    assert trainer(job_file, run_dir, "--export", str(out)).returncode == 0
    scored = mlx_lm("lora", "--model", str(assets / "llama"), "--adapter-path", str(out), "--data", str(assets / "chat"),
                    "--test", "--test-batches", "-1", "--batch-size", "4", "--mask-prompt", "--max-seq-length", "512")
    match = re.search(r"Test loss ([0-9.]+)", scored.stdout + scored.stderr)
    assert match, scored.stdout[-2000:] + scored.stderr[-2000:]
    assert abs(float(match.group(1)) - reported) <= 1e-3, (match.group(1), reported)

    # The trainer's --test (what `dpctl test` runs on a node) gives the same for the last step, and
    # another loss for an earlier one.
    for step in (4, 2):
        done = trainer(job_file, run_dir, "--test", str(tmp_path / f"test-{step}"), "--step", str(step))
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads((tmp_path / f"test-{step}" / "test.json").read_text())
        assert (got["step"], got["examples"]) == (step, 8)
        if step == 4:
            assert abs(got["test_loss"] - reported) <= 1e-5, (got, reported)
        else:
            assert abs(got["test_loss"] - reported) > 1e-4, (got, reported)


def test_test_without_a_test_jsonl_is_refused_at_start_naming_it(assets, tmp_path):
    data = tmp_path / "data"
    tinylm.make_chat_data(data, train=24, valid=8, seed=3, fmt="chat")
    job_file = lm_job(assets, tmp_path, eval={"test": True}, data={"source": str(data)})
    done = trainer(job_file, tmp_path / "run")
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"data.source = '{data}'" in done.stderr and "test.jsonl" in done.stderr and "does not exist" in done.stderr, done.stderr


@pytest.mark.parametrize("base", ["llama-4bit"])  # the quantized base: fusing dequantizes, requantizes (a plain base: tests/test_lm_mlxlm_pool.py)
def test_fused_export_loads_without_adapters_generates_and_computes_the_adapter_models_logits(assets, tmp_path, base):
    from mlx_lm import generate, load

    if not (assets / base).is_dir():
        tinylm.quantize(assets / "llama", assets / base, bits=4)
    extra = ["--dequantize"] if base.endswith("4bit") else []
    job_file = lm_job(assets, tmp_path, model={"path": str(assets / base), "lora_keys": ["self_attn.q_proj", "mlp.up_proj"]},
                      checkpoint={"every_steps": 4})
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env={"DPOOL_CACHE_DIR": str(tmp_path / "cache")})
    adapters, fused = tmp_path / "adapters", tmp_path / "fused"
    assert trainer(job_file, run_dir, "--export", str(adapters)).returncode == 0
    done = trainer(job_file, run_dir, "--export", str(fused), "--fuse", *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in fused.iterdir()}
    assert not (fused / "adapters.safetensors").exists()
    config = json.loads((fused / "config.json").read_text())
    assert ("quantization" in config) == (base.endswith("4bit") and not extra)

    with_adapters, tokenizer = load(str(assets / base), adapter_path=str(adapters))
    alone, tokenizer2 = load(str(fused))
    assert not any("lora" in k for k, _ in tree_flatten(alone.parameters()))
    prompt = mx.array(tokenizer.encode("What is 2 + 3?"))[None]
    a, b = with_adapters(prompt), alone(prompt)
    base_model, _ = load(str(assets / base))
    assert float(mx.abs(a - base_model(prompt)).max()) > 1e-3  # the adapters change the output
    assert float(mx.abs(a - b).max()) <= 1e-4
    assert generate(alone, tokenizer2, "What is 2 + 3?", max_tokens=6)  # it generates

    cli = mlx_lm("generate", "--model", str(fused), "--prompt", "What is 2 + 3?", "--max-tokens", "6")
    assert cli.returncode == 0 and re.search(r"Generation: [1-9]\d* tokens", cli.stdout), cli.stdout + cli.stderr


def test_fuse_of_a_full_fine_tune_is_its_model_and_flags_are_checked(assets, tmp_path):
    job_file = lm_job(assets, tmp_path, model={"fine_tune": "full", "lora_layers": 1}, checkpoint={"every_steps": 4}, train={"lr": 1e-3})
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env={"DPOOL_CACHE_DIR": str(tmp_path / "cache")})
    plain, fused = tmp_path / "plain", tmp_path / "fused"
    assert trainer(job_file, run_dir, "--export", str(plain)).returncode == 0
    assert trainer(job_file, run_dir, "--export", str(fused), "--fuse").returncode == 0
    from mlx_lm import load

    prompt = mx.array([[1, 5, 9, 13]])
    assert mx.array_equal(load(str(plain))[0](prompt), load(str(fused))[0](prompt)).item()
    bad = trainer(job_file, run_dir, "--export", str(tmp_path / "x"), "--dequantize")
    assert bad.returncode == 2 and "--dequantize goes with --fuse" in bad.stderr, bad.stderr


def test_a_batch_larger_than_the_training_set_is_refused_at_start_naming_both(assets, tmp_path):
    """mlx-lm refuses a batch_size above the number of training examples; dpool trained on, each
    step's batch holding examples two or three times."""
    job_file = lm_job(assets, tmp_path, train={"global_batch": 40})  # 24 examples
    done = trainer(job_file, tmp_path / "run")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "train.global_batch = 40 is more than the 24 training examples" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("key", ["model.path", "data.source"])
def test_a_relative_path_found_only_under_the_current_folder_is_refused_naming_the_key(assets, tmp_path, key):
    """`path = "models/tiny"` in jobs/job.toml, run from a folder that holds models/tiny: the path is
    taken from the job file's folder, which has none, so it read as a Hugging Face id, and mlx-lm
    then loaded the current folder's copy (the trainer ended with exit 1 and a Hub error), while
    `datasets` trained on the current folder's data. The same job file trained different things
    from different folders; now it is refused, naming the key and both folders."""
    import shutil

    here = tmp_path / "here"
    (here / "models").mkdir(parents=True)
    shutil.copytree(assets / "llama", here / "models" / "tiny")
    shutil.copytree(assets / "chat", here / "data" / "chat")
    given = {"model.path": {"model": {"path": "models/tiny"}}, "data.source": {"data": {"source": "data/chat"}}}[key]
    job_file = lm_job(assets, tmp_path / "jobs", **given)
    done = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(job_file), "--run-dir", str(tmp_path / "run")],
        cwd=here, env=ring.trainer_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    value = given[key.split(".")[0]][key.split(".")[1]]
    assert f"{key} = '{value}'" in done.stderr and str(tmp_path / "jobs" / value) in done.stderr and str(here / value) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
