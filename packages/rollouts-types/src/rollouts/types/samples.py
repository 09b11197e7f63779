"""Samples and batches: the currency every stage of the pipeline passes on.

Legend: T tokens in a sample (prompt + response), R response tokens (T - num_prompt_tokens).

A Sample's per-token data is packed (rollouts.types.arrays: int32 token ids, float32 loss weights,
float64 log-probs), validated once when the Sample is built; `dataclasses.replace` and the `with_*`
methods pass the arrays on without looking at them again.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollouts.types.arrays import LogProbs, LossMask, TokenIds
from rollouts.types.frozen import check_finite, empty_mapping, freeze, thaw


class Status(enum.StrEnum):
    """Where a sample is in its life: generated fully, cut short, or lost."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit max tokens (or max_length in SFT)
    ABORTED = "aborted"
    FAILED = "failed"


Prompt = str | tuple[Mapping[str, Any], ...]
"""A prompt: plain text, or chat messages ({"role": ..., "content": ...} mappings)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One prompt/response pair and everything training needs from it."""

    prompt: Prompt = ""
    """Text, or a tuple of chat messages (frozen mappings)."""
    response: str = ""
    """Decoded response text (what a reward function reads)."""
    tokens: TokenIds = TokenIds()
    """[T] prompt token ids followed by response token ids (any sequence of ints is taken and packed)."""
    num_prompt_tokens: int = 0
    """How many of `tokens` are the prompt; the response is tokens[num_prompt_tokens:]."""
    loss_mask: LossMask = LossMask()
    """[T] 1.0 on trained tokens, 0.0 on prompt and tool/user turns (any sequence of floats >= 0)."""
    reward: float | None = None
    """Scalar reward, set by a reward function."""
    advantage: float | None = None
    """Scalar advantage, set from the rewards of the sample's group."""
    group_index: int | None = None
    """Which prompt group the sample belongs to (GRPO compares samples within a group)."""
    index: int | None = None
    """Position of the sample in its step (stable id for logging and carry-over)."""
    rollout_logprobs: LogProbs | None = None
    """[R] log p of each response token under the engine that sampled it (0.0 on tool tokens)."""
    weight_version: int | None = None
    """Version of the policy weights that generated the response."""
    metadata: Mapping[str, Any] = field(default_factory=empty_mapping)
    """Free-form JSON-like data (frozen): answers, tool traces, filter reasons."""
    status: Status = Status.PENDING

    def __post_init__(self) -> None:
        for check in _CHECKS.values():
            check(self)

    def replace(self, **changes: Any) -> Sample:
        """A copy with `changes` applied, like `dataclasses.replace` but checking only what changed
        (the arrays are not looked at again unless one of them, or num_prompt_tokens, changes), which
        counts at a thousand samples per step and several replaces each."""
        names = tuple(changes)
        checks = _CHECKS_OF_CHANGES.get(names)
        if checks is None:
            checks = _checks_of_changes(names)
        out = _copy(self)
        for name, value in changes.items():
            _setattr(out, name, value)
        for check in checks:
            check(out)
        return out

    __replace__ = replace  # copy.replace (Python 3.13+)

    @property
    def response_length(self) -> int:
        """Number of tokens after the prompt (R)."""
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def prompt_tokens(self) -> TokenIds:
        """[P] the prompt's token ids."""
        return self.tokens[: self.num_prompt_tokens]

    @property
    def response_tokens(self) -> TokenIds:
        """[R] the response's token ids."""
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_loss_tokens(self) -> int:
        """Number of tokens with a non-zero loss weight."""
        return self.loss_mask.count_positive()

    @property
    def has_loss_tokens(self) -> bool:
        """Whether any token has a non-zero loss weight (cheaper than num_loss_tokens > 0)."""
        return self.loss_mask.any_positive()

    def with_reward(self, reward: float) -> Sample:
        """A copy with `reward` set."""
        return self.replace(reward=reward)

    def with_advantage(self, advantage: float) -> Sample:
        """A copy with `advantage` set."""
        return self.replace(advantage=advantage)

    def with_metadata(self, **updates: Any) -> Sample:
        """A copy whose metadata has `updates` merged in."""
        return self.replace(metadata={**self.metadata, **updates})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (plain lists and dicts); `Sample.from_dict` inverts it."""
        out = {f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        """Build a Sample from `to_dict` output; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"Sample.from_dict: unknown keys {unknown}; allowed: {sorted(known)}")
        return cls(**data)


