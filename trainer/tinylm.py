"""Tiny mlx-lm models and chat datasets, built offline in about a second.

Tests, benchmarks and `dpctl demo --lm` fine-tune a real mlx-lm model, so they need one without a
network. This module writes a Hugging Face style model folder that `mlx_lm.load` reads with strict
weight checking: the model is mlx-lm's own class for the architecture, with seeded random weights,
and the tokenizer is a byte-level BPE trained here on the same text the datasets hold. Nothing here
names a hub repository, so nothing can be downloaded.

The datasets are in mlx-lm's four formats and hold easy tasks (sums, counting, times tables, words
backwards, a handful of facts), so the loss falls fast: from 6.3 to 4.1 in 50 full fine-tuning
steps of the default llama. Their lengths are spread on purpose, from about 15 to about 200 tokens
(120 to 400 in the tools format, where every example lists its tools): a trainer that weights
workers by example count instead of by token count shows a wrong loss on such data, and not on
uniform data.

    python -m dpool.trainer.tinylm model OUT [--arch llama|qwen2|qwen3] [--dtype bfloat16]
    python -m dpool.trainer.tinylm data OUT [--format chat|completions|text|tools]
    python -m dpool.trainer.tinylm quantize SRC DST [--bits 4] [--group-size 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# mlx_lm is imported where it is used: it pulls in transformers (about 2 s), and writing data
# needs neither.

ARCHS = ("llama", "qwen2", "qwen3")
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FORMATS = ("chat", "completions", "text", "tools")
DTYPES = ("float32", "bfloat16", "float16")

# Id 0 is the pad token on purpose: mlx-lm's loss counts one target past each sequence's end (its
# mask is `steps <= length`), and that target is the batch padding, id 0. With pad at 0 the extra
# target is "pad after end of turn", a harmless thing to learn, and the same for every model here.
# "<|endoftext|>" is Qwen's default unk/eos: transformers 5 loads a `qwen2` folder with its own
# Qwen2Tokenizer whatever tokenizer_config.json says, and appends that token when it is missing.
PAD, BOS, IM_START, IM_END, ENDOFTEXT = (
    "<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"
)
SPECIAL_TOKENS = (PAD, BOS, IM_START, IM_END, ENDOFTEXT)
EOS = IM_END  # generation stops at the end of the assistant's turn

# Qwen2's pre-tokenizer split (digits one by one, newlines apart), for the same reason: the
# Qwen2Tokenizer that transformers substitutes rebuilds the pipeline with this regex and NFC, so
# every arch here must use them to tokenize alike. Single digits also make sums easier to learn.
SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen uses, with a bos in front as Llama has. Every turn ends in "<|im_end|>\n" and
# the generation prompt ends in "assistant\n"; the pre-tokenizer cuts after that newline unless
# more whitespace follows, so for an answer that starts with a visible character (all of ours do)
# the tokens of the prompt are a prefix of the tokens of prompt + answer. `--mask-prompt` relies
# on that: it masks len(tokens(prompt)) tokens of the whole. The names
# `<tool_call>` and `tool_call.name` make mlx-lm pick its `json_tools` parser for generated calls.
CHAT_TEMPLATE = """
{{- bos_token }}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if system %}{{ system + '\\n\\n' }}{% endif %}
{{- '# Tools\\nCall a function as <tool_call>{"name": ..., "arguments": ...}</tool_call>.\\n' }}
{%- for tool in tools %}{{ (tool | tojson) + '\\n' }}{% endfor %}
{{- '<|im_end|>\\n' }}
{%- elif system %}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('Only the first message may be a system message.') }}{% endif %}
{%- elif message.role in ['user', 'assistant', 'tool'] %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
{%- if message.content or not loop.first %}{{ '\\n' }}{% endif %}
{{- '<tool_call>{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{ tool_call.arguments }}{% else %}{{ tool_call.arguments | tojson }}{% endif %}
{{- '}</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- raise_exception('Unknown role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
""".strip()

# The words of the template, so the tokenizer learns them whole whatever corpus it is given.
TEMPLATE_TEXT = (
    "system\nuser\nassistant\ntool\n# Tools\nCall a function as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>.\n'
)


def make_tokenizer(out: Path, corpus: Iterable[str], vocab_size: int = 512) -> None:
    """Train a byte-level BPE on `corpus` and write it as a Hugging Face fast tokenizer.

    Byte-level means any text encodes, even text the corpus never had. The files are what
    `transformers.AutoTokenizer` reads (tokenizer.json, tokenizer_config.json with the chat
    template, special_tokens_map.json), written by hand so that building needs only `tokenizers`.
    Plain `encode` adds a bos, as Llama's does; the chat template writes its own bos, because
    `apply_chat_template` encodes without special tokens.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size}: a byte-level tokenizer needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes and {len(SPECIAL_TOKENS)} special tokens)"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEMPLATE_TEXT, *corpus], trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer.save(str(out / "tokenizer.json"))

    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "tool_parser_type": "json_tools",  # mlx-lm would infer it from the template; say it
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special)


def _model_config(
    arch: str, *, layers: int, hidden: int, heads: int, kv_heads: int, vocab_size: int,
    intermediate: int, dtype: str,
) -> dict[str, Any]:
    """config.json for `arch`: the fields its mlx_lm ModelArgs needs, named as Hugging Face names them.

    Llama keeps a separate output matrix, as Llama 3 8B does; the Qwen models tie it to the
    embedding, as their small sizes do, so both of mlx-lm's code paths get exercised.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r}: expected one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [HF_CLASSES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "rope_theta": 10000.0 if arch == "llama" else 1000000.0,
        "tie_word_embeddings": arch != "llama",
        "torch_dtype": dtype,  # mlx_lm.convert casts to this unless told otherwise
    }
    if arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    return config


def make_model(
    out: Path,
    arch: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    intermediate: int = 128,
    seed: int = 0,
    dtype: str = "float32",
    corpus: Iterable[str] | None = None,
) -> Path:
    """Write a model folder that `mlx_lm.load(out)` loads: config, random weights, tokenizer.

    The model is built by mlx-lm's own class for `arch`, after `mx.random.seed(seed)` (mlx's global
    generator: layers draw their initial weights from it), so the same arguments give the same
    weights. Its parameter names are already the Hugging Face names
    (`model.layers.0.self_attn.q_proj.weight`), so mlx-lm's `save_model` writes a file its loader
    accepts with strict checking. The default widths (64, 128) are multiples of 32 and 64, the
    group sizes 4-bit quantization can use. The tokenizer is trained on `corpus`, by default the
    text of every format `make_chat_data` writes.
    """
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = _model_config(
        arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        vocab_size=vocab_size, intermediate=intermediate, dtype=dtype,
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, default_corpus() if corpus is None else corpus, vocab_size)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    config |= {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


# ---- datasets ----------------------------------------------------------------------------------

WORDS = (
    "apple", "garden", "river", "pencil", "window", "basket", "candle", "dragon", "forest",
    "guitar", "harbor", "island", "jacket", "kitten", "lemon", "marble", "needle", "orange",
    "planet", "rabbit", "silver", "tunnel", "violet", "winter", "yellow", "zebra",
)
FACTS = (
    ("What colour is the sky?", "Blue."),
    ("How many legs does a cat have?", "Four."),
    ("What is the capital of France?", "Paris."),
    ("How many days are in a week?", "Seven."),
    ("What do bees make?", "Honey."),
    ("What is frozen water called?", "Ice."),
    ("How many hours are in a day?", "Twenty-four."),
    ("Which planet is closest to the sun?", "Mercury."),
)
SYSTEMS = (
    "You are a terse tutor. Answer with the result only.",
    "You are a patient maths teacher.",
    "Answer briefly and exactly.",
)
TOOLS = (
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "reverse", "description": "Spell a word backwards.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                       "required": ["word"]}}},
)

QA = tuple[str, str]


def _short(rng: random.Random) -> QA:
    """One question with a short answer: a sum, a fact or a word backwards."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        return f"What is {a} + {b}?", str(a + b)
    if kind == 1:
        return rng.choice(FACTS)
    word = rng.choice(WORDS)
    return f"Spell {word} backwards.", word[::-1]


def _long(rng: random.Random, size: int) -> QA:
    """A question whose answer has about `size` lines or numbers: counting or a times table."""
    if rng.random() < 0.5:
        start = rng.randint(1, 30)
        end = start + size
        return f"Count from {start} to {end}.", ", ".join(str(i) for i in range(start, end + 1))
    k = rng.randint(2, 9)
    lines = "\n".join(f"{k} x {i} = {k * i}" for i in range(1, size + 1))
    return f"Write the {k} times table up to {k} x {size}.", lines


def _turns(rng: random.Random, length: int) -> list[QA]:
    """Question-answer pairs for one example of length class 0 (short), 1 (medium) or 2 (long).

    Every third example is of each class, so any dataset of three or more examples spans
    lengths from a one-line sum to a multi-turn times table, whatever the seed.
    """
    if length == 0:
        return [_short(rng)]
    if length == 1:
        return [_long(rng, rng.randint(3, 6))]
    return [_long(rng, rng.randint(6, 9)), _short(rng), _long(rng, rng.randint(3, 5))]


def _chat(rng: random.Random, length: int) -> dict[str, Any]:
    messages = []
    if length and rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for question, answer in _turns(rng, length):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def _completion(rng: random.Random, length: int) -> dict[str, Any]:
    question, answer = _long(rng, rng.randint(10, 14)) if length == 2 else _turns(rng, length)[0]
    return {"prompt": question, "completion": answer}


def _text(rng: random.Random, length: int) -> dict[str, Any]:
    return {"text": "\n\n".join(f"Q: {q}\nA: {a}" for q, a in _turns(rng, length))}


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    """An assistant turn that calls one tool, in OpenAI's format (arguments as a JSON string)."""
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _tool_use(rng: random.Random, length: int) -> dict[str, Any]:
    """A tools example: answered directly (short), through one call (medium) or two (long)."""
    tools = list(TOOLS) if length else [rng.choice(TOOLS)]
    if length == 0:
        question, answer = rng.choice(FACTS)
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"messages": messages, "tools": tools}
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    messages = [{"role": "user", "content": f"Use the tools: what is {a} + {b}?"},
                _call("add", a=a, b=b),
                {"role": "tool", "content": str(a + b)}]
    if length == 1:
        messages.append({"role": "assistant", "content": f"{a} + {b} = {a + b}."})
    else:
        messages[0]["content"] = f"Use the tools: what is ({a} + {b}) x {c}?"
        messages += [_call("multiply", a=a + b, b=c),
                     {"role": "tool", "content": str((a + b) * c)},
                     {"role": "assistant", "content": f"{a} + {b} = {a + b}, and "
                                                      f"{a + b} x {c} = {(a + b) * c}."}]
    return {"messages": messages, "tools": tools}


