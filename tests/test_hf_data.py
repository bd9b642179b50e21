"""Hugging Face datasets as mlx-lm reads them: `[data.hf_dataset]` and `data.source` = a dataset id.

Offline: the datasets are files this test writes (JSON lines, parquet, a `save_to_disk` folder)
and `datasets` never reaches the network (HF_DATASETS_OFFLINE). What must hold: the examples are
the very token lists mlx-lm's own loader makes for the same config, and a job that maps columns
(`prompt_feature = "question"`) trains on two ranks exactly as the same examples in jsonl files do
on one.
"""

from __future__ import annotations

import json
import os
import random
import types
from pathlib import Path

import pytest
import ring
from jobs import write_job

from dpool.protocol.jobfile import dump_job
from dpool.protocol.jobspec import JobFileError, check_paths, data_location, parse_job
from dpool.trainer import tinylm

datasets = pytest.importorskip("datasets")

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
MAPPED = {"prompt_feature": "question", "completion_feature": "answer"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A tiny llama and question/answer data in three forms that `datasets.load_dataset` reads."""
    root = tmp_path_factory.mktemp("hf")
    tinylm.make_model(root / "llama", arch="llama", seed=1)
    rows = [{"question": r["prompt"], "answer": r["completion"], "id": i}
            for i, r in enumerate(tinylm.examples("completions", 60, random.Random(3)))]
    (root / "qa-json").mkdir()
    (root / "qa-json" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    (root / "qa-parquet").mkdir()
    ds.to_parquet(str(root / "qa-parquet" / "train.parquet"))
    datasets.DatasetDict({"train": ds.select(range(40)), "test": ds.select(range(40, 60))}).save_to_disk(str(root / "qa-saved"))
    chat = tinylm.examples("chat", 30, random.Random(4))
    datasets.Dataset.from_list([{"conversation": r["messages"]} for r in chat]).to_parquet(str(root / "chat.parquet"))
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory) -> dict[str, str]:
    env = {**OFFLINE, "HF_HOME": str(tmp_path_factory.getbasetemp() / "hf-home")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def spec_of(assets: Path, data: dict, **sections) -> object:
    doc = {"name": "hf", "model": {"kind": "mlx_lm", "path": str(assets / "llama")}, "data": data, **sections}
    return parse_job(doc, source="job.toml", base_dir=str(assets))


def tokenizer(assets: Path):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(assets / "llama")


def as_lists(split) -> list[tuple[list[int], int]]:
    return [(t.tolist(), int(o)) for t, o in zip(split.tokens, split.offsets, strict=True)]


def mlx_lm_examples(dataset) -> list[tuple[list[int], int]]:
    return [(list(t), int(o)) for t, o in (dataset.process(dataset[i]) for i in range(len(dataset)))]


# ---------------------------------------------------------------------------------------------
# The job file: mlx-lm's fields, checked; a job without them keeps its hash.


def test_hf_dataset_fields_are_mlx_lms_and_checked(assets):
    one = spec_of(assets, {"hf_dataset": {"path": "qa-json", **MAPPED}})
    (d,) = one.data.hf_dataset
    assert (d.train_split, d.valid_split, d.test_split, d.text_feature) == ("train[:80%]", "train[-10%:]", None, "text")
    assert data_location(one) == ("hf_dataset", "")
    two = spec_of(assets, {"hf_dataset": [{"path": "a"}, {"path": "b", "config": {"name": "x"}}]})
    assert [x.path for x in two.data.hf_dataset] == ["a", "b"] and two.data.hf_dataset[1].config == {"name": "x"}
    # Written back as [[data.hf_dataset]] and read to the same job; the datasets enter the hash.
    import tomllib

    again = parse_job(tomllib.loads(dump_job(two)), source="again.toml")
    assert again.training_hash() == two.training_hash() != one.training_hash()
    assert "[[data.hf_dataset]]" in dump_job(two) and "source" not in again.to_dict()["data"]
    # On the wire (dpctl submit to the coordinator, the coordinator to each dpd) as it was written.
    from dpool.protocol import messages as m

    wired = {"path": "json", "config": {"data_files": {"train": ["a.jsonl", "b.jsonl"]}, "name": "x"}}
    three = spec_of(assets, {"hf_dataset": [wired, {"path": "c", **MAPPED}]})
    back, _ = m.decode(m.Submit(job=three.to_dict(), source="job.toml").to_frames())
    assert parse_job(back.job, source="wire") == three
    plain = spec_of(assets, {"source": "chat"})
    assert "hf_dataset" not in plain.to_dict()["data"]  # absent: jobs from before it keep their hash

    refused = [
        ({"hf_dataset": {"path": "a", "prompt_column": "q"}}, "data.hf_dataset.prompt_column", "allowed: path, config"),
        ({"hf_dataset": [{"path": "a"}, {"train_split": "train"}]}, "data.hf_dataset[1].path", "required"),
        ({"hf_dataset": {"path": "a", "mask_prompt": True}}, "data.hf_dataset.mask_prompt", "data.mask_prompt"),
        ({"hf_dataset": {"path": "a", "config": {"split": "train"}}}, "data.hf_dataset.config.split", "train_split"),
        ({"hf_dataset": {"path": "a", "valid_split": ""}}, "data.hf_dataset.valid_split", "non-empty string"),
        ({"hf_dataset": "mlx-community/wikisql"}, "data.hf_dataset", "a table"),
        ({"hf_dataset": {"path": "a"}, "source": "chat"}, "data.source", "not both"),
    ]
    for data, key, allowed in refused:
        with pytest.raises(JobFileError) as e:
            spec_of(assets, data)
        assert e.value.key == key and allowed in str(e.value), str(e.value)
    with pytest.raises(JobFileError, match=r"data.hf_dataset.test_split missing: required with eval.test"):
        spec_of(assets, {"hf_dataset": {"path": "a"}}, eval={"test": True})
    with pytest.raises(JobFileError, match=r"only for model.kind = 'mlx_lm'"):
        parse_job({"name": "g", "data": {"hf_dataset": {"path": "a"}}})


def test_a_dataset_id_is_no_folder_unless_one_exists(assets, tmp_path):
    from dpool.protocol.content import data_tree

    hub = spec_of(assets, {"source": "mlx-community/wikisql"})
    assert data_location(hub) == ("hub", "mlx-community/wikisql")
    check_paths(hub, "job.toml")  # no "no such directory": each worker loads it
    assert data_tree(hub) is None  # submit names no content and stages nothing for it
    check_paths(spec_of(assets, {"hf_dataset": {"path": "qa-json"}}), "job.toml")
    # A folder of that spelling, where the job is, wins (as in mlx-lm), and is staged as a folder.
    (tmp_path / "mlx-community" / "wikisql").mkdir(parents=True)
    (tmp_path / "mlx-community" / "wikisql" / "train.jsonl").write_text('{"text": "a b c"}\n')
    here = parse_job({**{"name": "hf"}, "model": {"kind": "mlx_lm", "path": "m"}, "data": {"source": "mlx-community/wikisql"}},
                     base_dir=str(tmp_path))
    assert data_location(here)[0] == "dir" and data_tree(here) is not None
    with pytest.raises(JobFileError, match="a Hugging Face dataset id is owner/name"):
        check_paths(spec_of(assets, {"source": "wikisql"}), "job.toml")


# ---------------------------------------------------------------------------------------------
# The examples are mlx-lm's own.


def test_examples_equal_mlx_lms_load_custom_hf_dataset(assets, tmp_path):
    """Two datasets concatenated (JSON lines with mlx-lm's default splits, and a save_to_disk
    folder with named splits), the columns mapped, prompts masked: the same token lists and
    offsets as mlx-lm's loader, split by split."""
    from mlx_lm.tuner.datasets import load_custom_hf_dataset

    from dpool.trainer.hf_data import load_hf_data

    hf = [
        {"path": str(assets / "qa-json"), **MAPPED, "test_split": "train[:10%]"},
        {"path": str(assets / "qa-saved"), **MAPPED, "train_split": "train", "valid_split": "test[:50%]", "test_split": "test[50%:]"},
    ]
    tok = tokenizer(assets)
    data = load_hf_data(spec_of(assets, {"hf_dataset": hf, "mask_prompt": True}), tok, [], tmp_path)
    args = types.SimpleNamespace(hf_dataset=[dict(d) for d in hf], mask_prompt=True, train=True, test=True)
    train, valid, test = load_custom_hf_dataset(args, tok)
    assert as_lists(data.train) == mlx_lm_examples(train) and len(data.train) == 48 + 40
    assert as_lists(data.val) == mlx_lm_examples(valid) and len(data.val) == 6 + 10
    assert data.test is not None and as_lists(data.test) == mlx_lm_examples(test)
    assert all(o > 0 for o in data.train.offsets), "mask_prompt: the prompt is masked"
    again = load_hf_data(spec_of(assets, {"hf_dataset": hf, "mask_prompt": True}), tok, [], tmp_path)
    assert (again.key, again.fingerprint) == (data.key, data.fingerprint)  # the cache


def test_chat_column_and_parquet_and_a_bad_mapping(assets, tmp_path):
    from mlx_lm.tuner.datasets import load_custom_hf_dataset

    from dpool.trainer.data import DataError
    from dpool.trainer.hf_data import load_hf_data

    hf = {"path": "parquet", "config": {"data_files": "chat.parquet"}, "chat_feature": "conversation"}
    tok = tokenizer(assets)
    data = load_hf_data(spec_of(assets, {"hf_dataset": hf}), tok, [], tmp_path)  # data_files from the job's folder
    absolute = {**hf, "config": {"data_files": str(assets / "chat.parquet")}}
    train, valid, _ = load_custom_hf_dataset(types.SimpleNamespace(hf_dataset=absolute, train=True, test=False), tok)
    assert as_lists(data.train) == mlx_lm_examples(train) and as_lists(data.val) == mlx_lm_examples(valid)
    assert set(data.formats.values()) == {"chat"}

    with pytest.raises(DataError, match=r"columns \['answer', 'id', 'question'\] hold no data format"):
        load_hf_data(spec_of(assets, {"hf_dataset": {"path": "qa-parquet"}}), tok, [], tmp_path)
    with pytest.raises(DataError, match=r"data.hf_dataset \(qa-parquet, split 'valid'\): datasets.load_dataset could not load it"):
        load_hf_data(spec_of(assets, {"hf_dataset": {"path": "qa-parquet", **MAPPED, "valid_split": "valid"}}), tok, [], tmp_path)
    int_answers = {"path": "qa-parquet", "prompt_feature": "question", "completion_feature": "id"}
    with pytest.raises(DataError, match=r"example 1: 'prompt' and 'completion' must be strings \(prompt = column 'question', completion = column 'id'\)"):
        load_hf_data(spec_of(assets, {"hf_dataset": int_answers}), tok, [], tmp_path)


def test_a_dataset_id_loads_its_splits_as_mlx_lm_does(assets, tmp_path, monkeypatch):
    """data.source = an id: `load_dataset(id)` and its train/valid/test splits (mlx-lm's
    load_hf_dataset). The Hub cannot be reached here, so load_dataset returns a DatasetDict made
    from the local files, for dpool and for mlx-lm alike."""
    from mlx_lm.tuner.datasets import load_hf_dataset

    from dpool.trainer.hf_data import load_hf_data

    full = datasets.load_dataset(str(assets / "qa-json"), split="train")
    splits = {"train": full.select(range(40)), "valid": full.select(range(40, 50)), "test": full.select(range(50, 60))}
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda ident, **kw: asked.append(ident) or datasets.DatasetDict(splits))
    tok = tokenizer(assets)
    # The columns named by the top-level features, as mlx-lm's --data with prompt_feature in its config.
    data = load_hf_data(spec_of(assets, {"source": "someone/qa", "mask_prompt": True, **MAPPED}), tok, [], tmp_path)
    train, valid, test = load_hf_dataset("someone/qa", tok, types.SimpleNamespace(mask_prompt=True, **MAPPED))
    assert asked == ["someone/qa", "someone/qa"]
    assert as_lists(data.train) == mlx_lm_examples(train)
    assert as_lists(data.val) == mlx_lm_examples(valid)
    assert data.test is not None and as_lists(data.test) == mlx_lm_examples(test)
    # Without a valid split, data.val_fraction of train is held out (by a seeded hash of the row).
    del splits["valid"]
    held = load_hf_data(spec_of(assets, {"source": "someone/qa", "val_fraction": 0.25, **MAPPED}), tok, [], tmp_path)
    assert len(held.train) + len(held.val) == 40 and 0 < len(held.val) < 20


