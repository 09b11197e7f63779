"""Calling user code: a function that may be sync or async, bounded in time, its errors kept with their cause.

Every place a loop calls a function a user gave it (a reward, a rollout function, an environment's
reset and step, a tool, a reward model's scorer, a generate function) calls it through `call_user`:

- a coroutine function is awaited in the running event loop;
- a plain function runs in a worker thread (Python cannot cancel a running thread: past the bound
  the thread is abandoned and its result discarded), and an awaitable it returns is awaited too;
- past `timeout_s` the call raises TimeoutError naming the function and the bound;
- an exception the function raised comes out as UserCodeError naming the function, the
  exception's type and message, with the exception itself as `__cause__`.

Runs under asyncio and trio (anyio).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import anyio

__all__ = ["UserCodeError", "call_user", "function_name", "user_error_text"]


class UserCodeError(RuntimeError):
    """A user's function raised; the message names it and the exception, which is `__cause__`."""

    def __init__(self, name: str, error: Exception) -> None:
        super().__init__(f"{name} raised {type(error).__name__}: {error}")
        self.error = error


def function_name(fn: Any) -> str:
    """How errors name `fn`: its qualified name (a partial's function's), else its repr."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def user_error_text(error: BaseException) -> str:
    """'<ExceptionType>: <message>' of what the user's code raised (a UserCodeError's cause), or of
    `error` itself."""
    while isinstance(error, UserCodeError):
        error = error.error
    return f"{type(error).__name__}: {error}"


async def call_user(
    fn: Callable[..., Any], *args: Any, timeout_s: float, limiter: anyio.CapacityLimiter | None = None
) -> Any:
    """fn(*args), sync or async, bounded by `timeout_s` seconds (module docstring). `limiter` bounds
    the worker threads of sync functions (anyio's default limiter when None)."""
    scope = anyio.CancelScope(deadline=anyio.current_time() + timeout_s)
    with scope:
        try:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            # boxed: a thread that returns a coroutine is refused by trio; a sync function may hand
            # back an awaitable (a lambda around an async call), awaited here in the event loop
            (result,) = await anyio.to_thread.run_sync(lambda: (fn(*args),), abandon_on_cancel=True, limiter=limiter)
            return await result if inspect.isawaitable(result) else result
        except UserCodeError:
            raise  # from a call_user inside fn: it names the function that failed
        except Exception as e:
            raise UserCodeError(function_name(fn), e) from e
    # only the deadline above ends the block without a return: an outer cancellation propagates
    raise TimeoutError(f"{function_name(fn)} took longer than {timeout_s} s")
