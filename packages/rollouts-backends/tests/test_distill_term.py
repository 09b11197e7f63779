"""forward_backward's distillation term: the gradient and metric of the full-vocabulary divergence
to a frozen teacher equal a naive computation from both models' whole logits, packed or padded,
split into micro-batches or not."""

import math

import numpy as np
import pytest
import torch
from helpers import grads, packed_batch, padded_batch, random_sequences, tiny_model

from rollouts.backends import DISTILL_DIVERGENCE_METRIC, DistillTerm, build_components, forward_backward
from rollouts.losses import distill_divergence, sft_loss_fn
from rollouts.types import OptimizerConfig

LENGTHS = [5, 11, 3, 8]
NUM_PROMPT = 2


def _zero_loss(logprobs_B_T, batch, **_):
    """A policy loss with no gradient of its own: what is left is the distillation term."""
    return (logprobs_B_T * 0.0).sum(), {}


def _naive(student, teacher, seqs, *, beta, temperature, coef):
    """coef * sum over loss tokens of the divergence / the number of loss tokens, sequence by sequence."""
    total, count = 0.0, 0
    for seq in seqs:
        ids = torch.tensor([seq])
        s_logits = student(ids).logits[0, NUM_PROMPT - 1 : -1]  # predicting tokens NUM_PROMPT..end
        with torch.no_grad():
            t_logits = teacher(ids).logits[0, NUM_PROMPT - 1 : -1]
        total = total + distill_divergence(s_logits, t_logits, beta=beta, temperature=temperature).sum()
        count += len(seq) - NUM_PROMPT
    return coef * total / count, count


@pytest.mark.parametrize(
    ("layout", "beta", "temperature"),
    [("packed", 1.0, 1.0), ("padded", 0.5, 0.7), ("split", 0.0, 1.0)],
)
def test_the_term_equals_the_naive_divergence_of_whole_logits(layout, beta, temperature):
    seqs = random_sequences(np.random.default_rng(0), LENGTHS)
    student = tiny_model(seed=0)
    teacher = build_components(tiny_model(seed=1), OptimizerConfig(lr=1e-3), num_training_steps=1)
    components = build_components(student, OptimizerConfig(lr=1e-3), num_training_steps=1)
    mbs = {
        "packed": [packed_batch(seqs, num_prompt=NUM_PROMPT)],
        "padded": [padded_batch(seqs, num_prompt=NUM_PROMPT)],
        "split": [packed_batch(seqs[:1], num_prompt=NUM_PROMPT), padded_batch(seqs[1:], num_prompt=NUM_PROMPT)],
    }[layout]
    term = DistillTerm(teacher=teacher, coef=0.5, beta=beta)
    expected, n = _naive(student, teacher.model, seqs, beta=beta, temperature=temperature, coef=0.5)
    expected.backward()
    g_naive = grads(student)
    student.zero_grad(set_to_none=True)
    metrics = forward_backward(
        components, mbs, _zero_loss, num_tokens=n, num_sequences=len(seqs), temperature=temperature, distill=term
    )
    g_ours = grads(student)
    assert math.isclose(metrics["loss"], expected.item(), rel_tol=1e-5)
    assert math.isclose(metrics[DISTILL_DIVERGENCE_METRIC], expected.item() / 0.5, rel_tol=1e-5)
    for name in g_naive:
        torch.testing.assert_close(g_ours[name], g_naive[name], atol=1e-6, rtol=1e-4)
    assert all(p.grad is None for p in teacher.model.parameters())
    assert teacher.model.training  # left in the mode it was in


def test_the_term_adds_to_the_loss_functions_loss():
    seqs = random_sequences(np.random.default_rng(1), LENGTHS)
    components = build_components(tiny_model(seed=0), OptimizerConfig(lr=1e-3), num_training_steps=1)
    teacher = build_components(tiny_model(seed=2), OptimizerConfig(lr=1e-3), num_training_steps=1)
    mbs = [packed_batch(seqs, num_prompt=NUM_PROMPT)]
    n = sum(len(s) - NUM_PROMPT for s in seqs)
    plain = forward_backward(components, mbs, sft_loss_fn(), num_tokens=n, num_sequences=len(seqs))
    distill_only = forward_backward(
        components, mbs, _zero_loss, num_tokens=n, num_sequences=len(seqs), distill=DistillTerm(teacher=teacher)
    )
    both = forward_backward(
        components, mbs, sft_loss_fn(), num_tokens=n, num_sequences=len(seqs), distill=DistillTerm(teacher=teacher)
    )
    assert math.isclose(both["loss"], plain["loss"] + distill_only["loss"], rel_tol=1e-5)


def test_a_teacher_the_student_equals_gives_zero():
    seqs = random_sequences(np.random.default_rng(2), LENGTHS)
    components = build_components(tiny_model(seed=0), OptimizerConfig(lr=1e-3), num_training_steps=1)
    twin = build_components(tiny_model(seed=0), OptimizerConfig(lr=1e-3), num_training_steps=1)
    metrics = forward_backward(
        components,
        [packed_batch(seqs, num_prompt=NUM_PROMPT)],
        _zero_loss,
        num_tokens=20,
        num_sequences=len(seqs),
        distill=DistillTerm(teacher=twin, beta=0.5),
    )
    assert abs(metrics[DISTILL_DIVERGENCE_METRIC]) < 1e-6


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"coef": 0.0}, ValueError, "DistillTerm.coef must be > 0, got 0.0"),
        ({"coef": math.nan}, ValueError, "DistillTerm.coef must be a finite number, got nan"),
        ({"beta": 2}, ValueError, r"beta must be a number in \[0, 1\].*got 2"),
        ({"teacher": "teacher/dir"}, TypeError, "DistillTerm.teacher must be TrainingComponents, got str"),
    ],
)
def test_bad_terms_are_refused(kwargs, error, match):
    teacher = build_components(tiny_model(seed=2), OptimizerConfig(lr=1e-3), num_training_steps=1)
    with pytest.raises(error, match=match):
        DistillTerm(**{"teacher": teacher, **kwargs})
