"""LoRA checkpoints: the adapter alone in PEFT's format, exact resume, merged export, wrong bases refused."""

import json

import pytest
import torch
from helpers import TRAIN_CONFIG_KW, VOCAB, tiny_model, train_steps
from transformers import AutoModelForCausalLM

from rollouts.backends import build_components, export_weights, latest_checkpoint, load_checkpoint, save_checkpoint
from rollouts.backends.checkpoint.lora_files import load_adapter_dir, save_adapter
from rollouts.types import LoraConfig, OptimizerConfig, TrainingState

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _components(seed=0, lora=LORA):
    return build_components(tiny_model(seed), OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=8, lora=lora)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_exact_resume_from_an_adapter_checkpoint_is_bit_identical(tmp_path):
    torch.manual_seed(7)
    straight = _components()
    train_steps(straight, TrainingState(), 5)

    torch.manual_seed(7)
    first = _components()
    state = train_steps(first, TrainingState(), 2)
    path = save_checkpoint(first, state, tmp_path)
    torch.manual_seed(999)  # another adapter init and RNG stream: load restores both
    resumed = _components()
    loaded, _ = load_checkpoint(resumed, path)
    assert loaded == state
    train_steps(resumed, loaded, 3)
    for (n, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    for (_, sa), (_, sb) in zip(straight.optimizer.state.items(), resumed.optimizer.state.items(), strict=True):
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def test_the_checkpoint_is_the_adapter_alone_and_peft_loads_it(tmp_path):
    from peft import PeftModel

    tiny_model(0).save_pretrained(tmp_path / "base", safe_serialization=True)
    components = build_components(
        tmp_path / "base", OptimizerConfig(**TRAIN_CONFIG_KW), num_training_steps=8, lora=LORA
    )
    state = train_steps(components, TrainingState(), 2)
    path = save_checkpoint(components, state, tmp_path / "ckpt")
    assert latest_checkpoint(tmp_path / "ckpt") == path
    record = json.loads((path / "state.json").read_text())
    assert set(record["files"]) == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "rollouts_adapter.json",
        "optimizer.safetensors",
    }
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    base_bytes = (tmp_path / "base" / "model.safetensors").stat().st_size
    assert (path / "adapter_model.safetensors").stat().st_size < base_bytes / 10

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), str(path))
    ids = torch.randint(2, VOCAB, (2, 9))
    components.model.eval()
    torch.testing.assert_close(_logits(peft_model, ids), _logits(components.model, ids), rtol=0, atol=1e-6)


def test_export_writes_merged_weights_that_transformers_loads(tmp_path):
    components = _components()
    train_steps(components, TrainingState(), 2)
    directory, manifest = export_weights(components, tmp_path / "merged")
    assert not any(".lora_" in n or "base_layer" in n for n in manifest["tensors"])
    merged = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    assert set(merged.state_dict()) == set(tiny_model(0).state_dict())
    ids = torch.randint(2, VOCAB, (2, 9))
    components.model.eval()
    torch.testing.assert_close(_logits(merged, ids), _logits(components.model, ids), rtol=0, atol=1e-5)


def test_an_adapter_for_another_base_model_is_refused(tmp_path):
    components = _components(seed=0)
    state = train_steps(components, TrainingState(), 1)
    path = save_checkpoint(components, state, tmp_path)
    other = _components(seed=5)  # same architecture, other weights
    with pytest.raises(ValueError, match=r"adapter for another base model \(base fingerprint '[0-9a-f]{16}'"):
        load_checkpoint(other, path)
    with pytest.raises(ValueError, match=r"r = 4 but the model's adapter has 8"):
        load_adapter_dir(_components(lora=LoraConfig(rank=8, target_modules=LORA.target_modules)).model, path)
    full = build_components(tiny_model(0), OptimizerConfig(), num_training_steps=1)
    with pytest.raises(ValueError, match="holds a LoRA adapter but the model has none"):
        load_checkpoint(full, path)


def test_save_adapter_round_trips(tmp_path):
    components = _components()
    train_steps(components, TrainingState(), 2)
    save_adapter(components.model, tmp_path / "adapter")
    save_adapter(components.model, tmp_path / "adapter")  # replaces it
    fresh = _components()
    load_adapter_dir(fresh.model, tmp_path / "adapter")
    for (n, a), (_, b) in zip(components.model.named_parameters(), fresh.model.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
