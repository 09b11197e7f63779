"""Calling user code: a function that may be sync or async, bounded in time, its errors kept with their cause.

Every place a loop calls a function a user gave it (a reward, a rollout function, an environment's
reset and step, a tool, a reward model's scorer, a generate function) calls it through `call_user`:

- a coroutine function is awaited in the running event loop;
- a plain function runs in a worker thread of a pool for user code (`UserThreads`), apart from the
  threads the loop itself starts; Python cannot cancel a running thread: past the bound the thread
  is abandoned, its result discarded, and it is counted as hung until it returns. While every
  thread of the pool is hung, a new call fails at once (UserThreadsExhausted) instead of waiting;
  an awaitable the function returns is awaited too;
- past `timeout_s` the call raises TimeoutError naming the function and the bound; an async
  function that blocks the event loop cannot be interrupted, so one that comes back past its bound
  without having yielded to it fails the same way, naming the rule it broke;
- an exception the function raised comes out as UserCodeError naming the function, the
  exception's type and message, with the exception itself as `__cause__` (a UserCodeFailure, which
  its raiser has named in full, passes through as it is);
- with `async_loop="asyncio"` an async function (or the awaitable a sync one returns) runs in an
  asyncio event loop: the caller's own under asyncio, else (under trio) the one event loop of
  `AsyncioThread`, in a thread of its own, so asyncio code (asyncio.sleep, aiohttp, an asyncio
  SDK) works from trio; past the bound its task there is cancelled.

Runs under asyncio and trio (anyio).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import anyio
from anyio.lowlevel import RunVar

__all__ = [
    "DEFAULT_USER_THREADS",
    "AsyncLoop",
    "AsyncioThread",
    "UserCodeError",
    "UserCodeFailure",
    "UserThreads",
    "UserThreadsExhausted",
    "call_user",
    "function_name",
    "own_copy",
    "user_error_text",
    "user_threads",
]

T = TypeVar("T")

DEFAULT_USER_THREADS = 40  # as many as trio lends by default: user code keeps its parallelism, in threads of its own
"""Threads of the pool that user code gets when its caller names none (one per event loop)."""


class UserCodeError(RuntimeError):
    """A user's function raised; the message names it and the exception, which is `__cause__`."""

    def __init__(self, name: str, error: Exception) -> None:
        super().__init__(f"{name} raised {type(error).__name__}: {error}")
        self.error = error


class UserCodeFailure(RuntimeError):
    """A failure of user code that the code calling it has named in full (which environment, which
    call, which turn): `call_user` lets it through unwrapped, so the name reaches the user."""


AsyncLoop = Literal["caller", "asyncio"]
"""Where `call_user` awaits user coroutines: the caller's event loop, or an asyncio one."""


class UserThreadsExhausted(RuntimeError):
    """Every thread of a user-code pool is held by a call abandoned past its bound."""


class UserThreads:
    """A bounded pool of worker threads for user code: its own CapacityLimiter of `size` threads,
    so user code never takes the threads the loop needs (trio's default limiter serves the
    training step), and the count of threads still held by abandoned calls (`hung`)."""

    def __init__(self, size: int = DEFAULT_USER_THREADS, *, limiter: anyio.CapacityLimiter | None = None) -> None:
        if limiter is None and size < 1:
            raise ValueError(f"a user-code thread pool needs size >= 1, got {size}")
        self.limiter = limiter if limiter is not None else anyio.CapacityLimiter(size)
        self._lock = threading.Lock()
        self._hung = 0

    @property
    def hung(self) -> int:
        """Threads still running a call that was abandoned past its bound."""
        with self._lock:
            return self._hung

    async def run_sync(self, work: Callable[[], T], *, name: str) -> T:
        """work() in one of the pool's threads; cancelled (a bound), the thread is abandoned and
        counted as hung until `work` returns. Raises UserThreadsExhausted naming `name` when every
        thread is hung."""
        size = self.limiter.total_tokens
        if self.hung >= size:
            raise UserThreadsExhausted(
                f"{name} not started: all {size} threads for user code are held by calls abandoned past "
                "their time bound (hung), so no call could run; fix what hangs, or raise its timeout"
            )
        state = {"done": False, "abandoned": False}

        def body() -> T:
            try:
                return work()
            finally:
                with self._lock:
                    state["done"] = True
                    self._hung -= state["abandoned"]

        try:
            return await anyio.to_thread.run_sync(body, abandon_on_cancel=True, limiter=self.limiter)
        except BaseException:
            with self._lock:
                if not state["done"]:  # cancelled while the thread runs on: it keeps its slot
                    state["abandoned"] = True
                    self._hung += 1
            raise


_DEFAULT_POOL: RunVar[UserThreads] = RunVar("rollouts_user_threads")
_POOLS: weakref.WeakKeyDictionary[Any, UserThreads] = weakref.WeakKeyDictionary()


