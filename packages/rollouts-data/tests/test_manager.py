"""AsyncRolloutManager with fake generate functions that are slow, fail or hang for chosen prompts.

`@pytest.mark.anyio` tests run under asyncio and trio (conftest's anyio_backend); the ones that need
virtual time (hour-long hangs against 30 s timeouts) run on trio's MockClock.
"""

import time

import anyio
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.data.filters import check_reward_nonzero_std
from rollouts.types import RolloutConfig, Sample, Status


def make_group(prompt, n, *, rewards=None):
    """n completed samples for `prompt`; metadata["r"] holds the reward a reward_fn will read."""
    rewards = rewards if rewards is not None else [float(i) for i in range(n)]
    return [
        Sample(
            prompt=str(prompt),
            response=f"r{i}",
            tokens=[1, 2, 3 + i],
            num_prompt_tokens=2,
            loss_mask=[0, 0, 1],
            rollout_logprobs=[-0.5],
            status=Status.COMPLETED,
            metadata={"prompt_id": prompt, "r": rewards[i]},
        )
        for i in range(n)
    ]


def reward_from_metadata(sample, record):
    return sample.metadata["r"]


def balanced(md):
    return md["groups_requested"] == (
        md["groups_kept_new"]
        + md["groups_carried_over"]
        + md["groups_filtered"]
        + md["groups_failed"]
        + md["groups_aborted"]
    )


def cfg(**kw):
    base = {"batch_size": 6, "samples_per_prompt": 2, "max_concurrency": 3, "request_timeout_s": 5.0, "max_retries": 1}
    return RolloutConfig(**{**base, **kw})


@pytest.mark.anyio
async def test_basic_step_groups_indices_and_accounting():
    async def gen(prompt, n):
        await anyio.sleep(0.01)
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(20)), seed=0), cfg(), gen, reward_fn=reward_from_metadata)
    batch = await manager.generate_batch(step=3)
    assert batch.num_kept == 12 and batch.step == 3 and batch.num_failed == 0
    assert [s.group_index for s in batch.samples] == [g for g in range(6) for _ in range(2)]
    assert [s.index for s in batch.samples] == list(range(12))
    assert batch.rewards == (0.0, 1.0) * 6
    assert balanced(batch.metadata) and batch.metadata["groups_requested"] == 6


@pytest.mark.anyio
async def test_concurrency_limit_holds_and_sync_functions_work():
    in_flight, peak = 0, 0

    async def gen(prompt, n):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await anyio.sleep(0.01)
        in_flight -= 1
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(30))), cfg(batch_size=20, max_concurrency=4), gen)
    await manager.generate_batch(step=0)
    assert peak == 4

    def sync_gen(prompt, n):
        time.sleep(0.001)
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(30))), cfg(), sync_gen)
    assert (await manager.generate_batch(step=0)).num_kept == 12


@pytest.mark.anyio
async def test_retries_then_failures_are_counted():
    calls: dict[int, int] = {}

    async def gen(prompt, n):
        calls[prompt] = calls.get(prompt, 0) + 1
        if prompt == 0 or (prompt == 1 and calls[prompt] == 1):
            raise RuntimeError(f"engine error for {prompt}")
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(6)), shuffle=False), cfg(max_retries=2), gen)
    batch = await manager.generate_batch(step=0)
    assert calls[0] == 3 and calls[1] == 2  # bounded retries: 1 + max_retries attempts at most
    assert batch.num_failed == 2 and batch.num_kept == 10
    assert batch.metadata["groups_failed"] == 1 and balanced(batch.metadata)
    assert "engine error for 0" in batch.metadata["errors"][0]
    assert batch.metadata["groups_retries"] == 3


def test_hanging_and_malformed_requests_time_out_and_fail():
    async def gen(prompt, n):
        if prompt == 2:
            await trio.sleep_forever()
        if prompt == 3:
            return make_group(prompt, n - 1)  # wrong group size
        return make_group(prompt, n)

    manager = AsyncRolloutManager(
        DataBuffer(list(range(6)), shuffle=False), cfg(request_timeout_s=30.0, max_retries=1), gen
    )
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def run():
        start = trio.current_time()
        batch = await manager.generate_batch(step=0)
        return batch, trio.current_time() - start

    batch, elapsed = trio.run(run, clock=clock)
    assert batch.metadata["groups_failed"] == 2 and batch.num_kept == 8 and balanced(batch.metadata)
    assert elapsed == pytest.approx(60.0)  # two bounded attempts of 30 s for the hanging request
    assert any("timed out" in e for e in batch.metadata["errors"])
    assert any("expected 2" in e for e in batch.metadata["errors"])


