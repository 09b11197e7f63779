"""Policy losses against naive formulations, plus their properties."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from losses_layouts import packed, padded, random_seqs

from rollouts.losses import Reduction, cispo_loss, gspo_loss, pg_loss, ppo_clip_loss, sft_loss, value_loss


def _batch(seed, b=3, t=6):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone()
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[:, 0] = 0.0
    mask[0, 1] = 1.0
    return logp, old, adv, mask


def _ppo_naive(logp, old, adv, mask, eps_low, eps_high, c):
    ratio = torch.exp(logp - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = torch.max(l1, l2)
    if c is not None:
        loss = torch.where(adv < 0, torch.min(loss, -adv * c), loss)
    return (loss * mask).sum() / mask.sum()


@pytest.mark.parametrize(("eps_low", "eps_high", "c"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.28, 1.5)])
def test_ppo_matches_naive(eps_low, eps_high, c):
    logp, old, adv, mask = _batch(0)
    ours, metrics = ppo_clip_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, dual_clip_c=c)
    ref = _ppo_naive(logp, old, adv, mask, eps_low, eps_high, c)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0])
    ratio = torch.exp(logp - old).detach()
    sel = mask > 0
    assert float(metrics["clip_frac_high"]) == pytest.approx(
        (((ratio > 1 + eps_high) & (adv > 0))[sel]).double().mean().item()
    )
    assert float(metrics["clip_frac_low"]) == pytest.approx(
        (((ratio < 1 - eps_low) & (adv < 0))[sel]).double().mean().item()
    )
    assert float(metrics["ratio_max"]) == pytest.approx(ratio[sel].max().item())
    assert float(metrics["approx_kl"]) == pytest.approx((old - logp)[sel].mean().item())
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert ("dual_clip_frac" in metrics) == (c is not None)


def test_ppo_is_weights_scale_each_token():
    logp, old, adv, mask = _batch(1)
    w = torch.rand(logp.shape, dtype=torch.float64)
    ours, _ = ppo_clip_loss(logp, old, adv, mask, is_weights=w, reduction=Reduction(mode="token-sum"))
    ratio = torch.exp(logp - old)
    ref = (torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * w * mask).sum()
    torch.testing.assert_close(ours, ref)


def test_ppo_log_ratio_is_clamped():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1000.0]])
    loss, metrics = ppo_clip_loss(logp, old, -torch.ones(1, 2), torch.ones(1, 2))
    assert torch.isfinite(loss) and float(metrics["ratio_max"]) == pytest.approx(float(torch.exp(torch.tensor(20.0))))


def _gspo_naive(logp, old, adv, mask, eps_low, eps_high):
    """GSPO on padded rows, one sequence per row, seq-mean-token-mean."""
    sel = (mask > 0).double()
    seq_log = ((logp - old) * sel).sum(-1) / sel.sum(-1)
    s = torch.exp(seq_log.detach()[:, None] + logp - logp.detach())
    loss = torch.max(-adv * s, -adv * torch.clamp(s, 1 - eps_low, 1 + eps_high))
    return ((loss * mask).sum(-1) / mask.sum(-1)).mean()


def test_gspo_matches_naive_and_packs():
    logp, old, adv, mask = _batch(2)
    ours, _ = gspo_loss(logp, old, adv, mask, eps_low=0.05, eps_high=0.1)
    ref = _gspo_naive(logp, old, adv, mask, 0.05, 0.1)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0])


def _verl_gspo(logp, old, adv, mask, eps_low, eps_high):
    """verl's compute_policy_loss_gspo on padded rows: the sequence log-ratio clamped above at 10, not below."""
    sel = (mask > 0).double()
    seq_log = ((logp - old) * sel).sum(-1) / sel.sum(-1)
    s = torch.exp(torch.clamp(seq_log.detach()[:, None] + logp - logp.detach(), max=10.0))
    loss = torch.max(-adv * s, -adv * torch.clamp(s, 1 - eps_low, 1 + eps_high))
    return ((loss * mask).sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("shift", [15.0, 10.5, -25.0, 0.3])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gspo_clamps_the_sequence_log_ratio_as_verl(shift, sign):
    """Mean log-ratio 15 with a negative advantage: verl's clamp at 10 gives e^10, not e^15."""
    logp, old, adv, mask = _batch(5)
    old = old - shift  # every row's mean log-ratio moves by `shift`
    ours, _ = gspo_loss(logp, old, sign * adv.abs(), mask)
    ref = _verl_gspo(logp, old, sign * adv.abs(), mask, 3e-4, 4e-4)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0])


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(2, 7), min_size=1, max_size=4), pad=st.integers(0, 2))
def test_gspo_packed_equals_padded(seed, lengths, pad):
    seqs = random_seqs(seed, lengths)
    results = []
    for layout in (padded(seqs), packed(seqs, pad=pad)):
        logp = layout["logprobs"].clone().requires_grad_()
        loss, _ = gspo_loss(
            logp,
            layout["old_logprobs"],
            layout["advantages"],
            layout["loss_mask"],
            eps_low=0.05,
            eps_high=0.1,
            reduction=Reduction(segment_ids_B_T=layout["segment_ids"]),
        )
        (grad,) = torch.autograd.grad(loss, logp)
        seg = layout["segment_ids"]
        results.append((loss, grad[seg >= 0]))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


