"""Distillation divergences against GKD's generalized JSD as TRL writes it (F.kl_div on log-probs),
values and gradients; the fused (hidden-state) form against the logits form."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.losses import distill_divergence, fused_distill_divergence

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _trl_generalized_jsd(student_logits, teacher_logits, beta):
    """GKD's divergence per position as TRL's GKDTrainer.generalized_jsd_loss computes it (before its
    reduction): F.kl_div(input, target, log_target=True) is KL(target || input)."""
    s = F.log_softmax(student_logits, dim=-1)
    t = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        mixture = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, t, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, s, reduction="none", log_target=True)
        jsd = b * kl_teacher + (1 - b) * kl_student
    return jsd.sum(-1)


def _inputs(seed, k=11, v=17, h=6, g=4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(k, h, generator=gen, dtype=dtype),
        torch.randn(v, h, generator=gen, dtype=dtype),
        torch.randn(k, g, generator=gen, dtype=dtype),
        torch.randn(v, g, generator=gen, dtype=dtype),
    )


@pytest.mark.parametrize("beta", BETAS)
def test_divergence_matches_trl_generalized_jsd_in_value_and_gradient(beta):
    hs, ws, ht, wt = _inputs(0)
    student = (hs @ ws.T).requires_grad_()
    teacher = ht @ wt.T
    weights = torch.rand(hs.shape[0], dtype=hs.dtype, generator=torch.Generator().manual_seed(1))
    ours = distill_divergence(student, teacher, beta=beta)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), student)
    theirs = _trl_generalized_jsd(student, teacher, beta)
    (grad_theirs,) = torch.autograd.grad((theirs * weights).sum(), student)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_fused_equals_the_logits_form_in_value_and_gradient(beta, chunk_size):
    hs, ws, ht, wt = _inputs(2)
    hs.requires_grad_()
    ws.requires_grad_()
    ht.requires_grad_()  # a teacher's tensors that track gradients get none from the divergence
    weights = torch.rand(hs.shape[0], dtype=hs.dtype, generator=torch.Generator().manual_seed(3))
    fused = fused_distill_divergence(hs, ws, ht, wt, beta=beta, temperature=0.7, chunk_size=chunk_size)
    grads_fused = torch.autograd.grad((fused * weights).sum(), (hs, ws))
    plain = distill_divergence(hs @ ws.T, ht @ wt.T, beta=beta, temperature=0.7)
    grads_plain = torch.autograd.grad((plain * weights).sum(), (hs, ws))
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_fused, grads_plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert ht.grad is None


def test_leading_dimensions_are_kept_and_float32_inputs_give_float32():
    hs, ws, ht, wt = (x.float() for x in _inputs(4, k=12))
    out = fused_distill_divergence(hs.view(3, 4, -1), ws, ht.view(3, 4, -1), wt)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out.reshape(-1), fused_distill_divergence(hs, ws, ht, wt))


def test_the_temperature_divides_the_students_logits_only():
    hs, ws, ht, wt = _inputs(5)
    student, teacher = hs @ ws.T, ht @ wt.T
    torch.testing.assert_close(
        distill_divergence(student, teacher, temperature=2.0), distill_divergence(student / 2.0, teacher)
    )


def test_no_positions_give_an_empty_result_that_backward_goes_through():
    _, ws, _, wt = _inputs(6)
    hs = torch.zeros(0, ws.shape[1], dtype=ws.dtype, requires_grad=True)
    ht = torch.zeros(0, wt.shape[1], dtype=wt.dtype)
    out = fused_distill_divergence(hs, ws, ht, wt)
    assert out.shape == (0,)
    out.sum().backward()
    assert hs.grad is not None and hs.grad.shape == hs.shape


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 1.5}, r"beta must be a number in \[0, 1\].*got 1.5"),
        ({"beta": True}, r"beta must be a number in \[0, 1\].*got True"),
        ({"temperature": 0.0}, r"temperature must be a number > 0, got 0.0"),
        ({"temperature": math.inf}, r"temperature must be finite, got inf"),
        ({"chunk_size": 0}, r"chunk_size must be an int >= 1, got 0"),
    ],
)
def test_bad_options_are_refused_naming_the_value(kwargs, match):
    hs, ws, ht, wt = _inputs(7)
    with pytest.raises(ValueError, match=match):
        fused_distill_divergence(hs, ws, ht, wt, **kwargs)


def test_other_vocabularies_or_positions_are_refused():
    hs, ws, ht, wt = _inputs(8)
    with pytest.raises(ValueError, match="student's vocabulary has 17 rows and the teacher's 16"):
        fused_distill_divergence(hs, ws, ht, wt[:16])
    with pytest.raises(ValueError, match="cover the same positions"):
        fused_distill_divergence(hs, ws, ht[:5], wt)
    with pytest.raises(ValueError, match=r"teacher's output projection must be \[V, 4\]"):
        fused_distill_divergence(hs, ws, ht, ws)
    with pytest.raises(ValueError, match="one shape"):
        distill_divergence(hs @ ws.T, (ht @ wt.T)[:, :16])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    beta=st.sampled_from(BETAS),
    scale=st.floats(0.1, 20.0),
)
def test_divergences_are_nonnegative_zero_only_at_the_teacher_and_reverse_kl_is_the_expectation(seed, beta, scale):
    hs, ws, ht, wt = _inputs(seed)
    student, teacher = scale * (hs @ ws.T), scale * (ht @ wt.T)
    d = distill_divergence(student, teacher, beta=beta)
    assert bool((d >= -1e-12).all())
    assert float(distill_divergence(teacher, teacher, beta=beta).abs().max()) <= 1e-12
    p, q = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    expected = (p.exp() * (p - q)).sum(-1) if beta == 1.0 else (q.exp() * (q - p)).sum(-1) if beta == 0.0 else None
    if expected is not None:
        torch.testing.assert_close(d, expected, rtol=1e-12, atol=1e-12)
    else:  # a JSD is bounded by the mixture's entropy terms: at most log(1/beta)*beta + log(1/(1-beta))*(1-beta)
        bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert float(d.max()) <= bound + 1e-12
