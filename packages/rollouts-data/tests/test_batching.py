"""Padding, packing (best-fit-decreasing), unpacking and the micro-batch planner."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data import best_fit_decreasing, pack_samples, plan_micro_batches, segment_attention_mask, unpack_values
from rollouts.data.batching import pad_batch, sample_arrays, unpack
from rollouts.types import Sample

_F32 = st.floats(-4.0, 4.0, allow_nan=False, width=32)


@st.composite
def samples(draw, max_len=40, rl=None):
    rl = draw(st.booleans()) if rl is None else rl
    out = []
    for i in range(draw(st.integers(1, 10))):
        t = draw(st.integers(2, max_len))
        p = draw(st.integers(1, t - 1))
        tokens = draw(st.lists(st.integers(1, 999), min_size=t, max_size=t))
        mask = [0.0] * p + [float(draw(st.sampled_from([0.0, 1.0, 1.0, 0.5, 2.0]))) for _ in range(t - p)]
        kw = {}
        if rl:
            kw = {"advantage": draw(_F32), "rollout_logprobs": [-abs(draw(_F32)) for _ in range(t - p)]}
        out.append(Sample(tokens=tokens, num_prompt_tokens=p, loss_mask=mask, index=i, **kw))
    return out


EXPECTED_DTYPES = {
    "input_ids": np.int64,
    "position_ids": np.int64,
    "segment_ids": np.int64,
    "attention_mask": np.int64,
    "loss_mask": np.float32,
    "advantages": np.float32,
    "rollout_logprobs": np.float32,
    "sample_indices": np.int64,
    "cu_seqlens": np.int32,
}


def _check_contract(mb):
    arrays = {**mb.token_arrays(), "sample_indices": mb.sample_indices}
    if mb.cu_seqlens is not None:
        arrays["cu_seqlens"] = mb.cu_seqlens
    for k, v in arrays.items():
        assert v.dtype == EXPECTED_DTYPES[k], k
    b, t = mb.input_ids.shape
    for k in ("position_ids", "segment_ids", "attention_mask", "loss_mask"):
        assert getattr(mb, k).shape == (b, t)
    real = mb.attention_mask == 1
    assert np.all(mb.segment_ids[~real] == -1) and np.all(mb.loss_mask[~real] == 0)
    # padding holds the pad id and zeros, never what the (uninitialised) memory held before
    assert np.all(mb.input_ids[~real] == 0) and np.all(mb.position_ids[~real] == 0)
    assert np.all(mb.attention_mask[~real] == 0)
    for name in ("advantages", "rollout_logprobs"):
        if mb.get(name) is not None:
            assert np.all(mb.get(name)[~real] == 0), name
    assert np.all(mb.loss_mask[mb.position_ids == 0] == 0)  # no prediction at a sequence start


def test_pad_batch_layout_and_rl_fields():
    a = Sample(
        tokens=[5, 6, 7, 8], num_prompt_tokens=2, loss_mask=[0, 0, 1, 1], advantage=0.5, rollout_logprobs=[-0.1, -0.2]
    )
    b = Sample(tokens=[9, 10], num_prompt_tokens=1, loss_mask=[0, 1], advantage=-1.0, rollout_logprobs=[-0.3])
    mb = pad_batch([a, b], pad_id=0)
    _check_contract(mb)
    np.testing.assert_array_equal(mb.input_ids, [[5, 6, 7, 8], [9, 10, 0, 0]])
    np.testing.assert_array_equal(mb.position_ids, [[0, 1, 2, 3], [0, 1, 0, 0]])
    np.testing.assert_array_equal(mb.segment_ids, [[0, 0, 0, 0], [1, 1, -1, -1]])
    np.testing.assert_array_equal(mb.loss_mask, [[0, 0, 1, 1], [0, 1, 0, 0]])
    np.testing.assert_array_equal(mb.advantages, np.array([[0.5] * 4, [-1, -1, 0, 0]], dtype=np.float32))
    np.testing.assert_allclose(mb.rollout_logprobs, [[0, 0, -0.1, -0.2], [0, -0.3, 0, 0]], rtol=1e-6)


def test_position_zero_never_trained():
    s = Sample(tokens=[1, 2, 3], num_prompt_tokens=0, loss_mask=[1, 1, 1])
    assert sample_arrays(s)["loss_mask"].tolist() == [0, 1, 1]


def test_mixed_optional_fields_raise():
    a = Sample(tokens=[1, 2], num_prompt_tokens=1, loss_mask=[0, 1], advantage=1.0)
    b = Sample(tokens=[1, 2], num_prompt_tokens=1, loss_mask=[0, 1])
    with pytest.raises(ValueError, match=r"samples\[1\]\.advantage is None"):
        pad_batch([a, b], pad_id=0)


@settings(max_examples=40, deadline=None)
@given(ss=samples(), extra=st.integers(0, 60), multiple=st.sampled_from([1, 8]))
def test_pack_then_unpack_is_identity_and_fits_budget(ss, extra, multiple):
    max_tokens = max(len(s.tokens) for s in ss) + extra
    mbs = pack_samples(ss, max_tokens=max_tokens, pad_to_multiple_of=multiple)
    seen = []
    for mb in mbs:
        _check_contract(mb)
        assert mb.input_ids.shape[0] == 1 and mb.input_ids.shape[1] <= max_tokens
        cu = mb.cu_seqlens
        assert cu[0] == 0 and len(cu) == len(mb.sample_indices) + 1
        seen.extend(mb.sample_indices.tolist())
    assert sorted(seen) == list(range(len(ss)))
    back = unpack(mbs)
    for i, s in enumerate(ss):
        expected = sample_arrays(s, fields=[k for k in ("advantages", "rollout_logprobs") if mbs[0].get(k) is not None])
        for k, v in expected.items():
            np.testing.assert_array_equal(back[i][k], v)
        np.testing.assert_array_equal(back[i]["position_ids"], np.arange(len(s.tokens)))
    # padded layout unpacks to the same arrays
    back_padded = unpack([pad_batch(ss, pad_id=0)])
    for i in range(len(ss)):
        for k in back[i]:
            np.testing.assert_array_equal(back[i][k], back_padded[i][k])


def test_unpack_values_routes_results_to_samples():
    ss = [
        Sample(tokens=list(range(1, n + 1)), num_prompt_tokens=1, loss_mask=[0] + [1] * (n - 1)) for n in (3, 5, 2, 4)
    ]
    mbs = pack_samples(ss, max_tokens=7)
    values = [mb.input_ids.astype(np.float32) * 10 for mb in mbs]  # stand-in for per-token log-probs
    out = unpack_values(mbs, values)
    for i, s in enumerate(ss):
        np.testing.assert_array_equal(out[i], np.asarray(s.tokens, dtype=np.float32) * 10)


def _optimal_bins(lengths, capacity):
    """Brute force: fewest bins over all assignments (tiny inputs only)."""
    best = len(lengths)
    for assign in itertools.product(range(len(lengths)), repeat=len(lengths)):
        loads = [0] * len(lengths)
        for n, b in zip(lengths, assign, strict=True):
            loads[b] += n
        if max(loads) <= capacity:
            best = min(best, sum(1 for x in loads if x))
    return best


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=6), capacity=st.integers(10, 14))
def test_bfd_near_optimal_and_valid(lengths, capacity):
    bins = best_fit_decreasing(lengths, capacity=capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) <= 11 / 9 * _optimal_bins(lengths, capacity) + 6 / 9  # the FFD/BFD worst-case bound
    # any-fit property: no two bins could be merged
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity


def _next_fit_bins(lengths, capacity):
    bins, load = 0, capacity
    for n in lengths:
        if load + n > capacity:
            bins, load = bins + 1, 0
        load += n
    return bins


def test_bfd_wastes_less_than_input_order_on_a_long_tailed_mix():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, size=500), 16, 4096).astype(int).tolist()
    bins = best_fit_decreasing(lengths, capacity=8192)
    waste_bfd = len(bins) * 8192 - sum(lengths)
    waste_naive = _next_fit_bins(lengths, 8192) * 8192 - sum(lengths)
    assert waste_bfd < waste_naive
    assert waste_bfd / (len(bins) * 8192) < 0.05


@settings(max_examples=30, deadline=None)
@given(ss=samples(rl=True), budget_extra=st.integers(0, 80), layout=st.sampled_from(["packed", "padded"]))
def test_plan_counts_give_big_batch_loss(ss, budget_extra, layout):
    max_tokens = max(len(s.tokens) for s in ss) + budget_extra
    plan = plan_micro_batches(ss, max_tokens=max_tokens, layout=layout)
    assert plan.num_sequences == sum(1 for s in ss if s.num_loss_tokens > 0)  # fully masked: not a sequence
    assert plan.num_loss_tokens == sum(int((sample_arrays(s)["loss_mask"] > 0).sum()) for s in ss)
    assert plan.num_tokens == sum(len(s.tokens) for s in ss)
    assert all(mb.input_ids.size <= max_tokens for mb in plan.micro_batches)
    assert plan.num_padding_tokens == sum(mb.input_ids.size for mb in plan.micro_batches) - plan.num_tokens

    # token-mean of a per-token quantity: summed micro-batch parts == one big batch
    def per_token(mb):
        return mb.advantages * mb.input_ids.astype(np.float32) / 1000.0

    accumulated = sum(
        float((per_token(mb) * mb.loss_mask).sum()) / max(plan.num_loss_tokens, 1) for mb in plan.micro_batches
    )
    big = pad_batch(ss, pad_id=0)
    reference = float((per_token(big) * big.loss_mask).sum()) / max(int((big.loss_mask > 0).sum()), 1)
    assert accumulated == pytest.approx(reference, rel=1e-5, abs=1e-6)
    for mb in plan.micro_batches:
        _check_contract(mb)


def test_plan_rejects_oversized_samples():
    s = Sample(tokens=list(range(1, 11)), num_prompt_tokens=1, loss_mask=[0] + [1] * 9)
    for layout in ("packed", "padded"):
        with pytest.raises(ValueError, match="10 tokens > max_tokens 8"):
            plan_micro_batches([s], max_tokens=8, layout=layout)
    with pytest.raises(ValueError, match="layout"):
        plan_micro_batches([s], max_tokens=16, layout="ragged")


def _reference_mask(segment_ids):
    """The rule written out one (query, key) pair at a time."""
    b, t = segment_ids.shape
    out = np.zeros((b, 1, t, t), dtype=bool)
    for r, q, k in itertools.product(range(b), range(t), range(t)):
        same = segment_ids[r, q] == segment_ids[r, k] and segment_ids[r, k] >= 0 and k <= q
        out[r, 0, q, k] = same or q == k
    return out


@settings(max_examples=40, deadline=None)
@given(samples(max_len=12), st.sampled_from(["packed", "padded"]))
def test_segment_attention_mask_matches_reference_and_blocks_cross_sequence_attention(batch, layout):
    plan = plan_micro_batches(batch, max_tokens=48, layout=layout)
    for mb in plan.micro_batches:
        mask = segment_attention_mask(mb.segment_ids)
        np.testing.assert_array_equal(mask, _reference_mask(mb.segment_ids))
        if mb.cu_seqlens is not None:
            cu = mb.cu_seqlens.tolist()
            for a, b in itertools.pairwise(cu):
                block = mask[0, 0, a:b, a:b]
                np.testing.assert_array_equal(block, np.tri(b - a, dtype=bool))  # causal within a sequence
                assert not mask[0, 0, a:b, :a].any()  # nothing packed before it is visible
            # the 2D attention_mask alone would let every later sequence see the earlier ones
            assert len(cu) == 2 or mb.attention_mask[0, cu[1]] == 1


def test_segment_attention_mask_rejects_bad_input():
    with pytest.raises(ValueError, match=r"segment_ids_B_T must be a 2D integer array \[B, T\], got shape \(3,\)"):
        segment_attention_mask(np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="dtype float32"):
        segment_attention_mask(np.zeros((1, 3), dtype=np.float32))
