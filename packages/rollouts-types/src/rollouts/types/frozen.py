"""Deep freezing of JSON-like values, so a frozen dataclass cannot be changed through its fields.

dict -> types.MappingProxyType over a private copy, list/tuple -> tuple, recursively. `thaw` is the
inverse (for JSON and for callers that want plain containers back).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


def freeze(value: Any) -> Any:
    """Return an immutable deep copy of a JSON-like value (mappings, sequences, scalars)."""
    if value is _EMPTY or type(value) in _SCALARS:  # already immutable: the common leaves, cheaply
        return value
    if type(value) is dict or isinstance(value, Mapping):
        if not value:
            return _EMPTY
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Return a plain-container deep copy (dict, list) of a frozen value (packed arrays: lists)."""
    tolist = getattr(value, "tolist", None)
    if tolist is not None and not isinstance(value, (Mapping, list, tuple)):
        return tolist()
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def empty_mapping() -> Mapping[str, Any]:
    """The shared immutable empty mapping used as a field default."""
    return _EMPTY


def check_finite(owner: str, field: str, value: float) -> None:
    """Raise ValueError naming the field when value is NaN or infinite."""
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{field} must be finite, got {value!r}")
