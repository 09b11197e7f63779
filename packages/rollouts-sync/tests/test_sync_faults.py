"""sync_weights_to_engines and retries against fake servers that fail: 5xx, 4xx, slow, dropped, gone for good."""

from __future__ import annotations

import math
import random
import time

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from rollouts.sync import (
    EngineError,
    EngineFailure,
    EnginePool,
    HTTPOptions,
    RetryPolicy,
    SGLangEngine,
    VLLMEngine,
    WeightSyncError,
    sync_weights_to_engines,
)
from rollouts.sync._http import backoff_s
from rollouts.sync.fake_server import FakeEngineState, Fault, serve_fake_engine

FAST_RETRY = RetryPolicy(max_retries=2, backoff_base_s=0.01, backoff_max_s=0.02)


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(path / "model.safetensors"))
    return str(path)


@settings(max_examples=50, deadline=None)
@given(
    base=st.floats(0.0, 2.0),
    factor=st.floats(1.0, 10.0),
    jitter=st.floats(0.0, 1.0),
    index=st.integers(0, 20),
    seed=st.integers(0, 2**32 - 1),
)
def test_backoff_is_bounded_and_jittered_below_cap(base, factor, jitter, index, seed):
    policy = RetryPolicy(backoff_base_s=base, backoff_max_s=base * factor, jitter_fraction=jitter)
    wait = backoff_s(policy, index, random.Random(seed))
    cap = min(policy.backoff_max_s, base * 2.0**index)
    assert (1.0 - jitter) * cap - 1e-12 <= wait <= cap + 1e-12


def test_retry_policy_rejects_bad_values():
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError, match="backoff_max_s"):
        RetryPolicy(backoff_base_s=2.0, backoff_max_s=1.0)
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match="backoff_base_s"):
            RetryPolicy(backoff_base_s=bad, backoff_max_s=math.inf)
        with pytest.raises(ValueError, match="backoff_max_s"):
            RetryPolicy(backoff_max_s=bad)


@pytest.mark.parametrize("engine_cls", [VLLMEngine, SGLangEngine])
@pytest.mark.anyio
async def test_transient_5xx_and_drops_are_retried(engine_cls, ckpt):
    state = FakeEngineState()
    state.faults += [
        Fault(kind="status", path="/pause", status=503, times=2),
        Fault(kind="drop", path="/collective_rpc" if engine_cls is VLLMEngine else "/update_weights", times=1),
    ]
    async with serve_fake_engine(state) as server, engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        result = await sync_weights_to_engines([engine], ckpt, 3, timeout_s=10.0)
        assert result.updated == (server.url,) and await engine.weight_version() == 3
    assert all(f.times == 0 for f in state.faults)


@pytest.mark.anyio
async def test_4xx_is_not_retried(ckpt):
    state = FakeEngineState()
    state.faults.append(Fault(kind="status", path="/pause", status=400, text="bad pause mode", times=5))
    async with serve_fake_engine(state) as server, VLLMEngine(server.url, http=HTTPOptions(retry=FAST_RETRY)) as engine:
        with pytest.raises(WeightSyncError) as info:
            await sync_weights_to_engines([engine], ckpt, 1, timeout_s=10.0)
    assert state.faults[0].times == 4  # exactly one attempt
    failure = info.value.failures[0]
    assert failure.status == 400 and "bad pause mode" in failure.text and failure.url.endswith("/pause")


@pytest.mark.anyio
async def test_mixed_pool_error_names_failed_and_updated_engines(ckpt):
    good, flaky, slow, gone = (FakeEngineState() for _ in range(4))
    flaky.faults.append(Fault(kind="status", path="/collective_rpc", status=500, text="CUDA is sad", times=99))
    slow.faults.append(Fault(kind="delay", path="/collective_rpc", delay_s=30.0, times=99))
    async with (
        serve_fake_engine(good) as s_good,
        serve_fake_engine(flaky) as s_flaky,
        serve_fake_engine(slow) as s_slow,
        serve_fake_engine(gone) as s_gone,
    ):
        s_gone.stop()  # an engine that never comes back: connection refused on every attempt
        engines = [
            VLLMEngine(s.url, http=HTTPOptions(retry=FAST_RETRY, timeout_s=0.5))
            for s in (s_good, s_flaky, s_slow, s_gone)
        ]
        start = time.perf_counter()
        with pytest.raises(WeightSyncError) as info:
            await sync_weights_to_engines(engines, ckpt, 7, timeout_s=3.0)
        elapsed_s = time.perf_counter() - start
        for e in engines:
            await e.aclose()
    err = info.value
    assert elapsed_s < 6.0  # bounded by timeout_s (3 s, plus slack for a loaded machine), not by the 30 s delay
    assert err.updated == (s_good.url,) and good.weight_version == "7"
    by_engine = {f.engine: f for f in err.failures}
    assert set(by_engine) == {s_flaky.url, s_slow.url, s_gone.url}
    assert by_engine[s_flaky.url].status == 500 and "CUDA is sad" in by_engine[s_flaky.url].text
    assert by_engine[s_slow.url].status is None and "timed out" in by_engine[s_slow.url].text
    assert by_engine[s_gone.url].status is None and "ConnectError" in by_engine[s_gone.url].text
    message = str(err)
    for url in (s_good.url, s_flaky.url, s_slow.url, s_gone.url):
        assert url in message
    assert not flaky.paused  # resumed after its failed update


