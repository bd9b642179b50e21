"""An `mlx_lm lora` config as it is: every key mapped to the job it means, or refused by name.

Pure conversion tests (no MLX run); the config trained on a pool of dpds is in test_mlxlm_pool.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dpool.protocol import mlxlm_config
from dpool.protocol.jobspec import JobFileError, load_job, parse_job

# mlx-lm's examples/lora_config.yaml, as it is but for the model and data paths (and one comment).
EXAMPLE = """\
# The path to the local model directory or Hugging Face repo.
model: "{model}"

# Whether or not to train (boolean)
train: true

# The fine-tuning method: "lora", "dora", or "full".
fine_tune_type: lora

# The training-mode: "normal", or "dpo"
training_mode: normal

# The Optimizer with its possible inputs
optimizer: adamw
# optimizer_config:
#   adamw:
#     betas: [0.9, 0.98]
#     eps: 1e-6
#     weight_decay: 0.05
#     bias_correction: true

# Directory with {{train, valid, test}}.jsonl files
data: "{data}"

# The PRNG seed
seed: 0

# Number of layers to fine-tune
num_layers: 16

# Minibatch size.
batch_size: 4

# Iterations to train for.
iters: 1000

# Number of validation batches, -1 uses the entire validation set.
val_batches: 25

# Adam learning rate.
learning_rate: 1e-5

# Number of training steps between loss reporting.
steps_per_report: 10

# Number of training steps between validations.
steps_per_eval: 200

# Load path to resume training with the given adapter weights.
resume_adapter_file: null

# Save/load path for the trained adapter weights.
adapter_path: "adapters"

# Save the model every N iterations.
save_every: 100

# Evaluate on the test set after training
test: false

# Number of test set batches, -1 uses the entire test set.
test_batches: 100

# Maximum sequence length.
max_seq_length: 2048

# Use gradient checkpointing to reduce memory use.
grad_checkpoint: false

# LoRA parameters can only be specified in a config file
lora_parameters:
  # The layer keys to apply LoRA to.
  # These will be applied for the last lora_layers
  keys: ["self_attn.q_proj", "self_attn.v_proj"]
  rank: 8
  scale: 20.0
  dropout: 0.0

# Schedule can only be specified in a config file, uncomment to use.
#lr_schedule:
#  name: cosine_decay
#  warmup: 100 # 0 for no warmup
#  warmup_init: 1e-7 # 0 if not specified
#  arguments: [1e-5, 1000, 1e-7] # passed to scheduler
"""

# The same job written by hand as a dpool job file.
HAND_WRITTEN = """\
name = "lora-config"

[model]
kind = "mlx_lm"
path = "{model}"
fine_tune = "lora"
lora_layers = 16
lora_rank = 8
lora_scale = 20.0
lora_dropout = 0.0
lora_keys = ["self_attn.q_proj", "self_attn.v_proj"]
context = 2048

[data]
source = "{data}"

[train]
steps = 1000
global_batch = 4
seed = 0
grad_clip = 0.0
optimizer = "adamw"
log_every_steps = 10
lr_schedule = {{ name = "constant", arguments = [1e-5] }}

[checkpoint]
every_steps = 100

