"""The built-in kind: a small byte-level GPT on windows of a token stream (`data.py`, `model.py`).

Every example is a window of `context + 1` tokens, all of them trained; the held-out set is a fixed
set of `eval.batches x global_batch` windows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from dpool.protocol.jobspec import JobSpec, ModelSpec
from dpool.trainer.data import VOCAB_SIZE, BatchSampler, eval_windows, load_corpus
from dpool.trainer.model import GPT, build_model, generate
from dpool.trainer.task import Example

DEFAULT_PROMPT = "def "


class GPTTask:
    pad_to = 1

    def __init__(self, spec: JobSpec, cache_dir: Path, *, with_data: bool = True):
        self.spec = spec
        m, t = spec.model, spec.train
        self.width_cap = m.context + 1
        self.model = build_model(m, VOCAB_SIZE, t.seed)
        self.fingerprints: dict[str, int] = {}
        self.val_count = 0
        if not with_data:
            return
        corpus = load_corpus(spec, cache_dir)
        self.corpus = corpus
        self.sampler = BatchSampler(corpus.train, m.context, t.global_batch, t.seed)
        self.val = eval_windows(corpus.val, m.context, spec.eval.batches * t.global_batch, t.seed)
        self.val_count = len(self.val)
        self.fingerprints = {"data": corpus.fingerprint}

    def examples(self, step: int, start: int, count: int) -> list[Example]:
        rows = self.sampler.sequences(step, start, count)
        first = (step - 1) * self.spec.train.global_batch + start
        return [Example(rows[i], 0, first + i) for i in range(count)]

    def val_examples(self, indices: list[int]) -> list[Example]:
        return [Example(self.val[i], 0, i) for i in indices]

    def sample(self, step: int) -> str:
        prompt = (self.spec.eval.sample_prompt or DEFAULT_PROMPT).encode()
        text = generate(self.model, prompt, self.spec.eval.sample_tokens, seed=self.spec.train.seed + step)
        return text.decode("utf-8", errors="replace")

    def export(self, out: Path) -> list[str]:
        """The weights (safetensors) and the model's shape; `build_model` rebuilds it from these."""
        mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(self.model.parameters())))
        config = {"kind": "gpt", "vocab_size": VOCAB_SIZE, **self.spec.to_dict()["model"]}
        (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
        return ["model.safetensors", "config.json"]

    def describe(self) -> dict[str, Any]:
        params = sum(v.size for _, v in tree_flatten(self.model.parameters()))
        return {"kind": "gpt", "params": params, "tokens": self.corpus.sizes if hasattr(self, "corpus") else None}

    def data_position(self, step: int) -> dict[str, Any]:
        return {**self.sampler.position(step), "data_key": self.corpus.key}

    def set_dropout_keys(self, keys: Any) -> None:
        """No dropout in the built-in GPT."""


def load_exported(folder: str | Path) -> GPT:
    """A built-in GPT as `dpctl export` wrote it (model.safetensors, config.json), ready for
    `dpool.trainer.model.generate`. ModelError names what is missing or does not fit."""
    # the trainer's error for a model it cannot load; imported here, not for every GPT job
    from dpool.trainer.lm import ModelError

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{folder}: not a built-in GPT export (model.safetensors and config.json from `dpctl export`): {e}") from None
    if not isinstance(config, dict) or config.get("kind") != "gpt":
        raise ModelError(f"{folder}: its config.json is not a built-in GPT's (an mlx_lm job's export loads with mlx_lm.load)")
    try:
        vocab = config.pop("vocab_size")
        config.pop("kind")
        model = GPT(ModelSpec(**config), vocab)
        model.load_weights(str(folder / "model.safetensors"), strict=True)
    except (OSError, KeyError, TypeError, ValueError, RuntimeError) as e:  # RuntimeError: MLX's, for a file it cannot read
        raise ModelError(f"{folder}: not a built-in GPT export (model.safetensors and config.json from `dpctl export`): {e}") from None
    mx.eval(model.parameters())
    return model