# Sample's checks, one per group of fields that are checked together: __post_init__ runs them all,
# Sample.replace only those of the fields it changes.
_NAME = "Sample"


def _check_prompt(sample: Sample) -> None:
    prompt = sample.prompt
    if isinstance(prompt, str):
        return
    if isinstance(prompt, Mapping) or not isinstance(prompt, Sequence):
        raise TypeError(f"{_NAME}.prompt must be a str or a sequence of messages, got {type(prompt).__name__}")
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise TypeError(f"{_NAME}.prompt[{i}] must be a message mapping, got {type(message).__name__}")
    object.__setattr__(sample, "prompt", freeze(prompt))


def _check_response(sample: Sample) -> None:
    if not isinstance(sample.response, str):
        raise TypeError(f"{_NAME}.response must be a str, got {type(sample.response).__name__}")


def _check_arrays(sample: Sample) -> None:
    """tokens, loss_mask, num_prompt_tokens and rollout_logprobs, which must agree in length.
    Packed and validated once: arrays already of these types (a replace) are taken as they are."""
    tokens = sample.tokens if type(sample.tokens) is TokenIds else TokenIds(sample.tokens, what=f"{_NAME}.tokens")
    mask = sample.loss_mask
    if type(mask) is not LossMask:
        mask = LossMask(mask, what=f"{_NAME}.loss_mask")
    object.__setattr__(sample, "tokens", tokens)
    object.__setattr__(sample, "loss_mask", mask)
    if len(mask) != len(tokens):
        raise ValueError(
            f"{_NAME}.loss_mask has {len(mask)} entries but tokens has {len(tokens)}: "
            "the mask needs one weight per token"
        )
    num_prompt = sample.num_prompt_tokens
    if isinstance(num_prompt, bool) or not isinstance(num_prompt, int):
        raise TypeError(f"{_NAME}.num_prompt_tokens must be an int, got {type(num_prompt).__name__}")
    if not 0 <= num_prompt <= len(tokens):
        raise ValueError(f"{_NAME}.num_prompt_tokens ({num_prompt}) must be in [0, len(tokens)={len(tokens)}]")
    logprobs = sample.rollout_logprobs
    if logprobs is not None:
        if type(logprobs) is not LogProbs:
            logprobs = LogProbs(logprobs, what=f"{_NAME}.rollout_logprobs")
        if len(logprobs) != sample.response_length:
            raise ValueError(
                f"{_NAME}.rollout_logprobs has {len(logprobs)} entries but the response has "
                f"{sample.response_length} tokens: one log-prob per response token"
            )
        object.__setattr__(sample, "rollout_logprobs", logprobs)


def _float_check(fname: str) -> Callable[[Sample], None]:
    def check(sample: Sample) -> None:
        value = getattr(sample, fname)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{_NAME}.{fname} must be a float or None, got {type(value).__name__}")
            check_finite(_NAME, fname, float(value))
            object.__setattr__(sample, fname, float(value))

    return check


def _index_check(fname: str) -> Callable[[Sample], None]:
    def check(sample: Sample) -> None:
        value = getattr(sample, fname)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{_NAME}.{fname} must be a non-negative int or None, got {value!r}")

    return check


def _check_metadata(sample: Sample) -> None:
    if not isinstance(sample.metadata, Mapping):
        raise TypeError(f"{_NAME}.metadata must be a mapping, got {type(sample.metadata).__name__}")
    object.__setattr__(sample, "metadata", freeze(sample.metadata))


def _check_status(sample: Sample) -> None:
    if type(sample.status) is not Status:
        object.__setattr__(sample, "status", Status(sample.status))


_CHECKS: dict[str, Callable[[Sample], None]] = {
    "prompt": _check_prompt,
    "response": _check_response,
    "arrays": _check_arrays,
    **{fname: _float_check(fname) for fname in ("reward", "advantage")},
    **{fname: _index_check(fname) for fname in ("group_index", "index", "weight_version")},
    "metadata": _check_metadata,
    "status": _check_status,
}
_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
_FIELD_SET = frozenset(_FIELDS)