@pytest.mark.anyio
async def test_dynamic_sampling_filters_refills_and_carries_over():
    async def gen(prompt, n):
        await anyio.sleep(0.01)
        rewards = [1.0] * n if prompt % 3 == 0 else [float(i) for i in range(n)]  # every third group: zero std
        return make_group(prompt, n, rewards=rewards)

    config = cfg(
        batch_size=4, dynamic_sampling=True, over_sampling_factor=2.0, max_generation_rounds=3, max_concurrency=8
    )
    manager = AsyncRolloutManager(
        DataBuffer(list(range(100)), shuffle=False), config, gen, reward_fn=reward_from_metadata
    )
    first = await manager.generate_batch(step=0)
    md = first.metadata
    assert first.num_kept == 8 and balanced(md)
    assert md["groups_requested"] == 8 and md["groups_filtered"] == 3  # prompts 0, 3, 6
    assert first.filter_reasons == {"reward_std_zero": 6}
    assert md["groups_carried_over"] == 1 and manager.num_carried_over_groups == 1
    assert all(np.std([s.reward for s in first.samples if s.group_index == g]) > 0 for g in range(4))
    second = await manager.generate_batch(step=1)
    assert second.metadata["groups_from_carry_over"] == 1 and second.num_kept == 8
    assert second.samples[0].metadata["prompt_id"] == 7  # the carried group comes first


@pytest.mark.anyio
async def test_max_rounds_bounds_a_batch_that_cannot_fill():
    async def gen(prompt, n):
        return make_group(prompt, n, rewards=[0.0] * n)

    config = cfg(batch_size=3, dynamic_sampling=True, max_generation_rounds=2)
    manager = AsyncRolloutManager(DataBuffer(list(range(50))), config, gen, reward_fn=reward_from_metadata)
    batch = await manager.generate_batch(step=0)
    assert batch.num_kept == 0 and batch.metadata["num_rounds"] == 2
    assert batch.metadata["groups_requested"] == 6 == batch.metadata["groups_filtered"]
    assert batch.num_filtered == 12 and balanced(batch.metadata)


@pytest.mark.anyio
async def test_abort_returns_promptly_keeping_finished_work():
    async def gen(prompt, n):
        if prompt % 2:
            await anyio.sleep_forever()
        await anyio.sleep(0.001)
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(8)), shuffle=False), cfg(batch_size=8, max_concurrency=8), gen)
    result = {}

    async def step():
        result["batch"] = await manager.generate_batch(step=0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        await anyio.sleep(0.2)  # the even prompts finish, the odd ones hang
        start = time.perf_counter()
        manager.abort()
    elapsed = time.perf_counter() - start
    batch = result["batch"]
    assert elapsed < 1.0  # the hanging requests would never return on their own (timeout is 5 s)
    md = batch.metadata
    assert md["aborted"] and batch.num_kept == 8 and md["groups_aborted"] == 4 and balanced(md)
    assert {s.metadata["prompt_id"] for s in batch.samples} == {0, 2, 4, 6}
    assert manager.num_pending_prompts == 4

    served = []

    async def record(prompt, n):
        served.append(prompt)
        return make_group(prompt, n)

    manager._generate_fn = record
    await manager.generate_batch(step=1)
    # the four aborted prompts are served first, then four fresh ones (the buffer's next epoch)
    assert sorted(served) == sorted([1, 3, 5, 7] + [0, 1, 2, 3])


async def _step_aborted_after(manager, delay_s):
    """Run step 0 and call abort() `delay_s` after starting it (None: at once, before it runs)."""
    out = {}

    async def step():
        out["b"] = await manager.generate_batch(step=0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        if delay_s is not None:
            await anyio.sleep(delay_s)
        manager.abort()
    return out["b"]


@pytest.mark.anyio
async def test_abort_racing_the_start_of_a_step_stops_that_step_only():
    served = []

    async def gen(prompt, n):
        served.append(prompt)
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(8)), shuffle=False), cfg(batch_size=2), gen)

    batch = await _step_aborted_after(manager, None)  # None: before the step's task has run
    assert batch.metadata["aborted"] and batch.num_kept == 0 and served == [] and balanced(batch.metadata)
    batch = await manager.generate_batch(step=1)
    assert not batch.metadata["aborted"] and batch.num_kept == 2 * 2 and sorted(served) == [0, 1]


@pytest.mark.anyio
async def test_abort_with_sync_hanging_function_returns():
    import threading

    release = threading.Event()

    def gen(prompt, n):
        if prompt == 0:
            release.wait(timeout=10.0)  # bounded so the abandoned thread always ends
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer([0, 1, 2], shuffle=False), cfg(batch_size=3), gen)

    t0 = time.perf_counter()
    batch = await _step_aborted_after(manager, 0.2)
    assert time.perf_counter() - t0 < 5.0
    release.set()
    assert batch.num_kept == 4 and batch.metadata["groups_aborted"] == 1


