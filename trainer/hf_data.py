"""Examples from Hugging Face datasets, read as mlx-lm reads them (`mlx_lm/tuner/datasets.py`).

Two ways in, as in mlx-lm:
- `data.source` = a dataset id (`mlx-community/wikisql`): `datasets.load_dataset(id)` and its
  `train`, `valid` and `test` splits (`load_hf_dataset`). dpool also takes a `validation` split for
  `valid`, and without either holds out data.val_fraction of train by a seeded hash of the row, as
  for a folder without valid.jsonl.
- `[data.hf_dataset]` (one table or several, concatenated in order): each split is
  `datasets.load_dataset(path, split=..., **config)` (`load_custom_hf_dataset`).

A row's format is mlx-lm's rule on its columns, in mlx-lm's order: prompt_feature and
completion_feature, then chat_feature, then text_feature. The row is renamed to dpool's own
`{"prompt", "completion"}` / `{"messages"}` / `{"text"}` (keeping a `tools` column, which mlx-lm
reads by that name) and from there is an example like a jsonl line: checked, tokenized by mlx-lm's
dataset classes (lm_data.tokenize), fingerprinted and cached (lm_data.finish). So the tokens are
those mlx-lm's own loader makes for the same config, and the cross-rank fingerprint check covers a
Hub dataset as it covers a folder.

Not staged by the pool: every worker loads the datasets itself (the Hub, or its `datasets` cache;
a local `path` must exist on every machine, at the path the job gives, taken from the job file's
folder when relative). `datasets` is the optional extra `dpool[hf]`.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dpool.protocol.jobspec import JobSpec, data_location
from dpool.trainer.data import DataError, file_stamp, is_validation
from dpool.trainer.lm_data import (
    CACHE_FORMAT,
    Features,
    _check_row,
    cached,
    example_format,
    features,
    finish,
    renamed,
    tokenize,
)

EXTRA = "pip install 'dpool[hf]'"


def _datasets(key: str, given: Any) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{key} = {given!r} is a Hugging Face dataset, and this machine lacks the `datasets` package: "
            f"{EXTRA} on every machine of the pool"
        ) from None
    datasets.disable_progress_bars()  # a worker's log is one line per event
    return datasets


def _load(datasets: Any, label: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # not found, offline without a cache, a bad split expression, bad config
        raise DataError(f"{label}: datasets.load_dataset could not load it ({type(e).__name__}: {e})") from None


class _Part:
    """One split of one dataset: its rows, how its columns map to dpool's formats, its name."""

    def __init__(self, label: str, ds: Any, f: Features) -> None:
        self.label, self.ds, self.f = label, ds, f
        # mlx-lm's create_dataset, on the first row's keys (a Dataset's rows all have its columns)
        fmt = example_format(dict.fromkeys(ds.column_names), f)
        if fmt is None:
            raise DataError(
                f"{label}: its columns {sorted(ds.column_names)} hold no data format: expected prompt_feature "
                f"{f.prompt!r} and completion_feature {f.completion!r}, chat_feature {f.chat!r}, or text_feature {f.text!r}"
            )
        self.fmt = fmt

    def rows(self) -> list[dict[str, Any]]:
        """The rows renamed to dpool's formats and checked; DataError names the first bad one."""
        out = []
        for i, r in enumerate(self.ds):
            row = renamed(r, self.fmt, self.f)
            problem = _check_row(row, self.fmt)
            if problem:
                raise DataError(f"{self.label}: example {i + 1}: {problem} ({self._columns()})")
            out.append(row)
        return out

    def _columns(self) -> str:
        names = {"completions": ("prompt", "completion"), "chat": ("chat",), "text": ("text",)}[self.fmt]
        return ", ".join(f"{n} = column {getattr(self.f, n)!r}" for n in names)


def _local(spec: JobSpec, path: str) -> str:
    """A path of the job that exists here, resolved as the job's other paths are; else as given
    (a Hub id or a builder name such as 'json')."""
    local = spec.resolve(path)
    return local if os.path.exists(local) else path


def _config(spec: JobSpec, config: dict[str, Any] | None) -> dict[str, Any]:
    """load_dataset's keyword arguments, with relative data_files and data_dir taken from the
    job file's folder when they name something there (else as given: a pattern for the Hub)."""
    config = dict(config or {})

    def files(v: Any) -> Any:
        if isinstance(v, str):
            local = spec.resolve(v)
            return local if glob.glob(local) else v
        if isinstance(v, list):
            return [files(x) for x in v]
        if isinstance(v, dict):
            return {k: files(x) for k, x in v.items()}
        return v

    if "data_files" in config:
        config["data_files"] = files(config["data_files"])
    if isinstance(config.get("data_dir"), str):
        config["data_dir"] = _local(spec, config["data_dir"])
    return config


