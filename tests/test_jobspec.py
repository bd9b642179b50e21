"""Bad job files are refused before anything runs: exit 2, one line naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dpool.protocol.jobspec import JobFileError, JobSpec, load_job, lora_blocks, parse_job

EXAMPLES = Path(__file__).parent.parent / "examples"

GOOD = """\
name = "ok"
[model]
layers = 1
dim = 32
heads = 2
context = 16
[train]
steps = 5
global_batch = 4
warmup_steps = 1
"""

LM = """\
name = "lm"
[model]
kind = "mlx_lm"
path = "/models/tiny"
[data]
source = "/data/chat"
[train]
steps = 5
global_batch = 4
warmup_steps = 1
"""

# (what is wrong, the job file, the key the message must name)
BAD = [
    ("unknown top-level key", GOOD + "\n[optimizer]\nkind = 'sgd'\n", "optimizer"),
    ("unknown key in a section", GOOD.replace("steps = 5", "steps = 5\nstepz = 3"), "train.stepz"),
    ("wrong type", GOOD.replace("layers = 1", 'layers = "one"'), "model.layers"),
    ("negative steps", GOOD.replace("steps = 5", "steps = -5"), "train.steps"),
    ("zero global batch", GOOD.replace("global_batch = 4", "global_batch = 0"), "train.global_batch"),
    ("global batch below world size", GOOD + "\n[workers]\nmin = 8\nmax = 8\n", "train.global_batch"),
    ("bad name", GOOD.replace('name = "ok"', 'name = "Has Spaces"'), "name"),
    ("missing name", GOOD.replace('name = "ok"\n', ""), "name"),
    ("heads do not divide dim", GOOD.replace("heads = 2", "heads = 3"), "model.heads"),
    ("micro batch neither auto nor int", GOOD.replace("global_batch = 4", 'global_batch = 4\nmicro_batch = "big"'), "train.micro_batch"),
    ("val fraction out of range", GOOD + "\n[data]\nval_fraction = 0.9\n", "data.val_fraction"),
    ("workers max below min", GOOD + "\n[workers]\nmin = 3\nmax = 2\n", "workers.max"),
    ("boolean for a number", GOOD.replace("steps = 5", "steps = true"), "train.steps"),
    ("section that is not a table", GOOD + "\ncheckpoint = 5\n", "checkpoint"),
    ("kind outside the allowed", GOOD.replace("layers = 1", 'layers = 1\nkind = "rnn"'), "model.kind"),
    ("mlx_lm without a path", LM.replace('path = "/models/tiny"\n', ""), "model.path"),
    ("mlx_lm on the stdlib corpus", LM.replace('source = "/data/chat"', 'source = "stdlib"'), "data.source"),
    ("a gpt key on an mlx_lm job", LM.replace('kind = "mlx_lm"', 'kind = "mlx_lm"\nlayers = 2'), "model.layers"),
    ("an mlx_lm key on a gpt job", GOOD.replace("layers = 1", 'layers = 1\nfine_tune = "lora"'), "model.fine_tune"),
    ("unknown fine-tune", LM.replace('kind = "mlx_lm"', 'kind = "mlx_lm"\nfine_tune = "qlora"'), "model.fine_tune"),
    ("dropout of one", LM.replace('kind = "mlx_lm"', 'kind = "mlx_lm"\nlora_dropout = 1.0'), "model.lora_dropout"),
    ("mask_prompt on a gpt job", GOOD + "\n[data]\nmask_prompt = true\n", "data.mask_prompt"),
    ("mask_prompt not a boolean", LM.replace('source = "/data/chat"', 'source = "/data/chat"\nmask_prompt = "yes"'), "data.mask_prompt"),
    ("a name with a trailing newline", GOOD.replace('name = "ok"', 'name = "ok\\n"'), "name"),
    ("warmup longer than the run", GOOD.replace("warmup_steps = 1", "warmup_steps = 50"), "train.warmup_steps"),
    ("not TOML at all", "name = \n[[[", "toml"),
    ("every held-out example as a float", LM + "\n[eval]\nbatches = -1.0\n", "eval.batches"),
    ("a name that reads as a flag", GOOD.replace('name = "ok"', 'name = "-"'), "name"),
    ("a micro batch beyond 2^53", GOOD.replace("global_batch = 4", "global_batch = 4\nmicro_batch = 100000000000000000000000"), "train.micro_batch"),
    ("schedule steps beyond 2^53", GOOD.replace("warmup_steps = 1", "")
     + '\n[train.lr_schedule]\nname = "cosine_decay"\narguments = [1e-3, 1e300]\n', "train.lr_schedule.arguments[1] (decay_steps)"),
]


@pytest.mark.parametrize(("what", "text", "key"), BAD, ids=[b[0] for b in BAD])
def test_bad_job_file_is_refused_naming_the_key(tmp_path, what, text, key):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(JobFileError) as err:
        load_job(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and key in message, message


# Paths are resolved where the training runs: the trainer refuses them, naming this machine.
MISSING_PATHS = [
    ("missing data path", GOOD + "\n[data]\nsource = '/no/such/corpus/*.txt'\n", "data.source"),
    ("missing model directory", LM.replace("/models/tiny", "/no/such/model"), "model.path"),
]


def test_the_client_does_not_resolve_paths(tmp_path):
    for _, text, _ in MISSING_PATHS:
        (tmp_path / "job.toml").write_text(text)
        load_job(tmp_path / "job.toml")  # parses: the paths belong to the workers


ON_TRAINER = BAD[:4] + MISSING_PATHS


@pytest.mark.parametrize(("what", "text", "key"), ON_TRAINER, ids=[b[0] for b in ON_TRAINER])
def test_trainer_exits_2_with_one_line(tmp_path, what, text, key):
    path = tmp_path / "job.toml"
    path.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(path), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and str(path) in lines[0], run.stderr
    if "path" in what:
        assert "on this machine" in lines[0], run.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_trainer_refuses_shares_that_do_not_add_up(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(GOOD)
    run = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(path), "--run-dir", str(tmp_path / "run"), "--shares", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2 and "train.global_batch is 4" in run.stderr, run.stderr


def test_defaults_and_round_trip(tmp_path):
    spec = load_job(EXAMPLES / "demo.toml")
    assert isinstance(spec, JobSpec) and spec.name == "stdlib-gpt" and spec.model.kind == "gpt"
    again = parse_job(spec.to_dict(), source="wire")
    assert again == spec and again.training_hash() == spec.training_hash()


def test_training_hash_ignores_what_does_not_change_the_math(tmp_path):
    base = parse_job({"name": "a", "train": {"steps": 10, "warmup_steps": 1}})
    logged = parse_job({"name": "a", "train": {"steps": 10, "warmup_steps": 1, "log_every_steps": 1, "micro_batch": 2}})
    other = parse_job({"name": "a", "train": {"steps": 10, "warmup_steps": 1, "lr": 1e-3}})
    assert base.training_hash() == logged.training_hash() != other.training_hash()


def test_relative_data_path_resolves_against_the_job_file(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello " * 100)
    (tmp_path / "job.toml").write_text(GOOD + '\n[data]\nsource = "corpus/*.txt"\n')
    spec = load_job(tmp_path / "job.toml")
    assert spec.resolved_source() == str(tmp_path / "corpus" / "*.txt")


def test_mlx_lm_defaults_and_wire_round_trip():
    spec = parse_job({"name": "lm", "model": {"kind": "mlx_lm", "path": "~/models/m"}, "data": {"source": "~/chat"}})
    m = spec.model
    assert (m.fine_tune, m.lora_rank, m.lora_scale, m.lora_layers, m.context) == ("lora", 8, 20.0, None, 2048)
    assert lora_blocks(m, 40) == 16 and lora_blocks(m, 4) == 4  # unset: mlx-lm's 16
    wire = spec.to_dict()
    assert "layers" not in wire["model"] and wire["model"]["path"] == "~/models/m"
    assert parse_job(wire, source="wire") == spec
    gpt = parse_job({"name": "g"})
    assert gpt.model.context == 128 and "fine_tune" not in gpt.to_dict()["model"]


def test_written_job_keeps_paths_and_hash(tmp_path):
    from dpool.protocol.jobfile import dump_job

    spec = parse_job(
        {"name": "lm", "model": {"kind": "mlx_lm", "path": "models/m"}, "data": {"source": "~/chat"}},
        base_dir=str(tmp_path / "client"),
    )
    (tmp_path / "job.toml").write_text(dump_job(spec))
    again = load_job(tmp_path / "job.toml")
    assert again.training_hash() == spec.training_hash()
    assert again.resolve(again.model.path) == str(tmp_path / "client" / "models" / "m")


def test_an_infinite_start_timeout_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(GOOD + "\n[recovery]\nstart_timeout_s = inf\n")
    with pytest.raises(JobFileError) as err:
        load_job(path)
    assert "recovery.start_timeout_s = inf" in str(err.value) and "finite" in str(err.value)


def _float_keys() -> list[tuple[str, str]]:
    from dataclasses import fields

    from dpool.protocol.jobspec import SECTIONS

    return [(section, f.name) for section, cls in SECTIONS.items() for f in fields(cls) if f.type == "float"]


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize(("section", "key"), _float_keys(), ids=[".".join(k) for k in _float_keys()])
def test_every_number_of_the_job_file_must_be_finite(section, key, value):
    import tomllib

    data = tomllib.loads(LM if section == "model" else GOOD)
    data.setdefault(section, {})[key] = value
    with pytest.raises(JobFileError) as err:
        parse_job(data, source="job.toml")
    assert err.value.key == f"{section}.{key}" and "finite" in str(err.value), str(err.value)


def test_integers_stay_below_2_to_the_53():
    with pytest.raises(JobFileError) as err:
        parse_job({"name": "big", "train": {"steps": 2**53}})
    assert err.value.key == "train.steps"
    assert parse_job({"name": "big", "train": {"steps": 2**53 - 1}}).train.steps == 2**53 - 1


def test_sync_section_is_checked_and_shapes_the_hash_only_where_it_changes_the_curve():
    plain = parse_job({"name": "j"})
    assert plain.training_hash() == parse_job({"name": "j", "sync": {"mode": "sync"}}).training_hash(), "jobs from before [sync] keep their checkpoints"
    assert plain.training_hash() != parse_job({"name": "j", "sync": {"dtype": "bfloat16"}}).training_hash()
    diloco = parse_job({"name": "j", "workers": {"max": 8}, "sync": {"mode": "diloco", "replicas": 3, "inner_steps": 20}})
    assert diloco.training_hash() != plain.training_hash()
    assert diloco.max_workers() == 3 and plain.max_workers() == 8  # a worker runs whole replicas
    assert parse_job(diloco.to_dict()) == diloco and parse_job(plain.to_dict()) == plain
    # warmup_steps: absent from the job and its hash at 0 (diloco jobs from before it keep their checkpoints)
    unset = {"name": "j", "sync": {"mode": "diloco", "replicas": 3, "inner_steps": 20}}
    zero = parse_job({**unset, "sync": {**unset["sync"], "warmup_steps": 0}})
    warm = parse_job({**unset, "sync": {**unset["sync"], "warmup_steps": 30}})
    assert "warmup_steps" not in zero.to_dict()["sync"] and zero.training_hash() == parse_job(unset).training_hash()
    assert warm.training_hash() != zero.training_hash() and parse_job(warm.to_dict()) == warm and warm.sync.warmup_steps == 30
    for data, key in [
        ({"sync": {"warmup_steps": 10}}, "sync.warmup_steps"),
        ({"sync": {"mode": "diloco", "warmup_steps": -1}}, "sync.warmup_steps"),
        ({"sync": {"inner_steps": 5}}, "sync.inner_steps"),  # a diloco key in sync mode does nothing: refused
        ({"sync": {"mode": "local"}}, "sync.mode"),
        ({"sync": {"mode": "diloco", "replicas": 2}, "workers": {"min": 3}}, "workers.min"),
        ({"sync": {"mode": "diloco", "replicas": 8}, "train": {"global_batch": 4}}, "train.global_batch"),
        ({"sync": {"mode": "diloco", "outer_momentum": 1.0}}, "sync.outer_momentum"),
        ({"sync": {"dtype": "float16"}}, "sync.dtype"),
    ]:
        with pytest.raises(JobFileError, match=key.replace(".", r"\.")):
            parse_job({"name": "j", **data})


def test_every_example_job_file_loads():
    for path in sorted(EXAMPLES.glob("*.toml")):
        spec = load_job(path)
        assert parse_job(spec.to_dict()) == spec, path


def test_a_job_file_that_is_no_utf8_text_or_a_folder_is_refused_naming_it(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('name = "café"\n'.encode("latin-1"))
    with pytest.raises(JobFileError, match=r"latin1\.toml: toml = 'byte 11': must be UTF-8 text"):
        load_job(latin1)
    with pytest.raises(JobFileError, match="is a directory"):
        load_job(tmp_path)


def test_a_jsonl_text_with_a_lone_surrogate_is_refused_naming_the_line(tmp_path):
    from dpool.trainer.data import DataError, iter_documents

    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": "lone \\ud800 half"}\n')
    spec = parse_job({"name": "s", "data": {"source": str(tmp_path / "*.jsonl")}, "train": {"steps": 5, "warmup_steps": 1}})
    with pytest.raises(DataError, match=r"a\.jsonl:3: 'text' holds '\\ud800' at character 5"):
        list(iter_documents(spec, [tmp_path / "a.jsonl"]))


def test_an_empty_file_is_not_the_document_held_out_when_none_falls_below_val_fraction(tmp_path):
    """Few documents may draw none below data.val_fraction: the lowest-scoring one that holds text
    is held out, not an empty file (whose split would be one separator, and the job refused)."""
    from dpool.trainer.data import load_corpus, split_score

    spec = parse_job({"name": "few", "data": {"source": str(tmp_path / "d" / "*.txt"), "val_fraction": 0.05}, "train": {"steps": 5, "warmup_steps": 1}})
    names = [f"doc{i}.txt" for i in range(200) if split_score(f"doc{i}.txt", spec.train.seed) >= 0.05]
    names.sort(key=lambda n: split_score(n, spec.train.seed))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / names[0]).write_text("")  # the lowest score of all: empty
    for n in names[1:4]:
        (tmp_path / "d" / n).write_text(n * 200)
    corpus = load_corpus(spec, tmp_path / "cache")
    assert bytes(corpus.val).count(names[1].encode()) == 200  # the lowest-scoring document with text


def test_a_file_replaced_with_its_size_and_time_kept_is_tokenized_again(tmp_path):
    """A staged tree fetched again after damage holds new files of the same names, sizes and (the
    cache's fixed) times: the tokens made from the damaged bytes must not be reused, or the node
    differs from its peers for good."""
    import os

    from dpool.trainer.data import load_corpus

    spec = parse_job({"name": "redo", "data": {"source": str(tmp_path / "d" / "*.txt")}, "train": {"steps": 5, "warmup_steps": 1}})
    (tmp_path / "d").mkdir()
    for i in range(4):
        (tmp_path / "d" / f"doc{i}.txt").write_text(f"document {i} " * 300)
    damaged = tmp_path / "d" / "doc1.txt"
    good = damaged.read_bytes()
    damaged.write_bytes(good.replace(b"document", b"documXnt", 1))
    os.utime(damaged, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = load_corpus(spec, tmp_path / "cache")
    fresh = tmp_path / "fresh.txt"  # the fetch writes a new file and moves it into place
    fresh.write_bytes(good)
    os.utime(fresh, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    os.replace(fresh, damaged)
    after = load_corpus(spec, tmp_path / "cache")
    assert after.key != before.key and after.fingerprint != before.fingerprint
    assert b"documXnt" not in bytes(after.train) + bytes(after.val)


def test_an_unset_warm_up_fits_a_short_run_and_a_given_one_is_checked():
    """The default warm-up (100 steps) is a tenth of a run shorter than that, not a refusal of a
    value the user never wrote; a warm-up the user gives longer than the run is still refused."""
    short = parse_job({"name": "short", "train": {"steps": 40}})
    assert short.train.warmup_steps == 4
    assert parse_job({"name": "long", "train": {"steps": 5000}}).train.warmup_steps == 100
    assert parse_job(short.to_dict()).train.warmup_steps == 4  # as written out and read back by the pool
    with pytest.raises(JobFileError, match=r"train\.warmup_steps = 50: must be <= train\.steps = 40"):
        parse_job({"name": "given", "train": {"steps": 40, "warmup_steps": 50}})


def test_a_refused_value_is_spelled_as_the_job_file_spells_it() -> None:
    """true, not Python's True; a table as {b = 1}; long values cut, on one line."""
    for given, said in (
        ({"train": {"steps": True}}, "train.steps = true: must be an integer"),
        ({"train": {"optimizer_config": {"nope": 1}}}, "train.optimizer_config = {nope = 1}: only with train.optimizer set"),
        ({"train": {"steps": list(range(100))}}, "train.steps = [0, 1, 2, 3, 4, 5, 6, 7, ...]: must be an integer"),
    ):
        with pytest.raises(JobFileError) as e:
            parse_job({"name": "ok", **given}, source="job.toml")
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_file_that_is_not_toml_says_so_and_where(tmp_path: Path) -> None:
    bad = tmp_path / "job.toml"
    bad.write_text("name = \n[[[")
    with pytest.raises(JobFileError) as e:
        load_job(bad)
    assert str(e.value) == f"{bad}: not valid TOML: Invalid value (at line 1, column 8)" and e.value.key == "toml"
