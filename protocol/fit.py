"""A message made to fit the bounds its own types declare, before it is sent.

Every field of every message carries its bound (protocol/schema.py), and a receiver refuses a
message with one value out of bound, whole. So a sender that derives a value (an ETA, a rate) from
valid reports can make a reply no client can read: one job's ETA of 1e12 s (the bound is 1e11)
once made every `dpctl status` fail for as long as that job ran. Values are bounded where they are
derived; `fit` is the net under that, run on what the coordinator sends:

- a finite number out of its bound is clamped into it (an ETA of 1e12 s is sent as 1e11);
- any other bad value is null where the field may be null (an infinite loss: null, as a diverged
  loss is);
- a row that still does not fit is left out of its list (one job's row, one worker of a job's
  row), and the others are sent;
- a message that still does not fit is None: the caller answers with an error instead.

Each fix is described ("jobs[3].eta_s: 1e12 -> 1e11") for the caller's log line. A message that
fits is returned as it is, after a check that costs about what reading it costs the receiver.
`trusted(row)` says which rows of a list were validated where they were made (rows the store read
back through `from_wire`): the check skips them, so a page of 2,000 stored rows costs nothing more.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
import threading
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

from dpool.protocol.schema import Float, Int, Invalid, Items, Record, Str, compile_type, shown

FIXES_MAX = 20  # fixes described per message; the rest are counted


class _Drop:
    """A value, row or message that cannot be made to fit."""

    def __init__(self, why: str) -> None:
        self.why = why


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """How one field of a record or message is checked and fixed."""

    name: str
    convert: Callable[[Any], Any]  # the receiver's own check, on the wire value
    nullable: bool
    plain: bool  # holds no record: its value is its wire form
    bound: Any  # the bound of its one non-null option (Int, Float, Str, Items), or None
    rows: tuple[type, ...]  # a list of records: the record classes it takes
    record: tuple[type, ...]  # a record (or null): the record classes it takes


def fit(msg: Any, trusted: Callable[[Any], bool] | None = None) -> tuple[Any, list[str]]:
    """`msg` (a Message or Record) within its bounds, and what was fixed to get there; (None,
    fixes) when it cannot be. Rows for which `trusted(row)` is true are taken as they are."""
    trust = trusted or _never
    if _fits(msg, trust):
        return msg, []
    fixes: list[str] = []
    out = _fit(msg, "", fixes, trust)
    if isinstance(out, _Drop):
        fixes.append(f"not sent ({out.why})")
    if len(fixes) > FIXES_MAX:
        fixes[FIXES_MAX:] = [f"and {len(fixes) - FIXES_MAX} more"]
    return (None if isinstance(out, _Drop) else out), fixes


# -- the check -------------------------------------------------------------------------------------


def _never(row: Any) -> bool:
    return False


def _fits(obj: Any, trust: Callable[[Any], bool]) -> bool:
    """Whether `obj` is within its bounds as it is (False: `_fit` looks closer). The plain fields
    are checked in one pass of the receiver's own converters: this runs for every message sent."""
    converters, values, nested, shared = _plan(type(obj))
    if converters:
        try:
            for convert, value in zip(converters, values(obj), strict=False):
                convert(value)
        except Invalid:
            return False
    for s in nested:
        value = getattr(obj, s.name)
        if not s.rows and not s.record:
            if s.name in shared:
                if not _checked.fits(s, value):
                    return False
            elif not _plain_fits(s, value):
                return False
        elif value is None:
            if not s.nullable:
                return False
        elif s.rows:
            if type(value) not in (list, tuple) or len(value) > s.bound.hi:
                return False
            for item in value:
                if not isinstance(item, s.rows) or not (trust(item) or _fits(item, trust)):
                    return False
        elif not isinstance(value, s.record) or not _fits(value, trust):
            return False
    return True


