"""Fine-tuning mlx-lm models: tiny real models made offline, trained by real trainer processes.

Two architectures (llama, qwen3), random weights in the Hugging Face layout, a BPE tokenizer
trained here with a chat template (`dpool.trainer.tinylm`). The same contract as the built-in GPT:
the curve depends on the job file only, a killed run resumes exactly, and what dpool exports is
what mlx-lm's own CLIs read.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import ring
from jobs import write_job

from dpool.trainer import tinylm

LM = {  # the base of this file's jobs: a tiny mlx-lm model fine-tuned on chat data
    "model": {"kind": "mlx_lm", "lora_rank": 4, "lora_layers": 8},
    "train": {"global_batch": 12, "warmup_steps": 1, "log_every_steps": 1},
    "checkpoint": {"keep": 10},
    "eval": {"batches": 2, "sample_tokens": 8, "sample_prompt": "What is 2 + 3?"},
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm")
    for arch in tinylm.ARCHS:
        tinylm.make_model(root / arch, arch=arch, seed=1)
    tinylm.quantize(root / "qwen3", root / "qwen3-4bit", bits=4)
    tinylm.make_chat_data(root / "chat", train=48, valid=12, seed=3, fmt="chat")
    tinylm.make_chat_data(root / "text", train=48, valid=12, seed=3, fmt="text")
    return root


@pytest.fixture(scope="module")
def env(assets) -> dict[str, str]:
    return {"DPOOL_CACHE_DIR": str(assets / "cache")}


def job(assets: Path, folder: Path, *, model: str = "llama", fine_tune: str = "lora", data: str = "chat",
        steps: int = 6, micro: int = 3, every: int = 3, dropout: float = 0.0, lr: float = 2e-3,
        eval_every: int = 3, context: int = 160, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    name = name or f"{model}-{fine_tune}-{data}".replace("_", "-")
    return write_job(
        folder, name, file=f"{name}-s{steps}-m{micro}-e{every}-d{dropout}.toml", base=LM,
        model={"path": str(assets / model), "fine_tune": fine_tune, "lora_dropout": dropout, "context": context},
        data={"source": str(assets / data), "mask_prompt": data != "text"},
        train={"steps": steps, "micro_batch": micro, "lr": lr},
        checkpoint={"every_steps": every},
        eval={"every_steps": eval_every, "sample_every_steps": steps},
    )


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in ring.metrics(run_dir).items()}


def assert_same_curve(a: dict[int, float], b: dict[int, float], tol: float, steps) -> None:
    diffs = {s: abs(a[s] - b[s]) for s in steps}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= tol, f"step {worst}: {a[worst]} vs {b[worst]} (|diff| {diffs[worst]:.2e} > {tol})"


def checkpoint_names(run_dir: Path, step: int) -> dict[str, str]:
    """Tensor name -> safetensors dtype of a checkpoint's model file (read from its header)."""
    raw = (run_dir / "checkpoints" / f"step-{step}" / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def export(job_file: Path, run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(job_file), "--run-dir", str(run_dir), "--export", str(out), *extra],
        env=ring.trainer_env(), capture_output=True, text=True, timeout=300,
    )


# ---------------------------------------------------------------------------------------------
# Every fine-tune kind, on both architectures, and QLoRA on a base that mlx-lm's convert quantized.

# Each architecture and each kind of fine-tune, not every pair (each case costs 6-8 s of the suite's
# 20 minutes): llama with all three, qwen3 with LoRA, and the quantized qwen3 with LoRA and DoRA.
KINDS = [("llama", "lora"), ("llama", "dora"), ("llama", "full"), ("qwen3", "lora"), ("qwen3-4bit", "lora"), ("qwen3-4bit", "dora")]


