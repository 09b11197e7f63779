"""aggregate: verl's agg_loss formulas, packed == padded, micro-batches summed == one batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import packed, padded, random_seqs

from rollouts.losses import AGGREGATION_MODES, aggregate


def _verl_agg_loss(loss, mask, mode):
    """verl's agg_loss, written out as in verl/trainer/ppo/core_algos.py (padded rows)."""
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum()
    if mode == "token-sum":
        return (loss * mask).sum()
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1)).mean()
    return (loss * mask).sum(-1).sum() / mask.shape[-1]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_matches_verl_on_padded_rows(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=g) > 0.4).double()
    mask[:, 1] = 1.0  # every row has a token, as verl's formulas assume
    torch.testing.assert_close(aggregate(loss, mask, mode), _verl_agg_loss(loss, mask, mode))


def test_norm_constant_replaces_t():
    loss, mask = torch.ones(2, 5), torch.ones(2, 5)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=20.0).item() == pytest.approx(0.5)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(2.0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_fully_masked_gives_zero_not_nan(mode):
    loss = torch.full((3, 4), float("nan")).requires_grad_()
    out = aggregate(loss, torch.zeros(3, 4), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(3, 4))
    seg = torch.full((1, 4), -1)
    assert aggregate(torch.zeros(1, 4), torch.zeros(1, 4), mode, segment_ids_B_T=seg).item() == 0.0


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(1, 8), min_size=1, max_size=5),
    mode=st.sampled_from(AGGREGATION_MODES),
    pad=st.integers(0, 3),
)
def test_packed_equals_padded(seed, lengths, mode, pad):
    seqs = random_seqs(seed, lengths)
    a, b = padded(seqs), packed(seqs, pad=pad)
    ref = aggregate(a["logprobs"], a["loss_mask"], mode)
    with_seg = aggregate(a["logprobs"], a["loss_mask"], mode, segment_ids_B_T=a["segment_ids"])
    ours = aggregate(b["logprobs"], b["loss_mask"], mode, segment_ids_B_T=b["segment_ids"])
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(with_seg, ref)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(1, 8), min_size=2, max_size=6),
    mode=st.sampled_from(AGGREGATION_MODES),
    split=st.integers(1, 5),
)
def test_micro_batches_sum_to_whole_batch(seed, lengths, mode, split):
    seqs = random_seqs(seed, lengths)
    split = min(split, len(seqs) - 1)
    whole = packed(seqs)
    num_tokens = int((whole["loss_mask"] > 0).sum())
    opts = {"num_tokens": num_tokens, "num_sequences": len(seqs), "norm_constant": 8.0}
    # the whole batch with a binary mask: sum(mask) == count of loss tokens
    ref = aggregate(
        whole["logprobs"], whole["loss_mask"], mode, segment_ids_B_T=whole["segment_ids"], norm_constant=8.0
    )
    parts = [packed(seqs[:split]), padded(seqs[split:])]
    total = sum(aggregate(p["logprobs"], p["loss_mask"], mode, segment_ids_B_T=p["segment_ids"], **opts) for p in parts)
    torch.testing.assert_close(total, ref)


def test_bad_arguments_raise():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mode"):
        aggregate(x, x, "mean")
    with pytest.raises(ValueError, match="one shape"):
        aggregate(x, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(x, x, num_tokens=-1)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(x, x, "seq-mean-token-sum-norm", norm_constant=0.0)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="num_tokens=0 for a batch that has loss tokens"):
        aggregate(x, mask, "token-mean", num_tokens=0)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        with pytest.raises(ValueError, match="num_sequences=0 for a batch that has loss tokens"):
            aggregate(x, mask, mode, num_sequences=0)
    # A micro-batch with no loss tokens (a rank's filler) may come with a step count of 0.
    assert aggregate(x, torch.zeros(2, 3), "token-mean", num_tokens=0).item() == 0.0
