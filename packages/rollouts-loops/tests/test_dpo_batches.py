"""Preference micro-batches keep each pair together under any budget and layout, and the step's
update does not depend on how its pairs are split into micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import build_components
from rollouts.loops.dpo.batches import chosen_loss_tokens, pair_micro_batches
from rollouts.loops.dpo.loop import dpo_step
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.types import DPOConfig, OptimizerConfig, Sample, TrainingState
from rollouts.types.preference import PREFERENCE_LOSSES


def _sample(n: int, seed: int) -> Sample:
    tokens = tuple((seed * 7 + j) % 14 + 2 for j in range(n))
    return Sample(tokens=tokens, num_prompt_tokens=2, loss_mask=(0.0, 0.0) + (1.0,) * (n - 2))


def _pairs(lengths):
    return [(_sample(c, 2 * k), _sample(r, 2 * k + 1)) for k, (c, r) in enumerate(lengths)]


@settings(deadline=None, max_examples=40)
@given(
    lengths=st.lists(st.tuples(st.integers(3, 20), st.integers(3, 20)), min_size=1, max_size=12),
    max_tokens=st.integers(40, 200),
    layout=st.sampled_from(["packed", "padded"]),
)
def test_pairs_stay_together_and_every_sequence_appears_once(lengths, max_tokens, layout):
    pairs = _pairs(lengths)
    micro_batches = pair_micro_batches(pairs, max_tokens=max_tokens, layout=layout)
    seen = []
    for mb in micro_batches:
        assert mb.input_ids.size <= max_tokens
        indices = sorted(mb.sample_indices.tolist())
        assert indices[0::2] == [i - 1 for i in indices[1::2]] and all(i % 2 == 0 for i in indices[0::2])
        for s, index in enumerate(mb.sample_indices.tolist()):  # each sequence is its sample's tokens
            c_or_r = pairs[index // 2][index % 2]
            assert mb.input_ids[mb.segment_ids == s].tolist() == list(c_or_r.tokens)
        seen += indices
    assert sorted(seen) == list(range(2 * len(pairs)))
    assert chosen_loss_tokens(micro_batches) == sum(len(c.tokens) - 2 for c, _ in pairs)


def test_a_pair_too_long_for_the_budget_is_refused():
    with pytest.raises(ValueError, match="pair 0 needs 30 tokens > max_tokens 20"):
        pair_micro_batches(_pairs([(15, 15)]), max_tokens=20)


def _step(loss: str, max_tokens: int):
    model = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    # eps=1 makes AdamW's first step lr * g / (|g| + 1): the weights then compare gradients
    optimizer = OptimizerConfig(lr=1.0, eps=1.0, schedule="constant", max_grad_norm=None, weight_decay=0.0)
    components = build_components(model, optimizer, num_training_steps=1)
    pairs = _pairs([(5, 12), (7, 20), (9, 3), (10, 10)])
    ref_N = -np.linspace(5.0, 30.0, 2 * len(pairs))  # any fixed reference values
    config = DPOConfig(loss=loss, max_length=24, max_tokens_per_micro_batch=max_tokens, optimizer=optimizer)
    _, metrics = dpo_step(
        components, TrainingState(), pairs, ref_N if config.preference.needs_reference else None, config
    )
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("loss", [loss for loss in PREFERENCE_LOSSES if loss != "kto"])  # KTO's kl is per batch
def test_the_update_is_the_same_however_the_pairs_are_split(loss):
    one_metrics, one = _step(loss, max_tokens=512)  # every pair in one micro-batch
    many_metrics, many = _step(loss, max_tokens=48)  # two pairs or fewer per micro-batch
    assert one_metrics["num_micro_batches"] == 1 and many_metrics["num_micro_batches"] >= 2
    assert many_metrics["loss"] == pytest.approx(one_metrics["loss"], rel=1e-5)
    for name in one:
        torch.testing.assert_close(many[name], one[name], rtol=1e-4, atol=1e-6)
