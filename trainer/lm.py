"""The mlx-lm kind: a language model that mlx-lm loads, fine-tuned with LoRA, DoRA or in full.

Everything model-shaped is mlx-lm's own: `mlx_lm.utils.load` reads the directory (or resolves a
Hugging Face repo id as mlx-lm does), its model classes run it, `linear_to_lora_layers` builds the
adapters (LoRA on a quantized base is QLoRA), `mlx_lm.utils.save` writes a full model. dpool adds
what the pool needs: a model checked before anything runs, LoRA dropout whose randomness comes from
(seed, step, example) so the split of a batch cannot change it, and exports that `mlx_lm generate
--adapter-path` and `mlx_lm fuse` read.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from dpool.protocol.joberrors import one_line
from dpool.protocol.jobspec import JobSpec, lora_blocks, model_location
from dpool.protocol.logs import get_logger
from dpool.protocol.modeldir import model_dir_problem
from dpool.trainer.data import DataError, ExampleOrder
from dpool.trainer.lm_data import load_lm_data, trainable
from dpool.trainer.task import Example

DEFAULT_PROMPT = "Hello"
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")  # a folder with none of these has no tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


def scored_count(examples: int, batch: int, batches: int) -> int:
    """How many of the held-out examples (in order) the validation loss scores, as mlx-lm's
    `evaluate` does with this batch size: whole batches only (its iterate_batches leaves out the
    last `examples % batch`), all of them (batches = -1) or the first `batches`. Fewer than one
    batch (which mlx-lm refuses): all of them."""
    if examples < batch:
        return examples
    whole = examples // batch
    return batch * (whole if batches == -1 else min(whole, batches))


class ModelError(ValueError):
    """The model directory, or the fine-tune asked of it, cannot be used (exit 2: a restart won't help)."""


class SeededDropout(nn.Module):
    """Dropout on an adapter's input whose mask for row b comes from that example's key alone.

    mlx's random draws for one key do not share a prefix across shapes, so each row draws a
    mask of the full `width` and keeps its first L positions: padding never changes a mask."""

    def __init__(self, p: float, keys: _Keys, layer: int, width: int):
        super().__init__()
        self.p, self._keys, self._layer, self._width = p, keys, layer, width

    def __call__(self, x: mx.array) -> mx.array:
        if not self.training or self.p == 0 or self._keys.value is None:
            return x
        keys = self._keys.value  # (B, 2) uint32, one key per example
        rows = []
        for b in range(x.shape[0]):
            key = keys[b] ^ mx.array([0, self._layer + 1], dtype=mx.uint32)
            keep = mx.random.bernoulli(1 - self.p, (self._width, *x.shape[2:]), key=key)[: x.shape[1]]
            rows.append(keep)
        mask = mx.stack(rows)
        return mx.where(mask, x / (1 - self.p), mx.zeros_like(x))


class _Keys:
    """Where the step puts this micro batch's per-example keys for the dropout layers to read
    (set inside the compiled function, so they are traced inputs, not constants)."""

    value: mx.array | None = None


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for m in model.modules())


def load_base(spec: JobSpec):
    """(model, tokenizer, config, model_dir) by mlx-lm's loader; ModelError names what is wrong."""
    from mlx_lm.utils import load

    where, path = model_location(spec)
    shown = f"model.path = {spec.model.path!r}"
    if where == "dir" and (problem := model_dir_problem(Path(path))) is not None:
        raise ModelError(f"{shown}: {problem}")
    try:
        model, tokenizer, config = load(path, return_config=True)
    except (ValueError, OSError, KeyError, TypeError, AttributeError, RuntimeError) as e:  # RuntimeError: MLX's, e.g. weights cut short
        if where == "dir" and not any((Path(path) / f).is_file() for f in TOKENIZER_NAMES):
            # transformers' own message runs to a paragraph and never names the files it looked for
            raise ModelError(f"{shown}: {path} has no tokenizer ({', '.join(TOKENIZER_NAMES)}); copy the model's tokenizer files beside its weights") from None
        if isinstance(e, ValueError):  # e.g. "Model type foo not supported."
            raise ModelError(f"{shown}: {one_line(e)}") from None
        raise ModelError(f"{shown}: mlx-lm could not load it ({type(e).__name__}: {one_line(e)})") from None
    from mlx_lm.utils import hf_repo_to_path

    try:
        model_dir = Path(path) if where == "dir" else hf_repo_to_path(path)
    except OSError as e:  # huggingface_hub's LocalEntryNotFoundError, after mlx-lm loaded it some other way
        raise ModelError(f"{shown}: mlx-lm loaded it, but not from the Hugging Face cache ({type(e).__name__}: {one_line(e)})") from None
    return model, tokenizer, config, model_dir


