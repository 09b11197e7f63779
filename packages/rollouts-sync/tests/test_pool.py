"""EnginePool: least outstanding requests, per-engine bound, health-check rotation, failover."""

from __future__ import annotations

import anyio
import pytest

from rollouts.sync import EngineError, EnginePool, HTTPOptions, NoHealthyEngineError, RetryPolicy, VLLMEngine
from rollouts.sync.fake_server import FakeEngineState, Fault, serve_fake_engine
from rollouts.types import InferenceEngine, Sample, SamplingParams

NO_RETRY = RetryPolicy(max_retries=0)
PARAMS = SamplingParams(max_new_tokens=2)


class ScriptedEngine:
    """An in-memory engine that blocks generate until released; records peak concurrency."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.in_flight = 0
        self.peak = 0
        self.calls = 0
        self.release = anyio.Event()
        self.healthy = True

    @property
    def name(self) -> str:
        return self._name

    async def generate(self, prompts, params):
        self.calls += 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.release.wait()
            return [Sample(tokens=(1, 2), num_prompt_tokens=1, loss_mask=(0.0, 1.0))]
        finally:
            self.in_flight -= 1

    async def update_weights_from_disk(self, path, weight_version):
        return None

    async def weight_version(self):
        return 0

    async def health(self):
        return self.healthy


@pytest.mark.anyio
async def test_least_outstanding_and_per_engine_bound():
    a, b = ScriptedEngine("a"), ScriptedEngine("b")
    pool = EnginePool([a, b], max_concurrency_per_engine=3)
    assert isinstance(pool, InferenceEngine)
    async with anyio.create_task_group() as nursery:
        for _ in range(10):
            nursery.start_soon(pool.generate, [[1]], PARAMS)
        await anyio.wait_all_tasks_blocked()
        assert (a.in_flight, b.in_flight) == (3, 3)  # bound holds; the rest wait
        assert pool.outstanding == (5, 5)  # spread evenly
        a.release.set()
        b.release.set()
    assert a.peak == 3 and b.peak == 3 and a.calls + b.calls == 10


@pytest.mark.anyio
async def test_busy_engine_gets_fewer_requests():
    a, b = ScriptedEngine("a"), ScriptedEngine("b")
    pool = EnginePool([a, b], max_concurrency_per_engine=8)
    async with anyio.create_task_group() as nursery:
        for _ in range(4):
            nursery.start_soon(pool.generate, [[1]], PARAMS)
        await anyio.wait_all_tasks_blocked()
        a.release.set()  # a finishes its two; b keeps two outstanding
        await anyio.wait_all_tasks_blocked()
        a.release = anyio.Event()
        for _ in range(4):
            nursery.start_soon(pool.generate, [[1]], PARAMS)
        await anyio.wait_all_tasks_blocked()
        assert (a.in_flight, b.in_flight) == (3, 3)  # a got 3 of the new 4: it had none outstanding
        a.release.set()
        b.release.set()


@pytest.mark.anyio
async def test_health_checks_take_engines_out_and_back():
    a, b = ScriptedEngine("a"), ScriptedEngine("b")
    a.release.set()
    b.release.set()
    pool = EnginePool([a, b])
    b.healthy = False
    assert await pool.check_health() == ("a",)
    for _ in range(4):
        await pool.generate([[1]], PARAMS)
    assert (a.calls, b.calls) == (4, 0)
    a.healthy = False
    await pool.check_health()
    with pytest.raises(NoHealthyEngineError, match="no engine in rotation"):
        await pool.generate([[1]], PARAMS)
    b.healthy = True
    async with anyio.create_task_group() as nursery:
        await nursery.start(lambda task_status: pool.run_health_checks(interval_s=0.01, task_status=task_status))
        assert pool.in_rotation == ("b",)
        a.healthy = True
        await anyio.sleep(0.05)
        assert pool.in_rotation == ("a", "b")
        nursery.cancel_scope.cancel()


@pytest.mark.anyio
async def test_failover_on_dead_engine_and_no_failover_on_4xx():
    async with serve_fake_engine(FakeEngineState()) as live, serve_fake_engine(FakeEngineState()) as dead:
        dead.stop()
        engines = [
            VLLMEngine(dead.url, model="fake-model", http=HTTPOptions(retry=NO_RETRY)),
            VLLMEngine(live.url, model="fake-model", http=HTTPOptions(retry=NO_RETRY)),
        ]
        pool = EnginePool(engines)
        samples = await pool.generate([[1, 2]], PARAMS)
        assert len(samples) == 1 and pool.in_rotation == (live.url,)
        live.state.faults.append(Fault(kind="status", path="/v1/completions", status=400, times=1))
        with pytest.raises(EngineError) as info:
            await pool.generate([[1, 2]], PARAMS)
        assert info.value.status == 400 and pool.in_rotation == (live.url,)
        for e in engines:
            await e.aclose()


class _HealthCounted(ScriptedEngine):
    def __init__(self, name):
        super().__init__(name)
        self.health_checks = 0

    async def health(self):
        self.health_checks += 1
        return self.healthy


@pytest.mark.anyio
async def test_an_engine_out_of_rotation_comes_back_on_its_own_once_healthy():
    """A run that runs no health checks does not lose an engine for good to one transient failure."""
    a, b = _HealthCounted("a"), _HealthCounted("b")
    a.release.set()
    b.release.set()
    pool = EnginePool([a, b], readmit_after_s=3600.0)
    b.healthy = False
    await pool.check_health()
    for _ in range(3):  # not due yet: no check, b stays out
        await pool.generate([[1]], PARAMS)
    assert pool.in_rotation == ("a",) and b.health_checks == 1
    pool.readmit_after_s = 0.0  # due at every call from now on
    await pool.generate([[1]], PARAMS)  # checked: still unhealthy, still out
    assert pool.in_rotation == ("a",) and b.health_checks == 2
    b.healthy = True
    await pool.generate([[1]], PARAMS)  # checked: back, and the next calls reach it
    assert pool.in_rotation == ("a", "b") and b.health_checks == 3
    for _ in range(4):
        await pool.generate([[1]], PARAMS)
    assert b.calls >= 2 and b.health_checks == 3  # an engine in rotation is not checked
    with pytest.raises(ValueError, match="readmit_after_s must be >= 0"):
        EnginePool([a], readmit_after_s=-1.0)


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError, match="empty"):
        EnginePool([])
    with pytest.raises(ValueError, match="unique"):
        EnginePool([ScriptedEngine("a"), ScriptedEngine("a")])
    with pytest.raises(ValueError, match="max_concurrency_per_engine"):
        EnginePool([ScriptedEngine("a")], max_concurrency_per_engine=0)
