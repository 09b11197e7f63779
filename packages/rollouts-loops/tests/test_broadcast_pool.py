"""Several engines synced by one broadcast (`BroadcastPool`): two fake SGLang servers behind one
pool, each joined to the trainer's gloo groups on loopback. One read of the exported files (or one
gather of the model's buckets) per sync reaches both; an engine that fails is named while the other
loads; generation still spreads over both."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import trio
from safetensors.torch import save_file

from rollouts.backends import build_components
from rollouts.backends.checkpoint.export import model_tensors
from rollouts.loops.engines import broadcast as broadcast_module
from rollouts.loops.engines.broadcast import BroadcastPool, BucketLoader
from rollouts.loops.engines.remote import remote_engine
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.loops.rl.generation import sync_engine
from rollouts.sync import BroadcastOptions, HTTPOptions, RetryPolicy, SGLangEngine, WeightSyncError
from rollouts.sync.fake_http import Fault
from rollouts.sync.fake_server import FakeEngineState, serve_fake_engine
from rollouts.types import OptimizerConfig, SamplingParams, TrainingState

HTTP = HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0))
FAST = BroadcastOptions(bucket_bytes=4096, setup_timeout_s=3.0, bucket_timeout_s=3.0, load_timeout_s=30.0)
SLACK_S = 5.0  # HTTP round trips and thread hand-offs on a loaded machine, beyond the bounds themselves


def _zeros() -> dict[str, np.ndarray]:
    return {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32, np.float32)}


def _export(path, seed: int) -> dict[str, torch.Tensor]:
    """Writes bf16 and float32 tensors (three buckets of FAST) to `path`; returns them."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(64, 32, generator=generator).bfloat16(), "b": torch.randn(32, generator=generator)}
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def _holds(state: FakeEngineState, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the fake engine holds exactly `tensors` (bf16 -> float32 is exact)."""
    return all(np.array_equal(state.weights[n], t.float().numpy()) for n, t in tensors.items())


def _joins(state: FakeEngineState) -> int:
    return sum(path == "/init_weights_update_group" for _, path in state.calls)


def _pool(*urls: str, **kwargs: float) -> BroadcastPool:
    return BroadcastPool([SGLangEngine(url, http=HTTP) for url in urls], FAST, **{"sync_timeout_s": 60.0, **kwargs})


def test_one_read_of_the_files_syncs_every_engine_and_generation_spreads_over_them(tmp_path, monkeypatch):
    states = [FakeEngineState(weights=_zeros()), FakeEngineState(weights=_zeros())]
    reads = []
    read = broadcast_module.read_torch_weights
    monkeypatch.setattr(broadcast_module, "read_torch_weights", lambda path: reads.append(path) or read(path))
    exported = _export(tmp_path, seed=0)

    async def main():
        async with serve_fake_engine(states[0]) as a, serve_fake_engine(states[1]) as b:
            common = {
                "api_key_env": "",
                "http": HTTPOptions(timeout_s=30.0, retry=RetryPolicy(max_retries=0)),
                "sync_timeout_s": 60.0,
            }
            pool = remote_engine("sglang", [a.url, b.url], sync="broadcast", **common)
            assert isinstance(pool, BroadcastPool) and isinstance(pool, BucketLoader)
            await pool.update_weights_from_disk(str(tmp_path), 1)
            assert all(_holds(s, exported) for s in states)
            result = await pool.sync(str(tmp_path), 2)  # the groups joined once serve each sync
            assert result.updated == (a.url, b.url) and await pool.weight_version() == 2
            assert pool.broadcast.last_num_bytes == 64 * 32 * 2 + 32 * 4  # bf16 stays bf16
            params = SamplingParams(max_new_tokens=2, temperature=0.0)
            for _ in range(2):  # equal loads rotate over the engines
                await pool.generate([[1, 2, 3]], params)

    trio.run(main)
    assert len(reads) == 2  # once per sync, not once per engine
    assert [_joins(s) for s in states] == [1, 1]
    assert all(s.weight_version == "2" for s in states)
    assert [sum(path == "/generate" for _, path in s.calls) for s in states] == [1, 1]


def test_a_streamed_sync_sends_the_models_buckets_to_every_engine_without_exporting(tmp_path, monkeypatch):
    model = build_tiny_model(64, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
    components = build_components(model.to(torch.bfloat16), OptimizerConfig(), num_training_steps=1)
    full = model_tensors(components.model)
    states = [FakeEngineState(weights={n: np.zeros(1, np.float32) for n in full}) for _ in range(2)]
    monkeypatch.setattr(broadcast_module, "read_torch_weights", lambda path: pytest.fail(f"read {path}"))

    async def main():
        async with serve_fake_engine(states[0]) as a, serve_fake_engine(states[1]) as b:
            pool = _pool(a.url, b.url)
            _, metrics = await sync_engine(
                components, pool, TrainingState(), tmp_path, shares_model=False, lock=trio.Lock()
            )
            return metrics, pool.broadcast.last_num_bytes

    metrics, num_bytes = trio.run(main)
    assert metrics["sync_export_s"] == 0.0 and not (tmp_path / "weights").exists()  # nothing written
    assert metrics["sync_gathered_bytes_max"] <= FAST.bucket_bytes  # one bucket at a time, for both engines
    assert num_bytes == sum(t.numel() * 2 for t in full.values())
    assert all(s.weight_version == "1" and _holds(s, full) for s in states)


def test_a_failed_engine_is_named_the_other_loads_and_a_restarted_one_rejoins(tmp_path):
    """Refusing mid-sync (its group breaks) names it, the other loads whole; at the next sync every
    engine joins afresh and both load; one that stays down is named again while the other loads."""
    states = [FakeEngineState(weights=_zeros()), FakeEngineState(weights=_zeros())]

    async def main():
        async with serve_fake_engine(states[0]) as a, serve_fake_engine(states[1]) as b:
            pool = _pool(a.url, b.url)
            first = _export(tmp_path, seed=1)
            states[1].faults.append(Fault(path="/update_weights_from_distributed", kind="status", status=500))
            start = time.monotonic()
            with pytest.raises(WeightSyncError) as info:
                await pool.update_weights_from_disk(str(tmp_path), 1)
            assert time.monotonic() - start < FAST.setup_timeout_s + FAST.bucket_timeout_s + SLACK_S
            assert [f.engine for f in info.value.failures] == [b.url] and "HTTP 500" in str(info.value)
            assert info.value.updated == (a.url,) and _holds(states[0], first) and states[0].weight_version == "1"
            assert not states[1].weights["w"].any() and states[1].weight_version == "default"  # old, whole

            second = _export(tmp_path, seed=2)  # the fault is spent: the engine is back
            assert (await pool.sync(str(tmp_path), 2)).updated == (a.url, b.url)
            assert [_joins(s) for s in states] == [2, 2]  # every engine joined afresh
            assert all(_holds(s, second) and s.weight_version == "2" for s in states)

            b.stop()  # from now on nothing answers at its URL
            for version in (3, 4):  # 3: its pause is refused; 4: it cannot join the fresh groups
                with pytest.raises(WeightSyncError) as info:
                    await pool.sync(str(tmp_path), version)
                assert [f.engine for f in info.value.failures] == [b.url] and info.value.updated == (a.url,)
                assert states[0].weight_version == str(version)
            assert info.value.failures[0].text.startswith("did not join the broadcast group")
            assert _joins(states[0]) == 3 and states[1].weight_version == "2"

    trio.run(main)


def test_a_sync_past_sync_timeout_s_names_the_engines_and_every_bucket_is_still_gathered():
    """An engine that hangs on joining: the sync ends by a WeightSyncError within the join's bound
    (a join under way ends at its own bound), and rank 0 took part in every bucket's gather anyway."""
    states = [FakeEngineState(weights=_zeros()), FakeEngineState(weights=_zeros())]
    states[1].faults.append(Fault(path="/init_weights_update_group", kind="delay", delay_s=60.0))
    tensors = {"w": torch.ones(64, 32), "b": torch.ones(32)}
    gathered = []

    class Counted:  # a BucketSource that records each bucket it hands over
        def specs(self):
            return [(n, "float32", tuple(t.shape)) for n, t in tensors.items()]

        def buckets(self, names):
            for group in names:
                gathered.append(list(group))
                yield [tensors[n] for n in group]

    async def main():
        async with serve_fake_engine(states[0]) as a, serve_fake_engine(states[1]) as b:
            pool = _pool(a.url, b.url, sync_timeout_s=1.0, health_timeout_s=5.0)
            start = time.monotonic()
            with pytest.raises(WeightSyncError, match="sync_timeout_s=1.0") as info:
                await pool.push_weights(Counted(), 1)
            assert time.monotonic() - start < FAST.setup_timeout_s + 5.0 + SLACK_S
            return info.value, (a.url, b.url)

    error, urls = trio.run(main)
    assert tuple(f.engine for f in error.failures) == urls and error.updated == ()  # neither got version 1
    assert [n for group in gathered for n in group] == ["w", "b"]  # every bucket, once
    assert all(s.weight_version == "default" for s in states)
