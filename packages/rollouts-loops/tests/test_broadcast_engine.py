"""`[engine] sync = "broadcast"`: the run file's setting, and an engine it builds pushing exported weights
(in their own dtype) to the fake SGLang server through a gloo group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio
from safetensors.torch import save_file

from rollouts.loops.app.config import EngineSpec
from rollouts.loops.engines.broadcast import BroadcastWeights
from rollouts.loops.engines.coalescing import remote_engine
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine


def test_broadcast_is_a_sync_for_server_engines_only():
    assert EngineSpec(kind="sglang", urls=("http://127.0.0.1:1",), sync="broadcast").sync == "broadcast"
    assert EngineSpec(kind="vllm", urls=("http://127.0.0.1:1",), sync="broadcast").sync == "broadcast"
    with pytest.raises(ValueError, match="EngineSpec.sync"):
        EngineSpec(kind="inprocess", sync="broadcast")


def test_an_engine_synced_by_broadcast_loads_the_exported_weights_in_their_dtype(tmp_path):
    exported = {"w": torch.randn(16, 8).bfloat16(), "b": torch.randn(8)}
    save_file(exported, str(tmp_path / "model.safetensors"))
    state = FakeEngineState(weights={"w": np.zeros((16, 8), np.float32), "b": np.zeros(8, np.float32)})

    async def main():
        async with serve_fake_engine(state) as server:
            common = {"api_key_env": "", "timeout_s": 30.0, "max_retries": 0, "sync_timeout_s": 60.0}
            engine = remote_engine("sglang", [server.url], sync="broadcast", **common)
            assert isinstance(engine.engine, BroadcastWeights)
            await engine.update_weights_from_disk(str(tmp_path), 1)
            await engine.update_weights_from_disk(str(tmp_path), 2)  # the group joined once serves each sync
            assert engine.engine.sync.last_num_bytes == 16 * 8 * 2 + 8 * 4
            return await engine.weight_version()

    assert trio.run(main) == 2
    np.testing.assert_array_equal(state.weights["w"], exported["w"].float().numpy())
    np.testing.assert_array_equal(state.weights["b"], exported["b"].numpy())
