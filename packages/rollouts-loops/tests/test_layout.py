"""The loops' micro-batch layout: padded for near-uniform lengths, always packed under flash attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import micro_batch_to_torch, packed_only
from rollouts.backends.train import _model_inputs, one_sequence_per_row
from rollouts.data import plan_micro_batches
from rollouts.loops.app.tiny import build_tiny_model
from rollouts.loops.micro_batches import choose_layout
from rollouts.types import Sample


def _samples(lengths):
    return [
        Sample(tokens=tuple(range(1, n + 1)), num_prompt_tokens=1, loss_mask=(0.0,) + (1.0,) * (n - 1)) for n in lengths
    ]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64
    )


def test_layout_follows_the_length_spread():
    assert choose_layout(_samples([10, 10, 9])) == "padded"
    assert choose_layout(_samples([40, 3, 2, 2])) == "packed"
    assert choose_layout(_samples([10, 10, 9]), packed_only=True) == "packed"


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=12),
    impl=st.sampled_from(["sdpa", "eager", "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn"]),
)
def test_the_chosen_layout_is_one_the_attention_accepts(model, lengths, impl):
    model.config._attn_implementation = impl
    try:
        flash = packed_only(model)
        assert flash == impl.startswith(("flash", "kernels"))
        plan = plan_micro_batches(
            _samples(lengths), max_tokens=48, layout=choose_layout(_samples(lengths), packed_only=flash)
        )
        for micro_batch in plan.micro_batches:
            batch = micro_batch_to_torch(micro_batch, torch.device("cpu"))
            inputs = _model_inputs(model, batch)
            # No mask under flash attention, or for rows of one sequence each (plain causal is exact)
            assert (inputs["attention_mask"] is None) == (flash or one_sequence_per_row(batch))
    finally:
        model.config._attn_implementation = "sdpa"


def test_sft_step_plans_packed_rows_under_flash_attention(model, monkeypatch):
    """Near-uniform lengths would be padded; a flash model gets packed rows (flash needs no CPU kernel here)."""
    import rollouts.loops.sft as sft
    from rollouts.backends import build_components
    from rollouts.types import OptimizerConfig, SFTConfig, TrainingState

    seen = []

    class Planned(Exception):
        pass

    def forward_backward(components, micro_batches, loss_fn, **kwargs):
        seen.extend(_model_inputs(components.model, mb)["attention_mask"] for mb in micro_batches)
        raise Planned

    monkeypatch.setattr(sft, "forward_backward", forward_backward)
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    components = build_components(model, OptimizerConfig(), num_training_steps=1)
    with pytest.raises(Planned):
        sft.sft_step(
            components, TrainingState(), _samples([10, 10, 9]), SFTConfig(max_length=16, max_tokens_per_micro_batch=64)
        )
    assert seen == [None]
