"""SAPO, GMPO, DPPO, Clip-Cov and KL-Cov against naive per-token loops in float64 (values and gradients),
on padded and packed rows, with step-wide counts and poisoned masked-out inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from losses_layouts import packed, padded, random_seqs

from rollouts.losses import ClipCovPick, Reduction, clip_cov_loss, dppo_loss, gmpo_loss, kl_cov_loss, sapo_loss

# float64 throughout: ours and the loops sum the same terms in different orders, so they agree to
# ~1e-15 relative; torch.testing's float64 default (rtol 1e-7, atol 1e-7) is far looser than that.


def _dppo_token(lp, old, a, divergence, eps_low, eps_high):
    p, p_old = math.exp(lp), math.exp(old)
    if divergence == "tv":
        outside = p - p_old > eps_high if a > 0 else p - p_old < -eps_low
    else:
        kl = p_old * (old - lp) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        outside = (kl > eps_high and p > p_old) if a > 0 else (kl > eps_low and p < p_old)
    return 0.0 if outside else -a * math.exp(lp - old)


def _tokens(seq):
    """[(index, lp tensor element, old, adv)] over a sequence's loss tokens."""
    return [i for i in range(len(seq["loss_mask"])) if seq["loss_mask"][i] > 0]


def _naive(seqs, logps, token_loss, mode):
    """Per-token loss from plain loops, reduced by token-mean or seq-mean-token-mean over the list."""
    per_seq, total, count = [], 0.0, 0
    for s, lp in zip(seqs, logps, strict=True):
        idx = _tokens(s)
        terms = [token_loss(lp[i], float(s["old_logprobs"][i]), float(s["advantages"][i])) for i in idx]
        per_seq.append(sum(terms) / len(idx) if idx else 0.0)
        total, count = total + sum(terms), count + len(idx)
    if mode == "token-mean":
        return total / count if count else 0.0
    return sum(per_seq) / len(seqs)


def _naive_torch(seqs, token_loss, mode):
    """(loss, per-sequence gradients) of the naive loops, each logprob a float64 scalar leaf."""
    logps = [[s["logprobs"][i].clone().requires_grad_() for i in range(len(s["logprobs"]))] for s in seqs]
    math_ops = {"exp": torch.exp, "log": torch.log}
    loss = _naive(seqs, logps, lambda lp, old, a: token_loss(lp, old, a, math_ops), mode)
    loss = torch.as_tensor(loss, dtype=torch.float64)
    leaves = [x for row in logps for x in row if x.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    flat = [torch.zeros((), dtype=torch.float64) if g is None else g for g in grads]
    out, k = [], 0
    for s in seqs:
        n = len(s["logprobs"])
        out.append(torch.stack(flat[k : k + n]) if n else torch.zeros(0, dtype=torch.float64))
        k += n
    return loss, out


def _sapo_torch(lp, old, a, ops):
    tau = 1.0 if a > 0 else 1.05
    r = ops["exp"](lp - old)
    return -a * (4.0 / tau) * torch.sigmoid(tau * (r - 1.0))


def _dppo_torch(divergence, eps_low, eps_high):
    def f(lp, old, a, ops):
        zero = _dppo_token(float(lp.detach()), old, a, divergence, eps_low, eps_high) == 0.0 and a != 0
        return lp * 0.0 if zero else -a * ops["exp"](lp - old)

    return f


def _probability_seqs(seed, lengths):
    """random_seqs with every log-prob <= 0 (they are probabilities: DPPO's binary KL needs p <= 1)."""
    seqs = random_seqs(seed, lengths)
    for s in seqs:
        for key in ("logprobs", "old_logprobs", "rollout_logprobs"):
            s[key] = s[key].clamp(max=-1e-3)
    return seqs


def _layouts(seqs):
    return {"padded": padded(seqs), "packed": packed(seqs, pad=3)}


def _ours(fn, batch, *, mode=None, num_tokens=None, num_sequences=None, **kw):
    """(loss, per-token grads of log-probs) of one of our losses on a layout."""
    logp = batch["logprobs"].clone().requires_grad_()
    reduction = Reduction(
        mode=mode, segment_ids_B_T=batch["segment_ids"], num_tokens=num_tokens, num_sequences=num_sequences
    )
    loss, metrics = fn(logp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], reduction=reduction, **kw)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return loss, (torch.zeros_like(logp) if grad is None else grad), metrics


def _per_seq(grad_B_T, batch, seqs):
    """[B, T] grads -> list of each sequence's grads (by segment id)."""
    return [grad_B_T[batch["segment_ids"] == i] for i in range(len(seqs))]


