"""On-policy distillation's advantages: coef * (teacher - student log-prob) on the trained tokens,
whatever the micro-batch split; a teacher equal to the student gives none; "add" keeps the task's;
a served teacher (fake vLLM prompt log-probs) scores what the fake model gives; a teacher of
another vocabulary is refused before any work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import build_components, compute_logprobs
from rollouts.data import unpack_values
from rollouts.loops.micro_batches import plan_shard
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.distill import REVERSE_KL_METRIC, Distillation, EngineTeacher, check_teacher, distill_advantages
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.types import OptimizerConfig, Sample

VOCAB = 16


def _components(seed: int, vocab: int = VOCAB):
    model = build_tiny_model(
        vocab,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=32,
        seed=seed,
    )
    return build_components(model, OptimizerConfig(lr=1e-3), num_training_steps=1)


def _samples(lengths):
    out = []
    for i, n in enumerate(lengths):
        tokens = tuple((i * 5 + j * 3) % VOCAB for j in range(n))
        out.append(Sample(tokens=tokens, num_prompt_tokens=2, loss_mask=(0.0, 0.0) + (1.0,) * (n - 2)))
    return out


def _advantages(student, teacher, samples, *, max_tokens, mode="replace", coef=1.0):
    shard = plan_shard(student, samples, max_tokens_per_micro_batch=max_tokens)
    mbs = list(shard.micro_batches)
    real = mbs[: shard.num_real]
    masks = unpack_values(real, [mb.loss_mask for mb in real])
    task = {i: np.full(len(masks[i]), 0.5, dtype=np.float32) for i in masks}
    old = compute_logprobs(student, mbs)
    distill = Distillation(teacher=teacher, coef=coef, mode=mode)
    return distill_advantages(distill, task, shard=shard, micro_batches=mbs, student=old, masks=masks), masks


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(3, 12), min_size=1, max_size=6), max_tokens=st.sampled_from([12, 24, 512]))
def test_the_advantage_is_coef_times_teacher_minus_student_whatever_the_split(lengths, max_tokens):
    torch.manual_seed(0)
    student, teacher = _components(0), _components(1)
    samples = _samples(lengths)
    (advantages, metrics), masks = _advantages(student, teacher, samples, max_tokens=max_tokens, coef=0.5)
    kl_sum = 0.0
    for i, s in enumerate(samples):  # one sample alone: the reference log-probs, no packing
        ids = torch.tensor([list(s.tokens.tolist())])
        with torch.no_grad():
            lp_s = torch.log_softmax(student.model(ids).logits[0, :-1].float(), -1)
            lp_t = torch.log_softmax(teacher.model(ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        gap = (lp_t.gather(1, target[:, None]) - lp_s.gather(1, target[:, None]))[:, 0].numpy()
        want = np.concatenate([[0.0], gap]) * (masks[i] > 0)
        # float32 log-softmax of the same logits in two layouts: a few ulps of values near 5
        np.testing.assert_allclose(advantages[i], 0.5 * want, rtol=0, atol=1e-5)
        kl_sum -= float(want.sum())
    num_tokens = sum(n - 2 for n in lengths)
    assert metrics[REVERSE_KL_METRIC] == pytest.approx(kl_sum / num_tokens, abs=1e-5)


def test_a_teacher_equal_to_the_student_gives_nothing_and_add_keeps_the_task_advantage():
    student = _components(0)
    samples = _samples([5, 9, 4])
    (replaced, metrics), masks = _advantages(student, student, samples, max_tokens=512)
    assert metrics[REVERSE_KL_METRIC] == 0.0
    assert all(not a.any() for a in replaced.values())
    (added, _), _ = _advantages(student, student, samples, max_tokens=512, mode="add")
    for i in added:
        np.testing.assert_array_equal(added[i], np.full(len(masks[i]), 0.5, dtype=np.float32))


def test_a_served_teacher_scores_with_the_fake_models_prompt_logprobs():
    sequences = [[1, 2, 3, 4], [5, 6], [7]]

    async def main():
        state = FakeEngineState(vocab_size=VOCAB)
        async with serve_fake_engine(state) as server:
            teacher = EngineTeacher(server.url, timeout_s=10, max_batch=2, vocab_size=VOCAB)
            # the trainer calls it from a worker thread, outside the run's event loop
            return await trio.to_thread.run_sync(teacher.sequence_logprobs, sequences), state

    rows, state = trio.run(main)
    for ids, row in zip(sequences, rows, strict=True):
        want = [0.0] + [float(state.logprobs_V(ids[:t])[ids[t]]) for t in range(1, len(ids))]
        np.testing.assert_allclose(row, np.asarray(want, dtype=np.float32))


def test_a_teacher_of_another_vocabulary_is_refused_naming_both_sizes():
    student, teacher = _components(0), _components(1, vocab=VOCAB + 8)
    with pytest.raises(ValueError, match=r"vocabulary has 24 tokens and the student's 16"):
        check_teacher(Distillation(teacher=teacher), student.model)
    with pytest.raises(ValueError, match="vocabulary has 99 tokens"):
        check_teacher(Distillation(teacher=EngineTeacher("http://127.0.0.1:9", vocab_size=99)), student.model)


def test_bad_distillation_settings_are_refused():
    student = _components(0)
    with pytest.raises(ValueError, match="coef must be > 0"):
        Distillation(teacher=student, coef=0.0)
    with pytest.raises(ValueError, match="mode must be"):
        Distillation(teacher=student, mode="both")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence_logprobs"):
        Distillation(teacher="models/teacher")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="estimate must be 'sampled' or 'full'"):
        Distillation(teacher=student, estimate="exact")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Distillation.beta must be a number in \[0, 1\]"):
        Distillation(teacher=student, estimate="full", beta=1.5)
    with pytest.raises(ValueError, match="beta=0.5 needs estimate='full'"):
        Distillation(teacher=student, beta=0.5)
    with pytest.raises(ValueError, match="estimate='full' needs the teacher's whole next-token distributions"):
        Distillation(teacher=EngineTeacher("http://127.0.0.1:9"), estimate="full")


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_the_full_estimate_trains_on_the_divergence_alone_in_replace_mode(beta):
    """rl_update with estimate='full', mode 'replace': the step's loss is coef times the token-mean
    divergence over the trained tokens (the zeroed advantages add nothing), and its metric is the
    divergence of the two models' whole softmaxes, computed here sample by sample."""
    from rollouts.backends import DISTILL_DIVERGENCE_METRIC
    from rollouts.loops.rl.step import rl_update
    from rollouts.losses import distill_divergence
    from rollouts.types import RLConfig, RolloutConfig, SamplingParams, TrainingState

    torch.manual_seed(0)
    student, teacher = _components(0), _components(1)
    samples = [dataclasses.replace(s, reward=float(i % 2), group_index=0) for i, s in enumerate(_samples([5, 9, 4, 7]))]
    total, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([list(s.tokens.tolist())])
        with torch.no_grad():
            d = distill_divergence(student.model(ids).logits[0, 1:-1], teacher.model(ids).logits[0, 1:-1], beta=beta)
        total, count = total + float(d.sum()), count + len(d)
    distill = Distillation(teacher=teacher, coef=0.25, estimate="full", beta=beta)
    config = RLConfig(  # three micro-batches of at most 12 tokens
        rollout=RolloutConfig(samples_per_prompt=4, sampling=SamplingParams(max_new_tokens=8)),
        max_tokens_per_micro_batch=12,
    )
    _, metrics = rl_update(student, TrainingState(), samples, config, distill=distill)
    assert metrics[DISTILL_DIVERGENCE_METRIC] == pytest.approx(total / count, rel=1e-5)
    assert metrics["loss"] == pytest.approx(0.25 * total / count, rel=1e-5)
    assert metrics["grad_norm"] > 0