def user_threads(limiter: anyio.CapacityLimiter | UserThreads | None = None) -> UserThreads:
    """The pool for `limiter`: itself, one kept per CapacityLimiter, or this event loop's default."""
    if isinstance(limiter, UserThreads):
        return limiter
    if limiter is not None:
        pool = _POOLS.get(limiter)
        if pool is None:
            pool = _POOLS[limiter] = UserThreads(limiter=limiter)
        return pool
    try:
        return _DEFAULT_POOL.get()
    except LookupError:
        pool = UserThreads()
        _DEFAULT_POOL.set(pool)
        return pool


def own_copy(record: Any) -> Any:
    """`record` with its JSON containers (dicts, lists) copied all the way down, other values shared:
    what a call of user code gets of a record shared with others (a prompt record graded for each
    sample of a group), so an edit in place changes no other call's record."""
    if isinstance(record, dict):
        return {key: own_copy(value) for key, value in record.items()}
    if isinstance(record, list):
        return [own_copy(value) for value in record]
    return record


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
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float,
    limiter: anyio.CapacityLimiter | UserThreads | None = None,
    async_loop: AsyncLoop = "caller",
) -> Any:
    """fn(*args), sync or async, bounded by `timeout_s` seconds (module docstring). `limiter` is
    the pool for the worker threads of sync functions: a UserThreads, a CapacityLimiter (counted
    as one), or None for this event loop's pool of DEFAULT_USER_THREADS. `async_loop`: where an
    async `fn` (or an awaitable a sync `fn` returns) runs: "caller" (this event loop) or "asyncio"."""
    start = anyio.current_time()
    scope = anyio.CancelScope(deadline=start + timeout_s)
    with scope:
        if inspect.iscoroutinefunction(fn):
            try:
                return _unless_blocked(fn, await _awaited_in(async_loop, fn(*args)), start, timeout_s)
            except (UserCodeError, UserCodeFailure, UserThreadsExhausted):
                raise  # from a call_user inside fn, or named by it: it names what failed
            except Exception as e:
                _unless_blocked(fn, None, start, timeout_s)
                raise UserCodeError(function_name(fn), e) from e
        try:
            # boxed: a thread that returns a coroutine is refused by trio; a sync function may hand
            # back an awaitable (a lambda around an async call), awaited here in the event loop
            (result,) = await user_threads(limiter).run_sync(lambda: (fn(*args),), name=function_name(fn))
            return await _awaited_in(async_loop, result) if inspect.isawaitable(result) else result
        except (UserCodeError, UserCodeFailure, UserThreadsExhausted):
            raise
        except Exception as e:
            raise UserCodeError(function_name(fn), e) from e
    # only the deadline above ends the block without a return: an outer cancellation propagates
    raise TimeoutError(f"{function_name(fn)} took longer than {timeout_s} s")


async def _awaited_in(async_loop: AsyncLoop, awaitable: Awaitable[T]) -> T:
    if async_loop == "caller" or _in_asyncio():
        return await awaitable
    return await AsyncioThread.shared().run(awaitable)


def _in_asyncio() -> bool:
    """Whether this thread runs an asyncio event loop (anyio's other backend is trio)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class AsyncioThread:
    """An asyncio event loop running in a daemon thread of its own: where `call_user` runs asyncio
    code a user gave when its caller runs under trio. One per process (`shared()`), so what an
    environment binds to its event loop in one call (a client, a session) still works in the next.
    Its calls share the loop: one that blocks it (a sync sleep in an async function) holds back
    the others, which then end at their own bounds."""

    _shared: AsyncioThread | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollouts-asyncio", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> AsyncioThread:
        """The process's one AsyncioThread, started on first use."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    async def run(self, awaitable: Awaitable[T]) -> T:
        """`awaitable` awaited in this thread's loop, from a trio task; when the task is cancelled
        (a bound), the awaitable's asyncio task is cancelled too and not waited for."""
        import trio  # only a trio caller gets here: anyio runs on asyncio or trio

        done, token = trio.Event(), trio.lowlevel.current_trio_token()
        future = asyncio.run_coroutine_threadsafe(_coroutine(awaitable), self.loop)

        def wake(_: Any) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the caller's run ended meanwhile
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        try:
            await done.wait()
        finally:
            future.cancel()  # a no-op once it is done
        return future.result()


async def _coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _unless_blocked(fn: Any, value: Any, start: float, timeout_s: float) -> Any:
    """`value`, unless the async `fn` came back past its bound: the deadline had no await to end
    it at, so `fn` held the event loop (and every other task) the whole time."""
    took_s = anyio.current_time() - start
    if took_s > timeout_s:
        raise TimeoutError(
            f"{function_name(fn)} took {took_s:.2f} s, past its bound of {timeout_s} s, without yielding to the "
            "event loop: an async function (a reward, a tool, an environment step) must not block; make it sync "
            "(it then runs in a worker thread) or await its slow work"
        )
    return value