LOSSES = [
    ("sapo", sapo_loss, {}, _sapo_torch, "seq-mean-token-mean"),
    (
        "dppo_tv",
        dppo_loss,
        {"divergence": "tv", "eps_low": 0.03, "eps_high": 0.02},
        _dppo_torch("tv", 0.03, 0.02),
        "token-mean",
    ),
    (
        "dppo_kl",
        dppo_loss,
        {"divergence": "kl", "eps_low": 0.02, "eps_high": 0.01},
        _dppo_torch("kl", 0.02, 0.01),
        "token-mean",
    ),
]


@pytest.mark.parametrize(("name", "fn", "kw", "naive", "mode"), LOSSES, ids=[x[0] for x in LOSSES])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_losses_match_naive_loops(name, fn, kw, naive, mode, layout):
    seqs = _probability_seqs(5, [9, 3, 8, 7])
    ref, ref_grads = _naive_torch(seqs, naive, mode)
    batch = _layouts(seqs)[layout]
    loss, grad, _ = _ours(fn, batch, mode=mode, **kw)
    torch.testing.assert_close(loss, ref)
    for ours_g, ref_g in zip(_per_seq(grad, batch, seqs), ref_grads, strict=True):
        torch.testing.assert_close(ours_g, ref_g)


def test_dppo_masks_some_and_keeps_some_tokens():
    """The DPPO fixtures above must exercise both sides of the trust region, or the comparison proves little."""
    seqs = _probability_seqs(5, [9, 3, 8, 7])
    for divergence, lo, hi in (("tv", 0.03, 0.02), ("kl", 0.02, 0.01)):
        _, _, metrics = _ours(dppo_loss, padded(seqs), divergence=divergence, eps_low=lo, eps_high=hi)
        masked = metrics["masked_frac_high"] + metrics["masked_frac_low"]
        assert 0.0 < masked < 1.0, (divergence, metrics)


