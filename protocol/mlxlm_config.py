"""An `mlx_lm lora` config (YAML) as a dpool job: every key mapped to the job it means.

`dpctl submit lora_config.yaml`, `dpctl convert lora_config.yaml` and `python -m dpool.trainer
lora_config.yaml` read the config people already run with `mlx_lm lora -c`. `job_document` turns it
into the dict of a job file (the same document a `job.toml` parses to), so the job goes through the
one validation, the one training hash and the one writer as any other: the job made from a YAML has
the hash of the hand-written TOML of the same meaning.

The config means what mlx-lm would run: a key it leaves out takes mlx-lm's default
(`MLX_LM_DEFAULTS`, mlx-lm 0.32's `CONFIG_DEFAULTS`; a test keeps the two equal), relative paths are
taken from the current folder as mlx-lm takes them, and mlx-lm's counts of iterations (`iters`,
`steps_per_eval`, `save_every`, `steps_per_report`) become optimizer steps (an iteration is one
micro batch; with `grad_accumulation_steps = g`, g iterations make one update). A key dpool cannot
honour is an error naming it, never dropped; a key that does not change what is trained (where
mlx-lm writes its adapters, its cache threshold) or that mlx-lm itself does not read (lora_parameters
with fine_tune_type full, data beside hf_dataset) is noted (`Converted.notes`), not refused.

Pure: no MLX, no file system beyond reading the config itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpool.protocol.joberrors import JobFileError, one_line, read_job_file

YAML_SUFFIXES = (".yaml", ".yml")

# mlx-lm 0.32's CONFIG_DEFAULTS (mlx_lm/lora.py): what a config that leaves a key out runs with.
MLX_LM_DEFAULTS: dict[str, Any] = {
    "model": "Qwen/Qwen3-0.6b",
    "train": False,
    "fine_tune_type": "lora",
    "optimizer": "adam",
    "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
    "data": "mlx-community/WikiSQL",
    "seed": 0,
    "num_layers": 16,
    "batch_size": 4,
    "iters": 1000,
    "val_batches": 25,
    "learning_rate": 1e-5,
    "steps_per_report": 10,
    "steps_per_eval": 200,
    "resume_adapter_file": None,
    "adapter_path": "adapters",
    "save_every": 100,
    "test": False,
    "test_batches": 500,
    "max_seq_length": 2048,
    "config": None,
    "grad_checkpoint": False,
    "grad_accumulation_steps": 1,
    "clear_cache_threshold": 0,
    "lr_schedule": None,
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
    "mask_prompt": False,
    "report_to": None,
    "project_name": None,
    "trust_remote_code": False,
}
LORA_PARAMETERS = ("rank", "dropout", "scale", "keys")
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")
# Keys mlx-lm reads from a config beyond its defaults: the data's column names (LORA.md, "Data"),
# Hugging Face datasets, the training mode of later versions, and the older W&B switch.
FEATURES = ("prompt_feature", "completion_feature", "text_feature", "chat_feature")
EXTRA_KEYS = (*FEATURES, "hf_dataset", "training_mode", "wandb")


@dataclass
class Converted:
    """The job document and what the conversion wants the user to know (one line each)."""

    job: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def is_mlx_lm_config(path: str) -> bool:
    return str(path).lower().endswith(YAML_SUFFIXES)


class _Loader(yaml.SafeLoader):
    """YAML as mlx-lm reads it: `1e-5` is a float (YAML 1.1 wants `1.0e-5`), as in mlx_lm/lora.py."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_config(path: str) -> dict[str, Any]:
    """The YAML file's mapping; JobFileError for a file that is missing, unreadable or not a mapping."""
    try:
        text = read_job_file(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobFileError(path, "file", path, f"cannot be read ({e})") from None
    try:
        config = yaml.load(text, _Loader)
    except yaml.YAMLError as e:
        raise JobFileError(path, "yaml", one_line(e), "must be valid YAML (an mlx_lm lora config)") from None
    if config is None or config == {}:
        # mlx-lm's defaults alone: a 0.6B model from the Hub on a Hub dataset. Never what an empty
        # file (or one of comments only) meant.
        raise JobFileError(path, "yaml", "empty", "must hold mlx_lm lora options (at least model and data); it holds none")
    if not isinstance(config, dict):
        raise JobFileError(path, "yaml", type(config).__name__, "must be a mapping of mlx_lm lora options")
    return config


def job_name(path: str) -> str:
    """A job name from the config's file name (`lora_config.yaml` -> `lora-config`)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(path).stem.lower()).strip("-")
    return stem[:63].strip("-") or "mlx-lm"


def job_document(config: dict[str, Any], source: str, name: str) -> Converted:
    """The job document an mlx-lm config means (raises JobFileError naming the config's key)."""
    for key in config:
        if key not in MLX_LM_DEFAULTS and key not in EXTRA_KEYS:
            raise JobFileError(source, str(key), config[key], "not an mlx_lm lora option; known: " + ", ".join([*MLX_LM_DEFAULTS, *EXTRA_KEYS]))
    c = {**MLX_LM_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}  # mlx-lm: None is "not given"
    out = Converted(job={"name": name, "model": {"kind": "mlx_lm"}, "data": {}, "train": {}, "checkpoint": {}, "eval": {}})
    model, data, train, ckpt, ev = (out.job[k] for k in ("model", "data", "train", "checkpoint", "eval"))

    def positive(key: str, *, minus_one: bool = False) -> int:
        v = c[key]
        if isinstance(v, bool) or not isinstance(v, int) or not (v >= 1 or (minus_one and v == -1)):
            raise JobFileError(source, key, v, "must be an integer >= 1" + (" or -1 (all)" if minus_one else ""))
        return v

    def flag(key: str) -> bool:
        if not isinstance(c[key], bool):
            raise JobFileError(source, key, c[key], "must be true or false")
        return c[key]

    if c["train"] is False and "train" in config:
        raise JobFileError(
            source, "train", False,
            "dpool trains: a test-only config is `dpctl test JOB` on a trained job (or `mlx_lm lora --test` on its export)",
        )
    if (report := _reporting(config, source)) is not None:
        out.job["report"] = report  # rank 0 reports to W&B in mlx-lm's keys (trainer/report.py)
    if c["trust_remote_code"] not in (False, None):
        raise JobFileError(source, "trust_remote_code", c["trust_remote_code"], "dpool loads only models that run without remote code; leave it false")

    model["path"] = c["model"]
    model["fine_tune"] = c["fine_tune_type"]
    model["lora_layers"] = c["num_layers"]
    model["context"] = c["max_seq_length"]
    model["grad_checkpoint"] = c["grad_checkpoint"]
    if c["resume_adapter_file"] is not None:
        model["adapters"] = c["resume_adapter_file"]
    if c["fine_tune_type"] != "full":
        _lora_parameters(c["lora_parameters"], model, source)
    elif config.get("lora_parameters") is not None:
        # mlx-lm's train_model sets lora_parameters to None for full: the weights themselves are trained.
        out.notes.append("lora_parameters: fine_tune_type = full trains the model's own weights, not adapters; "
                         "the adapters' rank, scale, dropout and keys are not used (mlx-lm ignores them too)")

    if config.get("hf_dataset") is not None:  # mlx-lm's load_dataset: hf_dataset wins, data is not read
        data["hf_dataset"] = config["hf_dataset"]
        if config.get("data") is not None:
            out.notes.append(f"data = {config['data']!r}: the examples come from hf_dataset; data is not used (mlx-lm ignores it too)")
    else:
        data["source"] = c["data"]
        folder = Path(str(c["data"])).expanduser()  # relative: to the current folder, as mlx-lm and the job resolve it
        if (folder / "train.jsonl").is_file() and not (folder / "valid.jsonl").is_file():
            out.notes.append(f"data: {folder} has no valid.jsonl: the job holds out data.val_fraction (default 0.05) of train.jsonl "
                             "to validate on (mlx-lm would train on all of it and validate on nothing)")
    data["mask_prompt"] = flag("mask_prompt")
    for key in FEATURES:  # the columns of data's examples (with hf_dataset, each dataset names its own)
        if config.get(key) is not None:
            data[key] = config[key]
    if config.get("training_mode", "normal") != "normal":
        raise JobFileError(source, "training_mode", config["training_mode"], "dpool trains with the language-model loss only: 'normal'")

    # Iterations are micro batches of batch_size; grad_accumulation_steps of them make one step.
    b, g, iters = positive("batch_size"), positive("grad_accumulation_steps"), positive("iters")
    if iters < g:
        raise JobFileError(source, "iters", iters, f"must be >= grad_accumulation_steps = {g} (mlx-lm updates once every {g} iterations)")
    train["steps"] = iters // g
    if iters % g:
        out.notes.append(f"iters = {iters} is not a multiple of grad_accumulation_steps = {g}: mlx-lm makes {iters // g} updates, and so does the job")
    train["global_batch"] = b * g
    train["seed"] = c["seed"]
    train["grad_clip"] = 0.0  # mlx-lm does not clip gradients
    train["log_every_steps"] = _per_step(positive("steps_per_report"), g)
    ev["every_steps"] = _per_step(positive("steps_per_eval"), g)
    ckpt["every_steps"] = _per_step(positive("save_every"), g)
    val = positive("val_batches", minus_one=True)
    ev["batches"] = -1 if val == -1 else math.ceil(val / g)  # mlx-lm's batches hold batch_size examples, dpool's global_batch
    ev["test"] = flag("test")
    test = positive("test_batches", minus_one=True)
    ev["test_batches"] = -1 if test == -1 else math.ceil(test / g)
    if g > 1 and ((val != -1 and val % g) or (test != -1 and test % g)):
        out.notes.append(f"val_batches/test_batches count batches of batch_size = {b}; the job counts batches of global_batch = {b * g} (rounded up)")

    _optimizer(c, config, train, source, out.notes)
    if c["adapter_path"] != MLX_LM_DEFAULTS["adapter_path"] or "adapter_path" in config:
        out.notes.append(f"adapter_path = {c['adapter_path']!r}: the pool keeps checkpoints itself; `dpctl export JOB {c['adapter_path']}` writes the adapters there")
    if c["clear_cache_threshold"]:
        out.notes.append("clear_cache_threshold: the trainer sizes micro batches to the machine's memory itself; the threshold is not used")
    if config.get("config") is not None:
        out.notes.append("config: the file's pointer to itself is not used")
    return out


# The config key each job key comes from, to name it when the job refuses a value.
FROM_CONFIG = {
    "model.path": "model", "model.fine_tune": "fine_tune_type", "model.lora_layers": "num_layers",
    "model.lora_rank": "lora_parameters.rank", "model.lora_scale": "lora_parameters.scale",
    "model.lora_dropout": "lora_parameters.dropout", "model.lora_keys": "lora_parameters.keys",
    "model.adapters": "resume_adapter_file", "model.context": "max_seq_length", "model.grad_checkpoint": "grad_checkpoint",
    "data.source": "data", "data.hf_dataset": "hf_dataset", "data.mask_prompt": "mask_prompt",
    **{f"data.{f}": f for f in FEATURES},
    "train.steps": "iters", "train.global_batch": "batch_size x grad_accumulation_steps", "train.seed": "seed",
    "train.optimizer": "optimizer", "train.optimizer_config": "optimizer_config", "train.lr_schedule": "lr_schedule",
    "train.log_every_steps": "steps_per_report", "eval.every_steps": "steps_per_eval", "checkpoint.every_steps": "save_every",
    "eval.batches": "val_batches", "eval.test": "test", "eval.test_batches": "test_batches",
    "report.project": "project_name", "report.to": "report_to",
}


def config_key(job_key: str, optimizer: str | None = None) -> str | None:
    """The config's key behind a job key (`train.lr_schedule.arguments` -> `lr_schedule.arguments`;
    `train.optimizer_config.betas` -> `optimizer_config.adamw.betas`, the settings of `optimizer`)."""
    for prefix, key in FROM_CONFIG.items():
        if job_key == prefix or job_key.startswith(prefix + ".") or job_key.startswith(prefix + "["):
            if prefix == "train.optimizer_config" and optimizer:
                key = f"{key}.{optimizer}"
            return key + job_key[len(prefix):]
    return None


def explained(e: JobFileError, job: dict[str, Any] | None = None) -> JobFileError:
    """The job's refusal, naming the config key it came from as well (`job`: the converted job
    document, whose optimizer names where its settings sat in the config)."""
    train = job.get("train") if isinstance(job, dict) else None
    key = config_key(e.key, train.get("optimizer") if isinstance(train, dict) else None)
    if key is None or e.source.endswith(".toml"):
        return e
    return JobFileError(e.source, e.key, e.given, f"{e.allowed} (from the config's {key})")


def _per_step(iterations: int, g: int) -> int:
    """mlx-lm counts reports, evaluations and saves in iterations: in updates, at least one."""
    return max(1, iterations // g)


def _reporting(config: dict[str, Any], source: str) -> dict[str, Any] | None:
    """mlx-lm's `report_to` (comma-separated, as its --report-to) and `project_name`, or its older
    `wandb: PROJECT`, as the job's [report] (None: it reports nowhere). W&B only: SwanLab is refused."""
    given, project, old = config.get("report_to"), config.get("project_name"), config.get("wandb")
    to: list[str] = []
    if given not in (None, "", False):
        if not isinstance(given, str):
            raise JobFileError(source, "report_to", given, "must be 'wandb' (mlx-lm's comma-separated --report-to)")
        to = [w.strip().lower() for w in given.split(",") if w.strip()]
        for w in to:
            if w != "wandb":
                raise JobFileError(source, "report_to", given, f"{w!r}: a pool reports to W&B only ([report] to = ['wandb']); remove {w!r}")
    if old not in (None, "", False):
        if not isinstance(old, str) or (project not in (None, "") and project != old):
            raise JobFileError(source, "wandb", old, "must be the W&B project's name (the older form of report_to: wandb with project_name), and agree with project_name")
        to, project = ["wandb"], old
    if not to:
        if project not in (None, ""):
            raise JobFileError(source, "project_name", project, "names the project of report_to: wandb; add report_to or remove it")
        return None
    return {"to": ["wandb"], **({"project": project} if project not in (None, "") else {})}


def _lora_parameters(given: Any, model: dict[str, Any], source: str) -> None:
    if not isinstance(given, dict):
        raise JobFileError(source, "lora_parameters", given, "must be a mapping of rank, dropout, scale, keys")
    for key in given:
        if key not in LORA_PARAMETERS:
            raise JobFileError(source, f"lora_parameters.{key}", given[key], "unknown; allowed: " + ", ".join(LORA_PARAMETERS))
    defaults = MLX_LM_DEFAULTS["lora_parameters"]
    model["lora_rank"] = given.get("rank", defaults["rank"])
    model["lora_dropout"] = given.get("dropout", defaults["dropout"])
    model["lora_scale"] = given.get("scale", defaults["scale"])
    if given.get("keys") is not None:
        model["lora_keys"] = given["keys"]


def _optimizer(c: dict[str, Any], config: dict[str, Any], train: dict[str, Any], source: str, notes: list[str]) -> None:
    """mlx-lm builds `Class(learning_rate=schedule or learning_rate, **optimizer_config[name])`."""
    name = c["optimizer"]
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise JobFileError(source, "optimizer", name, "must be one of " + ", ".join(OPTIMIZERS))
    name = name.lower()
    train["optimizer"] = name
    configs = c["optimizer_config"]
    if not isinstance(configs, dict):
        raise JobFileError(source, "optimizer_config", configs, "must map optimizer names to their settings (optimizer_config: {adamw: {weight_decay: 0.01}})")
    mine = configs.get(name) or {}
    if not isinstance(mine, dict):
        raise JobFileError(source, f"optimizer_config.{name}", mine, "must be a mapping of the optimizer's settings")
    if mine:
        train["optimizer_config"] = dict(mine)
    for other, settings in configs.items():
        if other != name and settings:
            if other in OPTIMIZERS:
                notes.append(f"optimizer_config.{other}: settings of an optimizer the config does not use (mlx-lm ignores them too)")
            else:  # a flat config: `optimizer_config: {weight_decay: 0.1}`
                notes.append(f"optimizer_config.{other}: not an optimizer's name, so not used (mlx-lm ignores it too); "
                             f"settings go under the optimizer's name: optimizer_config: {{{name}: {{{other}: ...}}}}")
    lr = c["learning_rate"]
    if isinstance(lr, bool) or not isinstance(lr, int | float):
        raise JobFileError(source, "learning_rate", lr, "must be a number")
    schedule = c["lr_schedule"]
    if schedule is None:
        # Without a schedule mlx-lm trains at a fixed learning_rate: no warm-up, no decay.
        train["lr_schedule"] = {"name": "constant", "arguments": [float(lr)]}
        return
    if not isinstance(schedule, dict):
        raise JobFileError(source, "lr_schedule", schedule, "must be a mapping with name, arguments, and optionally warmup, warmup_init")
    train["lr_schedule"] = dict(schedule)
    if "learning_rate" in config:
        notes.append("learning_rate: with lr_schedule the schedule's first argument is the peak (mlx-lm does not use learning_rate either)")
