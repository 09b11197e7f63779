"""A Sample's loss weights stored as runs of equal non-zero weight, standard library only.

A loss mask is zeros on the prompt and on tool/user turns and one weight (1.0) on each trained
turn: a handful of runs whatever the length. Held as runs (start, stop, weight) it costs a few
dozen bytes per sample instead of 4 per token, which is what keeps a Sample's per-token storage
(int32 ids + mask + float32 log-probs) under 8 bytes per token. Weights are float32 values (what
training reads), finite and >= 0; -0.0 is 0.0.

It is a read-only Sequence of floats (len, indexing, slicing, iteration, ==, hash, ordering, `+`);
`buffer` builds the float32 values for `np.frombuffer`, `runs` gives the runs themselves.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any, cast

__all__ = ["LossMask"]

_F32 = struct.Struct("<f")
Run = tuple[int, int, float]


def _float32(value: float) -> float:
    """`value` rounded to float32 (inf past float32's range)."""
    try:
        return float(_F32.unpack(_F32.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def _is_sequence(values: Any) -> bool:
    return isinstance(values, (Sequence, memoryview)) and not isinstance(values, (str, bytes, bytearray))


def _as_list(values: Any, what: str) -> list[Any] | tuple[Any, ...]:
    """A list or tuple of the values: from a sequence, or a 1-D buffer (array.array, numpy)."""
    if isinstance(values, (list, tuple)):
        return values
    if isinstance(values, (str, bytes, bytearray)):
        raise TypeError(f"{what} must be a sequence of numbers, got {type(values).__name__}")
    try:
        view = memoryview(values)
    except TypeError:
        view = None
    if view is not None:
        if view.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got a buffer of shape {view.shape}")
        return view.tolist()
    if isinstance(values, Sequence):
        return list(values)
    raise TypeError(f"{what} must be a sequence of numbers, got {type(values).__name__}")


class LossMask(Sequence[float]):
    """[T] per-token loss weights: float32, finite, >= 0 (0 on tokens that are not trained)."""

    __slots__ = ("_length", "_runs", "_starts")
    _length: int
    _runs: tuple[Run, ...]
    _starts: tuple[int, ...]

    def __init__(self, values: Any = (), *, what: str = "values") -> None:
        if type(values) is LossMask:
            built = values
        else:
            seq = _as_list(values, what)
            built = LossMask._from_values(seq, what)
        self._length, self._runs, self._starts = built._length, built._runs, built._starts

    @classmethod
    def _make(cls, length: int, runs: tuple[Run, ...]) -> LossMask:
        out = cls.__new__(cls)
        out._length, out._runs, out._starts = length, runs, tuple(r[0] for r in runs)
        return out

    @classmethod
    def _from_values(cls, seq: list[Any] | tuple[Any, ...], what: str) -> LossMask:
        n = len(seq)
        if seq.count(0.0) + seq.count(1.0) == n:  # a 0/1 mask: C-level searches find the runs
            runs: list[Run] = []
            pos = 0
            while pos < n:
                try:
                    start = seq.index(1.0, pos)
                except ValueError:
                    break
                try:
                    stop = seq.index(0.0, start)
                except ValueError:
                    stop = n
                runs.append((start, stop, 1.0))
                pos = stop
            return cls._make(n, tuple(runs))
        general: list[Run] = []
        for i, v in enumerate(seq):
            if isinstance(v, (str, bytes)) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
                raise TypeError(f"{what}[{i}] must be a finite float, got {v!r}")
            w = _float32(float(v))
            if not math.isfinite(w):
                raise ValueError(f"{what}[{i}] must be finite, got {v!r}")
            if w < 0.0:
                raise ValueError(f"{what}[{i}] must be >= 0, got {v!r}")
            if w == 0.0:
                continue
            if general and general[-1][1] == i and general[-1][2] == w:
                general[-1] = (general[-1][0], i + 1, w)
            else:
                general.append((i, i + 1, w))
        return cls._make(n, tuple(general))

    @classmethod
    def from_runs(cls, length: int, runs: Sequence[Sequence[Any]], *, what: str = "runs") -> LossMask:
        """Zeros of `length`, with weight w on [start, stop) for each (start, stop, w) run; the runs
        sorted and disjoint, the weights finite and >= 0."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"{what}: length must be a non-negative int, got {length!r}")
        clean: list[Run] = []
        end = 0
        for i, run in enumerate(runs):
            if len(run) != 3:
                raise ValueError(f"{what}[{i}] must be (start, stop, weight), got {run!r}")
            start, stop, weight = run
            if not (type(start) is int and type(stop) is int) and any(  # exact ints: the common case, cheaply
                isinstance(x, bool) or not isinstance(x, int) for x in (start, stop)
            ):
                raise TypeError(f"{what}[{i}]: start and stop must be ints, got {run!r}")
            if not end <= start <= stop <= length:
                raise ValueError(
                    f"{what}[{i}] = {tuple(run)!r} must satisfy previous stop ({end}) <= start <= stop <= length ({length})"
                )
            w = _float32(float(weight))
            if not math.isfinite(w) or w < 0.0:
                raise ValueError(f"{what}[{i}]: the weight must be finite and >= 0, got {weight!r}")
            if start < stop and w != 0.0:
                if clean and clean[-1][1] == start and clean[-1][2] == w:
                    clean[-1] = (clean[-1][0], stop, w)
                else:
                    clean.append((start, stop, w))
            end = stop
        return cls._make(length, tuple(clean))

    @classmethod
    def prompt_response(cls, num_prompt: int, num_response: int) -> LossMask:
        """0.0 on `num_prompt` tokens, then 1.0 on `num_response` (the single-turn mask)."""
        if num_prompt < 0 or num_response < 0:
            raise ValueError(f"token counts must be >= 0, got {num_prompt} and {num_response}")
        n = num_prompt + num_response
        return cls._make(n, ((num_prompt, n, 1.0),) if num_response else ())

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, *, what: str = "values", share: bool = False) -> LossMask:
        """From little-endian float32 bytes (as `to_bytes` gives), validated. `share` is accepted for
        the packed arrays' signature; runs never keep `data`."""
        raw = bytes(data)
        if len(raw) % 4:
            raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of 4-byte values")
        return cls._from_values(list(struct.unpack(f"<{len(raw) // 4}f", raw)), what)

    @property
    def runs(self) -> tuple[Run, ...]:
        """The non-zero runs (start, stop, weight): sorted, disjoint, adjacent equal weights merged."""
        return self._runs

    def to_bytes(self) -> bytes:
        """The weights as little-endian float32 bytes."""
        parts, end = [], 0
        for start, stop, weight in self._runs:
            parts += [bytes(4 * (start - end)), _F32.pack(weight) * (stop - start)]
            end = stop
        parts.append(bytes(4 * (self._length - end)))
        return b"".join(parts)

    @property
    def buffer(self) -> memoryview[float]:
        """The weights as a read-only float32 memoryview (built on each call: the runs are the storage)."""
        return memoryview(self.to_bytes()).cast("f")

    @property
    def nbytes(self) -> int:
        """Bytes of `buffer` (4 per token); the runs themselves take a few dozen bytes per run."""
        return 4 * self._length

    def any_positive(self) -> bool:
        """Whether some token has a weight > 0."""
        return bool(self._runs)

    def count_positive(self) -> int:
        """How many tokens have a weight > 0."""
        return sum(stop - start for start, stop, _ in self._runs)

    def tolist(self) -> list[float]:
        out = [0.0] * self._length
        for start, stop, weight in self._runs:
            out[start:stop] = [weight] * (stop - start)
        return out

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                return LossMask(self.tolist()[index])
            stop = max(start, stop)
            runs = tuple(
                (max(a, start) - start, min(b, stop) - start, w) for a, b, w in self._runs if a < stop and b > start
            )
            return LossMask._make(stop - start, runs)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"LossMask indices must be ints or slices, got {type(index).__name__}")
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError(f"LossMask index {index} out of range for length {self._length}")
        k = bisect.bisect_right(self._starts, i) - 1
        return self._runs[k][2] if k >= 0 and i < self._runs[k][1] else 0.0

    def __iter__(self) -> Iterator[float]:
        return iter(self.tolist())

    def __add__(self, other: Any) -> Any:
        if not _is_sequence(other):
            return NotImplemented
        right = other if type(other) is LossMask else LossMask(other)
        n = self._length
        return LossMask._make(
            n + right._length, _merge(self._runs, tuple((a + n, b + n, w) for a, b, w in right._runs))
        )

    def __radd__(self, other: Any) -> Any:
        if not _is_sequence(other):
            return NotImplemented
        return LossMask(other) + self

    def __eq__(self, other: object) -> bool:
        if type(other) is LossMask:
            return self._length == other._length and self._runs == other._runs
        if not _is_sequence(other):
            return NotImplemented
        seq = cast(Sequence[Any], other)
        return len(seq) == self._length and self.tolist() == list(seq)

    def _ordered(self, other: Any) -> list[Any] | None:
        return (other.tolist() if hasattr(other, "tolist") else list(other)) if _is_sequence(other) else None

    def __lt__(self, other: Any) -> bool:
        theirs = self._ordered(other)
        return NotImplemented if theirs is None else self.tolist() < theirs

    def __le__(self, other: Any) -> bool:
        theirs = self._ordered(other)
        return NotImplemented if theirs is None else self.tolist() <= theirs

    def __gt__(self, other: Any) -> bool:
        theirs = self._ordered(other)
        return NotImplemented if theirs is None else self.tolist() > theirs

    def __ge__(self, other: Any) -> bool:
        theirs = self._ordered(other)
        return NotImplemented if theirs is None else self.tolist() >= theirs

    def __hash__(self) -> int:
        return hash(tuple(self.tolist()))  # equal to the hash of the equal tuple

    def __repr__(self) -> str:
        return f"LossMask.from_runs({self._length}, {list(self._runs)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (LossMask._make, (self._length, self._runs))

    def __copy__(self) -> LossMask:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> LossMask:
        return self


def _merge(left: tuple[Run, ...], right: tuple[Run, ...]) -> tuple[Run, ...]:
    """Runs of two adjacent masks joined (a run ending where an equal one starts becomes one)."""
    if left and right and left[-1][1] == right[0][0] and left[-1][2] == right[0][2]:
        return (*left[:-1], (left[-1][0], right[0][1], left[-1][2]), *right[1:])
    return left + right