def _gmpo_naive(seqs, eps_low, eps_high):
    """GMPO per sequence from plain loops; mean over sequences (seq-mean-token-mean of a per-sequence loss)."""
    logps = [s["logprobs"].clone().requires_grad_() for s in seqs]
    losses = []
    for s, lp in zip(seqs, logps, strict=True):
        idx = _tokens(s)
        if not idx:
            losses.append(lp.sum() * 0.0)
            continue
        terms, adv = [], []
        for i in idx:
            lr = lp[i] - float(s["old_logprobs"][i])
            a = float(s["advantages"][i])
            clipped = torch.clamp(lr, -eps_low, eps_high)
            sign = (a > 0) - (a < 0)
            terms.append(sign * torch.minimum(sign * lr, sign * clipped))
            adv.append(a)
        losses.append(-(sum(adv) / len(adv)) * torch.exp(sum(terms) / len(terms)))
    loss = sum(losses) / sum(1 for s in seqs if _tokens(s))  # sequences with a loss token (current verl)
    return loss, list(torch.autograd.grad(loss, logps))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gmpo_matches_naive_loops(layout):
    seqs = random_seqs(4, [6, 3, 9, 1])
    ref, ref_grads = _gmpo_naive(seqs, 0.2, 0.25)
    batch = _layouts(seqs)[layout]
    loss, grad, metrics = _ours(gmpo_loss, batch, eps_low=0.2, eps_high=0.25)
    torch.testing.assert_close(loss, ref)
    for ours_g, ref_g in zip(_per_seq(grad, batch, seqs), ref_grads, strict=True):
        torch.testing.assert_close(ours_g, ref_g)
    assert metrics["clip_frac_low"] + metrics["clip_frac_high"] > 0  # the clip is exercised


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_gmpo_keeps_the_token_log_ratio_within_20_where_verl_has_no_clamp(dtype, rel):
    """A kept departure: verl's clamp is commented out, so one token with log r = 200 and A < 0 makes its
    sequence ratio exp(200 / 2) overflow to inf; ours counts that token as log r = 20."""
    logp = torch.tensor([[0.0, -0.5]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-200.0, -0.5]], dtype=dtype)
    adv, mask = -torch.ones(1, 2, dtype=dtype), torch.ones(1, 2, dtype=dtype)
    loss, _ = gmpo_loss(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == pytest.approx(math.exp((20.0 + 0.0) / 2), rel=rel)
    assert grad[0, 0].item() == 0.0  # beyond the clamp
    assert grad[0, 1].item() == pytest.approx(math.exp(10.0) / 2, rel=rel)
    verl_ratio = torch.exp(((logp - old).detach() * mask).sum() / 2)  # no clamp: e^100 overflows float32 and bf16
    assert not torch.isfinite(verl_ratio)


def _kl_cov_naive(seqs, fraction, coef):
    """KL-Cov from plain loops over the concatenated loss tokens."""
    logps = [s["logprobs"].clone().requires_grad_() for s in seqs]
    toks = [(k, i) for k, s in enumerate(seqs) for i in _tokens(s)]
    a = [float(seqs[k]["advantages"][i]) for k, i in toks]
    lp = [float(seqs[k]["logprobs"][i]) for k, i in toks]
    mean_a, mean_lp = sum(a) / len(a), sum(lp) / len(lp)
    cov = [(x - mean_a) * (y - mean_lp) for x, y in zip(a, lp, strict=True)]
    num = max(1, int(fraction * len(toks)))
    picked = set(sorted(range(len(toks)), key=lambda j: -cov[j])[:num])
    total = 0.0
    for j, (k, i) in enumerate(toks):
        lr = logps[k][i] - float(seqs[k]["old_logprobs"][i])
        total = total - a[j] * torch.exp(lr) + (coef * lr.abs() if j in picked else 0.0)
    loss = total / len(toks)
    return loss, list(torch.autograd.grad(loss, logps)), len(picked) / len(toks)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_kl_cov_matches_naive_loops(layout):
    seqs = random_seqs(5, [7, 4, 9, 6])
    ref, ref_grads, picked_frac = _kl_cov_naive(seqs, 0.2, 0.7)
    batch = _layouts(seqs)[layout]
    loss, grad, metrics = _ours(kl_cov_loss, batch, cov_fraction=0.2, kl_coef=0.7)
    torch.testing.assert_close(loss, ref)
    for ours_g, ref_g in zip(_per_seq(grad, batch, seqs), ref_grads, strict=True):
        torch.testing.assert_close(ours_g, ref_g)
    assert float(metrics["cov_picked_frac"]) == pytest.approx(picked_frac) and picked_frac > 0


def _clip_cov_naive(seqs, eps, bounds, drop):
    """PPO clip per token from loops, with the loss of the tokens `drop(k, i)` says set to 0; token-mean."""
    logps = [s["logprobs"].clone().requires_grad_() for s in seqs]
    toks = [(k, i) for k, s in enumerate(seqs) for i in _tokens(s)]
    total = 0.0
    for k, i in toks:
        a = float(seqs[k]["advantages"][i])
        r = torch.exp(logps[k][i] - float(seqs[k]["old_logprobs"][i]))
        term = torch.maximum(-a * r, -a * torch.clamp(r, 1 - eps, 1 + eps))
        total = total + (0.0 * term if drop(k, i) else term)
    loss = total / len(toks)
    return loss, list(torch.autograd.grad(loss, logps))


def _eligible(seqs, eps, bounds):
    """Loss tokens PPO left unclipped whose covariance lies strictly inside bounds, from loops."""
    toks = [(k, i) for k, s in enumerate(seqs) for i in _tokens(s)]
    a = {t: float(seqs[t[0]]["advantages"][t[1]]) for t in toks}
    lp = {t: float(seqs[t[0]]["logprobs"][t[1]]) for t in toks}
    mean_a, mean_lp = sum(a.values()) / len(toks), sum(lp.values()) / len(toks)
    out = set()
    for t in toks:
        r = math.exp(lp[t] - float(seqs[t[0]]["old_logprobs"][t[1]]))
        clipped = -a[t] * min(max(r, 1 - eps), 1 + eps) > -a[t] * r
        cov = (a[t] - mean_a) * (lp[t] - mean_lp)
        if not clipped and bounds[0] < cov < bounds[1]:
            out.add(t)
    return out, len(toks)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_clip_cov_with_every_eligible_token_picked_matches_naive(layout):
    seqs = random_seqs(6, [7, 4, 9, 6])
    bounds = (-0.05, 10.0)
    eligible, _ = _eligible(seqs, 0.2, bounds)
    assert eligible  # the fixture picks something
    ref, ref_grads = _clip_cov_naive(seqs, 0.2, bounds, lambda k, i: (k, i) in eligible)
    batch = _layouts(seqs)[layout]
    loss, grad, _ = _ours(clip_cov_loss, batch, pick=ClipCovPick(cov_fraction=1.0, cov_bounds=bounds))
    torch.testing.assert_close(loss, ref)
    for ours_g, ref_g in zip(_per_seq(grad, batch, seqs), ref_grads, strict=True):
        torch.testing.assert_close(ours_g, ref_g)


def test_clip_cov_picks_the_fraction_among_eligible_tokens_reproducibly():
    seqs = random_seqs(6, [7, 4, 9, 6])
    bounds = (-0.05, 10.0)
    eligible, n = _eligible(seqs, 0.2, bounds)
    batch = padded(seqs)
    runs = [
        _ours(
            clip_cov_loss,
            batch,
            pick=ClipCovPick(cov_fraction=0.1, cov_bounds=bounds, generator=torch.Generator().manual_seed(7)),
        )
        for _ in range(2)
    ]
    assert float(runs[0][2]["cov_picked_frac"]) == pytest.approx(min(max(1, int(0.1 * n)), len(eligible)) / n)
    torch.testing.assert_close(runs[0][1], runs[1][1])  # same generator seed, same picks
    # a token's gradient vanishes only where it was picked: every picked token is eligible
    ppo_grad = _ours(clip_cov_loss, batch, pick=ClipCovPick(cov_fraction=1.0, cov_bounds=(1e6, 2e6)))[
        1
    ]  # nothing eligible
    zeroed = (runs[0][1] == 0) & (ppo_grad != 0)
    picked = {(k, i) for k in range(len(seqs)) for i in range(len(seqs[k]["logprobs"])) if zeroed[k, i]}
    assert picked and picked <= eligible


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """SAPO's gate has slope 1 at r = 1: on-policy, its gradient is the policy gradient's, -A."""
    logp = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, _ = sapo_loss(logp, logp.detach(), adv, mask, reduction=Reduction(mode="token-sum"))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, -adv)