[eval]
every_steps = 200
batches = 25
test_batches = 100
"""


def convert(text: str, tmp_path: Path, name: str = "lora_config.yaml") -> mlxlm_config.Converted:
    path = tmp_path / name
    path.write_text(text)
    return mlxlm_config.job_document(mlxlm_config.read_config(str(path)), str(path), mlxlm_config.job_name(str(path)))


def test_the_defaults_are_mlx_lms() -> None:
    """A key the config leaves out means what mlx-lm would run: its own defaults, kept in step."""
    from mlx_lm.lora import CONFIG_DEFAULTS

    assert mlxlm_config.MLX_LM_DEFAULTS == CONFIG_DEFAULTS


def test_mlx_lms_example_config_is_the_hand_written_job(tmp_path: Path) -> None:
    made = convert(EXAMPLE.format(model="/models/qwen", data="/data/sql"), tmp_path)
    yaml_job = parse_job(made.job, source="lora_config.yaml", base_dir=str(tmp_path))
    hand_path = tmp_path / "hand.toml"
    hand_path.write_text(HAND_WRITTEN.format(model="/models/qwen", data="/data/sql"))
    hand = load_job(hand_path)
    assert yaml_job.training_hash() == hand.training_hash()
    assert yaml_job.name == "lora-config"
    t = yaml_job.train
    assert (t.steps, t.global_batch, t.seed, t.optimizer) == (1000, 4, 0, "adamw")
    assert yaml_job.model.lora_keys == ["self_attn.q_proj", "self_attn.v_proj"]
    assert any("adapter_path" in n for n in made.notes)  # where mlx-lm writes adapters: said, not dropped


def test_full_fine_tuning_ignores_lora_parameters_as_mlx_lm_does(tmp_path: Path) -> None:
    """mlx-lm's example config with `fine_tune_type: full` runs under `mlx_lm lora -c` (its
    train_model drops lora_parameters for full): it is the hand-written full job, keys and all
    ignored, and the note says so. A job file that itself asks for full with lora_keys is refused."""
    text = EXAMPLE.format(model="/models/qwen", data="/data/sql").replace("fine_tune_type: lora", "fine_tune_type: full")
    made = convert(text.replace("rank: 8", "rank: 16"), tmp_path)
    spec = parse_job(made.job, source="lora_config.yaml", base_dir=str(tmp_path))
    assert spec.model.fine_tune == "full" and spec.model.lora_keys is None
    assert any("lora_parameters: fine_tune_type = full" in n and "not used" in n for n in made.notes), made.notes
    hand = HAND_WRITTEN.format(model="/models/qwen", data="/data/sql").replace('fine_tune = "lora"', 'fine_tune = "full"')
    hand = "\n".join(line for line in hand.splitlines() if not line.startswith("lora_") or line.startswith("lora_layers"))
    (tmp_path / "hand.toml").write_text(hand)
    assert spec.training_hash() == load_job(tmp_path / "hand.toml").training_hash()
    (tmp_path / "keys.toml").write_text(hand.replace('fine_tune = "full"', 'fine_tune = "full"\nlora_keys = ["self_attn.q_proj"]'))
    with pytest.raises(JobFileError, match=r"model\.lora_keys.*only for model\.fine_tune = 'lora' or 'dora'"):
        load_job(tmp_path / "keys.toml")
    assert not any("lora_parameters" in n for n in convert("model: m\nfine_tune_type: full\n", tmp_path).notes)


def test_hf_dataset_wins_over_data_as_in_mlx_lm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example config's `data:` line with its `hf_dataset:` block uncommented: mlx-lm's
    load_dataset reads hf_dataset and not data; so does the job, and the note says data is unused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "x"}\n')  # no valid.jsonl: not the job's data, no note on it
    text = EXAMPLE.format(model="/models/qwen", data="data") + (
        "\nhf_dataset:\n  path: billsum\n  train_split: train[:1000]\n  valid_split: train[-100:]\n"
        "  prompt_feature: text\n  completion_feature: summary\n"
    )
    made = convert(text, tmp_path)
    spec = parse_job(made.job, source="lora_config.yaml", base_dir=str(tmp_path))
    assert "source" not in made.job["data"] and spec.data.source == "stdlib"
    assert [d.path for d in spec.data.hf_dataset or ()] == ["billsum"]
    assert any("data = 'data'" in n and "hf_dataset" in n and "not used" in n for n in made.notes), made.notes
    assert not any("valid.jsonl" in n for n in made.notes), made.notes


def test_accumulation_turns_iterations_into_steps(tmp_path: Path) -> None:
    """mlx-lm counts iterations (micro batches); g of them make one update."""
    made = convert(
        "model: m\ndata: d\nbatch_size: 2\ngrad_accumulation_steps: 4\niters: 400\nsteps_per_eval: 40\n"
        "save_every: 20\nsteps_per_report: 2\nval_batches: -1\nnum_layers: -1\n", tmp_path,
    )
    spec = parse_job(made.job, source="c.yaml", base_dir=str(tmp_path))
    assert (spec.train.steps, spec.train.global_batch) == (100, 8)
    assert (spec.eval.every_steps, spec.checkpoint.every_steps, spec.train.log_every_steps) == (10, 5, 1)
    assert spec.eval.batches == -1 and spec.model.lora_layers == -1
    assert spec.train.optimizer == "adam"  # mlx-lm's default optimizer, not dpool's
    assert (spec.train.lr_schedule.name, spec.train.lr_schedule.arguments) == ("constant", (1e-5,))  # mlx-lm: a fixed learning_rate
    assert spec.train.grad_clip == 0


def test_a_schedule_and_an_optimizer_config_carry_over(tmp_path: Path) -> None:
    made = convert(
        "model: m\ndata: d\noptimizer: sgd\noptimizer_config:\n  sgd:\n    momentum: 0.9\n  adamw:\n    weight_decay: 0.1\n"
        "lr_schedule:\n  name: cosine_decay\n  warmup: 100\n  warmup_init: 1e-7\n  arguments: [1e-5, 1000, 1e-7]\n",
        tmp_path,
    )
    assert made.job["train"]["optimizer_config"] == {"momentum": 0.9}
    assert made.job["train"]["lr_schedule"] == {"name": "cosine_decay", "warmup": 100, "warmup_init": 1e-7, "arguments": [1e-5, 1000, 1e-7]}
    assert any("optimizer_config.adamw" in n for n in made.notes)
    parse_job(made.job, source="c.yaml", base_dir=str(tmp_path))


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        ("model: m\nlearning_rat: 1e-5\n", "learning_rat", "not an mlx_lm lora option"),
        ("model: m\nreport_to: wandb,swanlab\n", "report_to", "W&B only"),
        ("model: m\nproject_name: p\n", "project_name", "add report_to"),
        ("model: m\ntrain: false\ntest: true\n", "train", "dpctl test"),
        ("model: m\ntrust_remote_code: true\n", "trust_remote_code", "remote code"),
        ("model: m\nlora_parameters:\n  rank: 8\n  alpha: 16\n", "lora_parameters.alpha", "unknown"),
        ("model: m\ngrad_accumulation_steps: 8\niters: 4\n", "iters", "grad_accumulation_steps"),
        ("model: m\noptimizer: lion\n", "optimizer", "must be one of"),
        ("model: m\ntraining_mode: dpo\n", "training_mode", "normal"),
        ("model: m\nbatch_size: 0\n", "batch_size", ">= 1"),
        ("- model: m\n", "yaml", "mapping"),
        ("model: [unclosed\n", "yaml", "valid YAML"),
        ("", "yaml", "it holds none"),  # mlx-lm's defaults alone: a 0.6B model and a dataset from the Hub
        ("# a comment only\n", "yaml", "it holds none"),
        ("{}\n", "yaml", "it holds none"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(tmp_path: Path, text: str, key: str, says: str) -> None:
    with pytest.raises(JobFileError) as e:
        convert(text, tmp_path)
    assert e.value.key == key and says in str(e.value), str(e.value)


def dpctl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dpool.client.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_dpctl_convert_writes_the_job_that_submit_would_send(tmp_path: Path) -> None:
    """Relative paths are the current folder's (mlx-lm's rule); the TOML written reads back as the
    same job (same hash) as the YAML itself, in dpctl and in the trainer's reader."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "lora_config.yaml").write_text(EXAMPLE.format(model="models/qwen", data="data"))
    r = dpctl("convert", "lora_config.yaml", "-o", "job.toml", "--set", "workers.max=2", cwd=work)
    assert r.returncode == 0, r.stderr
    saved = load_job(work / "job.toml")
    assert saved.workers.max == 2 and saved.resolve(saved.model.path) == str(work / "models" / "qwen")
    here = os.getcwd()
    try:
        os.chdir(work)
        direct = load_job("lora_config.yaml")
    finally:
        os.chdir(here)
    assert saved.training_hash() == direct.training_hash()
    shown = dpctl("submit", "--dry-run", "--json", "lora_config.yaml", cwd=work)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["job"]["train"]["optimizer"] == "adamw"
    printed = dpctl("convert", "lora_config.yaml", cwd=work)
    assert tomllib.loads(printed.stdout)["model"]["lora_keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    bad = dpctl("convert", "missing.yaml", cwd=work)
    assert bad.returncode == 2 and "missing.yaml" in bad.stderr


def test_the_job_name_comes_from_the_file_name() -> None:
    assert mlxlm_config.job_name("/x/Lora_Config.v2.yaml") == "lora-config-v2"
    assert mlxlm_config.job_name("/x/___.yml") == "mlx-lm"


def test_a_value_the_job_refuses_names_the_configs_key_too(tmp_path: Path) -> None:
    """The job's checks run on what the config meant; the message says where it came from."""
    (tmp_path / "c.yaml").write_text("model: m\nlora_parameters:\n  rank: 0\nlr_schedule:\n  name: cosine_decay\n  arguments: [1e-5, 100]\n")
    r = dpctl("convert", "c.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "model.lora_rank" in r.stderr and "the config's lora_parameters.rank" in r.stderr, r.stderr
    with pytest.raises(JobFileError, match=r"from the config's lora_parameters\.rank"):
        load_job(tmp_path / "c.yaml")
    assert mlxlm_config.config_key("train.lr_schedule.arguments") == "lr_schedule.arguments"
    assert mlxlm_config.config_key("data.hf_dataset[1].path") == "hf_dataset[1].path"
    assert mlxlm_config.config_key("workers.max") is None
    # an optimizer's settings sit under its name in the config; a --set names itself, not the config
    (tmp_path / "o.yaml").write_text("model: m\noptimizer: adamw\noptimizer_config:\n  adamw:\n    betaz: [0.9, 0.99]\n")
    r = dpctl("submit", "o.yaml", "--dry-run", cwd=tmp_path)
    assert r.returncode == 2 and "(from the config's optimizer_config.adamw.betaz)" in r.stderr, r.stderr
    (tmp_path / "plain.yaml").write_text("model: m\n")
    r = dpctl("submit", "plain.yaml", "--dry-run", "--set", "train.steps=abc", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.rstrip().endswith("(from --set train.steps=abc)") and "the config's" not in r.stderr, r.stderr


def test_a_data_folder_without_valid_jsonl_and_a_flat_optimizer_config_are_noted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm trains on all of train.jsonl when valid.jsonl is missing; the job holds some out to
    validate on: said, not silent. A flat optimizer_config is not used by either: said so, with
    where its settings go."""
    monkeypatch.chdir(tmp_path)  # a config's relative paths are the current folder's, as in mlx-lm
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"text": "x"}\n')
    made = convert("model: m\ndata: d\noptimizer: adamw\noptimizer_config:\n  weight_decay: 0.1\n", tmp_path)
    assert any("has no valid.jsonl: the job holds out data.val_fraction" in n for n in made.notes), made.notes
    assert any("optimizer_config.weight_decay: not an optimizer's name" in n and "{adamw: {weight_decay: ...}}" in n for n in made.notes), made.notes
    (tmp_path / "d" / "valid.jsonl").write_text('{"text": "y"}\n')
    assert not any("valid.jsonl" in n for n in convert("model: m\ndata: d\n", tmp_path).notes)
