"""The rollout manager's gate: whether a request may start (`Hold`s: a pause, a tail cut), the
requests running, a step's abort, and whether a round was cut short (rollouts.data.manager)."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import anyio

__all__ = ["Gate", "Hold", "TailCut"]


class Hold(enum.Enum):
    """Why no request may start (those held are served again after)."""

    PAUSED = "paused"
    """A `paused()` block holds generation (a weight sync)."""
    TAIL_CUT = "tail_cut"
    """tail="first_n" has its round's groups and cut the requests still running short."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TailCut:
    """How partial rollouts with tail="first_n" cut a round's tail short: the engine's pair."""

    interrupt: Callable[[], object]
    """The engine's abort(): the requests running come back as partial groups."""
    resume: Callable[[], object]
    """The engine's resume(): called at the round's end, once every request cut short is back."""


class Gate:
    """Holds, the requests running, a step's abort and the round in progress, for one manager.

    A round is cut short when a pause begins or a request is held during it: such a round is not
    one of a step's `max_generation_rounds`. An abort ends the step in progress, or the next one
    when none runs.
    """

    def __init__(self, *, tail_cut: TailCut | None, request_timeout_s: float, max_pause_s: float, source: str) -> None:
        self._tail_cut = tail_cut
        self._request_timeout_s = request_timeout_s
        self._max_pause_s = max_pause_s
        self._source = source
        self._holds: set[Hold] = set()
        self._pause_end: anyio.Event | None = None  # the pause in progress's end (made in the event loop)
        self._in_flight = 0  # requests past the concurrency limiter and running
        self._idle: anyio.Event | None = None  # set when _in_flight drops to 0 (waited on by paused())
        self._aborted = False
        self._scope: anyio.CancelScope | None = None  # the round in progress
        self._round_cut_short = False

    @property
    def holds(self) -> frozenset[Hold]:
        """What keeps requests from starting now (empty: they start)."""
        return frozenset(self._holds)

    @property
    def aborted(self) -> bool:
        """Whether an abort waits to end the step in progress (or the next one)."""
        return self._aborted

    def abort(self) -> None:
        """Cancel the round in progress, if any, and end its step (or the next one) after it."""
        self._aborted = True
        if self._scope is not None:
            self._scope.cancel()

    def take_abort(self) -> bool:
        """Whether the step was aborted; the next step runs again."""
        aborted, self._aborted = self._aborted, False
        return aborted

    @asynccontextmanager
    async def paused(self, interrupt: Callable[[], object] | None) -> AsyncIterator[None]:
        """Hold requests for the block; with `interrupt`, call it and enter once none runs."""
        if Hold.PAUSED in self._holds:
            raise RuntimeError("the rollout manager is already paused (paused() blocks do not nest)")
        self._holds.add(Hold.PAUSED)
        self._pause_end = anyio.Event()
        self._round_cut_short = True  # a round a pause began in does not count against its step
        try:
            if interrupt is not None:
                interrupt()
                await self._wait_idle()
            yield
        finally:
            self._holds.discard(Hold.PAUSED)
            self._idle = None
            self._pause_end.set()

    async def _wait_idle(self) -> None:
        """Until no request runs, at most twice request_timeout_s (the engine's abort returns them)."""
        bound = 2 * self._request_timeout_s
        with anyio.move_on_after(bound) as deadline:
            while self._in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
        if deadline.cancelled_caught:
            where = f" ({self._source})" if self._source else ""
            raise TimeoutError(
                f"{self._in_flight} generate requests still running {bound} s after the engine's "
                f"abort{where}: the engine does not abort"
            )

    async def wait_resumed(self) -> None:
        """Until no pause holds generation (one may begin as soon as another ends), at most max_pause_s."""
        with anyio.move_on_after(self._max_pause_s) as deadline:
            while Hold.PAUSED in self._holds:
                assert self._pause_end is not None  # made with the hold
                await self._pause_end.wait()
        if deadline.cancelled_caught:
            raise TimeoutError(f"generation stayed paused over max_pause_s={self._max_pause_s} s")

    def holding(self) -> bool:
        """Whether a hold keeps a request from starting now; a request held cuts its round short."""
        if self._holds:
            self._round_cut_short = True
        return bool(self._holds)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Counts a request as running for the block (a pause with interrupt waits for none)."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()

    def cut_tail(self) -> None:
        """first_n has its groups: hold new requests and have the engine cut the running ones short."""
        assert self._tail_cut is not None  # checked at setup: partial first_n needs the engine's pair
        self._holds.add(Hold.TAIL_CUT)
        self._tail_cut.interrupt()

    def begin_round(self, scope: anyio.CancelScope) -> None:
        """A round runs in `scope` (cancelled at once if an abort waits)."""
        self._scope = scope
        self._round_cut_short = False
        if self._aborted:
            scope.cancel()

    def end_round(self) -> bool:
        """The round is over: a tail cut is lifted (the engine resumed). Whether it was cut short."""
        self._scope = None
        if Hold.TAIL_CUT in self._holds:  # every request cut short is back
            self._holds.discard(Hold.TAIL_CUT)
            assert self._tail_cut is not None  # only cut_tail adds the hold
            self._tail_cut.resume()
        return self._round_cut_short
