"""Data for language models: mlx-lm's formats, checked line by line, tokenized by mlx-lm's datasets.

`data.source` is a directory holding `train.jsonl` and optionally `valid.jsonl`; each line is one
example in one of mlx-lm's formats, with mlx-lm's meaning:

    {"text": ...}                      every token trained
    {"prompt": ..., "completion": ...} through the chat template; with mask_prompt, the completion only
    {"messages": [...]}                through the chat template; with mask_prompt, the last message only
    {"messages": [...], "tools": [...]}

Tokens and the offset of the first trained token come from mlx-lm's own dataset classes
(`mlx_lm.tuner.datasets`), so `mask_prompt` masks exactly what `mlx_lm lora --mask-prompt` masks.
What dpool adds: every line is checked first (a bad one is named by file and line number), the
held-out split without a valid.jsonl is a seeded hash of the line, and the tokenized examples are
cached under the worker's cache dir (a restart loads them in milliseconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpool.protocol.joberrors import one_line
from dpool.protocol.jobspec import JobSpec, data_location
from dpool.trainer.data import DataError, file_stamp, is_validation, split_score

CACHE_FORMAT = 3  # 2: a test.jsonl beside the data is read too; 3: the test split fingerprinted apart
FORMATS = {
    "completions": "{\"prompt\", \"completion\"}",
    "chat": "{\"messages\"}",
    "text": "{\"text\"}",
}


@dataclass(frozen=True)
class Features:
    """The keys (columns) that hold an example's parts: mlx-lm's prompt_feature, completion_feature,
    chat_feature and text_feature, with mlx-lm's defaults."""

    prompt: str = "prompt"
    completion: str = "completion"
    chat: str = "messages"
    text: str = "text"


DEFAULT_FEATURES = Features()


def features(spec: JobSpec) -> Features:
    """data.prompt_feature etc. (for a folder or a dataset id; each data.hf_dataset has its own)."""
    d = spec.data
    given = {"prompt": d.prompt_feature, "completion": d.completion_feature, "chat": d.chat_feature, "text": d.text_feature}
    return Features(**{k: v for k, v in given.items() if v is not None})


def example_format(row: Any, f: Features = DEFAULT_FEATURES) -> str | None:
    """mlx-lm's rule (create_dataset), in its order: prompt+completion, then messages, then text."""
    if not isinstance(row, dict):
        return None
    if f.prompt in row and f.completion in row:
        return "completions"
    if f.chat in row:
        return "chat"
    if f.text in row:
        return "text"
    return None


def renamed(row: dict[str, Any], fmt: str, f: Features) -> dict[str, Any]:
    """The row under dpool's keys, which the checks and mlx-lm's dataset classes (with their
    default keys) read; mlx-lm reads `tools` by that name whatever the features, so it is kept."""
    if fmt == "text":
        return {"text": row[f.text]}
    out = {"prompt": row[f.prompt], "completion": row[f.completion]} if fmt == "completions" else {"messages": row[f.chat]}
    if row.get("tools") is not None:
        out["tools"] = row["tools"]
    return out


def _check_row(row: dict[str, Any], fmt: str) -> str | None:
    """What is wrong with a row of a known format, or None."""
    if fmt == "text":
        return None if isinstance(row["text"], str) else "'text' must be a string"
    if fmt == "completions":
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str):
            return "'prompt' and 'completion' must be strings"
    else:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                return f"messages[{i}] must be an object with a 'role' string"
            if "content" in msg and not isinstance(msg["content"], str | list | type(None)):
                return f"messages[{i}].content must be a string"
    if row.get("tools") is not None and not isinstance(row["tools"], list):  # null: none (as datasets' to_json writes it)
        return "'tools' must be a list"
    return None