@pytest.mark.anyio
async def test_state_dict_round_trip():
    async def gen(prompt, n):
        return make_group(prompt, n)

    config = cfg(batch_size=2, over_sampling_factor=2.0)
    manager = AsyncRolloutManager(DataBuffer(list(range(10)), shuffle=False), config, gen)
    await manager.generate_batch(step=0)
    state = manager.state_dict()
    assert len(state["carry_over"]) == 2
    other = AsyncRolloutManager(DataBuffer(list(range(10)), shuffle=False), config, gen)
    other.load_state_dict(state)
    a = await manager.generate_batch(step=1)
    b = await other.generate_batch(step=1)
    assert a.samples == b.samples


def test_default_filter_with_dynamic_sampling_is_zero_std():
    cfg_dyn = cfg(dynamic_sampling=True)
    manager = AsyncRolloutManager(DataBuffer([1]), cfg_dyn, lambda p, n: make_group(p, n))
    group = [s.with_reward(1.0) for s in make_group(0, 2)]
    assert manager._filter_fn(group) == check_reward_nonzero_std()(group) == "reward_std_zero"


@settings(max_examples=20, deadline=None)
@given(
    behaviours=st.lists(st.sampled_from(["ok", "zero_std", "fail", "hang", "flaky"]), min_size=20, max_size=20),
    batch_size=st.integers(1, 6),
    factor=st.sampled_from([1.0, 1.5, 2.0]),
    dynamic=st.booleans(),
    max_retries=st.integers(0, 2),
)
def test_property_accounting_balances_and_bounds_hold(behaviours, batch_size, factor, dynamic, max_retries):
    attempts: dict[int, int] = {}

    async def gen(prompt, n):
        attempts[prompt] = attempts.get(prompt, 0) + 1
        kind = behaviours[prompt % 20]
        if kind == "fail" or (kind == "flaky" and attempts[prompt] == 1):
            raise RuntimeError("boom")
        if kind == "hang":
            await trio.sleep_forever()
        await trio.sleep(0.01 * (prompt % 3))
        return make_group(prompt, n, rewards=[1.0] * n if kind == "zero_std" else None)

    config = cfg(
        batch_size=batch_size,
        dynamic_sampling=dynamic,
        over_sampling_factor=factor,
        max_generation_rounds=3,
        max_retries=max_retries,
        request_timeout_s=1.0,
    )
    buffer = DataBuffer(list(range(200)), shuffle=False)  # enough prompts that none is drawn twice
    manager = AsyncRolloutManager(buffer, config, gen, reward_fn=reward_from_metadata)

    async def run():
        start = trio.current_time()
        batches = [await manager.generate_batch(step=i) for i in range(2)]
        return batches, trio.current_time() - start

    batches, elapsed = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(count <= 1 + max_retries for count in attempts.values())
    # 2 steps x 3 rounds x at most ceil(12 requests / concurrency 3) waves, each wave bounded by
    # (1 + max_retries) timeouts (plus the fake's own sleep of at most 20 ms)
    assert elapsed <= 2 * 3 * 4 * ((1 + max_retries) * config.request_timeout_s + 0.02) + 1e-6
    for batch in batches:
        md = batch.metadata
        assert balanced(md)
        assert batch.num_kept == 2 * (md["groups_kept_new"] + md["groups_from_carry_over"]) <= 2 * batch_size
        assert batch.num_failed == 2 * md["groups_failed"] and batch.num_filtered == 2 * md["groups_filtered"]
        assert md["num_rounds"] <= (3 if dynamic else 1)
        kinds = {behaviours[s.metadata["prompt_id"] % 20] for s in batch.samples}
        assert kinds <= ({"ok", "flaky"} if dynamic else {"ok", "flaky", "zero_std"})
    total_carry = sum(b.metadata["groups_carried_over"] for b in batches)
    used_carry = sum(b.metadata["groups_from_carry_over"] for b in batches)
    assert total_carry - used_carry == manager.num_carried_over_groups


def test_an_asyncio_user_with_an_asyncio_generate_function():
    """Plain asyncio.run, a generate function on asyncio.sleep: every group is kept (it failed under trio-only code)."""
    import asyncio

    async def gen(prompt, n):
        await asyncio.sleep(0.001)
        return make_group(prompt, n)

    manager = AsyncRolloutManager(DataBuffer(list(range(20)), seed=0), cfg(), gen, reward_fn=reward_from_metadata)
    batch = asyncio.run(manager.generate_batch(step=0))
    assert batch.num_kept == 12 and batch.num_failed == 0 and balanced(batch.metadata)