@pytest.mark.parametrize(("model", "fine_tune"), KINDS, ids=[f"{m}-{f}" for m, f in KINDS])
def test_fine_tune_learns_checkpoints_what_it_trains_and_exports(assets, env, tmp_path, model, fine_tune):
    from mlx_lm import load

    job_file = job(assets, tmp_path, model=model, fine_tune=fine_tune, lr=5e-3 if fine_tune == "full" else 1e-2)
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env=env)
    evals = ring.metrics(run_dir, "eval")
    assert evals[6]["val_loss"] < evals[0]["val_loss"] - 0.05, evals
    names = checkpoint_names(run_dir, 6)
    if fine_tune == "full":
        # lora_layers = 8 (LM's) with full: every block, and embeddings and head frozen, as mlx-lm's full fine-tune
        assert any(".layers.0." in k for k in names) and not any("embed_tokens" in k for k in names), sorted(names)
    else:
        leaves = {k.rsplit(".", 1)[-1] for k in names}
        assert leaves <= {"lora_a", "lora_b", "m"}, f"{fine_tune}: the checkpoint holds adapters only, not {leaves}"
        assert ("m" in leaves) == (fine_tune == "dora")
    out = tmp_path / "export"
    done = export(job_file, run_dir, out)
    assert done.returncode == 0, done.stderr
    if fine_tune == "full":
        assert {"config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
        loaded, _ = load(str(out))
    else:
        assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapters.safetensors"]
        assert json.loads((out / "adapter_config.json").read_text())["fine_tune_type"] == fine_tune
        loaded, _ = load(str(assets / model), adapter_path=str(out))
    assert loaded is not None


def test_bf16_stays_bf16(assets, env, tmp_path):
    tinylm.make_model(tmp_path / "bf16", arch="llama", dtype="bfloat16", seed=2)
    job_file = job(assets, tmp_path, fine_tune="full", steps=2, every=2, eval_every=2)
    job_file.write_text(job_file.read_text().replace(str(assets / "llama"), str(tmp_path / "bf16")))
    ring.run(job_file, str(tmp_path / "run"), 1, tmp_path / "logs", env=env)
    dtypes = set(checkpoint_names(tmp_path / "run", 2).values())
    assert dtypes == {"BF16"}, f"the checkpoint of a bf16 model holds {dtypes}"


# ---------------------------------------------------------------------------------------------
# The math: world-size invariance on chat data of varied lengths, with the prompts masked.


@pytest.mark.parametrize(("fine_tune", "dropout"), [("lora", 0.1), ("full", 0.0)])
def test_one_rank_and_three_unequal_ranks_agree(assets, env, tmp_path, fine_tune, dropout):
    job_file = job(assets, tmp_path, fine_tune=fine_tune, dropout=dropout, micro=2, every=6,
                   lr=5e-3 if fine_tune == "full" else 1e-2)
    one, three = tmp_path / "one", tmp_path / "three"
    ring.run(job_file, str(one), 1, tmp_path / "logs", env=env)
    ring.run(job_file, str(three / "r{rank}"), 3, tmp_path / "logs", env=env, shares=[2, 3, 7])
    assert_same_curve(losses(one), losses(three / "r0"), 1e-4, steps=range(1, 7))
    v1, v3 = ring.metrics(one, "eval"), ring.metrics(three / "r0", "eval")
    assert all(abs(v1[s]["val_loss"] - v3[s]["val_loss"]) < 1e-4 for s in v1)
    # Token weighting: the ranks held different numbers of trained tokens, and their sum is the step's.
    row = ring.metrics(three / "r0")[1]
    assert row["tokens"] == ring.metrics(one)[1]["tokens"]


@pytest.mark.parametrize("fine_tune", [pytest.param("lora", marks=pytest.mark.long), "full"])
def test_diloco_on_one_worker_and_on_two_gives_the_same_curve_and_exports(assets, env, tmp_path, fine_tune):
    """The low-communication mode fine-tunes mlx-lm models too: 3 virtual replicas on 1 and on 2
    workers, the same curve; the export of its last outer step loads in mlx-lm."""
    base = job(assets, tmp_path, fine_tune=fine_tune, micro=2, every=2, lr=5e-3 if fine_tune == "full" else 1e-2)
    text = base.read_text() + '\n[sync]\nmode = "diloco"\nreplicas = 3\ninner_steps = 2\n'
    job_file = tmp_path / f"diloco-{fine_tune}.toml"
    job_file.write_text(text.replace("\n[sync]\nmode = \"sync\"\ndtype = \"float32\"\n", "\n", 1))
    one, two = tmp_path / "one", tmp_path / "two"
    ring.run(job_file, str(one), 1, tmp_path / "logs", env=env)
    ring.run(job_file, str(two / "r{rank}"), 2, tmp_path / "logs", env=env, shares=[4, 8])
    assert_same_curve(losses(one), losses(two / "r0"), 1e-4, steps=range(1, 7))
    out = tmp_path / "export"
    r = export(job_file, one, out)
    assert r.returncode == 0, r.stderr
    load = "import sys; from mlx_lm import load; load(sys.argv[1]" + (", adapter_path=sys.argv[2])" if fine_tune == "lora" else ")")
    args = [str(assets / "llama"), str(out)] if fine_tune == "lora" else [str(out)]
    done = subprocess.run([sys.executable, "-c", load, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_killed_run_resumes_exactly(assets, env, tmp_path):
    job_file = job(assets, tmp_path, steps=8, every=2, dropout=0.1)
    ref = tmp_path / "ref"
    ring.run(job_file, str(ref), 1, tmp_path / "logs", env=env)
    killed = tmp_path / "killed"
    ring.kill_at_checkpoint(job_file, killed, 4, tmp_path / "logs", env=env)
    assert not (killed / "checkpoints" / "step-8").exists(), "killed before the end"
    resumed = ring.run(job_file, str(killed), 1, tmp_path / "logs", env=env)
    assert '"resume_step":' in resumed.output(0) and '"resume_step":0' not in resumed.output(0)
    assert_same_curve(losses(ref), losses(killed), 1e-6, steps=range(5, 9))
    assert sorted(ring.metrics(killed)) == list(range(1, 9)), "metrics hold each step once"


# ---------------------------------------------------------------------------------------------
# mlx-lm reads what dpool exports.


def test_mlx_lm_scores_generates_and_fuses_the_export(assets, env, tmp_path):
    # A context that holds every example: mlx-lm scores an example truncated to nothing but its
    # prompt as 0/0 (nan); dpool counts it as no tokens.
    job_file = job(assets, tmp_path, model="qwen3", steps=6, every=6, context=512)
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env=env)
    out = tmp_path / "adapters"
    assert export(job_file, run_dir, out).returncode == 0
    reported = ring.metrics(run_dir, "eval")[6]["val_loss"]

    test_data = tmp_path / "test-data"
    test_data.mkdir()
    (test_data / "test.jsonl").write_text((assets / "chat" / "valid.jsonl").read_text())
    model = str(assets / "qwen3")
    mlx = [sys.executable, "-m", "mlx_lm"]
    scored = subprocess.run(
        [*mlx, "lora", "--model", model, "--adapter-path", str(out), "--data", str(test_data), "--test",
         "--mask-prompt", "--batch-size", "1", "--max-seq-length", "512"],
        env=ring.trainer_env(), capture_output=True, text=True, timeout=300,
    )
    match = re.search(r"Test loss ([0-9.]+)", scored.stdout + scored.stderr)
    assert match, scored.stdout[-2000:] + scored.stderr[-2000:]
    assert abs(float(match.group(1)) - reported) <= 1e-3, (match.group(1), reported)

    gen = subprocess.run(
        [*mlx, "generate", "--model", model, "--adapter-path", str(out), "--prompt", "What is 2 + 3?", "--max-tokens", "12"],
        env=ring.trainer_env(), capture_output=True, text=True, timeout=300,
    )
    assert gen.returncode == 0, gen.stdout + gen.stderr
    generated = re.search(r"Generation: (\d+) tokens", gen.stdout)
    assert generated and int(generated.group(1)) > 0 and gen.stdout.split("==========")[1], gen.stdout

    fused = tmp_path / "fused"
    done = subprocess.run(
        [*mlx, "fuse", "--model", model, "--adapter-path", str(out), "--save-path", str(fused)],
        env=ring.trainer_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0 and (fused / "config.json").is_file(), done.stdout + done.stderr


def test_export_of_a_step_and_refusals(assets, env, tmp_path):
    job_file = job(assets, tmp_path, steps=4, every=2, eval_every=4)
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env=env)
    assert export(job_file, run_dir, tmp_path / "s2", "--step", "2").returncode == 0
    assert export(job_file, run_dir, tmp_path / "s4").returncode == 0
    assert (tmp_path / "s2" / "adapters.safetensors").read_bytes() != (tmp_path / "s4" / "adapters.safetensors").read_bytes()
    missing = export(job_file, run_dir, tmp_path / "s3", "--step", "3")
    assert missing.returncode == 2 and "--step 3" in missing.stderr and not (tmp_path / "s3").exists()
    (tmp_path / "full-dir").mkdir()
    (tmp_path / "full-dir" / "keep.txt").write_text("mine")
    taken = export(job_file, run_dir, tmp_path / "full-dir")
    assert taken.returncode == 2 and "not an empty directory" in taken.stderr
    assert (tmp_path / "full-dir" / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# Bad input: one clear line, exit 2, nothing trained.


def _broken_model(assets: Path, folder: Path, how: str) -> Path:
    import shutil

    dst = folder / f"model-{how}"
    shutil.copytree(assets / "llama", dst)
    if how == "no-config":
        (dst / "config.json").unlink()
    elif how == "unknown-arch":
        config = json.loads((dst / "config.json").read_text())
        config["model_type"] = "nosuchformer"
        (dst / "config.json").write_text(json.dumps(config))
    elif how == "no-tokenizer":
        for f in dst.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                f.unlink()
    elif how == "no-template":
        tok = json.loads((dst / "tokenizer_config.json").read_text())
        tok.pop("chat_template", None)
        (dst / "tokenizer_config.json").write_text(json.dumps(tok))
        (dst / "chat_template.jinja").unlink(missing_ok=True)
    return dst


BAD = [
    ("no-config", "chat", "config.json"),
    ("unknown-arch", "chat", "nosuchformer"),
    ("no-template", "chat", "chat template"),
    ("no-tokenizer", "chat", "has no tokenizer (tokenizer.json, tokenizer.model, vocab.json"),
    ("bad-line", "chat", "train.jsonl:3"),
    ("full-on-quantized", "chat", "quantized"),
]


@pytest.mark.parametrize(("how", "data", "says"), BAD, ids=[b[0] for b in BAD])
def test_bad_model_or_data_is_one_line_and_exit_2(assets, tmp_path, how, data, says):
    model, fine_tune, data_dir = assets / "llama", "lora", assets / data
    if how in ("no-config", "unknown-arch", "no-template", "no-tokenizer"):
        model = _broken_model(assets, tmp_path, how)
    elif how == "bad-line":
        data_dir = tmp_path / "data"
        data_dir.mkdir()
        lines = (assets / data / "train.jsonl").read_text().splitlines()
        lines[2] = json.dumps({"question": "what?", "answer": "this"})
        (data_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
    elif how == "full-on-quantized":
        model, fine_tune = assets / "qwen3-4bit", "full"
    job_file = job(assets, tmp_path, fine_tune=fine_tune)
    text = job_file.read_text().replace(str(assets / "llama"), str(model)).replace(str(assets / data), str(data_dir))
    job_file.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "dpool.trainer", str(job_file), "--run-dir", str(tmp_path / "run")],
        env=ring.trainer_env({"DPOOL_CACHE_DIR": str(tmp_path / "cache")}), capture_output=True, text=True, timeout=300,
    )
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and says in lines[0], run.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# Data and packing, without processes.


def test_a_file_of_mixed_formats_is_refused_at_the_line(tmp_path):
    from dpool.trainer.data import DataError
    from dpool.trainer.lm_data import read_jsonl

    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n\n{"prompt": "p", "completion": "c"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:3: a \{\"prompt\", \"completion\"\} example in a file of \{\"text\"\}"):
        read_jsonl(path)
    path.write_text('{"messages": "not a list"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:1: 'messages' must be a non-empty list"):
        read_jsonl(path)
    path.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(DataError, match=r"train.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_a_row_the_template_cannot_render_or_with_a_lone_surrogate_is_named_by_its_line(assets, tmp_path):
    from mlx_lm.utils import load_tokenizer

    from dpool.protocol.jobspec import parse_job
    from dpool.trainer.data import DataError
    from dpool.trainer.lm_data import load_lm_data, read_jsonl

    data = tmp_path / "data"
    data.mkdir()
    good = (assets / "chat" / "train.jsonl").read_text().splitlines()[:6]
    (data / "train.jsonl").write_text("\n".join(good[:3]) + "\n\n\n" + '{"messages": [{"role": "wizard", "content": "hi"}]}\n' + "\n".join(good[3:]) + "\n")
    spec = parse_job({"name": "s", "model": {"kind": "mlx_lm", "path": str(assets / "llama")}, "data": {"source": str(data)}})
    with pytest.raises(DataError, match=r"train\.jsonl:6: the tokenizer could not render it \(TemplateError: .*wizard"):
        load_lm_data(spec, load_tokenizer(assets / "llama"), [], tmp_path / "cache")
    # With mask_prompt, the messages before the last are the prompt: one message alone has none.
    (data / "train.jsonl").write_text("\n".join(good[:3]) + "\n" + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    masked = parse_job({"name": "s", "model": {"kind": "mlx_lm", "path": str(assets / "llama")}, "data": {"source": str(data), "mask_prompt": True}})
    with pytest.raises(DataError, match=r"train\.jsonl:4: data\.mask_prompt = true trains the last message .* one message only"):
        load_lm_data(masked, load_tokenizer(assets / "llama"), [], tmp_path / "cache")
    (data / "train.jsonl").write_text('{"text": "fine"}\n{"text": "half \\ud800 a pair"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:2: holds '\\ud800', half of a UTF-16 surrogate pair"):
        read_jsonl(data / "train.jsonl")


def test_without_valid_jsonl_examples_are_held_out_by_a_seeded_hash(assets, tmp_path):
    from mlx_lm.utils import load_tokenizer

    from dpool.protocol.jobspec import parse_job
    from dpool.trainer.lm_data import load_lm_data

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text((assets / "chat" / "train.jsonl").read_text())
    tokenizer = load_tokenizer(assets / "llama")

    def split(seed: int):
        spec = parse_job({"name": "s", "model": {"kind": "mlx_lm", "path": str(assets / "llama")},
                          "data": {"source": str(data), "val_fraction": 0.25, "mask_prompt": True}, "train": {"seed": seed}})
        return load_lm_data(spec, tokenizer, [], tmp_path / f"cache-{seed}")

    a, again, other = split(1), split(1), split(2)
    assert len(a.train) + len(a.val) == 48 and 4 <= len(a.val) <= 20
    assert [t.tolist() for t in a.val.tokens] == [t.tolist() for t in again.val.tokens]
    assert [t.tolist() for t in a.val.tokens] != [t.tolist() for t in other.val.tokens]
    assert all(0 < o < len(t) for t, o in zip(a.train.tokens, a.train.offsets, strict=True)), "prompts are masked"
    # A fraction too small for the examples still holds one out (20 at 0.05 held out none: refused).
    (data / "train.jsonl").write_text("\n".join((assets / "chat" / "train.jsonl").read_text().splitlines()[:6]) + "\n")
    few = parse_job({"name": "s", "model": {"kind": "mlx_lm", "path": str(assets / "llama")},
                     "data": {"source": str(data), "val_fraction": 0.01}, "train": {"seed": 1}})
    small = load_lm_data(few, tokenizer, [], tmp_path / "cache-few")
    assert (len(small.train), len(small.val)) == (5, 1)


def test_examples_with_nothing_to_train_within_the_context_are_left_out_or_refused(assets, tmp_path):
    """With data.mask_prompt, a prompt as long as model.context cuts the example before its answer:
    no trained token (mlx-lm trains it with a NaN loss; a batch of only those divided by zero).
    They are left out with a warning; a split of nothing else is refused, naming the setting."""
    from mlx_lm.utils import load_tokenizer

    from dpool.protocol.jobspec import parse_job
    from dpool.trainer.data import DataError
    from dpool.trainer.lm_data import load_lm_data, trainable

    tokenizer = load_tokenizer(assets / "llama")
    spec = parse_job({"name": "s", "model": {"kind": "mlx_lm", "path": str(assets / "llama")},
                      "data": {"source": str(assets / "chat"), "mask_prompt": True}})
    data = load_lm_data(spec, tokenizer, [], tmp_path / "cache")
    offsets = sorted(int(o) for o in data.train.offsets)
    width = offsets[len(offsets) // 2]  # half the prompts reach it
    kept, dropped = trainable(data, width, "chat")
    assert dropped["train"] == sum(o >= width for o in offsets) > 0 and len(kept.train) == len(data.train) - dropped["train"]
    assert all(o < width for o in kept.train.offsets) and all(o < width for o in kept.val.offsets)
    assert trainable(data, offsets[-1] + 1, "chat") == (data, {})  # nothing to leave out: the same data
    with pytest.raises(DataError, match=r"every training example's prompt is \d+ tokens or longer.*model.context \(max_seq_length\) = 1"):
        trainable(data, 1, "chat")


def test_tools_null_is_no_tools_as_mlx_lm_reads_it(tmp_path):
    from dpool.trainer.data import DataError
    from dpool.trainer.lm_data import read_jsonl

    path = tmp_path / "train.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps({**chat, "tools": None}) + "\n" + json.dumps(chat) + "\n")
    fmt, rows = read_jsonl(path)
    assert fmt == "chat" and len(rows) == 2
    path.write_text(json.dumps({**chat, "tools": "search"}) + "\n")
    with pytest.raises(DataError, match=r"train.jsonl:1: 'tools' must be a list"):
        read_jsonl(path)


def test_pack_groups_by_length_and_pads_as_mlx_lm():
    import numpy as np

    from dpool.trainer.task import Example, pack

    ex = [Example(np.arange(1, n + 1, dtype=np.int32), 2, i) for i, n in enumerate([40, 5, 70, 6])]
    batches = pack(ex, micro=2, pad_to=32, width_cap=64)
    assert [b.idents.tolist() for b in batches] == [[1, 3], [0, 2]], "shortest first"
    assert [b.tokens.shape[1] for b in batches] == [33, 64], "1 + a multiple of 32, capped by the context"
    assert batches[1].lengths.tolist() == [[2, 40], [2, 64]], "the 70-token example is truncated to 64"
    assert batches[0].tokens[0, 5:].sum() == 0, "zero padding"


def test_global_batches_cover_each_epoch_once_and_group_similar_lengths():
    import numpy as np

    from dpool.trainer.data import ExampleOrder

    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 500, size=200)
    order = ExampleOrder(200, 8, seed=7, lengths=lengths)
    epoch = [i for s in range(1, 26) for i in order.indices(s, 0, 8)]
    assert sorted(epoch) == list(range(200)), "every example once per epoch"
    assert order.indices(3, 2, 4) == order.indices(3, 0, 8)[2:6], "a share is a slice of the global batch"
    assert order.indices(26, 0, 8) != order.indices(1, 0, 8), "the next epoch is another order"
    spread = np.mean([np.ptp(lengths[order.indices(s, 0, 8)]) for s in range(1, 26)])
    shuffled = ExampleOrder(200, 8, seed=7)
    random_spread = np.mean([np.ptp(lengths[shuffled.indices(s, 0, 8)]) for s in range(1, 26)])
    assert spread < random_spread / 3, (spread, random_spread)


def test_the_validation_loss_scores_whole_batches_as_mlx_lm_evaluates():
    """mlx-lm's evaluate (iterate_batches) leaves out the last `len % batch_size` examples; scoring
    them too gave another number than `mlx_lm lora --test` with the job's batch (6 of them at a
    batch of 4: 5.97 against mlx-lm's 6.80 on a tiny gemma2)."""
    from dpool.trainer.lm import scored_count

    assert scored_count(6, 4, -1) == 4 and scored_count(12, 12, -1) == 12 and scored_count(30, 4, -1) == 28
    assert scored_count(30, 4, 2) == 8 and scored_count(30, 4, 100) == 28
    assert scored_count(3, 4, -1) == 3 and scored_count(3, 4, 1) == 3  # under one batch (mlx-lm refuses): all


def test_examples_longer_than_the_context_are_trained_truncated_and_said_so(assets, env, tmp_path):
    """As mlx-lm warns of sequences longer than max_seq_length, the trainer says how many of the
    training examples it cuts to model.context, and the longest."""
    job_file = job(assets, tmp_path, data="text", steps=1, every=1, eval_every=1, context=24, name="cut")
    g = ring.run(job_file, str(tmp_path / "run"), 1, tmp_path / "logs", env=env)
    (said,) = [json.loads(line) for line in g.output(0).splitlines() if '"data.truncated"' in line]
    assert said["context"] == 24 and 0 < said["examples"] <= said["of"] == 48 and said["longest"] > 24, said


def test_a_test_jsonl_added_under_a_run_does_not_refuse_its_resume_but_edited_training_data_does(assets, env, tmp_path):
    """The resume compares what the checkpoint trained on (train and validation examples), not
    the test split `dpctl test` scores, which a user may add at any time."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(assets / "chat", data)
    job_file = job(assets, tmp_path, steps=4, every=2, eval_every=2, name="addtest")
    text = job_file.read_text().replace(str(assets / "chat"), str(data))
    job_file.write_text(text)
    run_dir = tmp_path / "run"
    ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env=env)
    shutil.rmtree(run_dir / "checkpoints" / "step-4")
    (data / "test.jsonl").write_text((data / "valid.jsonl").read_text())
    g = ring.run(job_file, str(run_dir), 1, tmp_path / "logs", env=env)
    assert '"resume_step":2' in g.output(0)
    shutil.rmtree(run_dir / "checkpoints" / "step-4")
    lines = (data / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    refused = ring.start(job_file, str(run_dir), 1, tmp_path / "logs", env=env)
    try:
        assert refused.wait(120) == [2]
    finally:
        refused.kill()
    assert "not the ones the checkpoint of step 2 was trained on" in refused.output(0)