def _not_text(row: dict[str, Any]) -> str | None:
    """A string of the row that is no text (JSON's \\ud800 escapes: half a UTF-16 surrogate pair,
    which no tokenizer takes), said; or None."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds {e.object[e.start:e.end]!r}, half of a UTF-16 surrogate pair: not text; mend or drop the line"
    return None


def read_jsonl(path: Path, keys: Features = DEFAULT_FEATURES) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    """The file's format and its (line number, row) pairs, under dpool's keys; DataError names the
    first bad line."""
    rows: list[tuple[int, dict[str, Any]]] = []
    fmt: str | None = None
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
            this = example_format(row, keys)
            if this is None:
                has = sorted(row) if isinstance(row, dict) else type(row).__name__
                named = "" if keys == DEFAULT_FEATURES else f" (under the job's data.*_feature names: {keys})"
                raise DataError(
                    f"{path}:{lineno}: matches no data format (has {has}); expected one of "
                    + ", ".join(FORMATS.values()) + " (optionally with \"tools\")" + named
                )
            if keys != DEFAULT_FEATURES:
                row = renamed(row, this, keys)
            if fmt is None:
                fmt = this
            elif this != fmt:
                raise DataError(
                    f"{path}:{lineno}: a {FORMATS[this]} example in a file of {FORMATS[fmt]} examples "
                    "(line 1's format); mlx-lm reads one format per file"
                )
            problem = _check_row(row, this) or _not_text(row)
            if problem:
                raise DataError(f"{path}:{lineno}: {problem}")
            rows.append((lineno, row))
    if fmt is None:
        raise DataError(f"{path}: no examples")
    return fmt, rows


def tokenize(
    path: Path | str, fmt: str, rows: list[dict[str, Any]], tokenizer, mask_prompt: bool, lines: list[int] | None = None,
) -> list[tuple[list[int], int]]:
    """(tokens, offset) per row, by mlx-lm's dataset classes; a row that fails is named by its line
    of the file (`lines`, one per row), else as the file's example N."""
    from mlx_lm.tuner.datasets import create_dataset

    if fmt == "text" and mask_prompt:
        raise DataError(f"{path}: data.mask_prompt = true needs prompts: {{\"text\"}} examples have none")
    if fmt != "text" and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{path}: {FORMATS[fmt]} examples go through the tokenizer's chat template, and this model's "
            "tokenizer has none; use {\"text\"} examples or a model with a chat template"
        )
    dataset = create_dataset(rows, tokenizer, types.SimpleNamespace(mask_prompt=mask_prompt))
    out = []
    for i in range(len(rows)):
        where = f"{path}:{lines[i]}" if lines is not None else f"{path}: example {i + 1}"
        try:
            tokens, offset = dataset.process(rows[i])
        except Exception as e:  # a template that raises on this example (e.g. a role it does not know)
            if mask_prompt and fmt == "chat" and len(rows[i].get("messages") or ()) == 1:
                # mlx-lm renders the messages before the last as the prompt: with one, none, which
                # most templates refuse as "an empty conversation" without saying why.
                raise DataError(
                    f"{where}: data.mask_prompt = true trains the last message and renders those before it as the "
                    f"prompt, and this conversation has one message only, which the chat template refuses "
                    f"({type(e).__name__}: {one_line(e)}); give it the prompt (a user message) before the answer"
                ) from None
            raise DataError(f"{where}: the tokenizer could not render it ({type(e).__name__}: {one_line(e)})") from None
        if len(tokens) < 2:
            raise DataError(f"{where}: fewer than 2 tokens")
        out.append((list(tokens), int(offset)))
    return out


@dataclass(frozen=True)
class Split:
    tokens: list[np.ndarray]  # int32 per example
    offsets: np.ndarray  # int64 per example

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class LMData:
    train: Split
    val: Split
    formats: dict[str, str]  # file name (or Hugging Face dataset and split) -> format
    fingerprint: int  # of the trained and validation examples
    key: str
    test: Split | None = None  # the test examples, where the data has them
    test_fingerprint: int = 0  # of the test examples (0: none)