def test_a_folder_of_jsonl_with_named_keys_reads_as_mlx_lm_reads_it(assets, tmp_path):
    """data.prompt_feature etc. (mlx-lm's top-level keys) rename a jsonl folder's keys too, and
    need no `datasets` package."""
    from mlx_lm.tuner.datasets import load_local_dataset

    from dpool.trainer.lm_data import load_lm_data

    folder = tmp_path / "qa"
    folder.mkdir()
    lines = (assets / "qa-json" / "train.jsonl").read_text().splitlines(keepends=True)
    (folder / "train.jsonl").write_text("".join(lines[:50]))
    (folder / "valid.jsonl").write_text("".join(lines[50:]))
    tok = tokenizer(assets)
    spec = spec_of(assets, {"source": str(folder), "mask_prompt": True, **MAPPED})
    assert spec.to_dict()["data"]["prompt_feature"] == "question"
    data = load_lm_data(spec, tok, [], tmp_path / "cache")
    train, valid, _ = load_local_dataset(folder, tok, types.SimpleNamespace(mask_prompt=True, **MAPPED))
    assert as_lists(data.train) == mlx_lm_examples(train) and as_lists(data.val) == mlx_lm_examples(valid)
    plain = spec_of(assets, {"source": str(folder), "mask_prompt": True})
    assert "prompt_feature" not in plain.to_dict()["data"] and plain.training_hash() != spec.training_hash()
    from dpool.trainer.data import DataError

    with pytest.raises(DataError, match=r"train.jsonl:1: matches no data format \(has \['answer', 'id', 'question'\]\)") as e:
        load_lm_data(plain, tok, [], tmp_path / "cache")
    assert "feature names" not in str(e.value)  # the job names none: nothing to say of them
    with pytest.raises(JobFileError, match=r"each data.hf_dataset names its own prompt_feature"):
        spec_of(assets, {"hf_dataset": {"path": "a"}, "prompt_feature": "q"})
    with pytest.raises(JobFileError, match=r"data.text_feature = 'body': only for model.kind = 'mlx_lm'"):
        parse_job({"name": "g", "data": {"text_feature": "body"}})


