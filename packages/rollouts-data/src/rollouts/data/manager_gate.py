"""The rollout manager's gate: whether a request may start (`Hold`s: a pause, a tail cut), the
requests running, a step's abort, and whether a round was cut short (rollouts.data.manager); and
`EngineCalls`, a request's engine calls counted one by one (episodes continued across a pause)."""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

import anyio
import anyio.lowlevel

__all__ = ["EngineCalls", "Gate", "Hold", "TailCut"]


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
        self._per_call: set[EngineCalls] = set()  # attempts counted through their engine calls
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
        for calls in self._per_call:
            calls.stop_clock()
        try:
            if interrupt is not None:
                interrupt()
                await self._wait_idle()
            yield
        finally:
            self._holds.discard(Hold.PAUSED)
            self._idle = None
            self._pause_end.set()
            for calls in self._per_call:
                calls.start_clock()

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
            self._left()

    def _left(self) -> None:
        self._in_flight -= 1
        if not self._in_flight and self._idle is not None:
            self._idle.set()

    @contextmanager
    def calls_counted(
        self, deadline: anyio.CancelScope, *, train_version: int | None, max_staleness: int | None
    ) -> Iterator[EngineCalls]:
        """For the block, the running request (its attempt bounded by `deadline`) counts as running
        only through its engine calls (`EngineCalls.call`), and its deadline stops while a pause holds
        generation."""
        calls = EngineCalls(self, deadline, train_version=train_version, max_staleness=max_staleness)
        if Hold.PAUSED in self._holds:
            calls.stop_clock()
        self._left()
        self._per_call.add(calls)
        try:
            yield calls
        finally:
            self._per_call.discard(calls)
            self._in_flight += 1

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


class EngineCalls:
    """The engine calls of one attempt at a request whose episodes go on across a pause (multi-turn
    episodes continued in place, rollouts.loops.rollouts.continued): each call counts as running,
    the request between calls does not, so a pause waits for the calls in flight to come back cut
    short by its interrupt, never for an episode between turns (which may be waiting for the pause
    to end: waiting for it would deadlock).

    `call()` holds one engine call. It first waits while a pause holds generation (at most the
    manager's max_pause_s). Where the attempt's oldest token would then be trained more than
    `max_staleness` versions behind `train_version`, the attempt is cancelled and its prompt
    generated again (`restarted`), as a partial group too stale to continue is. The attempt's
    deadline (rollout.request_timeout_s) stops while a pause holds generation: a sync is not the
    request's slowness."""

    def __init__(
        self, gate: Gate, deadline: anyio.CancelScope, *, train_version: int | None, max_staleness: int | None
    ) -> None:
        self._gate, self._deadline = gate, deadline
        self._train_version, self._max_staleness = train_version, max_staleness
        self.restarted = False
        """The attempt was cancelled as too stale: its prompt is to be generated again."""
        self.continued = False
        """A call continued a response cut short (`call(continues=True)`)."""
        self._remaining_s: float | None = None  # the deadline's time left while a pause stops it

    def stop_clock(self) -> None:
        """Stop the attempt's deadline (a pause began)."""
        if self._remaining_s is None:
            self._remaining_s = self._deadline.deadline - anyio.current_time()
            self._deadline.deadline = math.inf

    def start_clock(self) -> None:
        """Run the attempt's deadline again with the time it had left (the pause ended)."""
        if self._remaining_s is not None:
            self._deadline.deadline = anyio.current_time() + self._remaining_s
            self._remaining_s = None

    def too_stale(self, oldest_version: int | None) -> bool:
        """Whether a token of `oldest_version` would be trained more than max_staleness versions late."""
        if oldest_version is None or self._train_version is None or self._max_staleness is None:
            return False
        return self._train_version - oldest_version > self._max_staleness

    @asynccontextmanager
    async def call(self, *, oldest_version: int | None, continues: bool = False) -> AsyncIterator[None]:
        """One engine call, once no pause holds generation; `oldest_version`: the weight version of
        the attempt's oldest token so far (None: none yet); `continues`: the call continues a
        response cut short."""
        await self._gate.wait_resumed()
        if self.too_stale(oldest_version):
            self.restarted = True
            self._deadline.cancel()
            await anyio.lowlevel.checkpoint()  # raises the cancellation: the attempt ends here
        self.continued = self.continued or continues
        with self._gate.running():
            yield