def trainable(data: LMData, width: int, source: str) -> tuple[LMData, dict[str, int]]:
    """The data without the examples that have no trained token within `width` tokens (a prompt,
    masked by data.mask_prompt, as long as the context: the example is cut before its answer
    starts; mlx-lm trains on them with a NaN loss), and how many each split left out. DataError
    when the training or validation examples are all of that kind."""
    dropped: dict[str, int] = {}
    kept: dict[str, Split | None] = {}
    for name in ("train", "val", "test"):
        split: Split | None = getattr(data, name)
        keep = [] if split is None else [i for i in range(len(split)) if split.offsets[i] < width]
        if split is None or len(keep) == len(split):
            kept[name] = split
            continue
        dropped[name] = len(split) - len(keep)
        if not keep and name != "test":
            raise DataError(
                f"data.source = {source!r}: every {'training' if name == 'train' else 'validation'} example's prompt is "
                f"{width} tokens or longer, so data.mask_prompt leaves nothing of it to train within model.context "
                f"(max_seq_length) = {width}; raise it, or shorten the prompts"
            )
        kept[name] = Split([split.tokens[i] for i in keep], split.offsets[keep])
    if not dropped:
        return data, {}
    train, val = kept["train"], kept["val"]
    assert train is not None and val is not None
    return dataclasses.replace(data, train=train, val=val, test=kept["test"]), dropped


def _cache_key(spec: JobSpec, files: list[Path], tokenizer_files: list[Path]) -> str:
    d = spec.data
    h = hashlib.sha256(f"v{CACHE_FORMAT}:{d.mask_prompt}:{d.val_fraction}:{spec.train.seed}".encode())
    if (f := features(spec)) != DEFAULT_FEATURES:
        h.update(f"{f}\n".encode())
    for p in files + tokenizer_files:
        h.update(file_stamp(p))
    return h.hexdigest()[:20]


def _split(pairs: list[tuple[list[int], int]]) -> Split:
    return Split([np.asarray(t, dtype=np.int32) for t, _ in pairs], np.asarray([o for _, o in pairs], dtype=np.int64))


def _save(path: Path, data: dict[str, Split], meta: dict[str, Any]) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name, split in data.items():
        lengths = np.asarray([len(t) for t in split.tokens], dtype=np.int64)
        arrays[f"{name}_tokens"] = np.concatenate(split.tokens) if split.tokens else np.zeros(0, np.int32)
        arrays[f"{name}_lengths"] = lengths
        arrays[f"{name}_offsets"] = split.offsets
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    os.replace(tmp, path)


def _load(path: Path) -> tuple[dict[str, Split], dict[str, Any]]:
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        out = {}
        for name in ("train", "val", "test"):
            if f"{name}_tokens" not in z:
                continue
            flat, lengths = z[f"{name}_tokens"], z[f"{name}_lengths"]
            cuts = np.cumsum(lengths)[:-1]
            out[name] = Split(list(np.split(flat, cuts)) if len(lengths) else [], z[f"{name}_offsets"])
    return out, meta


def cached(cache_dir: Path, key: str) -> LMData | None:
    """The examples tokenized before under this key (None: not cached, or a damaged cache)."""
    path = Path(cache_dir) / f"lm-examples-{key}.npz"
    if not path.is_file():
        return None
    try:
        splits, meta = _load(path)
        return LMData(splits["train"], splits["val"], meta["formats"], int(meta["fingerprint"]), key, splits.get("test"), int(meta["test_fingerprint"]))
    except (OSError, ValueError, KeyError):
        return None  # rebuilt


