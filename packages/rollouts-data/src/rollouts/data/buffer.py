"""DataBuffer: prompts in a deterministic per-epoch shuffled order, resumable to the prompt.

The one legitimately stateful iterator of the project. Its state is three integers (seed, epoch,
offset into the epoch's permutation); `BufferState` + `next_prompts` are the functional twin for
loops that thread state explicitly, and the class is a thin holder around them, so the two agree
by construction.

An epoch that is consumed exactly to its end is stored as (epoch + 1, offset 0), never as
(epoch, offset == num_prompts): a resumed run then starts the next epoch instead of finding an
"exhausted" epoch and running zero steps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BufferState", "DataBuffer", "epoch_order", "next_prompts"]

_STATE_KEYS = ("seed", "epoch_id", "sample_offset", "num_prompts", "shuffle")


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferState:
    """Where a pass over `num_prompts` prompts stands: epoch and offset into its order."""

    num_prompts: int
    """Size of the prompt list the state belongs to (a resume against another list is refused)."""
    seed: int = 0
    """Seed of the per-epoch shuffle; epoch e uses the permutation drawn from (seed, e)."""
    shuffle: bool = True
    """False: every epoch visits prompts in file order."""
    epoch_id: int = 0
    """Completed passes over the prompts."""
    sample_offset: int = 0
    """Prompts of the current epoch already handed out (always < num_prompts)."""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "seed", "epoch_id", "sample_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"BufferState.{name} must be a non-negative int, got {value!r}")
        if self.num_prompts < 1:
            raise ValueError("BufferState.num_prompts must be >= 1: an empty prompt list yields no steps")
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"BufferState.shuffle must be a bool, got {type(self.shuffle).__name__}")
        if self.sample_offset >= self.num_prompts:
            raise ValueError(
                f"BufferState.sample_offset ({self.sample_offset}) must be < num_prompts ({self.num_prompts}); "
                "a finished epoch is stored as the next epoch at offset 0"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; `BufferState.from_dict` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BufferState:
        """Inverse of `to_dict`; missing or unknown keys are an error."""
        keys = set(data)
        if keys != set(_STATE_KEYS):
            raise ValueError(
                f"BufferState.from_dict: keys must be exactly {sorted(_STATE_KEYS)}, "
                f"missing {sorted(set(_STATE_KEYS) - keys)}, unknown {sorted(keys - set(_STATE_KEYS))}"
            )
        return cls(**data)


def epoch_order(state: BufferState, epoch_id: int) -> np.ndarray:
    """[N] the order in which epoch `epoch_id` visits the prompts (a permutation of 0..N-1),
    read-only: made once per epoch and kept (every step draws from it, and making it is
    linear in the number of prompts)."""
    return _epoch_order(state.seed, epoch_id, state.num_prompts, state.shuffle)


@functools.lru_cache(maxsize=2)  # the epoch being drawn, and the next one a draw crosses into
def _epoch_order(seed: int, epoch_id: int, num_prompts: int, shuffle: bool) -> np.ndarray:
    order = np.random.default_rng([seed, epoch_id]).permutation(num_prompts) if shuffle else np.arange(num_prompts)
    order.flags.writeable = False
    return order


def next_prompts(prompts: Sequence[Any], state: BufferState, n: int) -> tuple[tuple[Any, ...], BufferState]:
    """The next `n` prompts (crossing epoch boundaries) and the state after them."""
    if len(prompts) != state.num_prompts:
        raise ValueError(
            f"prompts has {len(prompts)} entries but the buffer state was made for {state.num_prompts}: "
            "resuming against a different prompt list would hand out different prompts"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    out: list[Any] = []
    epoch_id, offset = state.epoch_id, state.sample_offset
    while len(out) < n:
        order = epoch_order(state, epoch_id)
        take = min(n - len(out), state.num_prompts - offset)
        out.extend(prompts[int(i)] for i in order[offset : offset + take])
        offset += take
        if offset == state.num_prompts:
            epoch_id, offset = epoch_id + 1, 0
    return tuple(out), dataclasses.replace(state, epoch_id=epoch_id, sample_offset=offset)


class DataBuffer:
    """Hands out prompts n at a time in a seeded per-epoch shuffle; `state_dict` resumes exactly."""

    def __init__(self, prompts: Sequence[Any], *, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a sequence of prompt records, got {type(prompts).__name__}")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: a DataBuffer needs at least one prompt")
        self._prompts = tuple(prompts)
        self._state = BufferState(num_prompts=len(self._prompts), seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def prompts(self) -> tuple[Any, ...]:
        """All prompts, in file order."""
        return self._prompts

    @property
    def state(self) -> BufferState:
        """The current (frozen) state."""
        return self._state

    @property
    def epoch_id(self) -> int:
        """Completed passes over the prompts."""
        return self._state.epoch_id

    @property
    def sample_offset(self) -> int:
        """Prompts of the current epoch already handed out."""
        return self._state.sample_offset

    def get_prompts(self, n: int) -> tuple[Any, ...]:
        """The next `n` prompts; epochs roll over seamlessly with a fresh shuffle."""
        batch, self._state = next_prompts(self._prompts, self._state, n)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state; `load_state_dict` on a buffer over the same prompts resumes exactly."""
        return self._state.to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state saved by `state_dict` (the prompt count must match)."""
        loaded = BufferState.from_dict(state)
        if loaded.num_prompts != len(self._prompts):
            raise ValueError(
                f"saved buffer state is for {loaded.num_prompts} prompts but this buffer holds "
                f"{len(self._prompts)}: resuming would hand out different prompts"
            )
        self._state = loaded
