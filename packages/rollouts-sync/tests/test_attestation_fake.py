"""Weight updates against the fake engine: bf16 travels as bf16, and every update is attested (the
engine's checksums of what it received against the sender's), a corrupted tensor failing by name."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from rollouts.sync import AttestationError, HTTPOptions, RetryPolicy, VLLMEngine, sync_weights_to_engines
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.sync.raw import bfloat16 as bf16
from rollouts.sync.raw import encode_safetensors

FAST = HTTPOptions(retry=RetryPolicy(max_retries=0))
SHAPES = {"embed": (32, 16), "w1": (16, 16), "norm": (16,)}


def bf16_weights(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {name: bf16(rng.standard_normal(shape).astype(np.float32)) for name, shape in SHAPES.items()}


def write_dir(path, tensors) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(encode_safetensors(tensors))
    return str(path)


@pytest.mark.anyio
async def test_a_bf16_http_sync_moves_the_bf16_byte_count(tmp_path):
    state = FakeEngineState()
    weights = bf16_weights(1)
    num_elements = sum(int(np.prod(shape)) for shape in SHAPES.values())
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=FAST) as engine:
        await engine.update_weights_from_disk(write_dir(tmp_path / "v0", bf16_weights(0)), 1)
        upload = await engine.update_weights_from_tensors(weights, 2)
        assert await engine.weight_version() == 2
    assert upload == engine.last_upload
    assert upload.tensor_bytes == 2 * num_elements  # bf16: 2 bytes each, not float32's 4
    assert upload.num_tensors == 3 and upload.num_requests == 1
    # the worker fetched the raw safetensors payload once: the tensors' bytes, their header (the JSON
    # of 3 entries, padded to 8) and the response head; the request body carries only the URL
    payload = len(encode_safetensors(weights))
    assert payload - upload.tensor_bytes < 300
    assert payload < upload.fetched_bytes < payload + 200 and upload.body_bytes < 400
    assert upload.wire_bytes == upload.body_bytes + upload.fetched_bytes
    for name, tensor in weights.items():
        np.testing.assert_array_equal(state.weights[name], tensor.view())  # bit patterns as sent


@pytest.mark.anyio
async def test_the_inline_wire_moves_base64_in_chunks(tmp_path):
    state = FakeEngineState()
    weights = bf16_weights(1)
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=FAST, tensor_wire="inline") as engine:
        await engine.update_weights_from_disk(write_dir(tmp_path / "v0", bf16_weights(0)), 1)
        upload = await engine.update_weights_from_tensors(weights, 2, chunk_bytes=600)
        assert await engine.weight_version() == 2
    assert upload.num_tensors == 3 and upload.num_requests == 2  # chunked below 600 tensor bytes each
    # base64 carries 3 bytes in 4 characters; each body adds its safetensors header and the JSON around it
    assert 4 * upload.tensor_bytes / 3 < upload.body_bytes < 4 * upload.tensor_bytes / 3 + 2 * 1000
    assert upload.fetched_bytes == 0
    for name, tensor in weights.items():
        np.testing.assert_array_equal(state.weights[name], tensor.view())


HAS_TORCH = importlib.util.find_spec("torch") is not None


def assert_serves(state: FakeEngineState, weights: dict) -> None:
    assert state.held is None and sorted(state.weights) == sorted(weights)
    for name, tensor in weights.items():
        np.testing.assert_array_equal(state.weights[name], tensor.view())


@pytest.mark.anyio
@pytest.mark.parametrize(
    "wire",
    [
        "fetch",
        "inline",
        pytest.param("ipc", marks=pytest.mark.skipif(not HAS_TORCH, reason="the IPC wire needs torch")),
    ],
)
async def test_a_tensor_corrupted_in_the_engine_fails_attestation_naming_it_and_nothing_is_loaded(tmp_path, wire):
    state = FakeEngineState()
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=FAST, tensor_wire=wire) as engine:
        await engine.update_weights_from_disk(write_dir(tmp_path / "v0", bf16_weights(0)), 1)
        await engine.update_weights_from_tensors(bf16_weights(1), 2, chunk_bytes=600)  # ipc, inline: two calls
        assert_serves(state, bf16_weights(1))
        state.corrupt = "w1"
        with pytest.raises(AttestationError) as info:
            await engine.update_weights_from_tensors(bf16_weights(2), 3, chunk_bytes=600)
        assert info.value.mismatched == ("w1",) and info.value.weight_version == 3
        assert "w1" in str(info.value) and server.url in str(info.value)
        assert await engine.weight_version() == 2 and not state.paused  # the version is not claimed; resumed
        assert_serves(state, bf16_weights(1))  # the weights that failed were dropped unloaded
    if wire == "ipc":  # the IPC wire's file in /dev/shm goes with the client
        from rollouts.sync.ipc_handles import shm_dir

        assert not any(name.startswith(f"rollouts-ipc-{os.getpid()}-") for name in os.listdir(shm_dir()))


@pytest.mark.anyio
async def test_a_disk_sync_is_attested_through_the_fingerprint_rpc(tmp_path):
    state = FakeEngineState()
    v1 = write_dir(tmp_path / "v1", bf16_weights(1))
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=FAST) as engine:
        await sync_weights_to_engines([engine], v1, 1, timeout_s=30.0)
        state.corrupt = "embed"
        with pytest.raises(AttestationError, match="embed") as info:
            await sync_weights_to_engines([engine], write_dir(tmp_path / "v2", bf16_weights(2)), 2, timeout_s=30.0)
        assert info.value.mismatched == ("embed",)
        assert ("POST", "/collective_rpc") in state.calls
        assert_serves(state, bf16_weights(1))


@pytest.mark.anyio
async def test_attest_false_is_the_off_switch(tmp_path):
    state = FakeEngineState(corrupt="w1")
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=FAST, attest=False) as engine:
        await engine.update_weights_from_disk(write_dir(tmp_path / "v1", bf16_weights(1)), 1)
        await engine.update_weights_from_tensors(bf16_weights(2), 2)
        assert await engine.weight_version() == 2  # the corruption goes unnoticed without the check


@pytest.mark.anyio
async def test_a_sync_that_fails_after_the_workers_hold_its_tensors_has_them_dropped_unloaded(tmp_path, monkeypatch):
    """Here the sender's checksums fail (a bug of the sender's, say): the engine's workers had received
    and held the tensors; they drop them, nothing is loaded and the engine serves what it had."""
    import rollouts.sync.vllm as vllm_module

    def broken(_):
        raise RuntimeError("the sender's checksums failed")

    state = FakeEngineState()
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=FAST) as engine:
        await engine.update_weights_from_tensors(bf16_weights(1), 1)
        monkeypatch.setattr(vllm_module, "fingerprint", broken)
        with pytest.raises(RuntimeError, match="the sender's checksums failed"):
            await engine.update_weights_from_tensors(bf16_weights(2), 2)
        assert await engine.weight_version() == 1 and not state.paused
    assert_serves(state, bf16_weights(1))  # held, then dropped: never loaded
    rpcs = [target for _, target in state.calls if target == "/collective_rpc"]
    assert len(rpcs) == 2 + 2  # the first sync's fetch and commit; the second's fetch and discard
