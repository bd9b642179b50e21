"""Tiny offline mlx-lm models and datasets (trainer/tinylm.py), checked with mlx-lm itself.

What a user of `dpctl demo --lm` or a benchmark relies on: the folder loads with `mlx_lm.load`
and strict weight checking, its chat template does what mlx-lm's datasets and `--mask-prompt`
assume, the data varies in length, and `mlx_lm lora` trains on it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.datasets import CacheDataset, create_dataset
from mlx_lm.tuner.trainer import default_loss, iterate_batches

from dpool.trainer import blas, tinylm


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """One float32 model folder per architecture, built once for the module."""
    root = tmp_path_factory.mktemp("tinylm")
    return {arch: tinylm.make_model(root / arch, arch) for arch in tinylm.ARCHS}


@pytest.fixture(scope="module")
def tokenizer(models):
    return mlx_lm.utils.load_tokenizer(models["llama"])


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def token_lengths(tokenizer, data: list[dict], mask_prompt: bool) -> list[int]:
    """The length of each example, tokenized the way `mlx_lm lora` does it."""
    dataset = create_dataset(data, tokenizer, SimpleNamespace(mask_prompt=mask_prompt))
    return [len(tokens) for tokens, _ in map(dataset.process, data)]


@pytest.mark.parametrize("arch", tinylm.ARCHS)
def test_every_arch_loads_strictly_and_gives_finite_logits(models, arch):
    model, tokenizer, config = mlx_lm.load(str(models[arch]), return_config=True)
    assert type(model).__module__ == f"mlx_lm.models.{arch}" and config["model_type"] == arch
    assert config["tie_word_embeddings"] == (arch != "llama")
    ids = tokenizer.encode("What is 2 + 3?")
    assert ids[0] == tokenizer.bos_token_id
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert mx.all(mx.isfinite(logits)).item()
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(tinylm.EOS) == config["eos_token_id"]
    assert tokenizer.pad_token_id == 0, "mlx-lm pads with 0 and trains on one pad target per sequence"
    assert len(tokenizer.get_vocab()) <= config["vocab_size"], "every token has an embedding row"


def test_every_arch_tokenizes_alike(models):
    """transformers 5 swaps in its own Qwen2Tokenizer for a `qwen2` folder; it must agree with ours."""
    texts = tinylm.default_corpus(count=6)
    tokenizers = {arch: mlx_lm.utils.load_tokenizer(path) for arch, path in models.items()}
    encoded = {arch: [t.encode(text) for text in texts] for arch, t in tokenizers.items()}
    assert encoded["qwen2"] == encoded["llama"] == encoded["qwen3"]


def test_same_seed_gives_the_same_weights_and_another_seed_does_not(tmp_path):
    def weights(seed: int, name: str) -> dict[str, mx.array]:
        return mx.load(str(tinylm.make_model(tmp_path / name, seed=seed) / "model.safetensors"))

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert a.keys() == b.keys() == c.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not mx.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"]).item()


def test_chat_template_renders_turns_and_the_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert whole == (
        "<|bos|><|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n5<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == whole[: whole.index("5<|im_end|>")]
    without = tokenizer.apply_chat_template(messages[:-1], tokenize=False)
    assert without.endswith("What is 2 + 3?<|im_end|>\n")
    with pytest.raises(Exception, match="first message"):
        tokenizer.apply_chat_template([*messages, messages[0]], tokenize=False)


def test_chat_template_lists_tools_and_renders_calls_mlx_lm_can_parse(tokenizer):
    example = next(r for r in tinylm.examples("tools", 6, random.Random(0)) if len(r["messages"]) > 2)
    text = tokenizer.apply_chat_template(example["messages"], tools=example["tools"], tokenize=False)
    assert text.startswith("<|bos|><|im_start|>system\n# Tools\n")
    for tool in example["tools"]:
        assert json.dumps(tool) in text
    assert "<|im_start|>tool\n" in text
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    body = text.split("<tool_call>", 2)[2].split("</tool_call>")[0]  # the first call after the header
    call = example["messages"][1]["tool_calls"][0]["function"]
    assert tokenizer.tool_parser(body) == {"name": call["name"], "arguments": json.loads(call["arguments"])}


@pytest.mark.parametrize("fmt", ["chat", "tools"])
def test_prompt_tokens_are_a_prefix_of_the_whole_example(tokenizer, fmt):
    """`--mask-prompt` masks len(tokens(prompt)) tokens of tokens(whole): they must line up."""
    for row in tinylm.examples(fmt, 30, random.Random(3)):
        whole = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"))
        prompt = tokenizer.apply_chat_template(
            row["messages"][:-1], tools=row.get("tools"), add_generation_prompt=True
        )
        assert whole[: len(prompt)] == prompt and len(whole) > len(prompt)


@pytest.mark.parametrize("fmt", tinylm.FORMATS)
def test_data_files_parse_as_mlx_lm_formats_and_lengths_vary(tmp_path, tokenizer, fmt):
    out = tinylm.make_chat_data(tmp_path, train=30, valid=9, test=6, fmt=fmt, seed=5)
    train, valid, test = (rows(out / f"{split}.jsonl") for split in ("train", "valid", "test"))
    assert (len(train), len(valid), len(test)) == (30, 9, 6)
    keys = {"chat": {"messages"}, "completions": {"prompt", "completion"}, "text": {"text"},
            "tools": {"messages", "tools"}}[fmt]
    assert all(set(r) == keys for r in train + valid + test)
    lengths = token_lengths(tokenizer, train, mask_prompt=fmt != "text")
    # The tools header (every example lists its tools) is a floor under that format's lengths.
    assert max(lengths) / min(lengths) >= (2.5 if fmt == "tools" else 4), sorted(lengths)
    if fmt in ("chat", "tools"):
        assert all(r["messages"][-1]["role"] == "assistant" for r in train)
        assert any(r["messages"][0]["role"] == "system" for r in train) or fmt == "tools"
        assert any(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in train) or fmt == "tools"


def test_data_depends_only_on_the_seed(tmp_path):
    a, b, c = (tinylm.make_chat_data(tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 1), ("c", 2)))
    assert (a / "train.jsonl").read_bytes() == (b / "train.jsonl").read_bytes()
    assert (a / "train.jsonl").read_bytes() != (c / "train.jsonl").read_bytes()
    assert rows(a / "train.jsonl") != rows(a / "valid.jsonl")
    assert not (a / "test.jsonl").exists(), "test.jsonl only when asked for"


def test_mlx_lm_counts_one_padding_target_per_sequence(models, tokenizer, tmp_path):
    """Why PAD is id 0: mlx-lm's loss counts targets offset..length, one past the last token.

    A trainer that weights workers by token count must count as mlx-lm does: length - offset + 1.
    """
    model, _ = mlx_lm.load(str(models["llama"]))
    data = rows(tinylm.make_chat_data(tmp_path, train=8, valid=0) / "train.jsonl")
    dataset = CacheDataset(create_dataset(data, tokenizer, SimpleNamespace(mask_prompt=True)))
    batch, lengths = next(iterate_batches(dataset, 4, 2048, seed=0))
    _, ntoks = default_loss(model, batch, lengths)
    spans = lengths.tolist()
    assert ntoks.item() == sum(n - offset + 1 for offset, n in spans)
    assert all(batch[i, n].item() == tokenizer.pad_token_id for i, (_, n) in enumerate(spans))


def test_bfloat16_model_loads_as_bfloat16(tmp_path):
    path = tinylm.make_model(tmp_path / "bf16", "qwen3", dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _ = mlx_lm.load(str(path))
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    assert dtypes == {mx.bfloat16}
    assert mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))).item()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_copy_has_quantized_layers_and_loads(models, tmp_path, arch):
    dst = tinylm.quantize(models[arch], tmp_path / "q4", bits=4, group_size=32)
    model, tokenizer, config = mlx_lm.load(str(dst), return_config=True)
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    quantized = [name for name, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert any(name.endswith("mlp.down_proj") for name in quantized)
    assert any(name.endswith("self_attn.q_proj") for name in quantized)
    assert not any(isinstance(m, nn.Linear) for _, m in model.named_modules()), "every Linear quantized"
    assert mx.all(mx.isfinite(model(mx.array([tokenizer.encode("hi")])))).item()
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_quantize_refuses_a_group_size_that_would_leave_layers_unquantized(models, tmp_path):
    with pytest.raises(ValueError, match="hidden_size=64"):
        tinylm.quantize(models["llama"], tmp_path / "q", group_size=128)
    assert not (tmp_path / "q").exists()


def test_cli_writes_and_prints_each_path(tmp_path, capsys):
    assert tinylm.main(["data", str(tmp_path / "d"), "--format", "completions", "--train", "6"]) == 0
    assert tinylm.main(["model", str(tmp_path / "m"), "--arch", "qwen3", "--seed", "2"]) == 0
    assert tinylm.main(["quantize", str(tmp_path / "m"), str(tmp_path / "q")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / n) for n in ("d", "m", "q")]
    assert len(rows(tmp_path / "d" / "train.jsonl")) == 6
    assert tinylm.main(["model", str(tmp_path / "x"), "--hidden", "66"]) == 2
    assert capsys.readouterr().err.startswith("error: hidden=66 is not a multiple of heads=4")
    assert tinylm.main(["quantize", str(tmp_path / "m"), str(tmp_path / "q")]) == 2, "q exists"


def test_mlx_lm_lora_trains_a_tiny_model(models, tmp_path):
    """The real `mlx_lm lora` CLI, a few steps with prompt masking: the adapter lowers the loss."""
    data = tinylm.make_chat_data(tmp_path / "data", train=16, valid=8)
    adapters = tmp_path / "adapters"
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(models["llama"]), "--train",
           "--data", str(data), "--iters", "8", "--batch-size", "4", "--mask-prompt",
           "--num-layers", "-1", "--learning-rate", "1e-3", "--adapter-path", str(adapters),
           "--steps-per-eval", "1000", "--val-batches", "1"]
    env = blas.preload_env() or dict(os.environ)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (adapters / "adapters.safetensors").is_file()

    tokenizer = mlx_lm.utils.load_tokenizer(models["llama"])
    valid = CacheDataset(create_dataset(rows(data / "valid.jsonl"), tokenizer,
                                        SimpleNamespace(mask_prompt=True)))

    def loss(model) -> float:
        batch, lengths = next(iterate_batches(valid, 8, 2048, seed=0))
        return default_loss(model, batch, lengths)[0].item()

    before = loss(mlx_lm.load(str(models["llama"]))[0])
    after = loss(mlx_lm.load(str(models["llama"]), adapter_path=str(adapters))[0])
    assert after < before - 0.5, (before, after)
