"""LoRA training with PEFT: only adapter weights train, the reference is the base with the adapter off."""

import json
import sys

import numpy as np
import pytest
import torch
from fsdp_worker import GLOBAL_SEQUENCES, NUM_STEPS
from helpers import TRAIN_CONFIG_KW, packed_batch, tiny_model
from safetensors.torch import load_file
from test_fsdp import _REL_TOL, _WEIGHT_ATOL, _torchrun

from rollouts.backends import build_components, compute_logprobs, forward_backward, load_hf_model, optim_step
from rollouts.backends.train.lora import (
    AdapterDisabled,
    adapter_state_dict,
    apply_lora,
    has_lora,
    reference_components,
    require_peft,
)
from rollouts.losses import sft_loss_fn
from rollouts.types import LoraConfig, OptimizerConfig, TrainingState

LORA = LoraConfig(rank=4, alpha=8.0)


def _train(components, num_steps=3, seqs=GLOBAL_SEQUENCES):
    batch = packed_batch(seqs)
    n = int((batch.loss_mask > 0).sum())
    state, losses, norms = TrainingState(), [], []
    for _ in range(num_steps):
        metrics = forward_backward(components, [batch], sft_loss_fn(), num_tokens=n, num_sequences=len(seqs))
        state, om = optim_step(
            components, state, OptimizerConfig(**TRAIN_CONFIG_KW), num_tokens=n, num_samples=len(seqs)
        )
        losses.append(metrics["loss"])
        norms.append(om["grad_norm"])
    return state, losses, norms


def _lora_components(seed=0, dtype=torch.float32, lora=LORA):
    return build_components(
        tiny_model(seed, dtype=dtype), OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS, lora=lora
    )


def test_only_adapter_weights_are_in_the_optimizer_and_change():
    components = _lora_components()
    model = components.model
    in_optimizer = {id(p) for g in components.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in in_optimizer}
    # 7 projections per layer x 2 layers x (A, B)
    assert len(names) == 28 and all(".lora_A." in n or ".lora_B." in n for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, losses, _ = _train(components)
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        # lora_A gets no gradient on the first step (B starts at 0) but moves afterwards
        assert changed == (n in names), n


def test_a_fresh_adapter_leaves_the_fused_log_probs_unchanged_and_gets_gradients():
    base = build_components(tiny_model(0), OptimizerConfig(), num_training_steps=1)
    components = _lora_components()
    batch = packed_batch(GLOBAL_SEQUENCES)
    # B = 0: the adapter adds exactly zero to every projection
    np.testing.assert_array_equal(compute_logprobs(components, [batch])[0], compute_logprobs(base, [batch])[0])
    n = int((batch.loss_mask > 0).sum())
    forward_backward(components, [batch], sft_loss_fn(), num_tokens=n, num_sequences=4)
    grads = {n: p.grad for n, p in components.model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    assert any(float(g.abs().max()) > 0 for n, g in grads.items() if ".lora_B." in n)


def test_the_reference_is_the_base_model_loaded_separately(tmp_path):
    tiny_model(3).save_pretrained(tmp_path / "base", safe_serialization=True)
    components = build_components(
        tmp_path / "base", OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=NUM_STEPS, lora=LORA
    )
    _train(components)
    batch = packed_batch(GLOBAL_SEQUENCES)
    trained = compute_logprobs(components, [batch])[0]
    ref_components = reference_components(components)
    assert isinstance(ref_components.model, AdapterDisabled)
    separately = build_components(load_hf_model(tmp_path / "base"), OptimizerConfig(), num_training_steps=1)
    expected = compute_logprobs(separately, [batch])[0]
    # Disabled LoRA layers call the frozen base layer alone: the same operations, bitwise equal.
    np.testing.assert_array_equal(compute_logprobs(ref_components, [batch])[0], expected)
    assert float(np.abs(trained - expected).max()) > 1e-3  # the adapter did train
    # the trained model is unchanged by the reference pass: adapter on, training mode, adapter trainable
    np.testing.assert_array_equal(compute_logprobs(components, [batch])[0], trained)
    assert {n for n, p in components.model.named_parameters() if p.requires_grad} == {
        n for n, _ in components.model.named_parameters() if ".lora_" in n
    }


def test_adapter_state_dict_uses_peft_names():
    model = apply_lora(tiny_model(0), LoraConfig(rank=2, target_modules=("q_proj",)))
    state = adapter_state_dict(model)
    assert sorted(state) == [
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{ab}.weight" for i in (0, 1) for ab in "AB"
    ]
    assert state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (2, 64)


def test_target_modules_that_match_nothing_are_named():
    with pytest.raises(ValueError, match=r"'qkv_proj' matches no linear layer.*'q_proj'"):
        apply_lora(tiny_model(0), LoraConfig(rank=4, target_modules=("q_proj", "qkv_proj")))


def test_a_rank_larger_than_a_layer_is_named():
    # k_proj maps 64 -> 32 (one key/value head of 32): rank 33 cannot fit it
    with pytest.raises(ValueError, match=r"rank = 33 is larger than layer 'model.layers.0.self_attn.k_proj'.*<= 32"):
        apply_lora(tiny_model(0), LoraConfig(rank=33))
    assert has_lora(apply_lora(tiny_model(0), LoraConfig(rank=32)))


def test_the_output_projection_cannot_carry_an_adapter():
    with pytest.raises(ValueError, match="output projection 'lm_head'"):
        apply_lora(tiny_model(0), LoraConfig(rank=4, target_modules=("lm_head",)))


def test_bad_lora_config_values_are_named():
    with pytest.raises(ValueError, match=r"LoraConfig.rank.*-1"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match=r"LoraConfig.dropout"):
        LoraConfig(rank=4, dropout=1.0)
    with pytest.raises(ValueError, match=r"target_modules\[0\] = '\(' must be a module name or regex"):
        LoraConfig(rank=4, target_modules=("(",))
    with pytest.raises(ValueError, match="rank >= 1"):
        apply_lora(tiny_model(0), LoraConfig())


def test_missing_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"rollouts-backends\[lora\]"):
        require_peft()


@pytest.mark.slow
def test_lora_under_fsdp2_on_two_gloo_ranks_matches_one_process(tmp_path):
    _torchrun("lora_fsdp_worker.py", tmp_path)
    result = json.loads((tmp_path / "lora.json").read_text())
    single = _lora_components(dtype=torch.float64)
    _, losses, norms = _train(single)
    assert result["losses"] == pytest.approx(losses, rel=_REL_TOL)
    assert result["grad_norms"] == pytest.approx(norms, rel=_REL_TOL)
    adapter, expected = load_file(str(tmp_path / "adapter.safetensors")), adapter_state_dict(single.model)
    assert set(adapter) == set(expected)
    worst = max(float((adapter[k] - expected[k]).abs().max()) for k in expected)
    assert worst <= _WEIGHT_ATOL
    resumed = load_file(str(tmp_path / "resumed.safetensors"))  # saved sharded, loaded into a fresh sharded model
    assert set(resumed) == set(adapter) and all(torch.equal(resumed[k], adapter[k]) for k in adapter)
    files = json.loads((tmp_path / "ckpt" / f"step_{NUM_STEPS}" / "state.json").read_text())["files"]
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    reference = compute_logprobs(reference_components(single), [packed_batch(GLOBAL_SEQUENCES)])[0]
    np.testing.assert_allclose(np.array(result["reference"]), reference, rtol=0, atol=1e-10)
