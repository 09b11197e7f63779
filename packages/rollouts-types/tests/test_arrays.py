"""The packed per-token arrays: the values round-trip exactly, bad values are named, and a Sample
passes its arrays on through replace without packing or checking them again."""

import array
import copy
import dataclasses
import json
import math
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


@settings(deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=30))
def test_log_probs_keep_python_floats_exactly(values):
    logprobs = LogProbs(values)
    assert logprobs == tuple(values) and logprobs.nbytes == 8 * len(values)
    with pytest.raises(ValueError, match="must be finite"):
        LogProbs([*values, math.nan])


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
