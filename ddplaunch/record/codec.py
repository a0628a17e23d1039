"""Typed data to JSON and back: the one codec of the event log, `--json` and the records.

`to_data` turns a dataclass (nested ones, enums, tuples) into JSON-ready values; `from_data`
rebuilds the dataclass from them, each field as its annotation says (an enum's value becomes the
enum again, a nested dataclass its class, a `dict[str, NodeState]` its enum values, a field that
may hold one of several classes the one its `kind` names), so a reader of the log gets the same
types the writer had. Unknown keys are ignored (a newer writer); a
missing field with no default, or a value of the wrong shape, raises `ValueError`.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import lru_cache
from typing import Any, TypeVar, Union

T = TypeVar("T")


def to_data(value: Any) -> Any:
    """JSON-ready values: dataclasses as dicts (with `kind`, where the class names its KIND: one
    of several classes a field may hold), enums as their values, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = getattr(type(value), "KIND", None)
        return {**({"kind": kind} if isinstance(kind, str) and kind else {}),
                **{f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(to_data(k)): to_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_data(v) for v in value]
    return value


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_data(cls: type[T], data: Any) -> T:
    """`cls` (a dataclass) rebuilt from what `to_data` made of one.

    Raises:
        ValueError: `data` is not an object, lacks a required field, or a value has the wrong shape.
    """
    return typing.cast(T, _convert(cls, data))


def _dataclass(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: not an object")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"key {f.name!r} is missing")
            continue
        try:
            kwargs[f.name] = _convert(hints[f.name], data[f.name])
        except ValueError as err:
            raise ValueError(f"key {f.name!r}: {err}") from None
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{cls.__name__}: {err}") from None


def _convert(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, dict) and "kind" in value:  # one of several classes, named by its KIND
            named = [a for a in args if getattr(a, "KIND", None) == value["kind"]]
            if named:
                return _convert(named[0], value)
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value)
            except (ValueError, TypeError):
                continue
        raise ValueError(f"{value!r} is none of {hint}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _dataclass(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return tuple(_convert(a, v) for a, v in zip(args, value))
        item = args[0] if args else Any
        converted = [_convert(item, v) for v in value]
        return tuple(converted) if origin is tuple else converted
    if origin is dict and isinstance(value, dict):
        key, item = args if args else (Any, Any)
        return {_key(key, k): _convert(item, v) for k, v in value.items()}
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{value!r} is not one of {args}")
        return value
    return _scalar(hint, value)


def _key(hint: Any, key: Any) -> Any:
    """A dict key as its annotation says: JSON keeps every key as a string (`{2: 0.5}` reads
    back as `{"2": 0.5}`), so an int key is read from its digits."""
    if hint is int and isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ValueError(f"key {key!r} is not int") from None
    return _convert(hint, key)


def _scalar(hint: Any, value: Any) -> Any:
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        return float(value)
    if isinstance(hint, type) and hint in (int, str, bool) and not isinstance(value, hint):
        raise ValueError(f"{value!r} is not {hint.__name__}")
    if hint is int and isinstance(value, bool):
        raise ValueError(f"{value!r} is not int")
    if typing.get_origin(hint) in (list, dict, tuple):
        raise ValueError(f"{value!r} is not {hint}")
    return value
