"""Type checking of dataclass fields against their annotations, and strict dict -> config building.

Used by every config: a wrong type raises TypeError and an unknown key or bad value raises
ValueError, each naming the full key path (``RLConfig.rollout.batch_size``), the value and the rule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")


def _hints(cls: type) -> dict[str, Any]:
    return _cached_hints(cls)


@functools.cache
def _cached_hints(cls: Any) -> dict[str, Any]:  # Any: classes are hashable, which `type` does not say
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def coerce(path: str, tp: Any, value: Any) -> Any:
    """Check `value` against annotation `tp`; return it normalized (int -> float, list -> tuple)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, path=path)
        raise TypeError(f"{path} must be a table of {tp.__name__} fields, got {type(value).__name__} {value!r}")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(path, arg, value)
            except (TypeError, ValueError) as e:
                errors.append(e)
        value_errors = [e for e in errors if isinstance(e, ValueError)]
        if value_errors:  # the type fit one member but the value broke its rule (e.g. inf for float | None)
            raise value_errors[0]
        raise TypeError(f"{path} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        raise ValueError(f"{path} must be {_type_name(tp)}, got {value!r}")
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise TypeError(f"{path} must be a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(f"{path}[{i}]", args[0], v) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ValueError(f"{path} must have {len(args)} entries, got {len(value)}: {value!r}")
        return tuple(coerce(f"{path}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # inf would pass every "> 0" rule: a timeout that never fires
                raise ValueError(f"{path} must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise TypeError(f"{path} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")


def check_fields(obj: Any) -> None:
    """Type-check and normalize every field of a frozen dataclass instance in place."""
    cls = type(obj)
    hints = _hints(cls)
    for f in dataclasses.fields(obj):
        value = coerce(f"{cls.__name__}.{f.name}", hints[f.name], getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str | None = None) -> T:
    """Build dataclass `cls` from a (possibly nested) mapping; unknown keys are a ValueError."""
    path = path or cls.__name__
    if not isinstance(data, Mapping):
        raise TypeError(f"{path} must be a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]  # T is a dataclass
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed keys: {sorted(fields)}")
    hints = _hints(cls)
    kwargs = {name: coerce(f"{path}.{name}", hints[name], value) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if path == cls.__name__:
            raise
        raise type(e)(f"{path}: {e}") from e


def require(ok: bool, path: str, value: Any, rule: str) -> None:
    """Raise ValueError('{path} must {rule}, got {value}') unless ok."""
    if not ok:
        raise ValueError(f"{path} must {rule}, got {value!r}")