@pytest.mark.parametrize("fn", [sapo_loss, gmpo_loss, dppo_loss, clip_cov_loss, kl_cov_loss])
def test_poisoned_masked_inputs_do_not_leak(fn):
    batch = padded(random_seqs(8, [5, 3, 6]))
    off = batch["loss_mask"] == 0
    logp = torch.where(off, torch.nan, batch["logprobs"]).requires_grad_()
    old = torch.where(off, -torch.inf, batch["old_logprobs"])
    adv = torch.where(off, torch.inf, batch["advantages"])
    loss, metrics = fn(logp, old, adv, batch["loss_mask"])
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert grad is None or torch.isfinite(grad).all()


@pytest.mark.parametrize("fn", [sapo_loss, gmpo_loss, dppo_loss, clip_cov_loss, kl_cov_loss])
def test_fully_masked_batch_gives_zero_not_nan(fn):
    logp = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    loss, _ = fn(logp, logp.detach(), torch.ones(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))
    assert loss.item() == 0.0


SPLITTABLE = [
    (sapo_loss, {}),
    (gmpo_loss, {}),
    (dppo_loss, {"divergence": "tv"}),
    (dppo_loss, {"divergence": "kl", "eps_low": 0.02, "eps_high": 0.02}),
]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 9), min_size=2, max_size=6),
    split=st.integers(1, 5),
    which=st.integers(0, len(SPLITTABLE) - 1),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "token-sum"]),
)
def test_micro_batches_with_step_counts_add_up_to_the_whole_step(seed, lengths, split, which, mode):
    """Packed or padded, split anywhere: the micro-batch losses (with the step's counts) sum to the step's loss,
    and so do their gradients."""
    fn, kw = SPLITTABLE[which]
    seqs = random_seqs(seed, lengths)
    split = min(split, len(seqs) - 1)
    num_tokens = int(sum((s["loss_mask"] > 0).sum() for s in seqs))
    counts = {"num_tokens": num_tokens, "num_sequences": len(seqs)}
    whole, whole_grad, _ = _ours(fn, packed(seqs), mode=mode, **counts, **kw)
    parts = [
        _ours(fn, layout(part), mode=mode, **counts, **kw)
        for part, layout in ((seqs[:split], padded), (seqs[split:], packed))
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole)
    first = _per_seq(parts[0][1], padded(seqs[:split]), seqs[:split])
    second = _per_seq(parts[1][1], packed(seqs[split:]), seqs[split:])
    for ours_g, ref_g in zip(first + second, _per_seq(whole_grad, packed(seqs), seqs), strict=True):
        torch.testing.assert_close(ours_g, ref_g)


@pytest.mark.parametrize(
    ("fn", "kw", "match"),
    [
        (sapo_loss, {"tau_pos": 0.0}, "tau_pos"),
        (gmpo_loss, {"eps_low": -0.1}, "eps_low"),
        (dppo_loss, {"divergence": "js"}, "divergence"),
        (clip_cov_loss, {"pick": ClipCovPick(cov_bounds=(5.0, 1.0))}, "cov_bounds"),
        (kl_cov_loss, {"cov_fraction": 0.0}, "cov_fraction"),
        (kl_cov_loss, {"kl_coef": -1.0}, "kl_coef"),
    ],
)
def test_bad_options_are_refused_by_name(fn, kw, match):
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match=match):
        fn(x, x, x, torch.ones(1, 3), **kw)