def _slot_writer(cls: type[Sample], fields: tuple[str, ...], *, copy: bool) -> Callable[..., Sample]:
    """A compiled function making a new `cls` whose `fields` are set unchecked, each slot by its
    descriptor in straight-line code (a third of the time of a loop over the names).
    copy=True: copy(obj), the fields read from obj in one C call. copy=False: build(*values), the
    values in `fields` order, for a caller that has checked each as __post_init__ would
    (rollouts.types.wire checks whole columns at once)."""
    values = ", ".join(f"v{i}" for i in range(len(fields)))
    setters = ", ".join(f"_set{i}=_setters[{i}]" for i in range(len(fields)))
    if copy:
        lines = [f"def f(obj, *, _get=_get, _new=_new, _cls=_cls, {setters}):", f"    ({values},) = _get(obj)"]
    else:
        lines = [f"def f({values}, *, _new=_new, _cls=_cls, {setters}):"]
    lines.append("    out = _new(_cls)")
    lines += [f"    _set{i}(out, v{i})" for i in range(len(fields))]
    lines.append("    return out")
    namespace: dict[str, Any] = {
        "_get": operator.attrgetter(*fields),
        "_new": object.__new__,
        "_cls": cls,
        "_setters": tuple(getattr(cls, name).__set__ for name in fields),
    }
    exec("\n".join(lines), namespace)  # noqa: S102 (code built from the dataclass's own field names)
    function: Callable[..., Sample] = namespace["f"]
    return function


_copy = _slot_writer(Sample, _FIELDS, copy=True)
_build_checked = _slot_writer(Sample, _FIELDS, copy=False)
"""A Sample from values already checked as Sample's checks would (positional, in _FIELDS order)."""
_CHECK_OF = {
    name: _CHECKS["arrays" if name in ("tokens", "loss_mask", "num_prompt_tokens", "rollout_logprobs") else name]
    for name in _FIELDS
}
_setattr = object.__setattr__
_CHECKS_OF_CHANGES: dict[tuple[str, ...], tuple[Callable[[Sample], None], ...]] = {}
"""Sample.replace's checks for each tuple of changed field names it has seen (a handful per program)."""


def _checks_of_changes(names: tuple[str, ...]) -> tuple[Callable[[Sample], None], ...]:
    """The checks of the fields `names`, each once, in order; TypeError naming any unknown field."""
    unknown = [name for name in names if name not in _FIELD_SET]
    if unknown:
        raise TypeError(f"Sample.replace: unknown fields {sorted(unknown)}; allowed: {list(_FIELDS)}")
    checks = tuple(dict.fromkeys(_CHECK_OF[name] for name in names))
    if len(_CHECKS_OF_CHANGES) < 1024:  # bounded, whatever the callers
        _CHECKS_OF_CHANGES[names] = checks
    return checks


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutBatch:
    """The samples of one training step plus what happened while collecting them."""

    samples: tuple[Sample, ...]
    """The kept samples, grouped: samples of one group share `group_index`."""
    epoch: int = 0
    """Epoch of the prompt buffer when the step's prompts were drawn."""
    step: int = 0
    """Training step the batch is for."""
    num_filtered: int = 0
    """Samples dropped by a filter (their reasons are in `filter_reasons`)."""
    num_failed: int = 0
    """Samples whose generation failed after all retries."""
    num_carried_over: int = 0
    """Finished samples beyond this step's need, kept for the next step."""
    filter_reasons: Mapping[str, int] = field(default_factory=empty_mapping)
    """Filter name -> number of samples it dropped."""
    metadata: Mapping[str, Any] = field(default_factory=empty_mapping)
    """Batch statistics (reward mean, response lengths, truncation rate, ...)."""

    def __post_init__(self) -> None:
        name = "RolloutBatch"
        if isinstance(self.samples, (str, bytes)) or not isinstance(self.samples, Sequence):
            raise TypeError(f"{name}.samples must be a sequence of Sample, got {type(self.samples).__name__}")
        samples = tuple(self.samples)
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"{name}.samples[{i}] must be a Sample, got {type(s).__name__}")
        object.__setattr__(self, "samples", samples)
        for fname in ("epoch", "step", "num_filtered", "num_failed", "num_carried_over"):
            value = getattr(self, fname)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}.{fname} must be a non-negative int, got {value!r}")
        object.__setattr__(self, "filter_reasons", freeze(self.filter_reasons))
        object.__setattr__(self, "metadata", freeze(self.metadata))

    @property
    def num_kept(self) -> int:
        """Number of samples in the batch."""
        return len(self.samples)

    @property
    def rewards(self) -> tuple[float, ...]:
        """Rewards of the samples (NaN where a sample has none)."""
        return tuple(math.nan if s.reward is None else s.reward for s in self.samples)