def test_without_the_datasets_package_the_error_names_the_extra(assets, tmp_path, monkeypatch):
    import sys

    from dpool.trainer.data import DataError
    from dpool.trainer.hf_data import load_hf_data

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"data.source = 'someone/qa' .* lacks the `datasets` package: pip install 'dpool\[hf\]'"):
        load_hf_data(spec_of(assets, {"source": "someone/qa"}), tokenizer(assets), [], tmp_path)


# ---------------------------------------------------------------------------------------------
# Training: two ranks on mapped columns, the same curve as one rank on the same examples in jsonl.


def test_mapped_columns_train_on_two_ranks_as_the_same_jsonl_on_one(assets, tmp_path, offline):
    base = {
        "model": {"kind": "mlx_lm", "path": str(assets / "llama"), "lora_rank": 4, "lora_layers": 8, "context": 160},
        "train": {"steps": 4, "global_batch": 8, "micro_batch": 2, "warmup_steps": 1, "log_every_steps": 1, "lr": 1e-2},
        "checkpoint": {"every_steps": 4},
        "eval": {"every_steps": 2, "batches": 1, "sample_every_steps": 4, "sample_tokens": 4, "sample_prompt": "What is 2 + 3?"},
    }
    hf_job = write_job(tmp_path, "hf-qa", base=base, data={"hf_dataset": {"path": str(assets / "qa-json"), **MAPPED}, "mask_prompt": True})
    # The same rows, renamed and split as train[:80%] / train[-10%:], as a folder of jsonl.
    rows = [json.loads(line) for line in (assets / "qa-json" / "train.jsonl").read_text().splitlines()]
    folder = tmp_path / "qa-jsonl"
    folder.mkdir()
    for name, part in (("train", rows[:48]), ("valid", rows[54:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": r["question"], "completion": r["answer"]}) + "\n" for r in part))
    jsonl_job = write_job(tmp_path, "jsonl-qa", base=base, data={"source": str(folder), "mask_prompt": True})

    env = {**offline, "DPOOL_CACHE_DIR": str(tmp_path / "cache")}
    two, one = tmp_path / "two", tmp_path / "one"
    group = ring.run(hf_job, str(two / "r{rank}"), 2, tmp_path / "logs", env=env, shares=[3, 5])
    ring.run(jsonl_job, str(one), 1, tmp_path / "logs", env=env)
    a, b = ring.metrics(two / "r0"), ring.metrics(one)
    assert sorted(a) == [1, 2, 3, 4]
    for s in a:
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-4, (s, a[s]["loss"], b[s]["loss"])
        assert a[s]["tokens"] == b[s]["tokens"]
    va, vb = ring.metrics(two / "r0", "eval"), ring.metrics(one, "eval")
    assert all(abs(va[s]["val_loss"] - vb[s]["val_loss"]) <= 1e-4 for s in vb)
    assert "Traceback" not in group.output(1)
    assert os.listdir(tmp_path / "cache")  # tokenized once, cached like a folder's examples
