"""Types with bounds, for everything that crosses the wire.

A field's type says what it may hold, bounds included: `Annotated[int, Int(0, 1023)]`, a string of
at most so many characters, a list of at most so many items, a nested record. Every `str`, `bytes`,
`list`, `dict` and `int` in a message or record must carry its bound (checked when the class is
registered, so an unbounded field is a bug caught at import), and every float is finite.

`compile_type` turns a type into a converter, once per field: it takes what msgpack decoded and
returns the typed value (a float for an int given to a float field, a record for a map), or raises
`Invalid` naming the path of the bad value (`info.slots`), what was expected and what was given.
Records (`Record` subclasses, frozen dataclasses) are the maps nested in message bodies: node info,
the rows of a status or metrics reply, and so on; `to_wire` turns them back into plain maps.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

MAX_INT = 2**53 - 1  # every integer on the wire is below 2^53: exact in a double, in JSON, in SQLite


# -- bounds --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Int:
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Float:
    """Always finite (no inf, no nan), and within [lo, hi]."""

    lo: float = -sys.float_info.max
    hi: float = sys.float_info.max


@dataclass(frozen=True, slots=True)
class Str:
    """A string of `lo` to `hi` characters; with `pattern`, one that matches it whole (`means`
    says what it allows, for the error)."""

    hi: int
    lo: int = 0
    pattern: str | None = None
    means: str = ""


@dataclass(frozen=True, slots=True)
class Bytes:
    hi: int


@dataclass(frozen=True, slots=True)
class Items:
    """A list of at most `hi` items, or a map of at most `hi` entries."""

    hi: int


@dataclass(frozen=True, slots=True)
class OneOf:
    """A string that is one of these."""

    values: tuple[str, ...]

    def __init__(self, *values: str) -> None:
        object.__setattr__(self, "values", values)


class Invalid(ValueError):
    """A value that does not fit its type. `path` is filled in as the error travels up.
    `out_of_range`: of the right type but outside its bound (a negative step, a string too long,
    an infinite number), which a receiver answers `bad_request` rather than `bad_body`."""

    def __init__(self, expected: str, value: Any, *, out_of_range: bool = False) -> None:
        super().__init__(expected)
        self.expected, self.value, self.out_of_range = expected, value, out_of_range
        self.path: list[str] = []

    def where(self) -> str:
        out = ""
        for part in self.path:
            out += part if part.startswith("[") or not out else f".{part}"
        return out

    def __str__(self) -> str:
        where = self.where()
        return f"{where + ': ' if where else ''}must be {self.expected}, got {shown(self.value)}"


def shown(value: Any) -> str:
    """A short account of a value for an error message: never a deep or long repr."""
    if isinstance(value, list | dict):
        return f"a {'list' if isinstance(value, list) else 'map'} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- records ------------------------------------------------------------------------------------


OMIT_NONE = {"omit_none": True}  # field metadata: left out of the wire form (and of JSON) while None


@dataclass(frozen=True, slots=True)
class Record:
    """A typed map nested in a message body. Subclasses are frozen dataclasses registered with
    `@record`; `from_wire` validates a decoded map into one, `to_wire` gives the map back.
    Readers use the fields as attributes: there is no map-style access."""

    FIELDS: ClassVar[tuple[Field, ...]] = ()
    _NAMES: ClassVar[tuple[str, ...]] = ()
    _VALUES: ClassVar[Any]  # an operator.attrgetter of the fields' values (and one more), at C speed
    _FIX: ClassVar[tuple[tuple[str, bool, bool], ...]] = ()  # (name, omit_none, plain) of fields to look at
    TAG: ClassVar[tuple[str, str] | None] = None  # (key, value) that tells this record apart in a union

    @classmethod
    def from_wire(cls, value: Any) -> Any:
        if type(value) is not dict:
            raise Invalid(f"a map ({cls.__name__})", value)
        return cls(**check_fields(cls.FIELDS, value, cls.__name__))

    def to_wire(self) -> dict[str, Any]:
        out = dict(zip(self._NAMES, self._VALUES(self), strict=False))  # _VALUES has one value more
        for name, omit_none, plain in self._FIX:
            v = out[name]
            if v is None:
                if omit_none:
                    del out[name]
            elif not plain:
                out[name] = to_wire(v)
        return out


def record(cls: type[Record]) -> type[Record]:
    """Register a record class: compile its fields' converters (and check every field is bounded)."""
    cls.FIELDS = field_converters(cls)
    cls._NAMES = tuple(f.name for f in cls.FIELDS)
    cls._VALUES = operator.attrgetter(*cls._NAMES, cls._NAMES[0])  # a tuple even for one field
    cls._FIX = tuple((f.name, f.omit_none, f.plain) for f in cls.FIELDS if f.omit_none or not f.plain)
    return cls


