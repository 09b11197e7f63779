"""ProcessEngine attests every full-weight sync: the engine process answers the checksums of the
weights its model holds after the load, and a tensor corrupted there fails the sync by name."""

import pytest
import safetensors.torch
import trio
from helpers import tiny_model

from rollouts.backends import ProcessEngine
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.sync import AttestationError
from rollouts.types import SamplingParams

pytestmark = pytest.mark.slow  # each test starts engine processes (seconds each)

CORRUPTED = "model.layers.0.mlp.down_proj.weight"


def _weights_dir(model, path):
    path.mkdir()
    model.config.save_pretrained(path)
    safetensors.torch.save_file(model_tensors(model), path / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def test_syncs_pass_attestation_until_a_tensor_is_corrupted_in_the_engine_process(monkeypatch, tmp_path):
    """float32 weights into a float32 engine pass, by shared memory and from disk; then the engine
    process corrupts a tensor after each load (fault injection, read at every load from a file) and
    both syncs fail naming it, the version unclaimed and the process healthy; it samples nothing from
    the weights that failed, and again once a sync passes."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("ROLLOUTS_SYNC_FAULT", f"file:{fault}")  # read by the engine process it starts
    base, other = tiny_model(seed=0), tiny_model(seed=5)
    with ProcessEngine.from_model(base, weight_version=0) as engine:
        trio.run(engine.load_weights, model_tensors(other), 1)
        trio.run(engine.update_weights_from_disk, _weights_dir(base, tmp_path / "w"), 2)
        assert trio.run(engine.weight_version) == 2
        fault.write_text(f"corrupt:{CORRUPTED}")
        with pytest.raises(AttestationError) as info:
            trio.run(engine.load_weights, model_tensors(other), 3)
        assert info.value.mismatched == (CORRUPTED,) and CORRUPTED in str(info.value)
        assert trio.run(engine.weight_version) == 2  # the version is not claimed
        with pytest.raises(AttestationError, match=CORRUPTED):
            trio.run(engine.update_weights_from_disk, _weights_dir(other, tmp_path / "w2"), 4)
        assert trio.run(engine.health)  # a refused sync names the tensors; the process itself is fine
        with pytest.raises(RuntimeError, match=f"samples nothing until a weight sync passes.*{CORRUPTED}"):
            trio.run(engine.generate, [[5, 6]], SamplingParams(max_new_tokens=2))
        fault.unlink()
        trio.run(engine.load_weights, model_tensors(base), 5)
        assert len(trio.run(engine.generate, [[5, 6]], SamplingParams(max_new_tokens=2))) == 1


def test_syncs_of_float32_weights_pass_attestation_in_a_bf16_engine(tmp_path):
    """The client checks against the weights cast to the engine's dtype, as its model holds them."""
    base, other = tiny_model(seed=0), tiny_model(seed=5)
    with ProcessEngine.from_model(base, weight_version=0, dtype="bfloat16") as engine:
        trio.run(engine.load_weights, model_tensors(other), 1)
        trio.run(engine.update_weights_from_disk, _weights_dir(base, tmp_path / "w"), 2)
        assert trio.run(engine.weight_version) == 2


def test_attest_false_is_the_off_switch(monkeypatch):
    monkeypatch.setenv("ROLLOUTS_SYNC_FAULT", f"corrupt:{CORRUPTED}")
    base, other = tiny_model(seed=0), tiny_model(seed=5)
    with ProcessEngine.from_model(base, weight_version=0, attest=False) as engine:
        trio.run(engine.load_weights, model_tensors(other), 1)  # unchecked: the corruption goes unnoticed
        assert len(trio.run(engine.generate, [[5, 6]], SamplingParams(max_new_tokens=2))) == 1
