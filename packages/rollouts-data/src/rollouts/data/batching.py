"""Samples -> micro-batches of numpy arrays: padding, best-fit-decreasing packing, step planning.

Legend: B rows, T tokens per row, S sequences in a micro-batch, N samples in a step.

A micro-batch is a `rollouts.types.MicroBatch[np.ndarray]` (frozen; fields and shapes in its
docstring): input_ids/position_ids/segment_ids/attention_mask int64 [B, T], loss_mask float32
[B, T], sample_indices int64 [S], cu_seqlens int32 [S+1] (packed layout only), and, when the
samples carry them, advantages and rollout_logprobs float32 [B, T]. Every per-token array is
aligned with input_ids: entry t concerns token t, so position 0 of every sequence has loss weight 0
(there is no prediction for it), even if a Sample's own mask says otherwise.

Attention: `attention_mask` only marks padding. A packed row holds several sequences, so a model
given that 2D mask lets each sequence attend to the ones packed before it. `segment_ids` (the
sequence each token belongs to, -1 on padding) say where the boundaries are:
`segment_attention_mask(mb.segment_ids)` is the [B, 1, T, T] block-diagonal causal mask for
attention that takes a dense mask (HF "sdpa"/"eager"); flash-attention kernels instead find the
boundaries from `position_ids` restarting at 0 (or from `cu_seqlens`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from rollouts.data.host_memory import HostMemoryPool, carve, default_pool
from rollouts.types import MicroBatch, Sample

__all__ = [
    "StepPlan",
    "best_fit_decreasing",
    "pack_samples",
    "pad_batch",
    "plan_micro_batches",
    "sample_arrays",
    "segment_attention_mask",
    "unpack",
    "unpack_values",
]


def _optional_fields(samples: Sequence[Sample]) -> tuple[str, ...]:
    """Which optional per-token arrays the batch carries; all samples must agree."""
    out = []
    for name, attr in (("advantages", "advantage"), ("rollout_logprobs", "rollout_logprobs")):
        present = [getattr(s, attr) is not None for s in samples]
        if any(present) and not all(present):
            missing = present.index(False)
            raise ValueError(
                f"samples[{missing}].{attr} is None while other samples have one: a batch carries "
                f"{name} for every sample or for none (a missing value would silently train as 0)"
            )
        if present and all(present):
            out.append(name)
    return tuple(out)


def sample_arrays(sample: Sample, *, fields: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """[T] token-aligned arrays of one sample: input_ids, loss_mask (0 at t=0), plus `fields`
    (read from the sample's packed storage without a per-token step)."""
    t = len(sample.tokens)
    if t == 0:
        raise ValueError("a sample with no tokens cannot be batched")
    loss_mask = np.zeros(t, dtype=np.float32)
    for start, stop, weight in sample.loss_mask.runs:
        loss_mask[start:stop] = weight
    loss_mask[0] = 0.0  # position 0 has no prediction
    input_ids = np.frombuffer(sample.tokens.buffer, dtype=np.int32).astype(np.int64)
    out: dict[str, np.ndarray] = {"input_ids": input_ids, "loss_mask": loss_mask}
    if "advantages" in fields:
        out["advantages"] = np.full(t, sample.advantage, dtype=np.float32)
    if "rollout_logprobs" in fields and sample.rollout_logprobs is not None:
        logprobs = np.zeros(t, dtype=np.float32)
        logprobs[sample.num_prompt_tokens :] = np.frombuffer(sample.rollout_logprobs.buffer, dtype=np.float32)
        out["rollout_logprobs"] = logprobs
    return out


def _check_samples(samples: Sequence[Sample]) -> None:
    if len(samples) == 0:
        raise ValueError("samples is empty: a micro-batch needs at least one sample")
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise TypeError(f"samples[{i}] must be a Sample, got {type(s).__name__}")
        if not s.tokens:
            raise ValueError(f"samples[{i}] has no tokens and cannot be batched")


def pad_batch(
    samples: Sequence[Sample], *, pad_id: int, sample_indices: Sequence[int] | None = None
) -> MicroBatch[np.ndarray]:
    """Right-padded [B, T] arrays, one row per sample (T = longest sample)."""
    _check_samples(samples)
    fields = _optional_fields(samples)
    b, t = len(samples), max(len(s.tokens) for s in samples)
    out: dict[str, np.ndarray] = {
        "input_ids": np.full((b, t), pad_id, dtype=np.int64),
        "position_ids": np.zeros((b, t), dtype=np.int64),
        "segment_ids": np.full((b, t), -1, dtype=np.int64),
        "attention_mask": np.zeros((b, t), dtype=np.int64),
    }
    for name in ("loss_mask", *fields):
        out[name] = np.zeros((b, t), dtype=np.float32)
    for row, s in enumerate(samples):
        n = len(s.tokens)
        for name, values in sample_arrays(s, fields=fields).items():
            out[name][row, :n] = values
        out["position_ids"][row, :n] = np.arange(n)
        out["segment_ids"][row, :n] = row
        out["attention_mask"][row, :n] = 1
    indices = np.asarray(list(range(b) if sample_indices is None else sample_indices), dtype=np.int64)
    if indices.shape != (b,):
        raise ValueError(f"sample_indices has {indices.size} entries for {b} samples: one per row")
    return _micro_batch(out, sample_indices=indices)


_INT_FIELDS = ("input_ids", "position_ids", "segment_ids", "attention_mask")


def _arenas(fields: Sequence[str], lengths: Sequence[int], memory: HostMemoryPool) -> list[dict[str, np.ndarray]]:
    """Uninitialised [1, n] arrays for micro-batches of `lengths` tokens: per field, views into one
    allocation for the whole step, taken from `memory`. At 1024 x 4096 tokens packing is
    memory-bound, and on fresh memory most of its time is the kernel faulting in and zeroing
    ~180 MB of pages; the pool hands back the memory of a previous step's micro-batches once
    nothing views them. A view keeps the step's whole allocation taken."""
    offsets = list(itertools.accumulate(lengths, initial=0))
    names = [*_INT_FIELDS, "loss_mask", *fields]
    dtypes = [np.dtype(np.int64)] * len(_INT_FIELDS) + [np.dtype(np.float32)] * (1 + len(fields))
    buffers = dict(zip(names, carve(memory, [(offsets[-1], d) for d in dtypes]), strict=True))
    return [
        {name: buffer[a:b].reshape(1, b - a) for name, buffer in buffers.items()}
        for a, b in itertools.pairwise(offsets)
    ]


def _pack_one(
    samples: Sequence[Sample], indices: Sequence[int], fields: Sequence[str], *, pad_id: int, out: dict[str, np.ndarray]
) -> MicroBatch[np.ndarray]:
    """One packed [1, length] row holding `samples` back to back (tail padded), written into the
    uninitialised arrays `out` from the samples' packed bytes: each entry is written once (its
    sequence's slice, or the padded tail) and there is no per-token Python."""
    lengths = [len(s.tokens) for s in samples]
    offsets = list(itertools.accumulate(lengths, initial=0))
    used = offsets[-1]
    rows = {name: array[0] for name, array in out.items()}
    for name, pad in (("input_ids", pad_id), ("position_ids", 0), ("segment_ids", -1), ("attention_mask", 0)):
        rows[name][used:] = pad
    for name in ("loss_mask", *fields):
        rows[name][used:] = 0.0
    rows["attention_mask"][:used] = 1
    positions = np.arange(max(lengths), dtype=np.int64)
    mask = rows["loss_mask"]
    for k, s in enumerate(samples):
        a, n = offsets[k], lengths[k]
        b = a + n
        rows["input_ids"][a:b] = np.frombuffer(s.tokens.buffer, dtype=np.int32)
        rows["position_ids"][a:b] = positions[:n]
        rows["segment_ids"][a:b] = k
        cursor = a
        for start, stop, weight in s.loss_mask.runs:  # a few runs per sample; zeros between them
            mask[cursor : a + start] = 0.0
            mask[a + start : a + stop] = weight
            cursor = a + stop
        mask[cursor:b] = 0.0
        mask[a] = 0.0  # position 0 of each sequence has no prediction
        if "advantages" in fields:
            rows["advantages"][a:b] = s.advantage
        if "rollout_logprobs" in fields:
            assert s.rollout_logprobs is not None  # _optional_fields: all or none
            row = rows["rollout_logprobs"]
            row[a : a + s.num_prompt_tokens] = 0.0
            row[a + s.num_prompt_tokens : b] = np.frombuffer(s.rollout_logprobs.buffer, dtype=np.float32)
    cu = np.asarray(offsets, dtype=np.int32)
    return _micro_batch(out, sample_indices=np.asarray(list(indices), dtype=np.int64), cu_seqlens=cu)


def _micro_batch(
    arrays: dict[str, np.ndarray], *, sample_indices: np.ndarray, cu_seqlens: np.ndarray | None = None
) -> MicroBatch[np.ndarray]:
    return MicroBatch(
        input_ids=arrays["input_ids"],
        position_ids=arrays["position_ids"],
        segment_ids=arrays["segment_ids"],
        attention_mask=arrays["attention_mask"],
        loss_mask=arrays["loss_mask"],
        sample_indices=sample_indices,
        cu_seqlens=cu_seqlens,
        advantages=arrays.get("advantages"),
        rollout_logprobs=arrays.get("rollout_logprobs"),
    )


def best_fit_decreasing(lengths: Sequence[int], *, capacity: int) -> list[list[int]]:
    """Bins of item indices, each with total length <= capacity; longest items placed first.

    Each item goes to the fullest bin it still fits in (ties: the earliest bin), else a new bin.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"item {i} has length {n} > capacity {capacity}: it fits no bin")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect.bisect_left(free, (n, -1))
        if j < len(free):
            remaining, b = free.pop(j)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (remaining - n, b))
    return bins


def pack_samples(
    samples: Sequence[Sample],
    *,
    max_tokens: int,
    pad_id: int = 0,
    pad_to_multiple_of: int = 1,
    memory: HostMemoryPool | None = None,
) -> list[MicroBatch[np.ndarray]]:
    """Packed micro-batches ([1, T], T <= max_tokens) filled by best-fit-decreasing.

    Each row is its sequences back to back, padded at the tail to a multiple of
    `pad_to_multiple_of` (never beyond max_tokens); position_ids restart at 0 per sequence and
    cu_seqlens marks the boundaries. The arrays are views into one allocation from `memory`
    (default: `rollouts.data.host_memory.default_pool`), which is reused for a later step once no
    array of this one is alive.
    """
    _check_samples(samples)
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    fields = _optional_fields(samples)
    lengths = [len(s.tokens) for s in samples]
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(
                f"samples[{i}] has {n} tokens > max_tokens {max_tokens}: it fits no micro-batch; "
                "truncate it or raise the token budget"
            )
    bins = best_fit_decreasing(lengths, capacity=max_tokens)
    sizes = []
    for bin_indices in bins:
        used = sum(lengths[i] for i in bin_indices)
        sizes.append(min(-(-used // pad_to_multiple_of) * pad_to_multiple_of, max_tokens))
    return [
        _pack_one([samples[i] for i in bin_indices], bin_indices, fields, pad_id=pad_id, out=arrays)
        for bin_indices, arrays in zip(bins, _arenas(fields, sizes, memory or default_pool), strict=True)
    ]


def segment_attention_mask(segment_ids_B_T: np.ndarray) -> np.ndarray:
    """[B, 1, T, T] bool: query t sees key s iff both are in one segment and s <= t; padding sees itself.

    The dense mask a packed micro-batch needs (HF "sdpa"/"eager" attention; pass it as the 4D
    `attention_mask`, or as its additive form `np.where(mask, 0, finfo.min)`). A padding query
    (segment -1) sees only itself, so its softmax is over one key, not over nothing (NaN). Same
    rule as rollouts.backends' `attention_mask_4d`. Memory is B * T * T bytes.
    """
    seg = np.asarray(segment_ids_B_T)
    if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
        raise ValueError(f"segment_ids_B_T must be a 2D integer array [B, T], got shape {seg.shape} dtype {seg.dtype}")
    t = seg.shape[1]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0) & np.tri(t, dtype=bool)
    allowed |= np.eye(t, dtype=bool)
    out: np.ndarray = allowed[:, None]
    return out


def _sequence_slices(micro_batch: MicroBatch[np.ndarray]) -> list[tuple[int, int, int, int]]:
    """(sample index, row, start, end) of every sequence in a micro-batch."""
    indices = micro_batch.sample_indices.tolist()
    if micro_batch.cu_seqlens is not None:
        cu = micro_batch.cu_seqlens.tolist()
        return [(idx, 0, cu[s], cu[s + 1]) for s, idx in enumerate(indices)]
    lengths = micro_batch.attention_mask.sum(axis=1).tolist()
    return [(idx, row, 0, int(lengths[row])) for row, idx in enumerate(indices)]


def unpack(micro_batches: Sequence[MicroBatch[np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
    """Sample index -> its [T_i] per-token arrays (by field name, extras included; not segment_ids or
    attention_mask), from packed or padded micro-batches."""
    out: dict[int, dict[str, np.ndarray]] = {}
    for mb in micro_batches:
        arrays = mb.token_arrays()
        arrays.pop("segment_ids")
        arrays.pop("attention_mask")
        for idx, row, a, b in _sequence_slices(mb):
            if idx in out:
                raise ValueError(f"sample index {idx} appears in more than one sequence")
            out[idx] = {k: v[row, a:b].copy() for k, v in arrays.items()}
    return out


def unpack_values(
    micro_batches: Sequence[MicroBatch[np.ndarray]], values: Sequence[np.ndarray]
) -> dict[int, np.ndarray]:
    """Sample index -> [T_i] slice of a per-token result (e.g. trainer log-probs), one [B, T] array per micro-batch."""
    out: dict[int, np.ndarray] = {}
    for mb, v in zip(micro_batches, values, strict=True):
        if v.shape != mb.input_ids.shape:
            raise ValueError(f"values shape {v.shape} must match its micro-batch's input_ids {mb.input_ids.shape}")
        for idx, row, a, b in _sequence_slices(mb):
            out[idx] = np.asarray(v[row, a:b]).copy()
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """A step's micro-batches plus the whole-step denominators the loss needs."""

    micro_batches: tuple[MicroBatch[np.ndarray], ...] = field(repr=False)
    """The micro-batches (numpy arrays; see the module docstring)."""
    num_loss_tokens: int
    """Tokens with loss_mask > 0 over the whole step (global token-mean denominator)."""
    num_sequences: int
    """Sequences with at least one loss token in the whole step (global sequence-mean denominator;
    a fully masked sample is not counted, as in verl)."""
    num_tokens: int
    """Real (non-padding) tokens over the whole step."""
    num_padding_tokens: int
    """Padding tokens over all micro-batches (capacity wasted)."""


def _padded_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of length-sorted samples whose padded size rows * longest <= max_tokens."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def plan_micro_batches(
    samples: Sequence[Sample],
    *,
    max_tokens: int,
    layout: Literal["packed", "padded"] = "packed",
    pad_id: int = 0,
    memory: HostMemoryPool | None = None,
) -> StepPlan:
    """Split a step's samples into micro-batches of at most `max_tokens` (B * T) tokens each.

    sample_indices in every micro-batch index into `samples`; the counts cover the whole step, so
    losses normalized by them and summed over micro-batches equal the loss of one big batch.
    The packed layout's arrays come from `memory` (see `pack_samples`).
    """
    _check_samples(samples)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    lengths = [len(s.tokens) for s in samples]
    if layout == "packed":
        micro_batches = pack_samples(samples, max_tokens=max_tokens, pad_id=pad_id, memory=memory)
    elif layout == "padded":
        for i, n in enumerate(lengths):
            if n > max_tokens:
                raise ValueError(f"samples[{i}] has {n} tokens > max_tokens {max_tokens}: it fits no micro-batch")
        micro_batches = [
            pad_batch([samples[i] for i in g], pad_id=pad_id, sample_indices=g)
            for g in _padded_groups(lengths, max_tokens)
        ]
    else:
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    num_tokens = sum(lengths)
    return StepPlan(
        micro_batches=tuple(micro_batches),
        num_loss_tokens=int(sum(int((mb.loss_mask > 0).sum()) for mb in micro_batches)),
        num_sequences=sum(1 for s in samples if s.has_loss_tokens),
        num_tokens=num_tokens,
        num_padding_tokens=sum(mb.input_ids.size for mb in micro_batches) - num_tokens,
    )
