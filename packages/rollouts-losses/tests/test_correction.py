"""Rejection masks, the off-policy sequence mask, the high-entropy mask and the off-policy diagnostics
against plain per-sequence loops in float64, on padded and packed rows."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import packed, padded, random_seqs

from rollouts.losses import (
    high_entropy_mask,
    metrics_to_floats,
    off_policy_diagnostics,
    off_policy_sequence_mask,
    rejection_mask,
)


def _loss_tokens(seq):
    return [i for i in range(len(seq["loss_mask"])) if seq["loss_mask"][i] > 0]


def _stat(log_r, estimator):
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": math.exp(log_r) - 1.0 - log_r}[estimator]


def _naive_keep(seqs, estimator, level, low, high):
    """Per sequence, the list of keep flags of every position, from loops."""
    out = []
    for s in seqs:
        idx = _loss_tokens(s)
        stats = {i: _stat(float(s["old_logprobs"][i] - s["rollout_logprobs"][i]), estimator) for i in idx}
        if level != "token" and idx:
            values = list(stats.values())
            seq_stat = {"seq_sum": sum(values), "seq_mean": sum(values) / len(values), "seq_max": max(values)}[level]
            stats = dict.fromkeys(idx, seq_stat)
        inside = {i: (low is None or v >= low) and (high is None or v <= high) for i, v in stats.items()}
        out.append([1.0 if inside.get(i, False) else 0.0 for i in range(len(s["loss_mask"]))])
    return out


def _per_seq(x_B_T, batch, n):
    return [x_B_T[batch["segment_ids"] == i] for i in range(n)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    estimator=st.sampled_from(["k1", "k2", "k3"]),
    level=st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"]),
    bounds=st.sampled_from([(None, 0.05), (-0.05, None), (-0.1, 0.1), (0.001, 0.2)]),
    layout=st.sampled_from([padded, packed]),
)
def test_rejection_mask_matches_naive_loops(seed, lengths, estimator, level, bounds, layout):
    seqs = random_seqs(seed, lengths)
    batch = layout(seqs)
    keep, metrics = rejection_mask(
        batch["old_logprobs"],
        batch["rollout_logprobs"],
        batch["loss_mask"],
        estimator=estimator,
        level=level,
        low=bounds[0],
        high=bounds[1],
        segment_ids_B_T=batch["segment_ids"],
    )
    naive = _naive_keep(seqs, estimator, level, *bounds)
    for ours, ref in zip(_per_seq(keep, batch, len(seqs)), naive, strict=True):
        assert ours.tolist() == ref
    assert ((keep == 0) | (batch["loss_mask"] > 0)).all()  # 0 off the loss mask
    num_loss = sum(len(_loss_tokens(s)) for s in seqs)
    rejected = sum(len(_loss_tokens(s)) - sum(k) for s, k in zip(seqs, naive, strict=True))
    assert float(metrics["rs_masked_frac"]) == pytest.approx(rejected / num_loss if num_loss else 0.0)


def test_rejection_bounds_are_two_sided_for_every_estimator():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[0.0, -0.5, 0.5]], dtype=torch.float64)  # log r = 0, 0.5, -0.5
    mask = torch.ones(1, 3, dtype=torch.float64)
    keep, _ = rejection_mask(old, rollout, mask, estimator="k1", level="token", low=-0.1, high=0.1)
    assert keep.tolist() == [[1.0, 0.0, 0.0]]  # k1 = -log r = 0, -0.5, 0.5: both sides rejected
    keep, _ = rejection_mask(old, rollout, mask, estimator="k3", level="token", low=0.01)
    assert keep.tolist() == [[0.0, 1.0, 1.0]]  # a lower bound on k3 rejects the on-policy token


def test_rejection_ignores_poison_off_the_mask():
    old = torch.tensor([[0.0, -torch.inf, torch.nan]])
    rollout = torch.tensor([[-0.1, 0.0, 0.0]])
    keep, metrics = rejection_mask(
        old, rollout, torch.tensor([[1.0, 0.0, 0.0]]), estimator="k3", level="seq_sum", high=1.0
    )
    assert keep.tolist() == [[1.0, 0.0, 0.0]] and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"estimator": "k4", "level": "token", "high": 1.0}, "estimator"),
        ({"estimator": "k1", "level": "seq", "high": 1.0}, "level"),
        ({"estimator": "k1", "level": "token"}, "low or high"),
        ({"estimator": "k1", "level": "token", "low": 1.0, "high": 0.5}, "low"),
    ],
)
def test_rejection_refuses_bad_rules(kw, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        rejection_mask(x, x, torch.ones(1, 2), **kw)


@pytest.mark.parametrize("layout", [padded, packed])
def test_off_policy_sequence_mask_matches_naive(layout):
    seqs = random_seqs(9, [6, 4, 8, 5, 7])
    seqs[0]["advantages"] = -seqs[0]["advantages"].abs()  # make sure a negative sequence exists
    batch = layout(seqs)
    threshold = 0.02
    keep, _ = off_policy_sequence_mask(
        batch["logprobs"],
        batch["rollout_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        threshold=threshold,
        segment_ids_B_T=batch["segment_ids"],
    )
    dropped = []
    for s, ours in zip(seqs, _per_seq(keep, batch, len(seqs)), strict=True):
        idx = _loss_tokens(s)
        kl = sum(float(s["rollout_logprobs"][i] - s["logprobs"][i]) for i in idx) / max(len(idx), 1)
        adv = sum(float(s["advantages"][i]) for i in idx) / max(len(idx), 1)
        drop = adv < 0 and kl > threshold
        dropped.append(drop)
        assert ours.tolist() == [0.0 if drop or i not in idx else 1.0 for i in range(len(s["loss_mask"]))]
    assert any(dropped) and not all(dropped)  # both outcomes exercised


def test_high_entropy_mask_keeps_the_top_quantile():
    g = torch.Generator().manual_seed(0)
    entropy = torch.rand(4, 50, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 50, generator=g) > 0.2).double()
    keep = high_entropy_mask(entropy, mask, top_quantile=0.2)
    values = sorted(entropy[mask > 0].tolist())
    position = 0.8 * (len(values) - 1)  # torch.quantile's linear interpolation
    low, frac = values[math.floor(position)], position - math.floor(position)
    threshold = low + frac * (values[math.ceil(position)] - low)
    expected = ((entropy >= threshold) & (mask > 0)).double()
    assert torch.equal(keep, expected)
    assert float(keep.sum()) == pytest.approx(0.2 * len(values), abs=1.0)
    assert torch.equal(high_entropy_mask(entropy, mask, top_quantile=1.0), mask)
    assert high_entropy_mask(entropy, torch.zeros_like(mask), top_quantile=0.5).sum() == 0
    with pytest.raises(ValueError, match="top_quantile"):
        high_entropy_mask(entropy, mask, top_quantile=0.0)


def _naive_diagnostics(seqs):
    tokens = [(s, i) for s in seqs for i in _loss_tokens(s)]
    log_r = [float(s["old_logprobs"][i] - s["rollout_logprobs"][i]) for s, i in tokens]
    seq_log_w = [
        sum(float(s["old_logprobs"][i] - s["rollout_logprobs"][i]) for i in _loss_tokens(s))
        for s in seqs
        if _loss_tokens(s)
    ]
    w = [math.exp(x) for x in log_r]
    sw = [math.exp(x) for x in seq_log_w]
    return {
        "offpolicy_kl_k1": sum(-x for x in log_r) / len(log_r),
        "offpolicy_kl_k3": sum(math.exp(x) - 1 - x for x in log_r) / len(log_r),
        "offpolicy_logprob_abs_diff": sum(abs(x) for x in log_r) / len(log_r),
        "offpolicy_logprob_abs_diff_max": max(abs(x) for x in log_r),
        "offpolicy_log_ppl_diff": sum(
            -x / len(_loss_tokens(s)) for s, x in zip([s for s in seqs if _loss_tokens(s)], seq_log_w, strict=True)
        )
        / len(seq_log_w),
        "offpolicy_chi2_token": sum(x * x for x in w) / len(w) - 1,
        "offpolicy_chi2_seq": sum(x * x for x in sw) / len(sw) - 1,
        "offpolicy_ess_token": sum(w) ** 2 / (len(w) * sum(x * x for x in w)),
        "offpolicy_ess_seq": sum(sw) ** 2 / (len(sw) * sum(x * x for x in sw)),
    }


@pytest.mark.parametrize("layout", [padded, packed])
def test_off_policy_diagnostics_match_naive(layout):
    seqs = random_seqs(12, [6, 4, 8, 5])
    batch = layout(seqs)
    ours = off_policy_diagnostics(
        batch["old_logprobs"], batch["rollout_logprobs"], batch["loss_mask"], segment_ids_B_T=batch["segment_ids"]
    )
    ref = _naive_diagnostics(seqs)
    assert metrics_to_floats(ours) == pytest.approx(ref, rel=1e-9)  # float64 on both sides, sums in different orders
    assert 0.0 < ours["offpolicy_ess_seq"] < ours["offpolicy_ess_token"] <= 1.0


def test_on_policy_diagnostics_are_ideal():
    batch = padded(random_seqs(13, [5, 7]))
    ours = off_policy_diagnostics(batch["old_logprobs"], batch["old_logprobs"], batch["loss_mask"])
    assert ours["offpolicy_ess_token"] == 1.0 and ours["offpolicy_ess_seq"] == 1.0
    assert ours["offpolicy_chi2_token"] == 0.0 and ours["offpolicy_kl_k3"] == 0.0
    empty = off_policy_diagnostics(
        batch["old_logprobs"], batch["rollout_logprobs"], torch.zeros_like(batch["loss_mask"])
    )
    assert empty["offpolicy_ess_token"] == 1.0 and empty["offpolicy_chi2_seq"] == 0.0


def _verl_offpolicy(old, rollout, mask, threshold):
    """verl's rollout-correction metrics on padded rows (rollout_corr_helper.py), written out from its formulas:
    log-ppl difference and sequence chi-square averaged over all rows, ESS of weights clamped to
    [1/threshold, threshold], the sequence ESS over tokens (each sequence's weight on each of its tokens)."""
    log_r = torch.where(mask > 0, old - rollout, 0.0)
    count = mask.sum(-1)
    log_ppl = torch.where(count > 0, -log_r.sum(-1) / count.clamp(min=1), 0.0)
    seq_w = torch.exp(log_r.sum(-1))

    def ess(w_B_T):
        w = w_B_T.clamp(1 / threshold, threshold)
        mean = (w * mask).sum() / mask.sum()
        return 1.0 / (((w / mean) ** 2 * mask).sum() / mask.sum())

    return {
        "offpolicy_log_ppl_diff": log_ppl.mean().item(),
        "offpolicy_chi2_seq": (seq_w**2).mean().item() - 1.0,
        "offpolicy_ess_token": ess(torch.exp(log_r)).item(),
        "offpolicy_ess_seq": ess(seq_w[:, None].expand_as(mask)).item(),
    }


def test_off_policy_diagnostics_keep_their_departures_from_verl():
    """Kept departures (module docstring, README): sequences without loss tokens are not averaged over,
    the ESS uses the raw weights, and the sequence ESS counts each sequence once."""
    g = torch.Generator().manual_seed(21)
    rollout = -torch.rand(8, 6, generator=g, dtype=torch.float64) * 3
    old = rollout + 0.8 * torch.randn(8, 6, generator=g, dtype=torch.float64)  # weights well outside [1/2, 2]
    mask = (torch.rand(8, 6, generator=g) > 0.3).double()
    mask[:, 1] = 1.0
    mask[[2, 5]] = 0.0  # two empty rows of eight
    ours = off_policy_diagnostics(old, rollout, mask)
    seqs = [{"old_logprobs": old[i], "rollout_logprobs": rollout[i], "loss_mask": mask[i]} for i in range(8)]
    documented = _naive_diagnostics(seqs)
    verl = _verl_offpolicy(old, rollout, mask, threshold=2.0)
    for name in verl:
        assert float(ours[name]) == pytest.approx(documented[name], rel=1e-9)
        assert float(ours[name]) != pytest.approx(verl[name], rel=1e-2)
    assert float(ours["offpolicy_log_ppl_diff"]) == pytest.approx(verl["offpolicy_log_ppl_diff"] * 8 / 6, rel=1e-9)
