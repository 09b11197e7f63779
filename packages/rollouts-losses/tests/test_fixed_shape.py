"""The fixed-shape forms the losses use so that nothing waits for the device (Clip-Cov / KL-Cov picks, the
high-entropy quantile, a division by a host count) against the plain forms that read device values on
the host: torch.topk with k read out, torch.quantile of the boolean-indexed entries, torch.as_tensor.
Where both compute the same arithmetic they must agree bit for bit."""

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollouts.losses import high_entropy_mask
from rollouts.losses.aggregate import safe_divide
from rollouts.losses.correction import _masked_quantile
from rollouts.losses.policy_variants import _num_picked, _top_k_mask

_SMALL = st.integers(1, 24)


def _topk_reference(scores_N, eligible_N, k):
    """The (at most) k eligible positions with the largest scores, ties to the earlier position, from a loop."""
    ranked = sorted((i for i in range(len(scores_N)) if eligible_N[i]), key=lambda i: (-scores_N[i], i))
    return {i for i in ranked[:k]}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=1, max_size=40),
    st.integers(0, 45),
    st.integers(1, 4),
)
def test_top_k_mask_picks_the_k_largest_eligible_scores_ties_to_the_earlier(entries, k, rows):
    """Small integer scores, so ties are common; any number of rows, one flat order (row-major)."""
    assume(len(entries) % rows == 0)
    scores = torch.tensor([float(s) for s, _ in entries]).reshape(rows, -1)
    eligible = torch.tensor([e for _, e in entries]).reshape(rows, -1)
    picked = _top_k_mask(scores, eligible, torch.tensor(k))
    assert picked.shape == scores.shape and picked.dtype == torch.bool
    expected = _topk_reference([s for s, _ in entries], [e for _, e in entries], k)
    assert set(picked.reshape(-1).nonzero().flatten().tolist()) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.integers(0, 310))
def test_top_k_mask_equals_torch_topk_on_distinct_scores(n, seed, eligible_frac, k):
    """Distinct scores (a random permutation): the same set as torch.topk of the eligible scores, k read out."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randperm(n, generator=g).float().reshape(1, n)
    eligible = torch.rand(1, n, generator=g) < eligible_frac
    expected = torch.zeros(n, dtype=torch.bool)
    k_host = min(k, int(eligible.sum()))
    expected[torch.topk(torch.where(eligible, scores, -torch.inf).reshape(-1), k_host).indices] = True
    assert torch.equal(_top_k_mask(scores, eligible, torch.tensor(k)).reshape(-1), expected)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.floats(1e-6, 1.0, exclude_min=True))
def test_num_picked_is_verls_count_as_a_device_tensor(num_tokens, fraction):
    """max(1, int(fraction x n)) in Python floats, 0 without loss tokens; the product is float64 on both sides."""
    mask = torch.zeros(num_tokens + 3)
    mask[:num_tokens] = 1.0
    expected = 0 if num_tokens == 0 else max(1, int(fraction * num_tokens))
    count = _num_picked(mask.reshape(1, -1), fraction)
    assert count.dim() == 0 and count.dtype == torch.int64 and int(count) == expected


def _quantile_reference(entropy_B_T, mask_B_T, top_quantile):
    """high_entropy_mask from torch.quantile of the boolean-indexed loss tokens (reads the device)."""
    selected = mask_B_T > 0
    if not bool(selected.any()):
        return torch.zeros_like(mask_B_T, dtype=entropy_B_T.dtype)
    threshold = torch.quantile(entropy_B_T[selected].float(), 1.0 - top_quantile)
    return (selected & (entropy_B_T.float() >= threshold)).to(entropy_B_T.dtype)


_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4),
    width=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    keep=st.sampled_from([0.0, 0.05, 0.5, 0.9, 1.0]),
    levels=st.sampled_from([0, 3, 1000]),
    top_quantile=st.one_of(st.floats(1e-3, 1.0), st.sampled_from([0.2, 0.5, 1.0])),
    dtype=_DTYPES,
)
def test_high_entropy_mask_equals_the_torch_quantile_reference(rows, width, seed, keep, levels, top_quantile, dtype):
    """All-masked, single-token and full batches (keep 0 / 0.05 / 1), with ties (levels 3: entropies in
    {0, 1, 2}) or not (levels 0: continuous), in float32, float64 and bf16: bit-equal masks."""
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(rows, width, generator=g, dtype=torch.float64) * 5
    if levels:
        entropy = torch.floor(entropy / 5 * levels)
    entropy = entropy.to(dtype)
    mask = (torch.rand(rows, width, generator=g) < keep).to(dtype)
    expected = _quantile_reference(entropy, mask, top_quantile)
    ours = high_entropy_mask(entropy, mask, top_quantile=top_quantile)
    assert ours.dtype == expected.dtype and torch.equal(ours, expected)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=30),
    st.integers(0, 2**32 - 1),
    st.floats(0.0, 1.0),
    st.booleans(),
)
def test_masked_quantile_is_torch_quantile_bit_for_bit(values, seed, q, with_nan):
    """The threshold itself, infinities and NaN included (torch.quantile is NaN when an entry is NaN)."""
    x = torch.tensor(values, dtype=torch.float32)
    selected = torch.rand(len(values), generator=torch.Generator().manual_seed(seed)) < 0.7
    assume(bool(selected.any()))
    if with_nan:
        x[int(selected.nonzero()[0])] = math.nan
    x[~selected] = -math.inf  # what was left out must not matter
    expected = torch.quantile(x[selected], q)
    ours = _masked_quantile(x, selected, q)
    assert ours.dim() == 0
    assert torch.equal(ours, expected) or (math.isnan(float(ours)) and math.isnan(float(expected)))


def test_masked_quantile_without_entries_is_nan_and_the_mask_empty():
    x = torch.tensor([0.5, -1.0, 2.0])
    assert math.isnan(float(_masked_quantile(x, torch.zeros(3, dtype=torch.bool), 0.3)))
    assert high_entropy_mask(x.reshape(1, 3), torch.zeros(1, 3), top_quantile=0.5).sum() == 0
    assert high_entropy_mask(torch.zeros(0, 4), torch.zeros(0, 4), top_quantile=0.5).shape == (0, 4)


@settings(max_examples=300, deadline=None)
@given(
    numerator=st.floats(-1e6, 1e6),
    denominator=st.one_of(st.integers(0, 10**7), st.floats(0.0, 1e7), st.sampled_from([0, 0.0, 3, 7.0, 1e-3])),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_safe_divide_by_a_host_number_equals_dividing_by_its_tensor(numerator, denominator, dtype):
    """A host number is filled in on the device (torch.full) rather than copied in (torch.as_tensor): the
    same value in the numerator's dtype, so the same quotient."""
    num = torch.tensor(numerator, dtype=dtype)
    as_tensor = torch.as_tensor(denominator, dtype=dtype)
    expected = torch.where(as_tensor != 0, num / torch.where(as_tensor != 0, as_tensor, 1.0), 0.0)
    ours = safe_divide(num, denominator)
    assert ours.dtype == dtype and (torch.equal(ours, expected) or bool(ours.isnan() & expected.isnan()))