def finish(cache_dir: Path, key: str, splits: dict[str, list[tuple[list[int], int]]], formats: dict[str, str]) -> LMData:
    """The tokenized examples as arrays, fingerprinted (every rank must hold the same) and cached."""
    out = {name: _split(pairs) for name, pairs in splits.items()}
    # Apart: a test.jsonl added or edited under a run changes what `dpctl test` scores, not what
    # the checkpoints were trained on (a resume compares the first, trainer/restore.py).
    fingerprint, test_fingerprint = _fingerprint(out, ("train", "val")), _fingerprint(out, ("test",)) if "test" in out else 0
    _save(Path(cache_dir) / f"lm-examples-{key}.npz", out, {"formats": formats, "fingerprint": fingerprint, "test_fingerprint": test_fingerprint})
    return LMData(out["train"], out["val"], formats, fingerprint, key, out.get("test"), test_fingerprint)


def _fingerprint(out: dict[str, Split], names: tuple[str, ...]) -> int:
    h = hashlib.sha256()
    for name in names:
        for t in out[name].tokens:
            h.update(t.tobytes())
            h.update(b"|")
        h.update(out[name].offsets.tobytes())
    return int.from_bytes(h.digest()[:7], "little")


def load_lm_data(spec: JobSpec, tokenizer, tokenizer_files: list[Path], cache_dir: Path) -> LMData:
    if data_location(spec)[0] != "dir":  # a Hugging Face dataset: the `datasets` package, only for jobs that use it
        from dpool.trainer.hf_data import load_hf_data

        return load_hf_data(spec, tokenizer, tokenizer_files, cache_dir)
    folder = Path(spec.resolved_source())
    train_file, valid_file, test_file = folder / "train.jsonl", folder / "valid.jsonl", folder / "test.jsonl"
    files = [train_file] + [f for f in (valid_file, test_file) if f.is_file()]
    key = _cache_key(spec, files, tokenizer_files)
    if (done := cached(cache_dir, key)) is not None:
        return done
    formats: dict[str, str] = {}
    fmt, rows = read_jsonl(train_file, features(spec))
    formats[train_file.name] = fmt
    pairs = tokenize(train_file, fmt, [r for _, r in rows], tokenizer, spec.data.mask_prompt, [n for n, _ in rows])
    if valid_file.is_file():
        vfmt, vrows = read_jsonl(valid_file, features(spec))
        formats[valid_file.name] = vfmt
        train_pairs = pairs
        val_pairs = tokenize(valid_file, vfmt, [r for _, r in vrows], tokenizer, spec.data.mask_prompt, [n for n, _ in vrows])
    else:
        # Held out by a seeded hash of the line, never by position.
        held = [is_validation(f"train.jsonl:{lineno}", spec.train.seed, spec.data.val_fraction) for lineno, _ in rows]
        if not any(held) and spec.data.val_fraction > 0 and len(rows) >= 2:
            # A fraction too small for so few examples still holds one out: the one the seeded
            # hash ranks first (20 examples at 0.05 held out none, and the job was refused).
            first = min(range(len(rows)), key=lambda i: split_score(f"train.jsonl:{rows[i][0]}", spec.train.seed))
            held[first] = True
        train_pairs = [p for p, h in zip(pairs, held, strict=True) if not h]
        val_pairs = [p for p, h in zip(pairs, held, strict=True) if h]
    if not train_pairs:
        raise DataError(f"{train_file}: no training examples left after holding out data.val_fraction")
    if not val_pairs:
        raise DataError(
            f"{folder}: no validation examples; add a valid.jsonl or raise data.val_fraction "
            f"({spec.data.val_fraction} of {len(rows)} examples held out none)"
        )
    splits = {"train": train_pairs, "val": val_pairs}
    if test_file.is_file():  # read when present, as mlx-lm's local datasets are: `dpctl test` may ask later
        tfmt, trows = read_jsonl(test_file, features(spec))
        formats[test_file.name] = tfmt
        splits["test"] = tokenize(test_file, tfmt, [r for _, r in trows], tokenizer, spec.data.mask_prompt, [n for n, _ in trows])
    return finish(cache_dir, key, splits, formats)


