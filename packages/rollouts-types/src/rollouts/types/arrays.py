"""Compact, read-only arrays for a Sample's per-token data, standard library only.

A 4096-token sample held as tuples of Python ints and floats costs ~36 bytes per token and a
Python-level loop to validate; at 1024 samples a step that is seconds of CPU. These hold the
values packed (int32 token ids: 4 bytes per token; float32 log-probs) in an
immutable `bytes`, are validated once when built (with whole-buffer byte checks, so the common
valid case costs microseconds), and are passed on as they are by `dataclasses.replace`.

They are Sequences (len, indexing, slicing, iteration, ==, hash), so code that read the tuples
keeps working; `buffer` is a read-only typed memoryview for zero-copy numpy
(`np.frombuffer(sample.tokens.buffer, dtype=np.int32)`), and `to_bytes` / `from_bytes` move them
without a per-element step. Loss weights are runs (rollouts.types.loss_mask.LossMask, re-exported
here): with them a Sample holds ~7.6 bytes per token at 4096 tokens (512 prompt).
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, TypeVar, overload

from rollouts.types.loss_mask import LossMask

__all__ = ["LogProbs", "LossMask", "TokenIds"]

_LITTLE = sys.byteorder == "little"
_LOW7 = bytes(range(128))
"""Deleting these from the high bytes leaves only those with the sign bit set."""
_NOT_EXP_ONES = bytes(b for b in range(256) if b not in (0x7F, 0xFF))
"""Deleting these from the high bytes leaves only those whose exponent bits could all be one."""

A = TypeVar("A", bound="_FrozenArray")


def _typed_view(data: bytes | memoryview, typecode: str) -> memoryview:
    """A read-only view of `data` as values of `typecode`."""
    view: memoryview = memoryview(data).cast(typecode)  # type: ignore[call-overload]
    return view


@functools.lru_cache(maxsize=256)
def _packer(typecode: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{typecode}")


class _FrozenArray(Sequence[Any]):
    """Immutable packed values of one struct typecode (little-endian)."""

    __slots__ = ("_data", "_view")
    _data: bytes | memoryview
    """The packed values: bytes, or a read-only view into an immutable bytes object (from_bytes(share=True))."""
    _view: memoryview | None
    """Made on first use: a view is a garbage-collected object, and most arrays are only passed on."""
    typecode: ClassVar[str]
    itemsize: ClassVar[int]
    _buffer_formats: ClassVar[tuple[str, ...]]
    """memoryview formats whose bytes are taken as they are (same type and width)."""

    def __init__(self, values: Any = (), *, what: str = "values") -> None:
        if isinstance(values, type(self)):
            data = values._data
        elif isinstance(values, (str, bytes, bytearray)):
            raise TypeError(f"{what} must be a sequence of numbers, got {type(values).__name__}")
        else:
            data = self._pack(values, what)
            self._validate(data, what)
            data = self._normalize(data)
        self._data = data
        self._view = None

    @classmethod
    def _pack(cls, values: Any, what: str) -> bytes:
        try:
            view = memoryview(values)
        except TypeError:
            view = None
        if view is not None:
            if view.format in cls._buffer_formats and view.itemsize == cls.itemsize and view.c_contiguous and _LITTLE:
                return view.tobytes()
            values = view.tolist()
        elif not isinstance(values, (list, tuple)):
            if not isinstance(values, Sequence) and not isinstance(values, Iterator):
                raise TypeError(f"{what} must be a sequence of numbers, got {type(values).__name__}")
            values = list(values)
        try:
            return _packer(cls.typecode, len(values)).pack(*values)
        except (struct.error, OverflowError, TypeError):
            for i, v in enumerate(values):  # the slow path only names the first bad element
                try:
                    struct.pack("<" + cls.typecode, v)
                except (struct.error, OverflowError, TypeError) as e:
                    raise (TypeError if not isinstance(v, (int, float)) else ValueError)(
                        f"{what}[{i}] must be {cls._element_rule}, got {v!r}"
                    ) from e
            raise

    _element_rule: ClassVar[str] = "a number"

    @classmethod
    def _validate(cls, data: bytes | memoryview, what: str) -> None:
        """Raise naming the first element that breaks the type's rule (subclasses)."""

    @classmethod
    def _normalize(cls, data: bytes | memoryview) -> bytes | memoryview:
        """The canonical bytes of valid values (subclasses)."""
        return data

    @classmethod
    def _trusted(cls: type[A], data: bytes | memoryview) -> A:
        """An array over bytes that are known to satisfy the rule (slices and copies of valid arrays)."""
        out = cls.__new__(cls)
        out._data = data
        out._view = None
        return out

    @classmethod
    def from_bytes(cls: type[A], data: bytes | memoryview, *, what: str = "values", share: bool = False) -> A:
        """From little-endian packed bytes (as `to_bytes` gives), validated. `share`: a read-only
        memoryview into an immutable bytes object is kept as it is instead of copied (the array then
        keeps that whole object alive)."""
        raw: bytes | memoryview
        if share and isinstance(data, memoryview) and data.readonly and isinstance(data.obj, bytes):
            raw = data.cast("B") if data.format != "B" else data
        else:
            raw = bytes(data)
        if len(raw) % cls.itemsize:
            raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of {cls.itemsize}-byte values")
        if not _LITTLE:  # pragma: no cover (no big-endian machine here)
            return cls(list(struct.unpack(f"<{len(raw) // cls.itemsize}{cls.typecode}", bytes(raw))), what=what)
        cls._validate(raw, what)
        return cls._trusted(cls._normalize(raw))

    def to_bytes(self) -> bytes:
        """The values packed little-endian (the array's own immutable bytes; a copy if it shares a view)."""
        data = self._data
        return data if isinstance(data, bytes) else data.tobytes()

    @property
    def buffer(self) -> memoryview:
        """A read-only typed view of the values (e.g. for `np.frombuffer`)."""
        if self._view is None:
            self._view = _typed_view(self._data, self.typecode)
        return self._view

    @property
    def nbytes(self) -> int:
        return len(self._data)

    def tolist(self) -> list[Any]:
        values: list[Any] = self.buffer.tolist()
        return values

    def __len__(self) -> int:
        return len(self._data) // self.itemsize

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self: A, index: slice) -> A: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self._trusted(self.buffer[index].tobytes())
        return self.buffer[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.buffer.tolist())

    def __add__(self: A, other: Sequence[Any]) -> A:
        """Concatenation: another array of this type is joined without a check; a list or tuple is
        packed and checked."""
        if type(other) is type(self):
            return self._trusted(self.to_bytes() + other.to_bytes())
        if isinstance(other, (list, tuple, _FrozenArray)):
            return type(self)(self.tolist() + list(other))
        return NotImplemented

    def __radd__(self: A, other: Sequence[Any]) -> A:
        if isinstance(other, (list, tuple)):
            return type(self)(list(other) + self.tolist())
        return NotImplemented

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._data == other._data or self.tolist() == other.tolist()
        if isinstance(other, (list, tuple, _FrozenArray)):
            return self.tolist() == list(other)
        return NotImplemented

    def _compare_as(self, other: object) -> list[Any] | None:
        if isinstance(other, (list, tuple, _FrozenArray)):
            return list(other)
        return None

    def __lt__(self, other: object) -> bool:
        theirs = self._compare_as(other)
        return NotImplemented if theirs is None else self.tolist() < theirs

    def __le__(self, other: object) -> bool:
        theirs = self._compare_as(other)
        return NotImplemented if theirs is None else self.tolist() <= theirs

    def __gt__(self, other: object) -> bool:
        theirs = self._compare_as(other)
        return NotImplemented if theirs is None else self.tolist() > theirs

    def __ge__(self, other: object) -> bool:
        theirs = self._compare_as(other)
        return NotImplemented if theirs is None else self.tolist() >= theirs

    def __hash__(self) -> int:
        return hash(tuple(self.buffer.tolist()))  # equal to the hash of the equal tuple

    def __repr__(self) -> str:
        values = self.buffer[:8].tolist()
        more = f", ... ({len(self)} values)" if len(self) > 8 else ""
        return f"{type(self).__name__}({values}{more})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self)._trusted, (self.to_bytes(),))

    def __copy__(self: A) -> A:
        return self

    def __deepcopy__(self: A, memo: dict[int, Any]) -> A:
        return self


