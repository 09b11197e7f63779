"""The critic's value model: token-aligned values from the backbone's hidden states, the same in
packed and padded layouts, a zero-initialised head, and a clipped value-loss step that moves it."""

import numpy as np
import pytest
import torch
from helpers import packed_batch, padded_batch, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import optim_step
from rollouts.backends.train.value import ValueModel, build_critic, compute_values, critic_forward_backward
from rollouts.types import OptimizerConfig, TrainingState


def _critic(seed=0):
    critic = build_critic(tiny_model(seed=seed), OptimizerConfig(lr=1e-2), num_training_steps=10)
    with torch.no_grad():
        critic.model.head.weight.normal_(0.0, 1.0)  # visible values (the head starts at zero)
    return critic


def test_the_head_starts_at_zero_and_a_non_causal_lm_is_refused():
    critic = build_critic(tiny_model(), OptimizerConfig(), num_training_steps=1)
    values = compute_values(critic, [packed_batch([[3, 4, 5, 6], [7, 8, 9]])])[0]
    assert np.all(values == 0.0)
    with pytest.raises(ValueError, match="backbone"):
        ValueModel(torch.nn.Linear(2, 2))


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(2, 9), min_size=1, max_size=4))
def test_values_are_token_aligned_and_the_same_packed_or_padded(lengths):
    critic = _critic()
    seqs = [[3 + (i + j) % 20 for j in range(n)] for i, n in enumerate(lengths)]
    packed = compute_values(critic, [packed_batch(seqs)])[0][0]
    padded = compute_values(critic, [padded_batch(seqs)])[0]
    start = 0
    for row, seq in enumerate(seqs):
        n = len(seq)
        with torch.no_grad():  # V at token t is the head on the hidden state at t - 1 of the sequence alone
            hidden = critic.model.backbone(input_ids=torch.tensor([seq]))[0]
            alone = critic.model.head(hidden[0, :-1]).squeeze(-1).numpy()
        np.testing.assert_allclose(padded[row, 1:n], alone, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(packed[start + 1 : start + n], alone, rtol=1e-5, atol=1e-5)
        assert padded[row, 0] == 0.0 and packed[start] == 0.0 and np.all(padded[row, n:] == 0.0)
        start += n


def test_a_value_loss_step_moves_the_values_toward_the_returns():
    critic = _critic()
    mb = packed_batch([[3, 4, 5, 6, 7], [8, 9, 10]])
    old = compute_values(critic, [mb])[0]
    returns = np.where(mb.loss_mask > 0, 1.0, 0.0).astype(np.float32)
    mb = mb.replace(old_values=old, returns=returns)
    before = float((((old - returns) ** 2) * mb.loss_mask).sum())
    for _ in range(5):
        metrics = critic_forward_backward(critic, [mb], num_tokens=int((mb.loss_mask > 0).sum()), clip_range=None)
        optim_step(critic, TrainingState(), OptimizerConfig(lr=1e-2))
    after_values = compute_values(critic, [mb])[0]
    after = float((((after_values - returns) ** 2) * mb.loss_mask).sum())
    assert after < before and metrics["vf_loss"] > 0
    with pytest.raises(ValueError, match="returns"):
        critic_forward_backward(critic, [packed_batch([[3, 4, 5]])], num_tokens=1, clip_range=0.2)