EXAMPLES: dict[str, Callable[[random.Random, int], dict[str, Any]]] = {
    "chat": _chat, "completions": _completion, "text": _text, "tools": _tool_use,
}


def examples(fmt: str, count: int, rng: random.Random) -> list[dict[str, Any]]:
    """`count` examples in mlx-lm's `fmt` format, a third of each length class, in seeded order."""
    if fmt not in EXAMPLES:
        raise ValueError(f"fmt={fmt!r}: expected one of {', '.join(FORMATS)}")
    rows = [EXAMPLES[fmt](rng, i % 3) for i in range(count)]
    rng.shuffle(rows)
    return rows


def make_chat_data(
    out: Path, *, train: int = 48, valid: int = 12, seed: int = 0, fmt: str = "chat", test: int = 0
) -> Path:
    """Write train.jsonl and valid.jsonl (and test.jsonl when `test` > 0) for `mlx_lm lora --data`.

    The files depend only on the arguments. The splits are drawn from one seeded stream, so they
    hold different examples of the same tasks.
    """
    rng = random.Random(seed)
    splits = {name: examples(fmt, count, rng)
              for name, count in (("train", train), ("valid", valid), ("test", test)) if count > 0}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _strings(value: Any) -> Iterable[str]:
    """Every string inside a JSON-like value; the tools lists as the template renders them."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        if "function" in value and "type" in value:
            yield json.dumps(value)
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def default_corpus(count: int = 96, seed: int = 0) -> list[str]:
    """The text of `count` examples of each format: what the tokenizer of `make_model` learns."""
    rng = random.Random(seed)
    return [s for fmt in FORMATS for row in examples(fmt, count, rng) for s in _strings(row)]


# ---- quantization ------------------------------------------------------------------------------


def quantize(src: Path, dst: Path, bits: int = 4, group_size: int = 32) -> Path:
    """Write a quantized copy of `src` to `dst` with mlx-lm's converter, as `mlx_lm convert -q` does.

    mlx-lm quietly leaves unquantized any layer whose input width is not a multiple of
    `group_size`, so a bad group size would give a float model named as quantized; it is refused
    here instead. The converter's progress lines go to stderr, keeping stdout for the CLI's path.
    """
    from mlx_lm.convert import convert

    config = json.loads((Path(src) / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size"):
        if not isinstance(config.get(key), int):
            continue  # another architecture's names (gpt2's n_embd): mlx-lm's converter checks its own
        if config[key] % group_size:
            raise ValueError(
                f"group_size={group_size}: {key}={config[key]} in {src}/config.json is not a "
                "multiple of it; use 32 or 64 for the default widths"
            )
    with contextlib.redirect_stdout(sys.stderr):
        convert(str(src), str(dst), quantize=True, q_group_size=group_size, q_bits=bits)
    return Path(dst)


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); prints the folder it wrote."""
    parser = argparse.ArgumentParser(prog="python -m dpool.trainer.tinylm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="write a tiny random model folder")
    model.add_argument("out", type=Path)
    model.add_argument("--arch", choices=ARCHS, default="llama")
    model.add_argument("--dtype", choices=DTYPES, default="float32")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--hidden", type=int, default=64)
    data = commands.add_parser("data", help="write train/valid(/test).jsonl")
    data.add_argument("out", type=Path)
    data.add_argument("--format", choices=FORMATS, default="chat")
    data.add_argument("--train", type=int, default=48)
    data.add_argument("--valid", type=int, default=12)
    data.add_argument("--test", type=int, default=0)
    data.add_argument("--seed", type=int, default=0)
    quant = commands.add_parser("quantize", help="write a quantized copy with mlx_lm.convert")
    quant.add_argument("src", type=Path)
    quant.add_argument("dst", type=Path)
    quant.add_argument("--bits", type=int, default=4)
    quant.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args(argv)

    try:
        if args.command == "model":
            path = make_model(args.out, args.arch, layers=args.layers, hidden=args.hidden,
                              seed=args.seed, dtype=args.dtype)
        elif args.command == "data":
            path = make_chat_data(args.out, train=args.train, valid=args.valid, test=args.test,
                                  seed=args.seed, fmt=args.format)
        else:
            path = quantize(args.src, args.dst, bits=args.bits, group_size=args.group_size)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, exit 2, as the trainer's
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
