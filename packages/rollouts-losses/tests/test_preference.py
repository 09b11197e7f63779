"""Preference losses against their formulas written out per pair in plain float64 Python (values,
and gradients by central differences), plus their properties and edge cases."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollouts.losses import (
    PairLogps,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    kto_loss,
    orpo_loss,
    preference_loss,
    robust_dpo_loss,
    simpo_loss,
)
from rollouts.types import PreferenceConfig


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# Each reference: lists of floats (one entry per pair) -> the mean loss, written from the papers' /
# TRL's formulas without sharing code with the implementation.
def ref_dpo(c, r, rc, rr, n_c, n_r, *, beta, e):
    return sum(
        -(1 - e) * logsig(beta * ((a - ra) - (b - rb))) - e * logsig(-beta * ((a - ra) - (b - rb)))
        for a, b, ra, rb in zip(c, r, rc, rr, strict=True)
    ) / len(c)


def ref_robust(c, r, rc, rr, n_c, n_r, *, beta, e):
    total = 0.0
    for a, b, ra, rb in zip(c, r, rc, rr, strict=True):
        z = beta * ((a - ra) - (b - rb))
        total += (-(1 - e) * logsig(z) + e * logsig(-z)) / (1 - 2 * e)
    return total / len(c)


def ref_hinge(c, r, rc, rr, n_c, n_r, *, beta, e):
    return sum(max(0.0, 1 - beta * ((a - ra) - (b - rb))) for a, b, ra, rb in zip(c, r, rc, rr, strict=True)) / len(c)


def ref_ipo(c, r, rc, rr, n_c, n_r, *, beta, e):
    return sum(
        ((a - ra) / nc - (b - rb) / nr - 1 / (2 * beta)) ** 2
        for a, b, ra, rb, nc, nr in zip(c, r, rc, rr, n_c, n_r, strict=True)
    ) / len(c)


def ref_simpo(c, r, rc, rr, n_c, n_r, *, beta, e, gamma=0.5):
    total = 0.0
    for a, b, nc, nr in zip(c, r, n_c, n_r, strict=True):
        z = beta * (a / nc - b / nr) - gamma
        total += -(1 - e) * logsig(z) - e * logsig(-z)
    return total / len(c)


def ref_orpo(c, r, rc, rr, n_c, n_r, *, beta, e):
    def log_odds(x):
        return x - math.log(1 - math.exp(x))

    nll = -sum(c) / sum(n_c)
    ratio = sum(logsig(log_odds(a / nc) - log_odds(b / nr)) for a, b, nc, nr in zip(c, r, n_c, n_r, strict=True))
    return nll - beta * ratio / len(c)


def ref_kto(c, r, rc, rr, n_c, n_r, *, beta, e, wd=1.0, wu=1.0):
    ratios = [a - ra for a, ra in zip(c, rc, strict=True)] + [b - rb for b, rb in zip(r, rr, strict=True)]
    kl = max(0.0, sum(ratios) / len(ratios))  # the batch estimate, treated as a constant
    chosen = [wd * (1 - sig(beta * (a - ra - kl))) for a, ra in zip(c, rc, strict=True)]
    rejected = [wu * (1 - sig(beta * (kl - (b - rb)))) for b, rb in zip(r, rr, strict=True)]
    return (sum(chosen) + sum(rejected)) / (2 * len(c))


def _ours(name, c, r, rc, rr, n_c, n_r, *, beta, e):
    if name == "sigmoid":
        return dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=e)
    if name == "robust":
        return robust_dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=e)
    if name == "hinge":
        return hinge_loss(c, r, rc, rr, beta=beta)
    if name == "ipo":
        return ipo_loss(c, r, rc, rr, n_c, n_r, beta=beta)
    if name == "simpo":
        return simpo_loss(c, r, n_c, n_r, beta=beta, gamma=0.5, label_smoothing=e)
    if name == "orpo":
        return orpo_loss(c, r, n_c, n_r, beta=beta)
    return kto_loss(c, r, rc, rr, beta=beta)


REFS = {
    "sigmoid": ref_dpo,
    "robust": ref_robust,
    "hinge": ref_hinge,
    "ipo": ref_ipo,
    "simpo": ref_simpo,
    "orpo": ref_orpo,
    "kto": ref_kto,
}
SMOOTHED = {"sigmoid", "robust", "simpo"}


def _pairs(seed, p=5):
    g = torch.Generator().manual_seed(seed)
    n_c = torch.randint(1, 9, (p,), generator=g).double()
    n_r = torch.randint(1, 9, (p,), generator=g).double()
    c = -torch.rand(p, generator=g, dtype=torch.float64) * 2 * n_c - 0.05
    r = -torch.rand(p, generator=g, dtype=torch.float64) * 2 * n_r - 0.05
    rc = c + 0.5 * torch.randn(p, generator=g, dtype=torch.float64)
    rr = r + 0.5 * torch.randn(p, generator=g, dtype=torch.float64)
    return c, r, rc, rr, n_c, n_r


@pytest.mark.parametrize(("name", "e"), [(n, 0.0) for n in REFS] + [(n, 0.2) for n in sorted(SMOOTHED)])
def test_values_and_gradients_match_the_formulas(name, e):
    c, r, rc, rr, n_c, n_r = _pairs(7)
    beta = 0.7
    c, r = c.clone().requires_grad_(), r.clone().requires_grad_()
    loss, metrics = _ours(name, c, r, rc, rr, n_c, n_r, beta=beta, e=e)
    lists = [t.detach().tolist() for t in (c, r, rc, rr, n_c, n_r)]
    expected = REFS[name](*lists, beta=beta, e=e)
    # float64 throughout: agreement to rounding of a few dozen operations
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    grad_c, grad_r = torch.autograd.grad(loss, (c, r))
    h = 1e-6  # central differences: truncation ~h^2 * f''' and rounding ~1e-16 / h, both < 1e-8
    for which, grad in ((0, grad_c), (1, grad_r)):
        for i in range(len(lists[0])):
            up = [list(x) for x in lists]
            down = [list(x) for x in lists]
            up[which][i] += h
            down[which][i] -= h
            numeric = (REFS[name](*up, beta=beta, e=e) - REFS[name](*down, beta=beta, e=e)) / (2 * h)
            assert float(grad[i]) == pytest.approx(numeric, rel=1e-6, abs=1e-8), (name, which, i)
    assert set(metrics) >= {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }


def test_metrics_are_trls():
    c = torch.tensor([-3.0, -5.0], dtype=torch.float64)
    r = torch.tensor([-4.0, -2.0], dtype=torch.float64)
    rc, rr = torch.tensor([-3.5, -5.0], dtype=torch.float64), torch.tensor([-4.0, -2.5], dtype=torch.float64)
    _, m = dpo_loss(c, r, rc, rr, beta=0.5)
    # rewards: beta * (pi - ref): chosen [0.25, 0], rejected [0, 0.25]
    assert float(m["rewards/chosen"]) == pytest.approx(0.125)
    assert float(m["rewards/rejected"]) == pytest.approx(0.125)
    assert float(m["rewards/accuracies"]) == pytest.approx(0.5)  # pair 0 right, pair 1 wrong
    assert float(m["rewards/margins"]) == pytest.approx(0.0)
    assert float(m["logps/chosen"]) == pytest.approx(-4.0)
    assert float(m["logps/rejected"]) == pytest.approx(-3.0)
    n = torch.tensor([2.0, 4.0], dtype=torch.float64)
    _, m = orpo_loss(c, r, n, n, beta=0.1)
    assert float(m["logps/chosen"]) == pytest.approx((-1.5 - 1.25) / 2)  # per-token means
    assert float(m["nll_loss"]) == pytest.approx(8.0 / 6.0)  # token mean over every chosen token
    assert {"log_odds_ratio", "log_odds_chosen"} <= set(m)
    _, m = kto_loss(c, r, rc, rr, beta=0.5, kl=0.3)
    assert float(m["kl"]) == pytest.approx(0.3)


def test_equal_policy_and_reference_gives_log_two_and_no_accuracy():
    c, r = torch.tensor([-3.0, -7.0]), torch.tensor([-2.0, -9.0])
    loss, m = dpo_loss(c, r, c, r, beta=0.1)
    assert float(loss) == pytest.approx(math.log(2.0))
    assert m["rewards/accuracies"] == 0.0  # ties count as wrong, as TRL counts them
    assert m["rewards/margins"] == 0.0


def test_ties_break_toward_the_gradient_that_raises_chosen():
    c = torch.tensor([-3.0], requires_grad=True)
    r = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(c, r, c.detach(), r.detach(), beta=0.1)
    gc, gr = torch.autograd.grad(loss, (c, r))
    assert float(gc) == pytest.approx(-0.05) and float(gr) == pytest.approx(0.05)  # beta * s(0) each way


finite = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, width=64)


@settings(deadline=None, max_examples=60)
@given(c=finite, r=finite, rc=finite, rr=finite, delta=st.floats(min_value=0.01, max_value=5.0))
def test_dpo_loss_decreases_as_the_margin_grows(c, r, rc, rr, delta):
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    base, _ = dpo_loss(t(c), t(r), t(rc), t(rr), beta=1.0)
    wider, _ = dpo_loss(t(c + delta), t(r), t(rc), t(rr), beta=1.0)
    assume(float(base) > 1e-12)  # saturated at 0: no room to decrease
    assert float(wider) < float(base)


@settings(deadline=None, max_examples=60)
@given(c=finite, r=finite, rc=finite, rr=finite, e=st.floats(min_value=0.0, max_value=0.49))
def test_swapping_chosen_and_rejected_mirrors_the_margin(c, r, rc, rr, e):
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    forward, m1 = dpo_loss(t(c), t(r), t(rc), t(rr), beta=0.5, label_smoothing=e)
    backward, m2 = dpo_loss(t(r), t(c), t(rr), t(rc), beta=0.5, label_smoothing=e)
    assert float(m1["rewards/margins"]) == pytest.approx(-float(m2["rewards/margins"]), abs=1e-12)
    z = 0.5 * ((c - rc) - (r - rr))
    # -log s(z) - -log s(-z) = -z, so the swap changes the loss by (1 - 2e) z
    assert float(backward) - float(forward) == pytest.approx((1 - 2 * e) * z, abs=1e-9)


@settings(deadline=None, max_examples=40)
@given(e=st.floats(min_value=0.0, max_value=0.45), z=st.floats(min_value=-20.0, max_value=20.0))
def test_robust_dpo_is_unbiased_under_flipped_labels(e, z):
    """rDPO's point: its expectation over labels flipped with probability e is the clean DPO loss."""
    t = lambda x: torch.tensor([x], dtype=torch.float64)  # noqa: E731
    zero = t(0.0)
    clean, _ = dpo_loss(t(z), zero, zero, zero, beta=1.0)
    kept, _ = robust_dpo_loss(t(z), zero, zero, zero, beta=1.0, label_smoothing=e)
    flipped, _ = robust_dpo_loss(zero, t(z), zero, zero, beta=1.0, label_smoothing=e)
    assert (1 - e) * float(kept) + e * float(flipped) == pytest.approx(float(clean), rel=1e-9, abs=1e-9)


