"""A small GPT in mlx.nn: pre-norm blocks, causal self-attention, rotary or learned positions."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from dpool.protocol.jobspec import ModelSpec


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, rope: bool):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rope = nn.RoPE(dim // heads, traditional=False) if rope else None

    def __call__(self, x: mx.array) -> mx.array:
        b, t, d = x.shape
        q, k, v = mx.split(self.qkv(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads).transpose(0, 2, 1, 3) for a in (q, k, v))
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        scale = (d // self.heads) ** -0.5
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
        return self.proj(out.transpose(0, 2, 1, 3).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, rope: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, rope)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec, vocab_size: int):
        super().__init__()
        self.context = spec.context
        self.embed = nn.Embedding(vocab_size, spec.dim)
        self.pos = nn.Embedding(spec.context, spec.dim) if spec.positions == "learned" else None
        self.blocks = [Block(spec.dim, spec.heads, spec.positions == "rope") for _ in range(spec.layers)]
        self.norm = nn.LayerNorm(spec.dim)
        self.head = nn.Linear(spec.dim, vocab_size, bias=False)

    def __call__(self, tokens: mx.array) -> mx.array:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(mx.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(spec: ModelSpec, vocab_size: int, seed: int) -> GPT:
    """Weights from the job's seed alone (rank 0's copy is also broadcast, so versions cannot drift)."""
    mx.random.seed(seed)
    model = GPT(spec, vocab_size)
    mx.eval(model.parameters())
    return model


def generate(model: GPT, prompt: bytes, tokens: int, seed: int, temperature: float = 0.8) -> bytes:
    """Sample `tokens` bytes after `prompt` (no KV cache: the models here are small)."""
    out = list(prompt)
    key = mx.random.key(seed)
    for _ in range(tokens):
        window = mx.array([out[-model.context :]], dtype=mx.int32)
        logits = model(window)[0, -1]
        key, sub = mx.random.split(key)
        nxt = mx.random.categorical(logits / temperature, key=sub)
        out.append(int(nxt.item()))
    return bytes(out)