def test_cispo_and_pg_match_naive():
    logp, old, adv, mask = _batch(3)
    ours, _ = cispo_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.3)
    w = torch.exp(logp - old).detach().clamp(0.9, 1.3)
    ref = (-w * adv * logp * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0])
    ours, _ = pg_loss(logp, adv, mask, reduction=Reduction(mode="seq-mean-token-sum"))
    torch.testing.assert_close(ours, (-adv * logp * mask).sum(-1).mean())


def test_sft_and_value_loss_match_naive():
    logp, _, _, mask = _batch(4)
    loss, metrics = sft_loss(logp, mask)
    torch.testing.assert_close(loss, -(logp * mask).sum() / mask.sum())
    assert metrics["num_loss_tokens"] == mask.sum().item()
    g = torch.Generator().manual_seed(5)
    v = torch.randn(mask.shape, generator=g, dtype=torch.float64, requires_grad=True)
    old_v, ret = (
        torch.randn(mask.shape, generator=g, dtype=torch.float64),
        torch.randn(mask.shape, generator=g, dtype=torch.float64),
    )
    ours, _ = value_loss(v, old_v, ret, mask, clip_range=0.2)
    clipped = old_v + (v - old_v).clamp(-0.2, 0.2)
    ref = 0.5 * (torch.max((v - ret) ** 2, (clipped - ret) ** 2) * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, ref)
    ours, _ = value_loss(v, old_v, ret, mask, clip_range=None)
    torch.testing.assert_close(ours, 0.5 * (((v - ret) ** 2) * mask).sum() / mask.sum())


def _all_losses(logp, old, adv, mask, mode="token-mean"):
    yield ppo_clip_loss(logp, old, adv, mask, dual_clip_c=3.0, reduction=Reduction(mode=mode))[0]
    yield gspo_loss(logp, old, adv, mask, reduction=Reduction(mode=mode))[0]
    yield cispo_loss(logp, old, adv, mask, reduction=Reduction(mode=mode))[0]
    yield pg_loss(logp, adv, mask, reduction=Reduction(mode=mode))[0]


_logp = st.floats(-20.0, 0.0, allow_nan=False, width=32)


@settings(max_examples=30, deadline=None)
@given(values=st.lists(_logp, min_size=6, max_size=6), mask_bits=st.lists(st.booleans(), min_size=6, max_size=6))
def test_ratio_one_and_zero_advantage_give_zero_loss_and_grad(values, mask_bits):
    logp = torch.tensor(values).reshape(2, 3).requires_grad_()
    mask = torch.tensor(mask_bits, dtype=torch.float32).reshape(2, 3)
    for loss in _all_losses(logp, logp.detach(), torch.zeros(2, 3), mask):
        (grad,) = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0
        assert torch.equal(grad, torch.zeros(2, 3))


@settings(max_examples=40, deadline=None)
@given(
    logp=_logp,
    old=_logp,
    adv=st.floats(-5.0, 5.0, allow_nan=False, width=32),
    eps_low=st.floats(0.0, 0.5),
    eps_high=st.floats(0.0, 0.5),
)
def test_clipping_never_exceeds_unclipped_objective(logp, old, adv, eps_low, eps_high):
    assume(abs(logp - old) < 20.0)
    lp, o, a, m = (torch.tensor([[x]], dtype=torch.float64) for x in (logp, old, adv, 1.0))
    loss, _ = ppo_clip_loss(lp, o, a, m, eps_low=eps_low, eps_high=eps_high)
    unclipped = (-a * torch.exp(lp - o)).item()
    # the loss is minus the objective: the clipped objective is a pessimistic (lower) bound
    assert loss.item() >= unclipped - 1e-9 * max(1.0, abs(unclipped))


@settings(max_examples=30, deadline=None)
@given(
    values=st.lists(st.floats(-50.0, 0.0, allow_nan=False, width=32), min_size=12, max_size=12),
    adv=st.floats(-10.0, 10.0, allow_nan=False, width=32),
    masked_row=st.integers(0, 1),
)
def test_losses_finite_with_fully_masked_rows(values, adv, masked_row):
    t = torch.tensor(values).reshape(2, 6)
    logp, old = t[:, :3].clone().requires_grad_(), t[:, 3:]
    mask = torch.ones(2, 3)
    mask[masked_row] = 0.0
    advantages = torch.full((2, 3), adv)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        for loss in _all_losses(logp, old, advantages, mask, mode):
            (grad,) = torch.autograd.grad(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), mode
    for loss in _all_losses(logp, old, advantages, torch.zeros(2, 3)):
        assert loss.item() == 0.0


