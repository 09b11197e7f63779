"""The RL loop's engine sync over HTTP: a bf16 model's weights travel as bf16, every sync is attested
(on by default, engine.attest), and a tensor corrupted in the engine stops the sync naming it."""

from __future__ import annotations

import logging

import pytest
import safetensors.torch
import torch
import trio

from rollouts.loops.app.config import EngineSpec
from rollouts.loops.engines.remote import remote_engine
from rollouts.sync import AttestationError, HTTPOptions, RetryPolicy
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.sync.fingerprint import fingerprint

COMMON = {
    "api_key_env": "",
    "http": HTTPOptions(timeout_s=10.0, retry=RetryPolicy(max_retries=0)),
    "sync_timeout_s": 30.0,
}


def bf16_export(path, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(32, generator=generator).to(torch.bfloat16),
    }
    path.mkdir()
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return tensors


def test_attestation_is_on_by_default():
    assert EngineSpec().attest is True


def test_an_http_sync_of_a_bf16_model_moves_bf16_bytes_and_is_attested(tmp_path):
    sent = bf16_export(tmp_path / "v1", seed=1)

    async def main():
        async with serve_fake_engine(FakeEngineState()) as server:
            engine = remote_engine("vllm", [server.url], sync="http", **COMMON)
            await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
            assert await engine.weight_version() == 1
            return engine.last_upload, server.state

    upload, state = trio.run(main)
    assert upload.tensor_bytes == sum(t.numel() * 2 for t in sent.values())  # 2 bytes each, not float32's 4
    assert fingerprint(state.weights) == fingerprint(sent)  # the engine holds the bf16 bits sent


@pytest.mark.parametrize("sync", ["http", "disk"])
def test_a_tensor_corrupted_in_the_engine_stops_the_sync_naming_it(tmp_path, sync):
    bf16_export(tmp_path / "v1", seed=1)

    async def main():
        async with serve_fake_engine(FakeEngineState(corrupt="model.norm.weight")) as server:
            engine = remote_engine("vllm", [server.url], sync=sync, **COMMON)
            with pytest.raises(AttestationError, match="model.norm.weight") as info:
                await engine.update_weights_from_disk(str(tmp_path / "v1"), 1)
            assert await engine.weight_version() is None  # the engine never claims the version
            return info.value

    error = trio.run(main)
    assert error.mismatched == ("model.norm.weight",) and "engine.attest = false" in str(error)


def test_engines_that_cannot_attest_say_so_once(caplog):
    with caplog.at_level(logging.WARNING):
        remote_engine("sglang", ["http://127.0.0.1:1", "http://127.0.0.1:2"], **COMMON)
        unattested = remote_engine("vllm", ["http://127.0.0.1:1"], attest=False, **COMMON)
    lines = [r.getMessage() for r in caplog.records if "attestation is off" in r.getMessage()]
    assert len(lines) == 2 and "SGLang" in lines[0] and "engine.attest = false" in lines[1]
    assert unattested.engine.attest is False
