"""A needle prompt's or cell's JSON record: its dataclass fields by name, tuples as lists, read back by each
field's declared type, so that a record round-trips exactly."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

SCALARS = (int, float, str, bool)


def to_record(obj, leave_out: tuple[str, ...] = ()) -> dict:
    """The fields of the dataclass `obj` in declared order (but `leave_out`), tuples (nested too) as lists."""
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in leave_out}


def from_record(cls, d: dict):
    """The dataclass `cls` from a record: each value converted to its field's declared type (int, float,
    str, bool, tuples of them); a field the record lacks takes its default."""
    values = {name: _typed(kind, d[name]) for name, kind in _field_types(cls).items() if name in d}
    return cls(**values)


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _typed(kind, value):
    if typing.get_origin(kind) is tuple:
        (item, *_) = typing.get_args(kind)
        return tuple(_typed(item, v) for v in value)
    return kind(value) if kind in SCALARS else value
