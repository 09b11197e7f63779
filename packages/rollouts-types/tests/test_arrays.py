"""The packed per-token arrays: the values round-trip exactly, bad values are named, and a Sample
passes its arrays on through replace without packing or checking them again."""

import array
import copy
import dataclasses
import json
import math
import struct
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.types import Sample
from rollouts.types.arrays import LogProbs, LossMask, TokenIds

token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=40)

weights = st.lists(st.floats(0.0, 1e6, width=32), max_size=40)


@given(values=token_lists)
def test_token_ids_hold_exactly_the_values_as_a_sequence(values):
    ids = TokenIds(values)
    assert list(ids) == values and ids.tolist() == values and len(ids) == len(values)
    assert ids == tuple(values) and ids == values and hash(ids) == hash(tuple(values))
    assert ids.nbytes == 4 * len(values)  # 4 bytes per token
    if values:
        assert ids[0] == values[0] and ids[-1] == values[-1]
        assert ids[1:3] == tuple(values[1:3]) and type(ids[1:3]) is TokenIds
    assert TokenIds.from_bytes(ids.to_bytes()) == ids
    assert ids + TokenIds([7]) == (*values, 7) and (7,) + ids == (7, *values)
    assert TokenIds(array.array("i", values)) == ids  # a buffer of int32 is taken as it is
    assert copy.deepcopy(ids) is ids
    other = TokenIds([*values, 0])
    assert (ids < other) == (values < [*values, 0]) and sorted([other, ids]) == sorted([[*values, 0], values])


@given(values=token_lists, bad=st.integers(-(2**31), -1), at=st.integers(0, 40))
def test_a_negative_or_non_int_token_is_named(values, bad, at):
    at = min(at, len(values))
    with pytest.raises(ValueError, match=rf"tokens\[{at}\] must be a non-negative int, got {bad}"):
        TokenIds([*values[:at], bad, *values[at:]], what="tokens")
    with pytest.raises(ValueError, match=rf"tokens\[{at}\] must be a non-negative int"):
        TokenIds([*values[:at], 2**31, *values[at:]], what="tokens")  # beyond int32
    with pytest.raises(TypeError, match=rf"tokens\[{at}\]"):
        TokenIds([*values[:at], "7", *values[at:]], what="tokens")
    with pytest.raises(ValueError, match=rf"tokens\[{at}\] must be a non-negative int"):
        TokenIds.from_bytes(TokenIds(values[:at]).to_bytes() + b"\xff" * 4, what="tokens")


@given(values=weights, bad=st.sampled_from([math.nan, math.inf, -math.inf, -0.5]), at=st.integers(0, 40))
def test_loss_weights_are_finite_and_non_negative(values, bad, at):
    mask = LossMask(values)
    assert mask.tolist() == values and mask.nbytes == 4 * len(values)
    assert mask.count_positive() == sum(v > 0 for v in values)
    assert mask.any_positive() == any(v > 0 for v in values)
    at = min(at, len(values))
    rule = "must be >= 0" if bad == -0.5 else "must be finite"
    with pytest.raises(ValueError, match=rf"mask\[{at}\] {rule}"):
        LossMask([*values[:at], bad, *values[at:]], what="mask")


def test_a_negative_zero_weight_is_zero():
    mask = LossMask([0.0, -0.0, 0.0])
    assert not mask.any_positive() and mask.count_positive() == 0


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@settings(deadline=None)
@given(values=st.lists(st.floats(-1e30, 1e30), max_size=30))
def test_log_probs_are_float32_rounded_once(values):
    logprobs = LogProbs(values)
    assert logprobs.tolist() == [_f32(v) for v in values] and logprobs.nbytes == 4 * len(values)
    assert LogProbs(logprobs.tolist()) == logprobs  # float32 values are kept exactly
    with pytest.raises(ValueError, match="must be finite"):
        LogProbs([*values, math.nan])
    with pytest.raises(ValueError, match=rf"\[{len(values)}\] must be a finite float, got 1e\+39"):
        LogProbs([*values, 1e39])  # past float32's range