@settings(deadline=None, max_examples=40)
@given(shift=st.floats(min_value=-50.0, max_value=50.0))
def test_reference_based_losses_see_only_log_ratios(shift):
    c, r, rc, rr, n_c, n_r = _pairs(3)
    for name in ("sigmoid", "robust", "hinge", "ipo", "kto"):
        a, _ = _ours(name, c, r, rc, rr, n_c, n_r, beta=0.3, e=0.0)
        b, _ = _ours(name, c + shift, r + shift, rc + shift, rr + shift, n_c, n_r, beta=0.3, e=0.0)
        assert float(a) == pytest.approx(float(b), rel=1e-9, abs=1e-9), name


def test_step_wide_counts_split_a_batch_exactly():
    c, r, rc, rr, n_c, n_r = _pairs(11, p=6)
    for loss in ("sigmoid", "ipo", "kto", "orpo", "simpo"):
        config = PreferenceConfig(loss=loss, beta=0.2)
        whole, _ = preference_loss(
            PairLogps(
                chosen_P=c, rejected_P=r, chosen_tokens_P=n_c, rejected_tokens_P=n_r, ref_chosen_P=rc, ref_rejected_P=rr
            ),
            config,
        )
        parts = 0.0
        for s in (slice(0, 2), slice(2, 6)):
            part, _ = preference_loss(
                PairLogps(
                    chosen_P=c[s],
                    rejected_P=r[s],
                    chosen_tokens_P=n_c[s],
                    rejected_tokens_P=n_r[s],
                    ref_chosen_P=rc[s],
                    ref_rejected_P=rr[s],
                ),
                config,
                num_pairs=6,
                num_chosen_tokens=int(n_c.sum()),
            )
            parts += float(part)
        if loss != "kto":  # KTO's reference point is estimated per batch
            assert parts == pytest.approx(float(whole), rel=1e-12), loss


