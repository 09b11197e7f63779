"""The sampler's fast decode path reproduces the HF forward: same tokens, same log-probs."""

import numpy as np
import pytest
import torch
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from rollouts.backends import generate
from rollouts.backends.sampling.decode import fast_decoder
from rollouts.types import SamplingParams


def _llama(seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama with no KV-head grouping, biased attention and llama3 rope scaling."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        attention_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
            "original_max_position_embeddings": 64,
        },
        eos_token_id=1,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


MODELS = {"qwen2-gqa": lambda: tiny_model(seed=1), "llama": _llama}


def _assert_same_samples(fast, slow):
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert a.tokens == b.tokens and a.status == b.status
        np.testing.assert_allclose(a.rollout_logprobs, b.rollout_logprobs, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fast_path_is_taken_for_llama_family_models(name):
    assert fast_decoder(MODELS[name](), total_length=32) is not None


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(MODELS)),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    n=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    stop=st.booleans(),
)
def test_fast_and_hf_decoding_sample_the_same(name, lengths, n, seed, stop):
    """Left padding, row dropping on stop tokens, GQA and rope scaling: identical samples."""
    model = MODELS[name]()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 128, size=k).tolist() for k in lengths]
    params = SamplingParams(
        n=n, max_new_tokens=10, temperature=1.0, seed=seed, stop_token_ids=tuple(range(100, 128)) if stop else ()
    )
    _assert_same_samples(generate(model, prompts, params), generate(model, prompts, params, fast_decode=False))


def test_step_logits_match_a_full_forward():
    model = tiny_model(seed=2)
    model.eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    continuation = [9, 10, 11]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        decoder = fast_decoder(model, total_length=7)
        decoder.load_cache(cache, repeats=2, capacity=7, mask_B_L=None)
        full = model(input_ids=torch.tensor([[5, 6, 7, 8, *continuation]])).logits[0]
        for i, token in enumerate(continuation):
            logits = decoder.step(torch.tensor([token, token]), torch.tensor([4 + i, 4 + i]))
            torch.testing.assert_close(logits, full[4 + i].expand(2, -1), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="decode cache is full"):
            decoder.step(torch.tensor([1, 1]), torch.tensor([7, 7]))


def test_architectures_the_fast_path_does_not_reproduce_fall_back():
    # A sliding window shorter than the sequence changes attention: the HF forward must run.
    windowed = tiny_model(seed=0, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert [layer.self_attn.sliding_window for layer in windowed.model.layers] == [4, 4]
    assert fast_decoder(windowed, total_length=16) is None
    assert fast_decoder(windowed, total_length=4) is not None  # the window covers every position
    # Eager attention casts probabilities to the model dtype before @ V: in bf16 SDPA would sample differently.
    assert fast_decoder(tiny_model(seed=0, attn="eager"), total_length=16) is None
    gelu = tiny_model(seed=0, hidden_act="gelu")
    assert fast_decoder(gelu, total_length=16) is None
    samples = generate(gelu, [[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert [s.response_length for s in samples] == [4, 4]


def test_bfloat16_decoding_is_bit_identical_to_the_hf_forward():
    """The same operations in the same order: in bf16, where any reordering would show, nothing differs."""
    model = tiny_model(seed=1).to(torch.bfloat16)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]
    fast = generate(model, prompts, SamplingParams(n=3, max_new_tokens=20, seed=5))
    slow = generate(model, prompts, SamplingParams(n=3, max_new_tokens=20, seed=5), fast_decode=False)
    assert [s.tokens for s in fast] == [s.tokens for s in slow]
    assert [s.rollout_logprobs for s in fast] == [s.rollout_logprobs for s in slow]


@settings(max_examples=20, deadline=None)
@given(biases=st.lists(st.booleans(), min_size=1, max_size=3), seed=st.integers(0, 2**16))
def test_stacked_projections_give_each_projection_its_own_columns(biases, seed):
    """One matmul over the stacked weights: each projection's columns, bias or none, as if run alone."""
    from rollouts.backends.sampling.decode import _stacked

    torch.manual_seed(seed)
    projections = [torch.nn.Linear(16, 8 * (i + 1), bias=b) for i, b in enumerate(biases)]
    x = torch.randn(5, 16)
    weight, bias = _stacked(*projections)
    assert (bias is None) == (not any(biases))
    columns = torch.nn.functional.linear(x, weight, bias).split([p.out_features for p in projections], dim=-1)
    for projection, out in zip(projections, columns, strict=True):
        # Same dot products; a projection without bias gets + 0.0 (exact) when another has one
        torch.testing.assert_close(out, projection(x), rtol=1e-6, atol=1e-6)