def _first(data: bytes | memoryview, typecode: str, bad: Any) -> tuple[int, Any] | None:
    for i, v in enumerate(_typed_view(data, typecode).tolist()):
        if bad(v):
            return i, v
    return None


def _high_bytes(data: bytes | memoryview, itemsize: int) -> bytes:
    """The most significant byte of every little-endian value (a view is copied whole first: a
    strided copy of a view is far slower)."""
    return (data if isinstance(data, bytes) else bytes(data))[itemsize - 1 :: itemsize]


class TokenIds(_FrozenArray):
    """[T] token ids, int32 (4 bytes each), every one >= 0."""

    __slots__ = ()
    typecode = "i"
    itemsize = 4
    _buffer_formats = ("i", "<i", "=i")
    _element_rule = "a non-negative int"

    @classmethod
    def _validate(cls, data: bytes | memoryview, what: str) -> None:
        if _LITTLE and not _high_bytes(data, 4).translate(None, _LOW7):
            return  # no sign bit set anywhere
        found = _first(data, "i", lambda v: v < 0)
        if found is not None:
            raise ValueError(f"{what}[{found[0]}] must be a non-negative int, got {found[1]}")

    def __iter__(self) -> Iterator[int]:
        return iter(self.buffer.tolist())


class _FloatArray(_FrozenArray):
    __slots__ = ()
    _element_rule = "a finite float"

    @classmethod
    def _check_finite(cls, data: bytes | memoryview, what: str) -> None:
        if _LITTLE and not _high_bytes(data, cls.itemsize).translate(None, _NOT_EXP_ONES):
            return  # no exponent can be all ones: no NaN, no infinity
        found = _first(data, cls.typecode, lambda v: not math.isfinite(v))
        if found is not None:
            raise ValueError(f"{what}[{found[0]}] must be finite, got {found[1]!r}")

    @classmethod
    def _validate(cls, data: bytes | memoryview, what: str) -> None:
        cls._check_finite(data, what)


class LogProbs(_FloatArray):
    """[R] log-probabilities, float32 (4 bytes each: what training reads), finite. Python floats
    are rounded to the nearest float32 once, when packed; one past float32's range is refused."""

    __slots__ = ()
    typecode = "f"
    itemsize = 4
    _buffer_formats = ("f", "<f", "=f")