@pytest.mark.anyio
async def test_overall_timeout_bounds_a_hanging_engine(ckpt):
    state = FakeEngineState(reload_delay_s=60.0)
    async with serve_fake_engine(state) as server:
        engine = VLLMEngine(server.url, http=HTTPOptions(retry=FAST_RETRY, timeout_s=100.0))
        start = time.perf_counter()
        with pytest.raises(WeightSyncError, match="timeout_s=1.0"):
            await sync_weights_to_engines([engine], ckpt, 1, timeout_s=1.0)
        assert time.perf_counter() - start < 10.0  # bounded by timeout_s, not by the 60 s reload
        await engine.aclose()


@pytest.mark.parametrize("engine_cls", [VLLMEngine, SGLangEngine])
@pytest.mark.anyio
async def test_a_deadline_during_the_pause_still_resumes_the_engine(engine_cls, ckpt):
    """The sync gives up while the server drains a long generation; the engine must not stay paused."""
    from rollouts.types import SamplingParams

    state = FakeEngineState(generate_delay_s=1.5)
    async with serve_fake_engine(state) as server:
        engine = engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY, timeout_s=10.0))
        params = SamplingParams(max_new_tokens=2)
        async with anyio.create_task_group() as nursery:
            nursery.start_soon(engine.generate, [[1, 2]], params)
            while state.num_in_flight == 0:
                await anyio.sleep(0.01)
            with pytest.raises(WeightSyncError, match="timeout_s=0.3"):
                await sync_weights_to_engines([engine], ckpt, 1, timeout_s=0.3)  # pause still draining
            assert not state.paused
        state.generate_delay_s = 0.0
        with anyio.fail_after(5.0):  # would wait for a /resume that never comes
            samples = await engine.generate([[3]], params)
        assert len(samples) == 1 and not state.paused
        await engine.aclose()


@pytest.mark.parametrize("engine_cls", [VLLMEngine, SGLangEngine])
@pytest.mark.anyio
async def test_a_lost_resume_is_retried_and_a_resume_that_never_lands_fails_the_update(engine_cls, ckpt):
    resume = "/resume" if engine_cls is VLLMEngine else "/continue_generation"

    state = FakeEngineState()
    async with serve_fake_engine(state) as server:
        engine = engine_cls(server.url, http=HTTPOptions(retry=FAST_RETRY, timeout_s=5.0))
        state.faults.append(Fault(kind="drop", path=resume, times=1))
        await engine.update_weights_from_disk(ckpt, 1)  # the second attempt lands
        assert not state.paused and await engine.weight_version() == 1
        state.faults.append(Fault(kind="drop", path=resume, times=99))
        with pytest.raises(WeightSyncError) as info:
            await sync_weights_to_engines([engine], ckpt, 2, timeout_s=30.0)
        assert resume in str(info.value) and "may still be paused" in str(info.value)
        await engine.aclose()


@pytest.mark.anyio
async def test_generate_timeout_error_says_what_happened():
    state = FakeEngineState()
    state.faults.append(Fault(kind="delay", path="/v1/completions", delay_s=5.0, times=99))
    async with serve_fake_engine(state) as server:
        async with VLLMEngine(
            server.url,
            model="fake-model",
            http=HTTPOptions(timeout_s=0.2, retry=RetryPolicy(max_retries=1, backoff_base_s=0.01)),
        ) as engine:
            from rollouts.types import SamplingParams

            with pytest.raises(EngineError, match=r"failed after 2 attempt\(s\): no response: timed out") as info:
                await engine.generate([[1]], SamplingParams(max_new_tokens=1))
            assert info.value.url == f"{server.url}/v1/completions"


@pytest.mark.anyio
async def test_sync_rejects_bad_arguments(ckpt):
    engine = VLLMEngine("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="empty"):
        await sync_weights_to_engines([], ckpt, 1, timeout_s=1.0)
    with pytest.raises(ValueError, match="unique"):
        await sync_weights_to_engines([engine, engine], ckpt, 1, timeout_s=1.0)
    for version in (-1, True, 1.5):
        with pytest.raises((ValueError, TypeError), match="weight_version"):
            await sync_weights_to_engines([engine], ckpt, version, timeout_s=1.0)
    with pytest.raises(ValueError, match="checkpoint_dir must be a non-empty str"):
        await sync_weights_to_engines([engine], "", 1, timeout_s=1.0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
            await sync_weights_to_engines([engine], ckpt, 1, timeout_s=bad)
        with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
            VLLMEngine("http://127.0.0.1:1", http=HTTPOptions(timeout_s=bad))
        with pytest.raises(ValueError, match="sync_timeout_s must be a finite number of seconds > 0"):
            EnginePool([engine], sync_timeout_s=bad)


class _OwnSync:
    """An engine whose reload is a sync of its own (a broadcast wrapper's): it fails naming itself."""

    name = "http://127.0.0.1:9"

    async def update_weights_from_disk(self, path, weight_version):
        failure = EngineFailure(engine=self.name, url=self.name, status=None, text="bucket 3 not received in 5 s")
        raise WeightSyncError(weight_version, [failure], [])


@pytest.mark.anyio
async def test_an_engines_own_sync_failure_is_reported_once_not_wrapped_in_another():
    with pytest.raises(WeightSyncError) as info:
        await sync_weights_to_engines([_OwnSync()], "/ckpt", 4, timeout_s=5.0)
    assert [f.text for f in info.value.failures] == ["bucket 3 not received in 5 s"]
    assert str(info.value).count("weight sync to version 4 failed") == 1
