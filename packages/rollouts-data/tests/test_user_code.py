"""call_user: sync and async user functions alike, bounded in time, their errors kept with their cause."""

import asyncio
import functools
import threading

import pytest
import trio

from rollouts.data.user_code import UserCodeError, call_user, function_name, user_error_text


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