def _plain_fits(s: _Slot, value: Any) -> bool:
    try:
        s.convert(_wire(value) if not s.plain else value)
    except Invalid:
        if not s.plain or not _has_tuple(value):
            return False
        try:  # msgpack sends a tuple as a list: judge it as one
            s.convert(_listed(value))
        except Invalid:
            return False
    return True


# -- the fixes -------------------------------------------------------------------------------------


def _fit(obj: Any, where: str, fixes: list[str], trust: Callable[[Any], bool]) -> Any:
    """`obj` fitted (a new one when a field changed), or a _Drop."""
    changes: dict[str, Any] = {}
    for s in _slots(type(obj)):
        value = getattr(obj, s.name)
        path = f"{where}{s.name}"
        if s.plain or (not s.rows and not s.record):
            if _plain_fits(s, value):
                continue
            new = _fix_scalar(s, value)
            if isinstance(new, _Drop):
                return _Drop(f"{path}: {new.why}")
            fixes.append(f"{path}: {shown(value)} -> {shown(new)}")
        elif value is None:
            if s.nullable:
                continue
            return _Drop(f"{path}: null")
        elif s.rows:
            new = _fit_rows(s, value, path, fixes, trust)
            if new is value:
                continue
        else:
            new = _fit(value, f"{path}.", fixes, trust) if isinstance(value, s.record) else _Drop(f"not a {s.record[0].__name__}")
            if new is value:
                continue
            if isinstance(new, _Drop):
                if not s.nullable:
                    return _Drop(new.why)
                fixes.append(f"{path}: null ({new.why})")
                new = None
        changes[s.name] = new
    return dataclasses.replace(obj, **changes) if changes else obj


def _fit_rows(s: _Slot, rows: Any, path: str, fixes: list[str], trust: Callable[[Any], bool]) -> Any:
    """A list of records with the rows that cannot be fixed left out (and cut to its bound)."""
    if type(rows) not in (list, tuple):
        return [] if not s.nullable else None
    out, changed = [], type(rows) is not list
    for i, row in enumerate(rows):
        if isinstance(row, s.rows) and trust(row):
            out.append(row)
            continue
        new = _fit(row, f"{path}[{i}].", fixes, trust) if isinstance(row, s.rows) else _Drop(f"not a {s.rows[0].__name__}")
        if isinstance(new, _Drop):
            fixes.append(f"{path}[{i}] dropped ({new.why})")
            changed = True
            continue
        changed = changed or new is not row
        out.append(new)
    if len(out) > s.bound.hi:
        fixes.append(f"{path}: {len(out)} rows cut to {s.bound.hi}")
        out, changed = out[: s.bound.hi], True
    return out if changed else rows


def _fix_scalar(s: _Slot, value: Any) -> Any:
    """A value the field takes in place of `value`, or a _Drop: a finite number clamped into its
    bound, else null where it may be, else a string or list cut to its bound."""
    b = s.bound
    number = type(value) in (int, float)
    if number and isinstance(b, Int | Float) and math.isfinite(value):
        clamped = min(max(value, b.lo), b.hi)
        new: Any = int(clamped) if isinstance(b, Int) else float(clamped)
        if _accepts(s, new):
            return new
    if s.nullable:
        return None
    if type(value) is str and isinstance(b, Str) and len(value) > b.hi and _accepts(s, value[: b.hi]):
        return value[: b.hi]
    if type(value) in (list, tuple) and isinstance(b, Items) and s.plain:
        kept = _listed(value)[: b.hi]
        if _accepts(s, kept):
            return kept
    try:
        s.convert(_wire(value))
    except Invalid as e:
        return _Drop(str(e))
    return _Drop(f"{shown(value)} does not fit")


def _accepts(s: _Slot, value: Any) -> bool:
    try:
        s.convert(value)
    except Invalid:
        return False
    return True


# -- the slots of a class ----------------------------------------------------------------------------


