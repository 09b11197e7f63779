"""The loops' micro-batch layout: padded for near-uniform lengths, always packed under flash attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import micro_batch_to_torch, packed_only
from rollouts.backends.train.inputs import model_inputs, one_sequence_per_row
from rollouts.data import plan_micro_batches
from rollouts.loops.micro_batches import attention_pair_cost, choose_layout, plan_shard
from rollouts.loops.recipes.tiny import build_tiny_model
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


def test_attention_pair_cost_is_the_ratio_of_multiply_adds(model):
    # hidden 64, intermediate 64, 2 heads of 32, 1 kv head: per pair 2 * 64; per token
    # q and o 2 * 64 * 64, k and v 2 * 64 * 32, gated MLP 3 * 64 * 64.
    per_token = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 64
    assert attention_pair_cost(model.config) == pytest.approx(2 * 64 / per_token, rel=1e-12)
    assert attention_pair_cost(object()) is None


def test_short_sequences_pad_when_packing_them_costs_more_attention():
    # 32 samples of 7..22 tokens (fill 0.83): one packed row of 584 tokens attends over the whole
    # row; padding to 22 wastes 120 tokens but its attention is 22 wide.
    lengths = [22] * 20 + [7, 9, 11, 13, 15, 17] * 2
    assert choose_layout(_samples(lengths)) == "packed"  # no cost known: fewest tokens
    assert choose_layout(_samples(lengths), pair_cost=1e-3) == "padded"
    # A large model (attention cheap beside the projections) and a long tail still pack.
    assert choose_layout(_samples([400, 20, 20, 20]), pair_cost=5e-5) == "packed"


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 64), min_size=1, max_size=32),
    pair_cost=st.floats(0.0, 0.1),
    max_tokens=st.integers(64, 4096),
)
def test_the_cost_model_picks_the_layout_with_fewer_estimated_operations(lengths, pair_cost, max_tokens):
    """Padded wins at >= 90% fill; otherwise whichever layout's tokens plus attention pairs cost less."""
    chosen = choose_layout(_samples(lengths), pair_cost=pair_cost, max_tokens=max_tokens)
    longest, total, rows = max(lengths), sum(lengths), len(lengths)
    padded = rows * longest * (1 + pair_cost * longest / 2)
    packed = total * (1 + pair_cost * min(total, max_tokens))
    if total >= 0.9 * rows * longest:
        assert chosen == "padded"
    else:
        assert chosen == ("padded" if padded <= packed else "packed")
    # No attention cost: the layout with fewer tokens (padding costs, packing does not)
    if pair_cost == 0.0 and total < 0.9 * rows * longest:
        assert chosen == "packed"


def test_plan_shard_pads_short_completions_of_a_small_model(model):
    from rollouts.backends import build_components
    from rollouts.types import OptimizerConfig

    components = build_components(model, OptimizerConfig(), num_training_steps=1)
    lengths = [22] * 20 + [7, 9, 11, 13, 15, 17] * 2
    shard = plan_shard(components, _samples(lengths), max_tokens_per_micro_batch=8192)
    assert [mb.input_ids.shape for mb in shard.micro_batches] == [(32, 22)]


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
            inputs = model_inputs(model, batch)
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
        seen.extend(model_inputs(components.model, mb)["attention_mask"] for mb in micro_batches)
        raise Planned

    monkeypatch.setattr(sft, "forward_backward", forward_backward)
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    components = build_components(model, OptimizerConfig(), num_training_steps=1)
    with pytest.raises(Planned):
        sft.sft_step(
            components, TrainingState(), _samples([10, 10, 9]), SFTConfig(max_length=16, max_tokens_per_micro_batch=64)
        )
    assert seen == [None]


def test_plan_shard_packs_when_packed_rows_attend_within_their_sequences():
    """The short completions that pad under the dense mask pack when DOCUMENT_SDPA runs them on CUDA."""
    import dataclasses

    from rollouts.backends import build_components
    from rollouts.backends.train.components import use_document_attention
    from rollouts.types import OptimizerConfig

    fresh = build_tiny_model(
        16, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=64
    )
    components = build_components(fresh, OptimizerConfig(), num_training_steps=1)
    use_document_attention(components.model)
    lengths = [22] * 20 + [7, 9, 11, 13, 15, 17] * 2
    on_cpu = plan_shard(components, _samples(lengths), max_tokens_per_micro_batch=8192)
    assert [mb.input_ids.shape for mb in on_cpu.micro_batches] == [(32, 22)]  # the dense mask there
    on_cuda = dataclasses.replace(components, device=torch.device("cuda"))  # planning only: nothing runs
    shard = plan_shard(on_cuda, _samples(lengths), max_tokens_per_micro_batch=8192)
    assert [mb.input_ids.shape for mb in shard.micro_batches] == [(1, sum(lengths))]
