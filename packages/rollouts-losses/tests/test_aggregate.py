"""aggregate: verl's agg_loss formulas, packed == padded, micro-batches summed == one batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import packed, padded, random_seqs

from rollouts.losses import AGGREGATION_MODES, aggregate


def _verl_agg_loss(loss, mask, mode, loss_scale_factor=None):
    """verl's agg_loss (verl/trainer/ppo/core_algos.py) written out naively for padded rows in one
    micro-batch, sequences without a loss token not counted in any seq-mean mode; except
    seq-mean-token-sum-norm, which is TRL's dr_grpo here: the mean over sequences of each sequence's
    token sum divided by the constant (default: the padded length). verl's divides the summed
    sequence losses by the constant only (`_verl_seq_mean_token_sum_norm`)."""
    counted = [i for i in range(loss.shape[0]) if mask[i].sum() > 0]
    sums = [float((loss[i] * mask[i]).sum()) for i in counted]
    if mode == "token-mean":
        return sum(sums) / float(mask.sum())
    if mode == "token-sum":
        return sum(sums)
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(counted)
    if mode == "seq-mean-token-mean":
        return sum(s / float(mask[i].sum()) for s, i in zip(sums, counted, strict=True)) / len(counted)
    factor = loss.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return sum(s / factor for s in sums) / len(counted)


def _trl_dr_grpo(loss, mask, max_completion_length):
    """TRL's GRPO loss_type="dr_grpo": (per_token_loss * mask).sum() / (batch_size * max_completion_length)."""
    return float((loss * mask).sum()) / (loss.shape[0] * max_completion_length)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_matches_verl_on_padded_rows(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 9, generator=g) > 0.4).double()
    mask[:, 1] = 1.0  # every row has a token here; rows without one: the next test
    assert aggregate(loss, mask, mode).item() == pytest.approx(_verl_agg_loss(loss, mask, mode), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 6),
    width=st.integers(1, 9),
    mode=st.sampled_from(AGGREGATION_MODES),
    empty_rows=st.sets(st.integers(0, 5)),
    norm=st.one_of(st.none(), st.floats(1.0, 64.0)),
)
def test_rows_without_loss_tokens_are_not_sequences_of_the_mean(seed, rows, width, mode, empty_rows, norm):
    """A sample fully masked (overlong filtering, a tool-only turn) is left out of the sequence count,
    in every seq-mean mode, locally and in a step-wide num_sequences counted the same way."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, width, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, width, generator=g) > 0.3).double()
    for r in empty_rows:
        if r < rows:
            mask[r] = 0.0
    if not bool(mask.sum()):
        return  # nothing to count: the zero case has its own test
    expected = _verl_agg_loss(loss, mask, mode, norm if mode == "seq-mean-token-sum-norm" else None)
    kwargs = {"norm_constant": norm} if mode == "seq-mean-token-sum-norm" else {}
    assert aggregate(loss, mask, mode, **kwargs).item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    num_sequences = int((mask.sum(-1) > 0).sum())
    got = aggregate(loss, mask, mode, num_sequences=num_sequences, num_tokens=int(mask.sum()), **kwargs)
    assert got.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_dr_grpo_equals_trl_and_keeps_the_one_over_g():
    """Dr.GRPO: TRL's dr_grpo divides the token sum by batch_size * max_completion_length; rollouts
    divided by the constant only (B times larger, which changed what gradient clipping did)."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(8, 16, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 16, generator=g) > 0.5).double()
    mask[:, 0] = 1.0
    got = aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=16.0)
    assert got.item() == pytest.approx(_trl_dr_grpo(loss, mask, 16), rel=1e-12)
    assert got.item() == pytest.approx(float((loss * mask).sum()) / 16.0 / 8, rel=1e-12)


def _verl_seq_mean_token_sum_norm(loss, mask, loss_scale_factor):
    """verl agg_loss "seq-mean-token-sum-norm": the sum over sequences of their token sums / the constant."""
    return float((loss * mask).sum()) / loss_scale_factor


def test_seq_mean_token_sum_norm_is_verls_divided_by_the_number_of_sequences():
    """The README's table: this mode follows TRL's dr_grpo; verl's is num_sequences times larger."""
    g = torch.Generator().manual_seed(4)
    loss = torch.randn(8, 16, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 16, generator=g) > 0.5).double()
    mask[[1, 6]] = 0.0  # two sequences without loss tokens: not counted
    got = aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=16.0).item()
    assert got * 6 == pytest.approx(_verl_seq_mean_token_sum_norm(loss, mask, 16.0), rel=1e-12)
    assert aggregate(loss, mask, "token-sum").item() / 16.0 == pytest.approx(got * 6, rel=1e-12)  # verl's, by hand


def test_norm_constant_replaces_t():
    loss, mask = torch.ones(2, 5), torch.ones(2, 5)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_constant=20.0).item() == pytest.approx(0.25)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.0)


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
    num_sequences = sum(1 for q in seqs if bool((q["loss_mask"] > 0).any()))  # as StepPlan counts them
    opts = {"num_tokens": num_tokens, "num_sequences": num_sequences, "norm_constant": 8.0}
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