@pytest.mark.anyio
async def test_a_hanging_request_is_bounded_in_real_time():
    async def gen(prompt, n):
        if prompt == 0:
            await anyio.sleep_forever()
        return make_group(prompt, n)

    manager = AsyncRolloutManager(
        DataBuffer(list(range(4)), shuffle=False), cfg(batch_size=2, request_timeout_s=0.2, max_retries=1), gen
    )
    start = time.perf_counter()
    batch = await manager.generate_batch(step=0)
    elapsed = time.perf_counter() - start
    assert 0.4 <= elapsed < 3.0  # two attempts of 0.2 s each, plus scheduling slack on a loaded machine
    assert batch.metadata["groups_failed"] == 1 and "timed out after 0.2 s" in batch.metadata["errors"][0]


def _seeded_cfg(**kw):
    from rollouts.types import SamplingParams

    return cfg(sampling=SamplingParams(seed=7), **kw)


async def _seeds_seen(*, concurrency, delays, steps=3, abort_first=False):
    """{prompt: seed} over `steps` steps of a seeded run whose requests finish in an order set by `delays`."""
    seen: dict[int, list[int]] = {}

    async def gen(prompt, n, *, seed=None):
        await anyio.sleep(delays[prompt % len(delays)])
        seen.setdefault(prompt, []).append(seed)
        return make_group(prompt, n)

    manager = AsyncRolloutManager(
        DataBuffer(list(range(12)), seed=3), _seeded_cfg(batch_size=4, max_concurrency=concurrency), gen
    )
    if abort_first:  # an aborted step's prompts are served again with the seeds of their positions
        manager.abort()
        await manager.generate_batch(step=0)
    for step in range(steps):
        await manager.generate_batch(step=step)
    return seen


@pytest.mark.anyio
async def test_request_seeds_follow_the_prompts_position_not_arrival_order():
    """The same seeded run at concurrency 1 and 4, with requests finishing in opposite orders:
    every prompt gets the same seed (samples would differ with arrival-order seeds)."""
    one = await _seeds_seen(concurrency=1, delays=[0.0])
    many = await _seeds_seen(concurrency=4, delays=[0.004, 0.003, 0.002, 0.001, 0.0])
    assert one == many and len(one) == 12 and all(len(set(s)) == 1 for s in one.values())
    assert len({s[0] for s in one.values()}) == 12  # every position its own seed


@pytest.mark.anyio
async def test_seeds_survive_an_abort_and_a_checkpoint():
    straight = await _seeds_seen(concurrency=2, delays=[0.0])
    aborted = await _seeds_seen(concurrency=2, delays=[0.0], abort_first=True)
    assert straight == aborted

    async def gen(prompt, n, *, seed=None):
        if prompt >= 2:
            await anyio.sleep_forever()
        return make_group(prompt, n)

    config = _seeded_cfg(batch_size=4, max_concurrency=4)
    manager = AsyncRolloutManager(DataBuffer(list(range(8)), shuffle=False), config, gen)
    await _step_aborted_after(manager, 0.05)
    state = manager.state_dict()
    assert state["pending_positions"] == [2, 3] and state["pending_prompts"] == [2, 3]
    restored = AsyncRolloutManager(DataBuffer(list(range(8)), shuffle=False), config, gen)
    restored.load_state_dict(state)
    assert restored.state_dict() == state


def test_a_generate_function_without_a_seed_keyword_is_called_as_before():
    from rollouts.data.manager_parts import takes_seed

    assert not takes_seed(lambda prompt, n: None) and takes_seed(lambda prompt, n, seed=None: None)
    assert takes_seed(lambda prompt, n, **kw: None)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**62), position=st.integers(0, 2**40))
def test_request_seed_is_a_pure_63_bit_function_of_seed_and_position(seed, position):
    from rollouts.data.manager import request_seed

    value = request_seed(seed, position)
    assert value == request_seed(seed, position) and 0 <= value < 2**63
    assert value != request_seed(seed, position + 1) or value != request_seed(seed + 1, position)


def test_failed_requests_are_counted_by_the_error_they_failed_with():
    def generate(prompt, n):
        if prompt % 2:
            raise RuntimeError("the sandbox is gone")
        raise ValueError(f"no tool for {prompt}")

    config = RolloutConfig(batch_size=4, samples_per_prompt=2, max_concurrency=4, max_retries=1, request_timeout_s=5.0)
    manager = AsyncRolloutManager(DataBuffer(list(range(8)), shuffle=False), config, generate)
    batch = trio.run(lambda: manager.generate_batch(step=0))
    causes = batch.metadata["error_causes"]
    assert causes == {
        "RuntimeError: the sandbox is gone": 2,
        "ValueError: no tool for 0": 1,
        "ValueError: no tool for 2": 1,
    }
    assert sum(causes.values()) == batch.metadata["groups_failed"] == 4 and len(batch.metadata["errors"]) == 4