BLOCK_PATH = re.compile(r"(^|\.)layers\.\d+(\.|$)")


class LMTask:
    pad_to = 32  # as mlx-lm's iterate_batches pads

    def __init__(self, spec: JobSpec, cache_dir: Path, *, with_data: bool = True):
        self.spec = spec
        m = spec.model
        self.width_cap = m.context
        model, tokenizer, config, self.model_dir = load_base(spec)
        self.tokenizer, self.config = tokenizer, config
        self.layers = len(model.layers)
        self.adapter_layers = lora_blocks(m, self.layers)
        self._keys = _Keys()
        self.model = self._prepare(model)
        self.fingerprints = {"model": self._model_fingerprint()}
        if m.adapters is not None:
            self.fingerprints["adapters"] = self._load_adapters()
        self.val_count = 0
        if not with_data:
            return
        files = [self.model_dir / f for f in TOKENIZER_FILES if (self.model_dir / f).is_file()]
        self.data, dropped = trainable(load_lm_data(spec, tokenizer, files, cache_dir), self.width_cap, spec.data.source)
        if dropped:
            get_logger().warning(
                "data.untrainable", left_out=dropped, context=self.width_cap,
                why="each prompt is as long as model.context (max_seq_length) with data.mask_prompt: nothing of its answer would be trained",
            )
        longer = [len(t) for t in self.data.train.tokens if len(t) > self.width_cap]
        if longer:
            # As mlx-lm warns: each is trained on its first model.context tokens.
            get_logger().warning(
                "data.truncated", examples=len(longer), of=len(self.data.train), longest=max(longer), context=self.width_cap,
                why="longer than model.context (max_seq_length): each is trained on its first model.context tokens",
            )
        if len(self.data.train) < spec.train.global_batch:
            # Each step's batch would hold some examples twice or more; mlx-lm refuses it too.
            raise DataError(
                f"train.global_batch = {spec.train.global_batch} is more than the {len(self.data.train)} training examples of "
                f"data.source = {spec.data.source!r}: every step would repeat examples; lower the batch (batch_size) or add examples"
            )
        lengths = np.array([len(t) for t in self.data.train.tokens], dtype=np.int64)
        self.order = ExampleOrder(len(lengths), spec.train.global_batch, spec.train.seed, lengths)
        self.val_count = scored_count(len(self.data.val), spec.train.global_batch, spec.eval.batches)
        self.fingerprints["data"] = self.data.fingerprint
        self.fingerprints["test"] = self.data.test_fingerprint  # every rank has the key: one broadcast each (0: no test.jsonl)

    def _prepare(self, model: nn.Module) -> nn.Module:
        """Freeze the base; unfreeze what `fine_tune` trains. The adapters' initial values come from
        the seed (rank 0's copy is broadcast anyway, so every rank starts from the same)."""
        from mlx_lm.tuner.trainer import grad_checkpoint
        from mlx_lm.tuner.utils import linear_to_lora_layers

        m = self.spec.model
        mx.random.seed(self.spec.train.seed)
        model.freeze()
        if m.fine_tune == "full":
            if _is_quantized(model):
                raise ModelError(
                    f"model.fine_tune = 'full' does not apply to {self.spec.model.path!r}: its weights are "
                    "quantized; train 'lora' or 'dora' adapters on it (QLoRA), or use an unquantized model"
                )
            if m.lora_layers is None:
                model.unfreeze()  # the whole model, embeddings and head too: what full meant before lora_layers applied to it
            else:
                for block in model.layers[len(model.layers) - self.adapter_layers :]:
                    block.unfreeze()  # as mlx-lm's full fine-tune: the last N blocks, the rest frozen
        else:
            params: dict[str, Any] = {"rank": m.lora_rank, "scale": m.lora_scale, "dropout": m.lora_dropout}
            if m.lora_keys is not None:
                self._check_keys(model, m.lora_keys)
                params["keys"] = list(m.lora_keys)
            try:
                linear_to_lora_layers(model, self.adapter_layers, params, use_dora=m.fine_tune == "dora")
            except ValueError as e:  # e.g. "SwitchLinear doesn't support DoRA yet."
                raise ModelError(f"model.fine_tune = {m.fine_tune!r} does not apply to {m.path!r}: {e}") from None
            self._seed_dropout(model)
        if m.grad_checkpoint:
            grad_checkpoint(model.layers[0])
        model.train()
        mx.eval(model.parameters())
        return model

    def _check_keys(self, model: nn.Module, keys: list[str]) -> None:
        """Every key names a layer mlx-lm can give adapters: inside a block (where mlx-lm looks
        first) or in the model itself (its second pass); else it would silently train nothing."""
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

        kinds = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)

        def convertible(module: nn.Module) -> bool:
            return hasattr(module, "to_lora") or isinstance(module, kinds)

        inside = {k for block in model.layers for k, mod in block.named_modules() if convertible(mod)}
        # the model's own layers, not the blocks' (under layers.N, model.layers.N, language_model.model.layers.N, ...)
        outside = {k for k, mod in model.named_modules() if convertible(mod) and not BLOCK_PATH.search(k)}
        for key in keys:
            if key not in inside and key not in outside:
                raise ModelError(
                    f"model.lora_keys: {key!r} names no linear layer of {self.spec.model.path!r}; the layers of a block are "
                    + ", ".join(sorted(inside)) + (" (and of the model: " + ", ".join(sorted(outside)) + ")" if outside else "")
                )

    def _load_adapters(self) -> int:
        """Start from trained adapters, as mlx-lm's resume_adapter_file (`load_weights(strict=False)`
        after the adapters are built), but every tensor of the file must be a trainable parameter of
        the same shape. Returns the file's content fingerprint (every rank must start the same)."""
        m = self.spec.model
        given = Path(self.spec.resolve(m.adapters or ""))
        file = given / "adapters.safetensors" if given.is_dir() else given
        shown = f"model.adapters = {m.adapters!r}"
        config_file = file.parent / "adapter_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except ValueError as e:
                raise ModelError(f"{shown}: {config_file} is not valid JSON ({e})") from None
            theirs = {
                "fine_tune_type": (config.get("fine_tune_type", "lora"), "model.fine_tune", m.fine_tune),
                "lora_parameters.rank": ((config.get("lora_parameters") or {}).get("rank", m.lora_rank), "model.lora_rank", m.lora_rank),
            }
            for key, (value, ours, mine) in theirs.items():
                if value != mine:
                    raise ModelError(f"{shown}: {config_file} has {key} = {value!r}, and this job's {ours} = {mine!r}; they must agree")
        try:
            raw = file.read_bytes()
            weights = mx.load(str(file))
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelError(f"{shown}: cannot read {file} ({e})") from None
        trainable = dict(tree_flatten(self.model.trainable_parameters()))
        for name, value in weights.items():
            if name not in trainable:
                raise ModelError(f"{shown}: {file} holds {name!r}, which is not a trained parameter of this job (lora_layers, lora_keys and fine_tune must match the adapters')")
            if tuple(value.shape) != tuple(trainable[name].shape):
                raise ModelError(f"{shown}: {file}: {name!r} has shape {tuple(value.shape)}, this job trains it as {tuple(trainable[name].shape)}")
        self.model.load_weights(list(weights.items()), strict=False)
        mx.eval(self.model.parameters())
        return int.from_bytes(hashlib.sha256(raw).digest()[:7], "little")

    def _seed_dropout(self, model: nn.Module) -> None:
        if self.spec.model.lora_dropout == 0:
            return
        index = 0
        for _, module in model.named_modules():
            if isinstance(getattr(module, "dropout", None), nn.Dropout) and ("lora_a" in module):
                module.dropout = SeededDropout(self.spec.model.lora_dropout, self._keys, index, self.width_cap)
                index += 1

    def _model_fingerprint(self) -> int:
        """The base model's identity: its config and weight files' names and sizes (cheap)."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode())
        for p in sorted(self.model_dir.glob("*.safetensors")):
            h.update(f"{p.name}:{p.stat().st_size}\n".encode())
        return int.from_bytes(h.digest()[:7], "little")

    # -- data -------------------------------------------------------------------------------------

    def examples(self, step: int, start: int, count: int) -> list[Example]:
        idx = self.order.indices(step, start, count)
        first = (step - 1) * self.spec.train.global_batch + start
        train = self.data.train
        return [Example(train.tokens[j], int(train.offsets[j]), first + i) for i, j in enumerate(idx)]

    def val_examples(self, indices: list[int]) -> list[Example]:
        val = self.data.val
        return [Example(val.tokens[i], int(val.offsets[i]), i) for i in indices]

    def test_indices(self) -> list[int]:
        """The test examples scored, in order, as mlx-lm's `--test` chooses them: whole batches of
        train.global_batch in file order (the last len % global_batch examples are left out, as
        mlx-lm's iterate_batches leaves them; its sort by length sees the raw rows, one JSON object
        each, so it keeps the file's order), all of them (test_batches = -1) or test_batches of
        those batches, chosen by the seed (mlx-lm draws them at random). Fewer examples than one
        batch (which mlx-lm refuses): all of them."""
        test = self.data.test
        if test is None or len(test) == 0:
            raise DataError(f"data.source = {self.spec.data.source!r}: no test examples (a test.jsonl beside train.jsonl)")
        gb = self.spec.train.global_batch
        order = list(range(len(test)))
        if len(order) < gb:
            return order
        batches = [order[b : b + gb] for b in range(0, len(order) - gb + 1, gb)]
        if self.spec.eval.test_batches != -1 and self.spec.eval.test_batches < len(batches):
            pick = np.random.default_rng(self.spec.train.seed).permutation(len(batches))[: self.spec.eval.test_batches]
            batches = [batches[i] for i in sorted(pick)]
        return [i for batch in batches for i in batch]

    def test_examples(self, indices: list[int]) -> list[Example]:
        test = self.data.test
        assert test is not None
        return [Example(test.tokens[i], int(test.offsets[i]), i) for i in indices]

    def set_dropout_keys(self, keys: Any) -> None:
        self._keys.value = keys

    def data_position(self, step: int) -> dict[str, Any]:
        return {**self.order.position(step), "data_key": self.data.key}

    # -- output -----------------------------------------------------------------------------------

    def sample(self, step: int) -> str:
        """A generation by mlx-lm from the sample prompt (a user message when the data is chat)."""
        from mlx_lm.generate import generate
        from mlx_lm.sample_utils import make_sampler

        prompt = self.spec.eval.sample_prompt or DEFAULT_PROMPT
        chat = any(f != "text" for f in self.data.formats.values()) if hasattr(self, "data") else False
        if chat and getattr(self.tokenizer, "chat_template", None) is not None:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        mx.random.seed(self.spec.train.seed + step)
        self.model.eval()
        try:
            return generate(
                self.model, self.tokenizer, prompt, max_tokens=self.spec.eval.sample_tokens,
                sampler=make_sampler(temp=0.8),
            )
        finally:
            self.model.train()

    def adapter_config(self) -> dict[str, Any]:
        m = self.spec.model
        return {
            "fine_tune_type": m.fine_tune,
            "num_layers": self.adapter_layers,
            "lora_parameters": {"rank": m.lora_rank, "scale": m.lora_scale, "dropout": m.lora_dropout}
            | ({"keys": list(m.lora_keys)} if m.lora_keys is not None else {}),
            "model": m.path,
            "max_seq_length": m.context,
            "mask_prompt": self.spec.data.mask_prompt,
            "trained_by": "dpool",
        }

    def export(self, out: Path) -> list[str]:
        """lora/dora: an mlx-lm adapter directory; full: a model directory mlx-lm loads."""
        if self.spec.model.fine_tune != "full":
            weights = dict(tree_flatten(self.model.trainable_parameters()))
            mx.save_safetensors(str(out / "adapters.safetensors"), weights, metadata={"format": "mlx"})
            (out / "adapter_config.json").write_text(json.dumps(self.adapter_config(), indent=4) + "\n")
            return ["adapters.safetensors", "adapter_config.json"]
        from mlx_lm.utils import save_config, save_model

        save_model(out, self.model, donate_model=False)
        save_config(dict(self.config), out / "config.json")
        self.tokenizer.save_pretrained(str(out))
        for extra in ("generation_config.json",):
            if (self.model_dir / extra).is_file():
                shutil.copy(self.model_dir / extra, out / extra)
        return sorted(p.name for p in out.iterdir())

    def export_fused(self, out: Path, *, dequantize: bool = False) -> list[str]:
        """A model directory with the adapters fused into the base, by mlx-lm's own fuse code
        (`mlx_lm fuse`: each adapter layer's `fuse(dequantize=...)`, then `mlx_lm.utils.save`, with
        the tokenizer and config); `mlx_lm generate --model OUT` loads it without adapters. full:
        already a whole model, saved the same way (dequantize still applies)."""
        from mlx.utils import tree_unflatten
        from mlx_lm.utils import dequantize_model, save

        model, config = self.model, dict(self.config)
        model.eval()
        fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules() if hasattr(module, "fuse")]
        if fused:
            model.update_modules(tree_unflatten(fused))
        if dequantize:
            model = dequantize_model(model)
            config.pop("quantization", None)
            config.pop("quantization_config", None)
        # The local folder, never a repo id: mlx-lm would fetch the repo's model card from the Hub.
        save(out, str(self.model_dir), model, self.tokenizer, config, donate_model=False)
        return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())

    def describe(self) -> dict[str, Any]:
        total = sum(v.size for _, v in tree_flatten(self.model.parameters()))
        trained = sum(v.size for _, v in tree_flatten(self.model.trainable_parameters()))
        out: dict[str, Any] = {
            "kind": "mlx_lm", "model": str(self.model_dir), "fine_tune": self.spec.model.fine_tune,
            "params": total, "trained_params": trained, "quantized": _is_quantized(self.model),
        }
        if hasattr(self, "data"):
            out |= {"examples": [len(self.data.train), len(self.data.val)], "formats": self.data.formats}
        return out
