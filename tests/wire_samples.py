"""Values that fit the protocol's types, made from the types themselves (bounds included): the
round-trip tests and the fuzz test's schema-driven frames use them."""

from __future__ import annotations

import dataclasses
import random
import types
import typing
from typing import Annotated, Any

from dpool.protocol import link_messages, owner_messages, sharing, stage_messages  # noqa: F401  (register the link probe's, owner's, sharing's and staging's message types)
from dpool.protocol import messages as m
from dpool.protocol.schema import Bytes, Float, Int, Items, OneOf, Record, Str


def example(hint: Any, rng: random.Random, *, edge: bool = False) -> Any:
    """A valid value of `hint`; `edge` picks bounds (the largest int, the longest string) more often."""
    bound = None
    if typing.get_origin(hint) is Annotated:
        hint, *extra = typing.get_args(hint)
        bound = extra[0] if extra else None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if len(options) < len(typing.get_args(hint)) and rng.random() < 0.2:
            return None
        return example(rng.choice(options), rng, edge=edge)
    if hint is type(None):
        return None
    if hint is bool:
        return rng.random() < 0.5
    if hint is int:
        assert isinstance(bound, Int)
        if edge and rng.random() < 0.5:
            return rng.choice([bound.lo, bound.hi])
        return rng.randint(bound.lo, min(bound.hi, bound.lo + 2**40))
    if hint is float:
        b = bound if isinstance(bound, Float) else Float()
        lo, hi = max(b.lo, -1e6), min(b.hi, 1e6)
        return rng.choice([lo, hi]) if edge and rng.random() < 0.5 else lo + (hi - lo) * rng.random()
    if hint is str:
        if isinstance(bound, OneOf):
            return rng.choice(bound.values)
        assert isinstance(bound, Str)
        n = rng.choice([bound.lo, min(bound.hi, 4096)]) if edge and rng.random() < 0.5 else rng.randint(bound.lo, min(bound.hi, max(bound.lo, 12)))
        if bound.pattern is not None:  # a name: its first character a letter, the rest its own alphabet
            return "n" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz-._0123456789") for _ in range(max(n, 1) - 1))
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz-0123456789ü") for _ in range(n))
    if hint is bytes:
        assert isinstance(bound, Bytes)
        return rng.randbytes(rng.randint(0, min(bound.hi, 64)))
    if origin is list:
        assert isinstance(bound, Items)
        (item,) = typing.get_args(hint)
        return [example(item, rng, edge=edge) for _ in range(rng.randint(0, min(bound.hi, 3)))]
    if origin is dict:
        assert isinstance(bound, Items)
        _, item = typing.get_args(hint)
        return {f"k{i}": example(item, rng, edge=edge) for i in range(rng.randint(0, min(bound.hi, 3)))}
    if isinstance(hint, type) and issubclass(hint, Record):
        return instance(hint, rng, edge=edge)
    raise AssertionError(f"no example of {hint!r}")


def instance(cls: type, rng: random.Random, *, edge: bool = False) -> Any:
    """A valid message or record of class `cls`."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return cls(**{f.name: example(hints[f.name], rng, edge=edge) for f in dataclasses.fields(cls) if f.name in hints and f.init})


def sample(cls: type[m.Message], rng: random.Random, *, edge: bool = False) -> m.Message:
    return instance(cls, rng, edge=edge)  # type: ignore[no-any-return]
