"""sft_step: one optimizer step whose gradient does not depend on how the batch is split."""

from __future__ import annotations

import typing

import pytest
import torch

from rollouts.backends import build_components
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.sft import sft_step
from rollouts.types import OptimizerConfig, Sample, SFTConfig, TrainingState
from rollouts.types.configs import LossAggregation


def _samples():
    out = []
    for i, n in enumerate([5, 12, 7, 20, 9, 3]):
        tokens = tuple((i * 7 + j) % 14 + 2 for j in range(n))
        out.append(Sample(tokens=tokens, num_prompt_tokens=2, loss_mask=(0.0, 0.0) + (1.0,) * (n - 2)))
    return out


def _step(mode, max_tokens):
    model = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    # eps=1 makes AdamW's first step lr * g / (|g| + 1): the weights then compare gradients (with a
    # small eps a gradient that is 0 but for rounding, like k_proj's bias, would step by +-lr).
    optimizer = OptimizerConfig(lr=1.0, eps=1.0, schedule="constant", max_grad_norm=None, weight_decay=0.0)
    components = build_components(model, optimizer, num_training_steps=1)
    config = SFTConfig(max_length=24, max_tokens_per_micro_batch=max_tokens, loss_aggregation=mode)
    _, metrics = sft_step(components, TrainingState(), _samples(), config)
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", typing.get_args(LossAggregation))
def test_the_update_is_the_same_however_the_batch_is_split(mode):
    one_metrics, one = _step(mode, max_tokens=512)  # every sample in one micro-batch
    many_metrics, many = _step(mode, max_tokens=24)  # several micro-batches of different padded lengths
    assert one_metrics["loss"] == pytest.approx(many_metrics["loss"], rel=1e-5)
    for name in one:
        torch.testing.assert_close(many[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


def test_data_without_a_loss_token_is_refused_before_training(tmp_path, caplog):
    """max_length shorter than every prompt: 0 loss tokens each step used to train nothing and exit 0."""
    from rollouts.loops import JsonlLogger, run_sft_training

    model = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=32
    )
    components = build_components(model, OptimizerConfig(lr=1e-3), num_training_steps=2)
    cut = [Sample(tokens=s.tokens[:2], num_prompt_tokens=2, loss_mask=(0.0, 0.0)) for s in _samples()]
    config = SFTConfig(num_steps=2, batch_size=2, max_length=2)
    with pytest.raises(ValueError, match=r"none of the 6 samples.*sft\.max_length=2"):
        run_sft_training(components, cut, config, logger=JsonlLogger(tmp_path / "m.jsonl"))
    some = cut[:3] + _samples()[3:]
    with caplog.at_level("WARNING"):
        state, _ = run_sft_training(components, some, config, logger=JsonlLogger(tmp_path / "m2.jsonl"))
    assert state.step == 2 and "3 of 6 samples have no token to learn from" in caplog.text