class _Checked:
    """The few newest values of messages' SHARED fields (a launch's job file, shares and hostfile,
    the same objects in each of its N group.starts) that fit, by identity: checked once per launch,
    not N times (at 1,000 nodes that was 10^6 hostfile entries, seconds in one unit of work). A
    shared value is never changed once sent (protocol/messages.py), and it is held here with its
    check, so its id cannot be reused by another object meanwhile."""

    def __init__(self, size: int = 8) -> None:
        self.size, self.lock = size, threading.Lock()
        self.entries: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()

    def fits(self, s: _Slot, value: Any) -> bool:
        key = (id(value), id(s.convert))
        with self.lock:
            if key in self.entries and self.entries[key] is value:
                self.entries.move_to_end(key)
                return True
        if not _plain_fits(s, value):
            return False
        with self.lock:
            self.entries[key] = value
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return True


_checked = _Checked()
_SLOTS: dict[type, tuple[_Slot, ...]] = {}
_PLANS: dict[type, tuple[tuple[Callable[[Any], Any], ...], Callable[[Any], Any], tuple[_Slot, ...], frozenset[str]]] = {}


def _plan(cls: type) -> tuple[tuple[Callable[[Any], Any], ...], Callable[[Any], Any], tuple[_Slot, ...], frozenset[str]]:
    """A class's plain fields' converters, a getter of their values (a tuple, at C speed: one value
    more than there are converters), its other fields, and which of those are SHARED (plain fields
    checked once per value, `_Checked`)."""
    got = _PLANS.get(cls)
    if got is None:
        slots = _slots(cls)
        shared: frozenset[str] = getattr(cls, "SHARED", frozenset())
        plain = [s for s in slots if s.plain and s.name not in shared]
        names = [s.name for s in plain]
        getter = operator.attrgetter(*names, names[0]) if names else (lambda obj: ())
        got = _PLANS[cls] = (tuple(s.convert for s in plain), getter, tuple(s for s in slots if not s.plain or s.name in shared), shared)
    return got


def _slots(cls: type) -> tuple[_Slot, ...]:
    got = _SLOTS.get(cls)
    if got is None:
        got = _SLOTS[cls] = _compile(cls)
    return got


def _compile(cls: type) -> tuple[_Slot, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in cls.FIELDS:  # type: ignore[attr-defined]
        options = _options(hints[f.name])
        nullable = type(None) in [o for o, _ in options]
        real = [(o, b) for o, b in options if o is not type(None)]
        bound = real[0][1] if len(real) == 1 else None
        rows: tuple[type, ...] = ()
        record: tuple[type, ...] = ()
        if len(real) == 1 and typing.get_origin(real[0][0]) is list:
            items = tuple(o for o, _ in _options(typing.get_args(real[0][0])[0]))
            if items and all(_is_record(o) for o in items):
                rows = items
        elif real and all(_is_record(o) for o, _ in real):
            record = tuple(o for o, _ in real)
        out.append(_Slot(f.name, compile_type(hints[f.name], f.name), nullable, f.plain, bound, rows, record))
    return tuple(out)


def _is_record(hint: Any) -> bool:
    return typing.get_origin(hint) is None and isinstance(hint, type) and issubclass(hint, Record)


def _options(hint: Any) -> list[tuple[Any, Any]]:
    """The options of a (union) type, each with its bound: [(float, Float(0, 1e11)), (NoneType, None)]."""
    bound = None
    if typing.get_origin(hint) is Annotated:
        hint, *extra = typing.get_args(hint)
        bound = extra[0] if extra else None
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return [o for part in typing.get_args(hint) for o in _options(part)]
    return [(hint, bound)]


def _wire(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_wire()
    if isinstance(value, list | tuple):
        return [_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items()}
    return value


def _has_tuple(value: Any) -> bool:
    if type(value) is tuple:
        return True
    if type(value) is list:
        return any(_has_tuple(v) for v in value)
    if type(value) is dict:
        return any(_has_tuple(v) for v in value.values())
    return False


def _listed(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_listed(v) for v in value]
    if isinstance(value, dict):
        return {k: _listed(v) for k, v in value.items()}
    return value