@settings(max_examples=40, deadline=None)
@given(
    poison=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    where=st.sampled_from(["logp", "old", "adv"]),
    mask_bits=st.lists(st.booleans(), min_size=6, max_size=6).filter(any),
    seed=st.integers(0, 2**16),
)
def test_non_finite_values_on_masked_tokens_reach_neither_loss_nor_gradient(poison, where, mask_bits, seed):
    """Padding and -inf log-probs sit under a 0 mask: they must not leak (NaN * 0 is NaN)."""
    torch.manual_seed(seed)
    mask = torch.tensor(mask_bits, dtype=torch.float32).reshape(2, 3)
    logp, old, adv = -torch.rand(2, 3) * 3, -torch.rand(2, 3) * 3, torch.randn(2, 3)
    clean = [t.clone() for t in (logp, old, adv)]
    poisoned = {"logp": logp, "old": old, "adv": adv}
    poisoned[where] = torch.where(mask > 0, poisoned[where], torch.tensor(poison))
    for mode in ("token-mean", "seq-mean-token-mean"):
        lp_clean = clean[0].clone().requires_grad_()
        lp_poisoned = poisoned["logp"].clone().requires_grad_()
        expected = _all_losses(lp_clean, clean[1], clean[2], mask, mode)
        got = _all_losses(lp_poisoned, poisoned["old"], poisoned["adv"], mask, mode)
        for want, have in zip(expected, got, strict=True):
            (g_want,) = torch.autograd.grad(want, lp_clean)
            (g_have,) = torch.autograd.grad(have, lp_poisoned)
            torch.testing.assert_close(have, want)
            torch.testing.assert_close(g_have, g_want * mask)


def test_bad_options_raise():
    logp, old, adv, mask = _batch(6)
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(logp, old, adv, mask, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(logp, old, adv, mask, eps_low=-0.1)
    with pytest.raises(ValueError, match="one shape"):
        pg_loss(logp, adv[:, :2], mask)


@pytest.mark.parametrize("eps_low", [1.0, 10.0])
def test_cispo_eps_low_of_one_or_more_means_no_lower_clip(eps_low):
    """verl's CISPO example sets clip_ratio_low = 10: the weight is clipped above only. rollouts
    raised ("eps_low must be in [0, 1)")."""
    logp, old, adv, mask = _batch(7)
    old = old + 2.0  # ratios far below 1, where a lower clip would bind
    ours, metrics = cispo_loss(logp, old, adv, mask, eps_low=eps_low, eps_high=0.28)
    weight = torch.clamp(torch.exp(logp - old), max=1.28).detach()
    ref = -(weight * adv * logp * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, ref)
    assert metrics["clip_frac_low"] == 0.0


def _verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    """verl's ``core_algos.compute_value_loss`` transcribed (its ``agg_loss`` for three modes)."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    loss_mat = torch.max(vf_losses1, vf_losses2)
    if loss_agg_mode == "token-mean":
        agg = (loss_mat * response_mask).sum() / response_mask.sum()
    elif loss_agg_mode == "seq-mean-token-sum":
        agg = (loss_mat * response_mask).sum(-1).mean()
    else:
        agg = ((loss_mat * response_mask).sum(-1) / response_mask.sum(-1)).mean()
    clipfrac = (torch.gt(vf_losses2, vf_losses1).double() * response_mask).sum() / response_mask.sum()
    return 0.5 * agg, clipfrac


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 10_000),
    clip=st.floats(0.01, 2.0),
    mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
)
def test_value_loss_matches_verl_compute_value_loss(seed, clip, mode):
    """Loss, clip fraction and gradient equal verl's critic loss for the shared aggregation modes."""
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 7
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    v = (2 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_()
    old_v = v.detach() + torch.randn(b, t, generator=g, dtype=torch.float64)
    ret = 2 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ours, metrics = value_loss(v, old_v, ret, mask, clip_range=clip, reduction=Reduction(mode=mode))
    (grad_ours,) = torch.autograd.grad(ours, v)
    ref, ref_clipfrac = _verl_compute_value_loss(v, ret, old_v, mask, clip, mode)
    (grad_ref,) = torch.autograd.grad(ref, v)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)
    # The metric averages a float32 0/1 indicator: a count over <= 28 tokens, exact up to float32 rounding.
    assert float(metrics["vf_clip_frac"]) == pytest.approx(ref_clipfrac.item(), rel=2**-23)
