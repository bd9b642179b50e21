"""`[data.hf_dataset]`: Hugging Face datasets as mlx-lm's `hf_dataset` config reads them.

One table, or a list of them (`[[data.hf_dataset]]`, concatenated in order as mlx-lm's
ConcatenatedDataset does), with mlx-lm's field names and defaults (`mlx_lm/tuner/datasets.py`,
`load_custom_hf_dataset`): each split is `datasets.load_dataset(path, split=..., **config)`, and
the four feature names say which columns hold the prompt and completion, the chat, or the text.
`mask_prompt` is `data.mask_prompt`, for every dataset alike, as in mlx-lm. Pure: no `datasets`
import here (the trainer loads them, trainer/hf_data.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from dpool.protocol.joberrors import MISSING, JobFileError

MAX_DATASETS = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class HFDatasetSpec:
    path: str = field(metadata={"doc": "what `datasets.load_dataset` loads: a Hub dataset id, a builder ('json', 'parquet', ...) or a local folder (taken from the job file's folder, on each machine)"})
    config: dict[str, Any] | None = field(default=None, metadata={"doc": "keyword arguments of `datasets.load_dataset` (name, data_files, revision, ...)"})
    train_split: str = field(default="train[:80%]", metadata={"doc": "the training examples (a `datasets` split expression)"})
    valid_split: str = field(default="train[-10%:]", metadata={"doc": "the validation examples"})
    test_split: str | None = field(default=None, metadata={"doc": "the test examples (eval.test); none when unset"})
    prompt_feature: str = field(default="prompt", metadata={"doc": "with completion_feature: the column of the prompt"})
    completion_feature: str = field(default="completion", metadata={"doc": "the column of the completion"})
    text_feature: str = field(default="text", metadata={"doc": "the column of plain text, every token trained"})
    chat_feature: str = field(default="messages", metadata={"doc": "the column of chat messages"})


FIELDS = tuple(f.name for f in fields(HFDatasetSpec))


def parse_hf_datasets(value: Any, key: str, source: str) -> tuple[HFDatasetSpec, ...]:
    """One table or a list of tables, checked field by field; JobFileError names the bad one
    (`data.hf_dataset[1].prompt_feature`)."""
    if isinstance(value, dict):
        return (_one(value, key, source),)
    if isinstance(value, list | tuple) and 0 < len(value) <= MAX_DATASETS:
        return tuple(_one(t, f"{key}[{i}]", source) for i, t in enumerate(value))
    return _refuse(source, key, value, f"must be a table ([{key}]) or a list of 1 to {MAX_DATASETS} tables ([[{key}]])")


def _one(table: Any, key: str, source: str) -> HFDatasetSpec:
    if not isinstance(table, dict):
        _refuse(source, key, table, "must be a table with a path")
    for name, v in table.items():
        if name not in FIELDS:
            hint = " (it is data.mask_prompt, for every dataset)" if name == "mask_prompt" else ""
            _refuse(source, f"{key}.{name}", v, "unknown field" + hint + "; allowed: " + ", ".join(FIELDS))
        if name == "config":
            if v is not None and not (isinstance(v, dict) and all(isinstance(k, str) and k for k in v)):
                _refuse(source, f"{key}.config", v, "must be a table of datasets.load_dataset's keyword arguments")
            if isinstance(v, dict) and ("split" in v or "path" in v):
                word = "split" if "split" in v else "path"
                _refuse(source, f"{key}.config.{word}", v[word], f"set by {key}.{'train_split, valid_split and test_split' if word == 'split' else 'path'}, not in config")
        elif not (isinstance(v, str) and v) and not (v is None and name == "test_split"):
            _refuse(source, f"{key}.{name}", v, "must be a non-empty string")
    if "path" not in table:
        _refuse(source, f"{key}.path", MISSING, "required: the dataset's Hub id, builder or local folder")
    return HFDatasetSpec(**table)


def _refuse(source: str, key: str, given: Any, allowed: str) -> Any:
    raise JobFileError(source, key, given, allowed)
