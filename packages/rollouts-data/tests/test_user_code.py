"""call_user: sync and async user functions alike, bounded in time, their errors kept with their cause."""

import asyncio
import functools
import threading
import time

import anyio
import pytest
import trio

from rollouts.data.user_code import (
    UserCodeError,
    UserThreads,
    UserThreadsExhausted,
    call_user,
    function_name,
    user_error_text,
)


def _both(main):
    """main() under trio and under asyncio, as the manager runs under either."""
    return trio.run(main), asyncio.run(main())


def test_a_sync_function_runs_in_a_worker_thread_and_an_async_one_in_the_loop():
    async def main():
        threads = []

        def sync(x):
            threads.append(threading.get_ident())
            return x + 1

        async def async_(x):
            threads.append(threading.get_ident())
            return x * 2

        values = (await call_user(sync, 1, timeout_s=5.0), await call_user(async_, 3, timeout_s=5.0))
        return values, threads[0] != threading.get_ident(), threads[1] == threading.get_ident()

    assert _both(main) == (((2, 6), True, True),) * 2


def test_an_awaitable_a_sync_function_returns_is_awaited():
    async def later(x):
        return x

    async def main():
        return await call_user(lambda: later(7), timeout_s=5.0)

    assert _both(main) == (7, 7)


def test_a_raised_error_names_the_function_and_keeps_the_exception_as_its_cause():
    def grade(sample):
        raise KeyError("answer")

    async def main():
        with pytest.raises(UserCodeError) as info:
            await call_user(grade, None, timeout_s=5.0)
        return info.value

    for error in _both(main):
        assert (
            str(error)
            == "test_a_raised_error_names_the_function_and_keeps_the_exception_as_its_cause.<locals>.grade raised KeyError: 'answer'"
        )
        assert isinstance(error.__cause__, KeyError) and error.error is error.__cause__
        assert user_error_text(error) == "KeyError: 'answer'"


def test_a_call_past_its_bound_is_a_timeout_naming_the_function():
    release = threading.Event()

    def hangs():
        release.wait(60)

    async def sleeps():
        await trio.sleep(60)

    async def main():
        with pytest.raises(TimeoutError, match=r"hangs took longer than 0.05 s"):
            await call_user(hangs, timeout_s=0.05)
        with pytest.raises(TimeoutError, match=r"sleeps took longer than 0.05 s"):
            await call_user(sleeps, timeout_s=0.05)

    try:
        trio.run(main)
    finally:
        release.set()


def test_an_error_of_a_nested_call_is_not_wrapped_twice():
    def inner():
        raise ValueError("bad")

    async def outer():
        return await call_user(inner, timeout_s=5.0)

    async def main():
        with pytest.raises(UserCodeError, match=r"inner raised ValueError: bad$"):
            await call_user(outer, timeout_s=5.0)

    trio.run(main)


def test_a_partial_is_named_by_its_function():
    def reward(sample, record):
        return 0.0

    assert function_name(functools.partial(reward, 1)).endswith("reward")


def test_hung_calls_hold_only_their_own_pool_and_then_fail_fast_naming_it():
    release = threading.Event()

    def hangs():
        release.wait(60)

    async def main():
        pool = UserThreads(2)
        for _ in range(2):
            with pytest.raises(TimeoutError, match="hangs took longer than 0.02 s"):
                await call_user(hangs, timeout_s=0.02, limiter=pool)
        assert pool.hung == 2
        with pytest.raises(UserThreadsExhausted, match=r"hangs not started: all 2 threads for user code are held"):
            await call_user(hangs, timeout_s=60.0, limiter=pool)
        # the loop's own threads are untouched by the hung calls
        assert await anyio.to_thread.run_sync(lambda: "free") == "free"
        return pool

    try:
        pools = _both(main)
    finally:
        release.set()
    for pool in pools:  # a hung thread that returns at last gives its slot back
        deadline = time.monotonic() + 10
        while pool.hung and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.hung == 0


def test_a_plain_limiter_is_counted_as_a_pool_of_its_own():
    release = threading.Event()

    async def main():
        limiter = anyio.CapacityLimiter(1)
        with pytest.raises(TimeoutError):
            await call_user(release.wait, 60, timeout_s=0.02, limiter=limiter)
        with pytest.raises(UserThreadsExhausted, match="all 1 threads"):
            await call_user(release.wait, 60, timeout_s=60.0, limiter=limiter)

    try:
        trio.run(main)
    finally:
        release.set()


def test_an_async_function_that_blocks_the_event_loop_fails_naming_the_rule():
    async def blocks():
        time.sleep(0.1)  # noqa: ASYNC251 (the mistake under test)
        return 1

    async def raises_late():
        time.sleep(0.1)  # noqa: ASYNC251
        raise ValueError("late")

    async def main():
        for fn in (blocks, raises_late):
            with pytest.raises(TimeoutError, match=rf"{fn.__name__} took .* past its bound of 0.01 s.* must not block"):
                await call_user(fn, timeout_s=0.01)
        assert await call_user(blocks, timeout_s=5.0) == 1  # inside its bound: a short block is let through

    _both(main)


def test_a_pool_needs_a_thread():
    with pytest.raises(ValueError, match="size >= 1"):
        UserThreads(0)


def test_asyncio_code_runs_from_trio_in_one_asyncio_loop_and_is_cancelled_at_its_bound():
    cancelled = threading.Event()

    async def loop_of(x):
        await asyncio.sleep(0.001)  # needs a running asyncio loop: under trio it would fail
        return asyncio.get_running_loop(), x

    async def raises():
        await asyncio.sleep(0)
        raise ValueError("asyncio said no")

    async def hangs():
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()

    async def main():
        (first, one), (second, two) = [await call_user(loop_of, x, timeout_s=5.0, async_loop="asyncio") for x in (1, 2)]
        assert (one, two) == (1, 2) and first is second  # what a call binds to its loop works in the next
        from_sync = await call_user(lambda: loop_of(3), timeout_s=5.0, async_loop="asyncio")
        assert from_sync == (first, 3)
        with pytest.raises(UserCodeError, match=r"raises raised ValueError: asyncio said no$"):
            await call_user(raises, timeout_s=5.0, async_loop="asyncio")
        with pytest.raises(TimeoutError, match=r"hangs took longer than 0.05 s"):
            await call_user(hangs, timeout_s=0.05, async_loop="asyncio")
        return first

    loop = trio.run(main)
    assert cancelled.wait(10)  # its asyncio task was cancelled, not left running
    assert loop is not None and loop.is_running()


def test_under_asyncio_asyncio_code_runs_in_the_callers_own_loop():
    async def loop_of():
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    async def main():
        return await call_user(loop_of, timeout_s=5.0, async_loop="asyncio") is asyncio.get_running_loop()

    assert asyncio.run(main())


def test_a_failure_named_by_its_raiser_passes_through_unwrapped():
    from rollouts.data.user_code import UserCodeFailure

    async def step():
        raise UserCodeFailure("environment E, turn 2: E.step raised ValueError: x")

    async def main():
        with pytest.raises(UserCodeFailure, match="^environment E, turn 2"):
            await call_user(step, timeout_s=5.0)
        with pytest.raises(UserCodeFailure, match="^environment E, turn 2"):
            await call_user(lambda: step(), timeout_s=5.0)

    _both(main)
