"""`[engine] sync = "broadcast"`: the run file's setting, and an engine it builds pushing weights (in
their own dtype) to the fake SGLang server through a gloo group: from exported files, or straight
from the model bucket by bucket in the RL loop's sync."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import trio
from safetensors.torch import save_file

from rollouts.backends import build_components
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.loops.app.config import EngineSpec
from rollouts.loops.engines.broadcast import BroadcastWeights
from rollouts.loops.engines.remote import SendWeights, remote_engine
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.generation import sync_engine
from rollouts.sync import AttestationError, BroadcastOptions, HTTPOptions, RetryPolicy, SGLangEngine, WeightSyncError
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.types import Abortable, OptimizerConfig, TrainingState, WeightLoader


def test_broadcast_is_a_sync_for_server_engines_only():
    assert EngineSpec(kind="sglang", urls=("http://127.0.0.1:1",), sync="broadcast").sync == "broadcast"
    assert EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="broadcast").sync == "broadcast"
    with pytest.raises(ValueError, match="EngineSpec.sync"):
        EngineSpec(kind="inprocess", sync="broadcast")


def test_the_http_wire_is_chosen_in_the_run_file_and_reaches_the_vllm_client():
    assert EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="http").http_wire == "fetch"
    spec = EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="http", http_wire="inline")
    common = {
        "api_key_env": "",
        "http": HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0)),
        "sync_timeout_s": 60.0,
    }
    engine = remote_engine("vllm", spec.urls, sync="http", http_wire=spec.http_wire, **common)
    assert engine.engine.engine.tensor_wire == "inline"  # BoundedSync > SendWeights > VLLMEngine
    with pytest.raises(ValueError, match="EngineSpec.http_wire"):
        EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="disk", http_wire="inline")
    # one server takes the model's tensors directly (a WeightLoader); several send the exported files
    one = remote_engine("vllm", spec.urls, sync="http", http_wire="ipc", **common)
    assert isinstance(one.engine, SendWeights) and isinstance(one, WeightLoader)
    assert one.engine.engine.tensor_wire == "ipc" and one.engine.sync_timeout_s == 60.0
    two = remote_engine("vllm", [*spec.urls, "http://127.0.0.1:2"], sync="http", http_wire="ipc", **common)
    assert not isinstance(two, WeightLoader) and {e.engine.tensor_wire for e in two.engines} == {"ipc"}
    with pytest.raises(ValueError, match="EngineSpec.http_wire"):
        EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="http", http_wire="base64")
    with pytest.raises(ValueError, match=r"engine.http_wire = 'ipc' .* http://192\.0\.2\.1:8000 is not this machine"):
        remote_engine("vllm", ["http://192.0.2.1:8000"], sync="http", http_wire="ipc", **common)


def test_a_wrapped_engines_capabilities_are_found_as_python_3_12_looks_for_them():
    """From 3.12 isinstance against a runtime protocol looks attributes up statically (never
    __getattr__): a wrapper must hold abort / load_weights / push_weights itself, and only when its
    engine has them."""
    common = {"api_key_env": "", "http": HTTPOptions(retry=RetryPolicy(max_retries=0)), "sync_timeout_s": 60.0}
    one = remote_engine("vllm", ("http://127.0.0.1:1",), sync="http", http_wire="ipc", **common)
    assert callable(inspect.getattr_static(one, "load_weights")) and isinstance(one, WeightLoader)
    by_disk = remote_engine("vllm", ("http://127.0.0.1:1",), sync="disk", **common)
    with pytest.raises(AttributeError):  # the engine cannot take tensors: neither can its wrapper
        inspect.getattr_static(by_disk, "load_weights")
    assert not isinstance(by_disk, WeightLoader) and not isinstance(by_disk, Abortable)
    pushed = remote_engine("sglang", ("http://127.0.0.1:1",), sync="broadcast", **common)
    assert inspect.getattr_static(pushed, "bucket_bytes") == BroadcastOptions().bucket_bytes
    assert callable(inspect.getattr_static(pushed, "push_weights"))


class _SlowEngine:
    """Stands in for a VLLMEngine: its sync never ends, or fails at once."""

    name = "http://127.0.0.1:9"

    def __init__(self, error=None):
        self.error = error

    async def update_weights_from_tensors(self, tensors, weight_version):
        if self.error is not None:
            raise self.error
        await trio.sleep_forever()


def test_a_sync_of_the_models_tensors_is_bounded_and_named_like_any_sync():
    tensors = {"w": torch.zeros(2)}

    async def load(engine):
        await SendWeights(engine, sync_timeout_s=0.2).load_weights(tensors, 3)

    with pytest.raises(WeightSyncError, match=r"http://127\.0\.0\.1:9.*did not finish within sync_timeout_s=0\.2"):
        trio.run(load, _SlowEngine())
    with pytest.raises(WeightSyncError, match=r"http://127\.0\.0\.1:9.*OSError: no such file"):
        trio.run(load, _SlowEngine(OSError("no such file")))
    mismatch = AttestationError(engine="e", weight_version=3, mismatched=("w",), missing=())
    with pytest.raises(AttestationError):  # never downgraded to an engine failure the run could go on from
        trio.run(load, _SlowEngine(mismatch))
    with pytest.raises(ValueError, match="cannot take weights in request bodies"):
        SendWeights(SGLangEngine("http://127.0.0.1:9"), sync_timeout_s=1.0)


def test_the_broadcast_backend_is_chosen_in_the_run_file_and_reaches_the_broadcast(monkeypatch):
    spec = EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="broadcast")
    assert spec.broadcast_backend == "gloo"
    common = {
        "api_key_env": "",
        "http": HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0)),
        "sync_timeout_s": 60.0,
    }
    engine = remote_engine("vllm", spec.urls, sync="broadcast", broadcast_backend=spec.broadcast_backend, **common)
    assert engine.engine.sync.options.backend == "gloo"  # BoundedSync > BroadcastWeights
    nccl = EngineSpec(kind="sglang", urls=("http://127.0.0.1:1",), sync="broadcast", broadcast_backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # where the trainer has a GPU
    two = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    pool = remote_engine("sglang", two, sync="broadcast", broadcast_backend="nccl", **common)
    assert pool.broadcast.options.backend == "nccl"  # one BroadcastPool for two engines
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match="'nccl' sends the weights from the trainer's GPU, but this process sees no CUDA"
    ):
        remote_engine("sglang", nccl.urls, sync="broadcast", broadcast_backend="nccl", **common)
    with pytest.raises(ValueError, match="EngineSpec.broadcast_backend"):
        EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="http", broadcast_backend="nccl")
    with pytest.raises(ValueError, match="EngineSpec.broadcast_backend"):
        EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="broadcast", broadcast_backend="mpi")


def test_an_engine_synced_by_broadcast_loads_the_exported_weights_in_their_dtype(tmp_path):
    exported = {"w": torch.randn(16, 8).bfloat16(), "b": torch.randn(8)}
    save_file(exported, str(tmp_path / "model.safetensors"))
    state = FakeEngineState(weights={"w": np.zeros((16, 8), np.float32), "b": np.zeros(8, np.float32)})

    async def main():
        async with serve_fake_engine(state) as server:
            common = {
                "api_key_env": "",
                "http": HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0)),
                "sync_timeout_s": 60.0,
            }
            engine = remote_engine("sglang", [server.url], sync="broadcast", **common)
            assert isinstance(engine.engine, BroadcastWeights)
            await engine.update_weights_from_disk(str(tmp_path), 1)
            await engine.update_weights_from_disk(str(tmp_path), 2)  # the group joined once serves each sync
            assert engine.engine.sync.last_num_bytes == 16 * 8 * 2 + 8 * 4
            return await engine.weight_version()

    assert trio.run(main) == 2
    np.testing.assert_array_equal(state.weights["w"], exported["w"].float().numpy())
    np.testing.assert_array_equal(state.weights["b"], exported["b"].numpy())


def test_a_single_process_sync_sends_the_models_buckets_without_exporting(tmp_path):
    """One process, engine.sync = 'broadcast': `sync_engine` sends the weights bucket by bucket
    straight from the model (no export directory, no disk round trip), each in its own dtype."""
    model = build_tiny_model(64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
    components = build_components(model.to(torch.bfloat16), OptimizerConfig(), num_training_steps=1)
    full = model_tensors(components.model)
    state = FakeEngineState(weights={n: np.zeros(1, np.float32) for n in full})
    options = BroadcastOptions(bucket_bytes=8192, setup_timeout_s=30.0, bucket_timeout_s=30.0)

    async def main():
        async with serve_fake_engine(state) as server:
            http = HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0))
            engine = BroadcastWeights(SGLangEngine(server.url, http=http), options, sync_timeout_s=60.0)
            training = TrainingState()
            _, metrics = await sync_engine(components, engine, training, tmp_path, shares_model=False, lock=trio.Lock())
            return metrics, engine.sync.last_num_bytes

    metrics, num_bytes = trio.run(main)
    assert state.weight_version == "1" and metrics["sync_export_s"] == 0.0
    assert not (tmp_path / "weights").exists()  # nothing written to disk
    assert metrics["sync_gathered_bytes_max"] <= 8192  # at most a bucket held beyond the model itself
    assert num_bytes == sum(t.numel() * 2 for t in full.values())  # bf16 bytes, no float32 detour
    for name, tensor in full.items():  # bf16 -> float32 is exact
        assert torch.from_numpy(np.asarray(state.weights[name], np.float32)).equal(tensor.float()), name


@pytest.mark.parametrize("wire", ["fetch", "ipc"])
def test_a_single_process_http_sync_sends_the_models_tensors_without_exporting(tmp_path, wire):
    """One process, engine.sync = 'http': `sync_engine` hands the model's tensors to the engine's
    wire (fetched by the server, or mapped from /dev/shm), bf16 as bf16, nothing written to disk."""
    model = build_tiny_model(64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
    components = build_components(model.to(torch.bfloat16), OptimizerConfig(), num_training_steps=1)
    full = model_tensors(components.model)
    state = FakeEngineState(weights={n: np.zeros(1, np.float32) for n in full})
    common = {"api_key_env": "", "http": HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0))}

    async def main():
        async with serve_fake_engine(state) as server:
            engine = remote_engine("vllm", [server.url], sync="http", http_wire=wire, sync_timeout_s=60.0, **common)
            _, metrics = await sync_engine(
                components, engine, TrainingState(), tmp_path, shares_model=False, lock=trio.Lock()
            )
            await engine.aclose()
            return metrics, engine.engine.last_upload

    metrics, upload = trio.run(main)
    assert state.weight_version == "1" and metrics["sync_export_s"] == 0.0
    assert not (tmp_path / "weights").exists()  # nothing written to disk
    assert upload.tensor_bytes == sum(t.numel() * 2 for t in full.values())  # bf16 bytes, no float32 detour
    for name, tensor in full.items():  # the fake keeps bf16 as its bit patterns
        assert np.array_equal(np.asarray(state.weights[name]), tensor.view(torch.int16).numpy().view(np.uint16)), name
