"""WeightBuckets gives what model_tensors gives (tied weights once, LoRA merged), bucket by bucket,
for any grouping of its names. (Under FSDP2 on two ranks: tests/test_sync_fsdp.py.)"""

import functools

import pytest
import torch
from helpers import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import WeightBuckets
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.backends.train.lora import apply_lora
from rollouts.types import LoraConfig


@functools.cache
def models() -> dict[str, torch.nn.Module]:
    """A model with tied embeddings, and a LoRA model whose adapter changes its weights."""
    lora = apply_lora(tiny_model(0), LoraConfig(rank=4, alpha=8.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # zero at init: a merge would change nothing
                p.normal_()
    return {"tied": tiny_model(0, tie_word_embeddings=True), "lora": lora}


@settings(deadline=None, max_examples=20)
@given(kind=st.sampled_from(["tied", "lora"]), cuts=st.sets(st.integers(1, 40)))
def test_the_buckets_hold_the_models_full_weights_for_any_grouping(kind, cuts):
    model = models()[kind]
    expected = model_tensors(model)
    weights = WeightBuckets(model)
    specs = weights.specs()
    assert [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in expected.items()] == specs
    names = [n for n, _, _ in specs]
    bounds = [0, *sorted(c for c in cuts if c < len(names)), len(names)]
    groups = [names[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    got = {}
    for group, bucket in zip(groups, weights.buckets(groups), strict=True):
        got.update(zip(group, bucket, strict=True))
    assert list(got) == names
    for name in names:
        assert got[name].is_contiguous() and got[name].equal(expected[name]), name


def test_the_lora_merge_is_counted_until_dropped_and_unknown_names_are_refused():
    model = models()["lora"]
    weights = WeightBuckets(model)
    merged = "model.layers.0.self_attn.q_proj.weight"
    (bucket,) = weights.buckets([[merged]])
    assert weights.held_bytes == bucket[0].numel() * 4  # the merged float32 weight, made here
    del bucket
    assert weights.held_bytes == 0
    with pytest.raises(ValueError, match="lora_A"):
        next(weights.buckets([["model.layers.0.self_attn.q_proj.lora_A.default.weight"]]))