class Field(typing.NamedTuple):
    name: str
    convert: Callable[[Any], Any]
    required: bool
    omit_none: bool  # left out of the wire form while None
    plain: bool  # holds no record: its value is already its wire form


def field_converters(cls: type) -> tuple[Field, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append(Field(f.name, compile_type(hint, f"{cls.__name__}.{f.name}"), required, bool(f.metadata.get("omit_none")), not _holds_record(hint)))
    return tuple(out)


def _holds_record(hint: Any) -> bool:
    if isinstance(hint, type) and issubclass(hint, Record):
        return True
    return any(_holds_record(a) for a in typing.get_args(hint) if not isinstance(a, Int | Float | Str | Bytes | Items | OneOf))


def check_fields(fields: tuple[Field, ...], value: dict[str, Any], what: str) -> dict[str, Any]:
    """The converted fields of a map, or Invalid naming the first bad one."""
    out = {}
    for name, convert, required, _, _ in fields:
        if name not in value:
            if required:
                err = Invalid("given (a required field)", _MissingValue())
                err.path.append(name)
                raise err
            continue
        try:
            out[name] = convert(value[name])
        except Invalid as e:
            e.path.insert(0, name)
            raise
    if len(out) != len(value):  # a key that is no field
        names = {f.name for f in fields}
        unknown = next(k for k in value if k not in names)
        err = Invalid(f"absent (not a field of {what}; fields: {', '.join(sorted(names))})", value[unknown])
        err.path.append(str(unknown)[:64])
        raise err
    return out


class _MissingValue:
    def __repr__(self) -> str:
        return "nothing"


def to_wire(value: Any) -> Any:
    """Plain maps, lists and scalars for msgpack or JSON: records become maps, recursively."""
    if isinstance(value, Record):
        return value.to_wire()
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


# -- compiling a type into a converter -----------------------------------------------------------


def compile_type(hint: Any, where: str) -> Callable[[Any], Any]:
    """A function that converts a decoded value to `hint` or raises Invalid. `where` names the
    field, for the TypeError raised when the type itself lacks a bound (a bug, found at import)."""
    return _compile(hint, where)[0]


def describe(hint: Any) -> str:
    """The type in words, bounds included (for protocol/README.md and error messages)."""
    return _compile(hint, "describe")[1]


def _compile(hint: Any, where: str) -> tuple[Callable[[Any], Any], str]:
    bounds: tuple[Any, ...] = ()
    if typing.get_origin(hint) is Annotated:
        hint, *extra = typing.get_args(hint)
        bounds = tuple(extra)
    bound = bounds[0] if bounds else None
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return _union([_compile(o, where) for o in typing.get_args(hint)], typing.get_args(hint))
    if hint is type(None):
        return _exact(type(None), "null"), "null"
    if hint is bool:
        return _exact(bool, "true or false"), "true or false"
    if hint is int:
        if not isinstance(bound, Int):
            raise TypeError(f"{where}: an int needs Annotated[int, Int(lo, hi)]")
        return _int(bound), f"an integer in [{bound.lo}, {bound.hi}]"
    if hint is float:
        b = bound if isinstance(bound, Float) else Float()
        return _float(b), "a finite number" + ("" if b == Float() else f" in [{b.lo:g}, {b.hi:g}]")
    if hint is str:
        if isinstance(bound, OneOf):
            text = "one of " + ", ".join(repr(v) for v in bound.values)
            return _one_of(bound.values, text), text
        if not isinstance(bound, Str):
            raise TypeError(f"{where}: a str needs Annotated[str, Str(hi)]")
        text = f"a string of {bound.lo}-{bound.hi} characters" if bound.lo else f"a string of at most {bound.hi} characters"
        if bound.pattern is not None:
            return _matching(re.compile(bound.pattern), bound.hi, bound.means), bound.means
        return _sized(str, bound.lo, bound.hi, text), text
    if hint is bytes:
        if not isinstance(bound, Bytes):
            raise TypeError(f"{where}: bytes need Annotated[bytes, Bytes(hi)]")
        text = f"bytes (at most {bound.hi})"
        return _sized(bytes, 0, bound.hi, text), text
    if origin is list:
        if not isinstance(bound, Items):
            raise TypeError(f"{where}: a list needs Annotated[list[...], Items(hi)]")
        item, item_text = _compile(typing.get_args(hint)[0], where)
        text = f"a list of at most {bound.hi} of ({item_text})"
        return _list(item, bound.hi, text), text
    if origin is dict:
        key, value = typing.get_args(hint)
        if key is not str or not isinstance(bound, Items):
            raise TypeError(f"{where}: a map needs Annotated[dict[str, ...], Items(hi)]")
        item, item_text = _compile(value, where)
        text = f"a map of at most {bound.hi} entries of ({item_text})"
        return _map(item, bound.hi, text), text
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_wire, f"a {hint.__name__} map"
    raise TypeError(f"{where}: unsupported field type {hint!r}")  # Any and the like: unbounded


def _exact(t: type, text: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if type(v) is not t:
            raise Invalid(text, v)
        return v

    return convert


def _int(b: Int) -> Callable[[Any], Any]:
    lo, hi, text = b.lo, b.hi, f"an integer in [{b.lo}, {b.hi}]"

    def convert(v: Any) -> Any:
        if type(v) is not int or not lo <= v <= hi:
            raise Invalid(text, v, out_of_range=type(v) is int)
        return v

    return convert


def _float(b: Float) -> Callable[[Any], Any]:
    lo, hi = b.lo, b.hi
    text = "a finite number" + ("" if b == Float() else f" in [{lo:g}, {hi:g}]")

    def convert(v: Any) -> Any:
        t = type(v)
        if (t is not float and t is not int) or not math.isfinite(v) or not lo <= v <= hi:
            raise Invalid(text, v, out_of_range=t is float or t is int)
        return float(v)

    return convert


def _sized(t: type[str] | type[bytes], lo: int, hi: int, text: str) -> Callable[[Any], Any]:
    """A str (length in characters) or bytes of `lo` to `hi`."""

    def convert(v: Any) -> Any:
        if type(v) is not t or not lo <= len(v) <= hi:
            raise Invalid(text, v, out_of_range=type(v) is t)
        return v

    return convert


def _matching(pattern: re.Pattern[str], hi: int, text: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if type(v) is not str or len(v) > hi or not pattern.fullmatch(v):
            raise Invalid(text, v, out_of_range=type(v) is str)
        return v

    return convert


def _one_of(values: tuple[str, ...], text: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if type(v) is not str or v not in values:
            raise Invalid(text, v, out_of_range=type(v) is str)
        return v

    return convert


def _list(item: Callable[[Any], Any], hi: int, text: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if type(v) is not list or len(v) > hi:
            raise Invalid(text, v, out_of_range=type(v) is list)
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except Invalid as e:
                e.path.insert(0, f"[{i}]")
                raise
        return out

    return convert


def _map(item: Callable[[Any], Any], hi: int, text: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if type(v) is not dict or len(v) > hi:
            raise Invalid(text, v, out_of_range=type(v) is dict)
        out = {}
        for k, x in v.items():
            if type(k) is not str or len(k) > 256:
                raise Invalid("a map with string keys of at most 256 characters", k)
            try:
                out[k] = item(x)
            except Invalid as e:
                e.path.insert(0, k[:64])
                raise
        return out

    return convert


def _union(options: list[tuple[Callable[[Any], Any], str]], hints: tuple[Any, ...]) -> tuple[Callable[[Any], Any], str]:
    """`X | Y | None`: the first option that fits. Only the options that take the value's Python
    type are tried (no exception on the common path); records with a TAG are chosen by it, so an
    error names the field of the record the value meant to be, not the first option tried."""
    text = " or ".join(t for _, t in options)
    tagged = {h.TAG: h.from_wire for h in hints if isinstance(h, type) and issubclass(h, Record) and h.TAG}
    by_type: dict[type, list[Callable[[Any], Any]]] = {}
    for (option, _), hint in zip(options, hints, strict=True):
        for t in _python_types(hint):
            by_type.setdefault(t, []).append(option)

    def convert(v: Any) -> Any:
        if tagged and type(v) is dict:
            for (key, value), from_wire in tagged.items():
                if v.get(key) == value:
                    return from_wire(v)
        out_of_range, deeper = False, None
        for option in by_type.get(type(v), ()):
            try:
                return option(v)
            except Invalid as e:
                if e.path:
                    deeper = e  # the option took the value's type and failed inside it: name that field
                out_of_range = out_of_range or e.out_of_range
        if deeper is not None:
            raise deeper
        raise Invalid(text, v, out_of_range=out_of_range)

    return convert, text


def _python_types(hint: Any) -> tuple[type, ...]:
    """What msgpack decodes to for a value of `hint`."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    origin = typing.get_origin(hint)
    if origin in (list, dict):
        return (origin,)
    if isinstance(hint, type) and issubclass(hint, Record):
        return (dict,)
    return (float, int) if hint is float else (hint,)


# -- how much a body holds, before it is built ---------------------------------------------------

# msgpack type bytes -> (bytes of a length that follows, fixed payload bytes), for what is skipped.
_SKIP = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin 8/16/32
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext 8/16/32 (refused later; skipped here)
    0xCA: (0, 4), 0xCB: (0, 8),  # float 32/64
    0xCC: (0, 1), 0xCD: (0, 2), 0xCE: (0, 4), 0xCF: (0, 8),  # uint
    0xD0: (0, 1), 0xD1: (0, 2), 0xD2: (0, 4), 0xD3: (0, 8),  # int
    0xD4: (0, 2), 0xD5: (0, 3), 0xD6: (0, 5), 0xD7: (0, 9), 0xD8: (0, 17),  # fixext
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str 8/16/32
}
_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # array/map 16/32: (length bytes, items per entry)


def count_objects(data: bytes, limit: int) -> int | None:
    """How many objects (maps, lists, scalars; a map's keys count) the msgpack value in `data`
    holds, or None once there are more than `limit`. Walks the bytes without building anything,
    so a body of a million empty lists is refused for the price of reading `limit` of them.
    Malformed data is counted as far as it goes: msgpack itself says what is wrong with it."""
    n, i, objects = len(data), 0, 0
    remaining = [1]  # items still to read at each open level
    while remaining:
        if remaining[-1] == 0:
            remaining.pop()
            continue
        remaining[-1] -= 1
        if i >= n:
            return objects
        b = data[i]
        i += 1
        objects += 1
        if objects > limit:
            return None
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            continue  # fixint, nil, bool
        if b <= 0x8F:
            remaining.append(2 * (b & 0x0F))  # fixmap
        elif b <= 0x9F:
            remaining.append(b & 0x0F)  # fixarray
        elif b <= 0xBF:
            i += b & 0x1F  # fixstr
        elif b in _CONTAINER:
            size, per = _CONTAINER[b]
            remaining.append(per * int.from_bytes(data[i : i + size], "big"))
            i += size
        elif b in _SKIP:
            size, fixed = _SKIP[b]
            i += size + fixed + (int.from_bytes(data[i : i + size], "big") if size else 0)
        else:
            return objects  # 0xC1, never used: msgpack refuses it
    return objects