def _parts(spec: JobSpec, datasets: Any) -> tuple[dict[str, list[_Part]], bool]:
    """The splits' parts, in mlx-lm's order; and whether val is still to be held out of train."""
    kind, _ = data_location(spec)
    parts: dict[str, list[_Part]] = {"train": [], "val": [], "test": []}
    if kind == "hub":
        ident = spec.data.source
        dd = _load(datasets, f"data.source = {ident!r}", ident)
        names = list(dd.keys()) if hasattr(dd, "keys") else []
        if "train" not in names:
            raise DataError(f"data.source = {ident!r}: the dataset has no 'train' split (its splits: {names})")
        f = features(spec)  # data.prompt_feature etc., as mlx-lm's top-level keys
        parts["train"].append(_Part(f"{ident}[train]", dd["train"], f))
        valid = next((n for n in ("valid", "validation") if n in names), None)
        if valid is not None:
            parts["val"].append(_Part(f"{ident}[{valid}]", dd[valid], f))
        if "test" in names:
            parts["test"].append(_Part(f"{ident}[test]", dd["test"], f))
        elif spec.eval.test:
            raise DataError(f"data.source = {ident!r}: eval.test = true needs a 'test' split (its splits: {names})")
        return parts, valid is None
    hf = spec.data.hf_dataset
    assert hf is not None
    for i, d in enumerate(hf):
        key = "data.hf_dataset" + (f"[{i}]" if len(hf) > 1 else "")
        path, config = _local(spec, d.path), _config(spec, d.config)
        for name, split in (("train", d.train_split), ("val", d.valid_split), ("test", d.test_split)):
            if split is None:
                continue
            label = f"{key} ({d.path}, split {split!r})"
            f = Features(d.prompt_feature, d.completion_feature, d.chat_feature, d.text_feature)
            parts[name].append(_Part(label, _load(datasets, label, path, split=split, **config), f))
    return parts, False


def _cache_key(spec: JobSpec, parts: dict[str, list[_Part]], tokenizer_files: list[Path]) -> str:
    """What the tokens depend on: the job's data keys, each loaded split's own fingerprint (the
    `datasets` library's hash of its source files and config), and the tokenizer's files."""
    d = spec.data
    what = [asdict(x) for x in d.hf_dataset] if d.hf_dataset else (d.source, features(spec))
    h = hashlib.sha256(f"v{CACHE_FORMAT}:hf:{what}:{d.mask_prompt}:{d.val_fraction}:{spec.train.seed}".encode())
    for name, ps in parts.items():
        for p in ps:
            h.update(f"{name}:{p.label}:{p.fmt}:{getattr(p.ds, '_fingerprint', None)}:{len(p.ds)}\n".encode())
    for p in tokenizer_files:
        h.update(file_stamp(p))
    return h.hexdigest()[:20]


def load_hf_data(spec: JobSpec, tokenizer, tokenizer_files: list[Path], cache_dir: Path):
    """lm_data.load_lm_data for a Hugging Face dataset: the same LMData, the same checks."""
    d = spec.data
    key_name, given = ("data.hf_dataset", d.hf_dataset[0].path) if d.hf_dataset else ("data.source", d.source)
    datasets = _datasets(key_name, given)
    parts, hold_out = _parts(spec, datasets)
    key = _cache_key(spec, parts, tokenizer_files)
    if (done := cached(cache_dir, key)) is not None:
        return done
    formats: dict[str, str] = {}
    splits: dict[str, list[tuple[list[int], int]]] = {}
    for name, ps in parts.items():
        if not ps:
            continue
        splits[name] = []
        for p in ps:
            formats[p.label] = p.fmt
            rows = p.rows()
            if not rows:
                raise DataError(f"{p.label}: no examples")
            splits[name] += tokenize(p.label, p.fmt, rows, tokenizer, d.mask_prompt)
    if hold_out:
        # Held out by a seeded hash of the row's index, never by position (as a folder's train.jsonl).
        pairs = splits["train"]
        held = [is_validation(f"train:{i}", spec.train.seed, d.val_fraction) for i in range(len(pairs))]
        splits["train"] = [p for p, h in zip(pairs, held, strict=True) if not h]
        splits["val"] = [p for p, h in zip(pairs, held, strict=True) if h]
        if not splits["val"]:
            raise DataError(
                f"data.source = {d.source!r}: no validation examples; the dataset has no valid split and "
                f"data.val_fraction = {d.val_fraction} of {len(pairs)} examples held out none"
            )
    if not splits.get("train"):
        raise DataError(f"{key_name}: no training examples")
    return finish(cache_dir, key, splits, formats)