def test_empty_batch_is_zero_not_nan():
    empty = torch.zeros(0, requires_grad=True)
    for name in REFS:
        loss, metrics = _ours(name, empty, empty, empty, empty, empty, empty, beta=0.1, e=0.0)
        assert float(loss) == 0.0, name
        assert all(math.isfinite(v) for v in metrics.values()), name
        loss.backward()


def test_orpo_survives_a_completion_of_probability_one():
    c = torch.tensor([0.0], requires_grad=True)
    loss, _ = orpo_loss(c, torch.tensor([-2.0]), torch.tensor([3.0]), torch.tensor([3.0]))
    assert math.isfinite(float(loss))
    (grad,) = torch.autograd.grad(loss, c)
    assert math.isfinite(float(grad))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: dpo_loss(t, t, t, t, beta=0.0), "beta must be"),
        (lambda t: dpo_loss(t, t, t, t, beta=float("nan")), "beta must be"),
        (lambda t: dpo_loss(t, t, t, t, label_smoothing=0.5), "label_smoothing"),
        (lambda t: dpo_loss(t, t[:1], t, t), r"\[P\] with one shape"),
        (lambda t: dpo_loss(t[None], t[None], t[None], t[None]), r"\[P\] with one shape"),
        (lambda t: dpo_loss(t, t, t, t, num_pairs=-1), "num_pairs"),
        (lambda t: ipo_loss(t, t, t, t, t.long(), t.long()), "floating"),
        (lambda t: simpo_loss(t, t, t, t, gamma=-1.0), "gamma"),
        (lambda t: kto_loss(t, t, t, t, desirable_weight=0.0), "desirable_weight"),
    ],
)
def test_bad_inputs_are_refused(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.tensor([-1.0, -2.0]))


def test_reference_losses_need_reference_log_probs():
    t = torch.tensor([-1.0])
    logps = PairLogps(chosen_P=t, rejected_P=t, chosen_tokens_P=t.abs(), rejected_tokens_P=t.abs())
    with pytest.raises(ValueError, match="needs reference log-probs"):
        preference_loss(logps, PreferenceConfig(loss="sigmoid"))
    loss, _ = preference_loss(logps, PreferenceConfig(loss="simpo"))  # reference-free
    assert math.isfinite(float(loss))
    with pytest.raises(ValueError, match="label_smoothing"):
        PreferenceConfig(loss="hinge", label_smoothing=0.1)