@settings(deadline=None)
@given(values=weights, lo=st.integers(0, 40), hi=st.integers(0, 40))
def test_a_loss_mask_is_its_runs(values, lo, hi):
    mask = LossMask(values)
    assert [mask[i] for i in range(len(values))] == values and list(mask) == values
    assert mask[lo:hi] == values[lo:hi] and mask[::2] == values[::2] and type(mask[lo:hi]) is LossMask
    assert mask[:lo] + mask[lo:] == mask and values[:lo] + mask[lo:] == mask and hash(mask) == hash(tuple(values))
    assert LossMask.from_runs(len(values), mask.runs) == mask
    assert LossMask.from_bytes(mask.to_bytes()) == mask and mask.buffer.tolist() == values
    assert sum(stop - start for start, stop, _ in mask.runs) == sum(v > 0 for v in values)
    for (_, stop, w), (start, _, w2) in zip(mask.runs, mask.runs[1:], strict=False):
        assert stop < start or w != w2  # adjacent equal runs are merged


def test_a_mask_is_taken_from_any_sequence_or_1d_buffer():
    assert LossMask(array.array("f", [0.0, 1.0, 1.0])) == LossMask(range(0)) + [0.0, 1.0, 1.0]
    assert LossMask(memoryview(array.array("d", [0.5, 0.0]))).runs == ((0, 1, 0.5),)
    with pytest.raises(TypeError, match="must be a sequence of numbers, got str"):
        LossMask("01")
    with pytest.raises(TypeError, match="must be a sequence of numbers, got int"):
        LossMask(3)


def test_a_multi_turn_mask_takes_a_few_runs_whatever_its_length():
    mask = LossMask([0.0] * 500 + [1.0] * 3000 + [0.0] * 100 + [1.0] * 496)
    assert mask.runs == ((500, 3500, 1.0), (3600, 4096, 1.0))
    assert sys.getsizeof(mask.runs) + sum(sys.getsizeof(r) for r in mask.runs) < 300


@pytest.mark.parametrize(
    ("runs", "match"),
    [
        ([(2, 5, 1.0)], r"runs\[0\] = \(2, 5, 1.0\) must satisfy previous stop \(0\) <= start <= stop <= length \(4\)"),
        ([(2, 3, 1.0), (1, 2, 1.0)], r"runs\[1\] = \(1, 2, 1.0\) must satisfy previous stop \(3\)"),
        ([(0, 1, -1.0)], r"runs\[0\]: the weight must be finite and >= 0, got -1.0"),
        ([(0, 1, math.nan)], r"runs\[0\]: the weight must be finite"),
        ([(0, 1)], r"runs\[0\] must be \(start, stop, weight\)"),
    ],
)
def test_bad_runs_are_named(runs, match):
    with pytest.raises(ValueError, match=match):
        LossMask.from_runs(4, runs)


@given(values=token_lists, prompt=st.integers(0, 40), reward=st.floats(-5, 5))
def test_replace_passes_the_packed_arrays_on_untouched(values, prompt, reward):
    prompt = min(prompt, len(values))
    sample = Sample(tokens=values, num_prompt_tokens=prompt, loss_mask=[0.0] * prompt + [1.0] * (len(values) - prompt))
    assert type(sample.tokens) is TokenIds and type(sample.loss_mask) is LossMask
    rewarded = dataclasses.replace(sample.with_reward(reward), group_index=3)
    assert rewarded.tokens is sample.tokens and rewarded.loss_mask is sample.loss_mask
    assert sample.num_loss_tokens == len(values) - prompt and sample.has_loss_tokens == (len(values) > prompt)
    back = Sample.from_dict(json.loads(json.dumps(rewarded.to_dict())))
    assert back == rewarded and back.tokens == tuple(values)


def test_token_storage_is_four_bytes_per_token():
    ids = TokenIds(range(100_000, 104_096))
    assert ids.nbytes / len(ids) == 4 and sys.getsizeof(ids.to_bytes()) < 4 * 4096 + 64
    with pytest.raises(TypeError, match="sequence of numbers"):
        TokenIds("1234")


@given(prompt=st.integers(0, 50), response=st.integers(0, 50))
def test_the_single_turn_mask_is_zeros_then_ones(prompt, response):
    assert LossMask.prompt_response(prompt, response) == LossMask([0.0] * prompt + [1.0] * response)
    with pytest.raises(ValueError, match=">= 0"):
        LossMask.prompt_response(-1, response)
