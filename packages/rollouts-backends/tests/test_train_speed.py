"""The GPU levers, checked on CPU: document-masked attention for packed rows (FlexAttention) and
regional compilation of the decoder layers, each against the plain path it replaces."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import grads, packed_batch, padded_batch, random_sequences, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import (
    attention_mask_4d,
    build_components,
    compute_logprobs,
    document_masked,
    forward_backward,
)
from rollouts.backends.train.attention import DOCUMENT_SDPA, document_block_mask
from rollouts.backends.train.components import use_document_attention
from rollouts.backends.train.inputs import micro_batch_to_torch, model_inputs
from rollouts.backends.train.regional_compile import compile_layers
from rollouts.losses import sft_loss_fn
from rollouts.types import OptimizerConfig

LENGTHS = [7, 19, 12]
FLOAT32_EPS = float(torch.finfo(torch.float32).eps)


def _document_model(seed: int = 0) -> torch.nn.Module:
    model = tiny_model(seed, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    use_document_attention(model)
    return model


def test_use_document_attention_switches_sdpa_models_only():
    model = _document_model()
    assert model.config._attn_implementation == DOCUMENT_SDPA
    eager = tiny_model(attn="eager")
    use_document_attention(eager)
    assert eager.config._attn_implementation == "eager"
    assert document_masked(model, torch.device("cuda")) and not document_masked(model, torch.device("cpu"))
    assert not document_masked(tiny_model(), torch.device("cuda"))  # plain sdpa: the dense mask


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    padding=st.integers(0, 5),
    rows=st.integers(1, 2),
)
def test_the_block_mask_allows_what_the_dense_mask_allows(lengths, padding, rows):
    row = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * padding
    segment_ids_B_T = torch.tensor([row] * rows)
    t = segment_ids_B_T.shape[1]
    block_mask = document_block_mask(segment_ids_B_T)
    q, kv = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for b in range(rows):
        allowed_T_T = block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        assert torch.equal(allowed_T_T, attention_mask_4d(segment_ids_B_T)[b, 0])


def test_packed_rows_through_flex_attention_match_per_sequence_forwards():
    """Three sequences of different lengths in one row; FlexAttention runs eagerly (no grad) on CPU."""
    model = _document_model()
    seqs = random_sequences(np.random.default_rng(1), LENGTHS)
    batch = micro_batch_to_torch(packed_batch(seqs), torch.device("cpu"))
    inputs = model_inputs(model, batch)
    inputs["attention_mask"] = document_block_mask(batch.segment_ids)  # what CUDA batches get
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's "not compiled" warning
        packed_T_V = model(**inputs).logits[0]
        alone_T_V = torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])
    # The same float32 products and softmax over the same keys, summed in another order: a few
    # roundings of the logits' size (about 1), far below any leak across sequences (order 0.1).
    torch.testing.assert_close(packed_T_V, alone_T_V, rtol=0, atol=64 * FLOAT32_EPS * float(alone_T_V.abs().max()))


def test_document_attention_keeps_the_dense_path_on_cpu():
    """Outside a CUDA BlockMask the function is transformers' SDPA: the same bits as an "sdpa" model."""
    seqs = random_sequences(np.random.default_rng(2), LENGTHS)
    plain = build_components(
        tiny_model(3, hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
        OptimizerConfig(),
        num_training_steps=1,
    )
    document = build_components(_document_model(3), OptimizerConfig(), num_training_steps=1)
    for batch in (packed_batch(seqs), padded_batch(seqs)):
        np.testing.assert_array_equal(compute_logprobs(document, [batch])[0], compute_logprobs(plain, [batch])[0])


def test_compute_logprobs_returns_each_micro_batch_in_its_own_shape():
    components = build_components(tiny_model(), OptimizerConfig(), num_training_steps=1)
    seqs = random_sequences(np.random.default_rng(4), [5, 11, 3, 8])
    batches = [packed_batch(seqs[:2]), padded_batch(seqs[2:])]
    together = compute_logprobs(components, batches)
    assert [a.shape for a in together] == [b.input_ids.shape for b in batches]
    for got, batch in zip(together, batches, strict=True):
        np.testing.assert_array_equal(got, compute_logprobs(components, [batch])[0])


def test_compile_layers_rejects_an_unknown_mode_and_leaves_none_eager():
    model = tiny_model()
    with pytest.raises(ValueError, match="compile mode"):
        compile_layers(model, "model")  # type: ignore[arg-type]
    compile_layers(model, "none")
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)


def test_compiled_layers_give_the_eager_loss_and_gradients():
    seqs = random_sequences(np.random.default_rng(5), [5, 11, 3, 8])
    batches = [packed_batch(seqs[:2]), padded_batch(seqs[2:])]
    out = {}
    for mode in ("none", "layers"):
        components = build_components(tiny_model(), OptimizerConfig(), num_training_steps=1)
        compile_layers(components.model, mode)
        metrics = forward_backward(components, batches, sft_loss_fn(), num_tokens=20, num_sequences=4)
        out[mode] = metrics["loss"], grads(components.model)
    assert all(layer._compiled_call_impl is not None for layer in components.model.model.layers)
    # Inductor fuses each layer's elementwise ops and may reorder its float32 sums (the RMSNorm's
    # mean over 64 features, the softmax over at most 11 keys): each value moves by some roundings.
    (loss_eager, grads_eager), (loss_compiled, grads_compiled) = out["none"], out["layers"]
    assert loss_compiled == pytest.approx(loss_eager, rel=64 * FLOAT32_EPS)
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_rows_on_cuda_take_the_block_mask_and_the_dense_gradients():
    seqs = random_sequences(np.random.default_rng(6), LENGTHS)
    out = {}
    for document in (False, True):
        model = tiny_model(7, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
        components = build_components(model, OptimizerConfig(), num_training_steps=1, device="cuda")
        if not document:  # back to the dense mask build_components switched away from
            components.model.set_attn_implementation("sdpa")
        batch = micro_batch_to_torch(packed_batch(seqs), components.device)
        mask = model_inputs(components.model, batch)["attention_mask"]
        assert (type(mask).__name__ == "BlockMask") is document
        forward_backward(components, [packed_batch(seqs)], sft_loss_fn(), num_tokens=35, num_sequences=3)
        out[document] = grads(components.model)
    for name, grad in out[False].items():  # float32; TF32 off by default for matmuls
        torch.testing.assert_close(out[True][name], grad, rtol=1e-4, atol=1e-5, msg=name)
