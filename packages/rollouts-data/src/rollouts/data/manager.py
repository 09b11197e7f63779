"""AsyncRolloutManager: a step's groups generated concurrently (asyncio or trio, via anyio), every bound explicit.

One generate request is one group (GenerateFn: prompt, n -> n Samples). Per step the manager:
1. takes kept groups left over from earlier steps (the carry-over cache) first;
2. runs rounds: draws ceil(missing * over_sampling_factor) prompts (aborted prompts first),
   runs them at most `max_concurrency` at a time, each attempt bounded by `request_timeout_s`
   and retried up to `max_retries` times; then scores and filters the finished groups;
3. with dynamic sampling (DAPO), repeats rounds until the batch is full or
   `max_generation_rounds` is reached; without it, runs one round.
Kept groups beyond the step's need go to the carry-over cache instead of being thrown away.
With `tail="first_n"` a round ends once the step's groups are kept (the first to finish, scored
on arrival); the requests still running are aborted and their prompts re-queued (below).

Accounting, per step, in groups (RolloutBatch.metadata):
  groups_requested == groups_kept_new + groups_carried_over + groups_filtered + groups_failed + groups_aborted
Aborted requests (in flight when `abort()` was called) put their prompt back in a queue that the
next step serves first, so no prompt is lost.

Partial rollouts (`config.partial`, with a `continue_fn`): a weight sync does not wait for the
step's generation. `async with manager.paused(interrupt=engine.abort):` stops new requests and has
the engine cut the running ones short (they come back as groups of partial samples with their
tokens and log-probs); the weights are synced inside it. On leaving it the partial groups are
continued first (`continue_fn`: prompt + partial response, the remaining budget, the new weights),
so no token is decoded twice; a paused round does not count against `max_generation_rounds`. With
tail="first_n", `interrupt` and `resume` cut the round's tail short the same way once the step's
groups are kept, and it is carried to the next step as partial groups. Partial groups are counted
in groups_aborted (and groups_partial), and kept across steps and in `state_dict`.

Staleness (`max_staleness`, `generate_batch(train_version=...)`): a sample is as old as its oldest
token. A partial group carried across syncs, or a kept group in the carry-over cache, that would be
trained over `max_staleness` versions after its oldest token is generated again from its prompt
(same position and seed, its tokens discarded), not trained stale nor dropped. In groups_restarted.

Seeds: with `config.sampling.seed` set, a generate function taking `seed` gets one per request,
from that seed and the prompt's position in the data stream (`request_seed`; kept by a retry or a
re-served aborted prompt), so a run repeats exactly at any concurrency.

Sync generate functions run in worker threads; on timeout or abort the thread is abandoned (its
result discarded: Python cannot cancel a running thread). Runs under asyncio and trio (anyio); a
generate function may be a coroutine function of the running event loop's library.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from rollouts.data.buffer import DataBuffer
from rollouts.data.filters import check_reward_nonzero_std
from rollouts.data.manager_parts import (
    FirstN,
    dump_state,
    parse_state,
    request_seed,
    split_stale,
    takes_seed,
    to_batch,
    too_stale,
)
from rollouts.data.rollout import Transformed, apply_sample_transforms, is_partial, validate_group
from rollouts.types import FilterFn, GenerateFn, RewardFn, RolloutBatch, RolloutConfig, Sample

__all__ = ["AsyncRolloutManager", "ContinueFn", "request_seed"]

ContinueFn = Callable[..., Awaitable[Sequence[Sample]]]
"""(prompt, group) -> the group with its partial samples continued (and scored once none is
partial); may take a `seed` keyword like a GenerateFn. The loops build it from an engine
(rollouts.loops.rollouts.functions.group_continuer), since continuing needs one."""

_Item = tuple[int | None, Any, tuple[Sample, ...] | None]
"""A request to make: (position in the data stream, prompt, the partial group to continue or None)."""

_MAX_ERRORS_REPORTED = 8  # keep batch metadata small when many requests fail the same way


class AsyncRolloutManager:
    """Generates the groups of one training step at a time; holds the carry-over cache between steps."""

    def __init__(
        self,
        buffer: DataBuffer,
        config: RolloutConfig,
        generate_fn: GenerateFn,
        *,
        reward_fn: RewardFn | None = None,
        filter_fn: FilterFn | None = None,
        source: str = "",
        continue_fn: ContinueFn | None = None,
        interrupt: Callable[[], object] | None = None,
        resume: Callable[[], object] | None = None,
        max_pause_s: float = 3600.0,
        max_staleness: int | None = None,
    ) -> None:
        """`source`: what generates (an engine's name or URL), named in the failure of a request
        that timed out, which otherwise has no error of its own to say where it hung.
        `continue_fn`: continues a group holding partial samples (needed by `config.partial`);
        without it a group holding a partial sample is a failed request, as before.
        `interrupt`, `resume` (an engine's abort() and resume()): with `config.partial` and
        tail="first_n", the requests still running once the step's groups are kept are cut short
        by `interrupt` and carried as partial groups (continued next step), not cancelled and
        restarted; `resume` is called once they are back.
        `max_pause_s`: bound on a step's wait for a `paused()` block to end.
        `max_staleness`: a partial group whose oldest token would be trained over this many versions
        late is restarted from its prompt (module docstring); None: always continued."""
        if not callable(generate_fn):
            raise TypeError(f"generate_fn must be callable, got {type(generate_fn).__name__}")
        if continue_fn is not None and not callable(continue_fn):
            raise TypeError(f"continue_fn must be callable or None, got {type(continue_fn).__name__}")
        if config.partial and continue_fn is None:
            raise ValueError(
                "RolloutConfig.partial=True needs a continue_fn ((prompt, partial group) -> continued group)"
            )
        if config.partial and config.tail == "first_n" and (interrupt is None or resume is None):
            raise ValueError("RolloutConfig.partial with tail='first_n' needs interrupt and resume (the engine's)")
        if not max_pause_s > 0:
            raise ValueError(f"max_pause_s must be > 0, got {max_pause_s}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(
                f"max_staleness must be >= 0, got {max_staleness}: a sample cannot be newer than its weights"
            )
        self._buffer = buffer
        self._config = config
        self._generate_fn = generate_fn
        self._continue_fn = continue_fn
        self._reward_fn = reward_fn
        if filter_fn is None and config.dynamic_sampling:
            filter_fn = check_reward_nonzero_std()
        self._filter_fn = filter_fn
        self._takes_seed = takes_seed(generate_fn)
        self._continue_takes_seed = continue_fn is not None and takes_seed(continue_fn)
        self._source = source
        self._max_pause_s = max_pause_s
        self._max_staleness = max_staleness
        self._carry: list[tuple[int | None, Any, tuple[Sample, ...]]] = []  # (position, prompt, kept group)
        self._pending_prompts: list[tuple[int | None, Any]] = []  # (position in the data stream, prompt)
        self._partial_groups: list[tuple[int | None, Any, tuple[Sample, ...]]] = []  # (position, prompt, group)
        self._scope: anyio.CancelScope | None = None
        self._aborted = False
        self._thread_limiter = anyio.CapacityLimiter(config.max_concurrency)
        self._in_flight = 0  # requests past the concurrency limiter and running
        self._idle: anyio.Event | None = None  # set when _in_flight drops to 0 (waited on by paused())
        self._resumed: anyio.Event | None = None  # set when a paused() block ends
        self._num_pauses = 0
        self._num_held = 0  # requests a pause or a tail cut kept from starting
        self._interrupt, self._resume = interrupt, resume
        self._tail_cut = False  # first_n cut the round's tail short: no request starts until its end

    @property
    def num_carried_over_groups(self) -> int:
        """Kept groups waiting in the carry-over cache for the next step."""
        return len(self._carry)

    @property
    def num_pending_prompts(self) -> int:
        """Prompts of aborted requests, served first by the next step."""
        return len(self._pending_prompts)

    @property
    def num_partial_groups(self) -> int:
        """Groups holding partial samples, continued first by the next round."""
        return len(self._partial_groups)

    def abort(self) -> None:
        """Stop the step in progress now: in-flight requests are cancelled, finished groups kept.

        Called between steps, it applies to the next one (which then returns only carried-over
        groups), so an abort racing the start of a step is never lost.
        """
        self._aborted = True
        if self._scope is not None:
            self._scope.cancel()

    @asynccontextmanager
    async def paused(self, interrupt: Callable[[], object] | None = None) -> AsyncIterator[None]:
        """Hold generation for the block (a weight sync): no request starts until it ends.

        With `interrupt` (an engine's abort()), it is called and the block is entered once the
        requests running have come back (partial groups, kept to continue), at most twice
        rollout.request_timeout_s; without it the requests keep running (an engine that aborts
        them itself, as vLLM's pause in mode 'abort' does). The step in progress, if any, goes on
        after the block, continuing the partial groups first."""
        if self._resumed is not None:
            raise RuntimeError("the rollout manager is already paused (paused() blocks do not nest)")
        self._resumed = anyio.Event()
        self._num_pauses += 1
        try:
            if interrupt is not None:
                interrupt()
                bound = 2 * self._config.request_timeout_s
                with anyio.move_on_after(bound) as deadline:
                    while self._in_flight:
                        self._idle = anyio.Event()
                        await self._idle.wait()
                if deadline.cancelled_caught:
                    raise TimeoutError(
                        f"{self._in_flight} generate requests still running {bound} s after the engine's "
                        f"abort{f' ({self._source})' if self._source else ''}: the engine does not abort"
                    )
            yield
        finally:
            resumed, self._resumed, self._idle = self._resumed, None, None
            resumed.set()

    async def _wait_resumed(self) -> None:
        """Until no pause holds generation (one may begin as soon as another ends), at most max_pause_s."""
        with anyio.move_on_after(self._max_pause_s) as deadline:
            while self._resumed is not None:
                await self._resumed.wait()
        if deadline.cancelled_caught:
            raise TimeoutError(f"generation stayed paused over max_pause_s={self._max_pause_s} s")

    def _held(self) -> bool:
        return self._resumed is not None or self._tail_cut

    def _cut_tail(self) -> None:
        self._tail_cut = True
        if self._interrupt is not None:
            self._interrupt()

    def _draw(self, num: int, train_version: int | None) -> tuple[list[_Item], int]:
        """The next `num` requests: partial groups to continue first (restarted from their prompt
        where too stale for `train_version`), then aborted prompts, then new prompts, each with its
        position in the data stream; and the number of partial groups restarted."""
        partial, self._partial_groups = self._partial_groups[:num], self._partial_groups[num:]
        items: list[_Item] = [
            (pos, p, None if too_stale(group, train_version, self._max_staleness) else group)
            for pos, p, group in partial
        ]
        num_restarted = sum(group is None for _, _, group in items)
        rest = num - len(items)
        from_pending, self._pending_prompts = self._pending_prompts[:rest], self._pending_prompts[rest:]
        items += [(pos, p, None) for pos, p in from_pending]
        rest -= len(from_pending)
        if rest:
            start = self._buffer.epoch_id * len(self._buffer) + self._buffer.sample_offset
            items += [(start + i, p, None) for i, p in enumerate(self._buffer.get_prompts(rest))]
        return items, num_restarted

    def _requeue(self, item: _Item) -> None:
        """A request that did not run (or was cancelled): served again first, partial tokens kept."""
        position, prompt, group = item
        if group is None:
            self._pending_prompts.append((position, prompt))
        else:
            self._partial_groups.append((position, prompt, group))

    def _seed_of(self, position: int | None) -> int | None:
        base = self._config.sampling.seed
        return None if base is None or position is None else request_seed(base, position)

    async def _call(self, prompt: Any, group: tuple[Sample, ...] | None, seed: int | None) -> Any:
        n = self._config.samples_per_prompt
        if group is None:
            fn: Any = self._generate_fn
            args: tuple[Any, ...] = (prompt, n)
            kwargs = {"seed": seed} if self._takes_seed and seed is not None else {}
        else:
            fn, args = self._continue_fn, (prompt, group)
            kwargs = {"seed": seed} if self._continue_takes_seed and seed is not None else {}
        if inspect.iscoroutinefunction(fn):
            result = await fn(*args, **kwargs)
        else:
            result = await anyio.to_thread.run_sync(
                lambda: fn(*args, **kwargs), abandon_on_cancel=True, limiter=self._thread_limiter
            )
            if inspect.isawaitable(result):
                result = await result
        return validate_group(result, n, prompt=prompt, allow_partial=self._continue_fn is not None)

    async def _request(
        self,
        rid: int,
        item: _Item,
        limiter: anyio.CapacityLimiter,
        results: dict[int, tuple[Sample, ...] | str],
        counts: dict[str, int],
        on_group: Any = None,
    ) -> None:
        cfg = self._config
        position, prompt, group = item
        errors = []
        async with limiter:
            if self._held():  # paused or tail cut: not started, served again after
                self._num_held += 1
                return
            self._in_flight += 1
            try:
                for attempt in range(cfg.max_retries + 1):
                    if attempt and self._held():  # no retry during a pause: served again after it
                        self._num_held += 1
                        return
                    try:
                        with anyio.move_on_after(cfg.request_timeout_s) as deadline:
                            results[rid] = await self._call(prompt, group, self._seed_of(position))
                        if not deadline.cancelled_caught:
                            counts["retries"] += attempt
                            if on_group is not None:
                                on_group(rid)
                            return
                        where = f" waiting for {self._source}" if self._source else ""
                        errors.append(f"timed out after {cfg.request_timeout_s} s{where} (rollout.request_timeout_s)")
                    except Exception as e:  # a failed request is retried, then counted; never lost
                        errors.append(f"{type(e).__name__}: {e}")
            finally:
                self._in_flight -= 1
                if not self._in_flight and self._idle is not None:
                    self._idle.set()
        counts["retries"] += cfg.max_retries
        results[rid] = f"prompt {prompt!r:.80} failed {len(errors)} times; last: {errors[-1]}"

    async def generate_batch(self, *, step: int, train_version: int | None = None) -> RolloutBatch:
        """Generate, score and filter one step's groups; returns them as a RolloutBatch.
        `train_version`: the weight version the batch will be trained at (the staleness bound of
        partial groups is checked against it; None: not checked)."""
        cfg, n = self._config, self._config.samples_per_prompt
        need = cfg.batch_size
        epoch = self._buffer.epoch_id
        self._carry, stale = split_stale(self._carry, train_version, self._max_staleness)
        self._pending_prompts[:0] = [(pos, prompt) for pos, prompt, _ in stale]  # generated again, first
        taken, self._carry = self._carry[:need], self._carry[need:]
        kept = [g for _, _, g in taken]
        names = ("requested", "kept_new", "carried_over", "filtered", "failed", "aborted", "partial", "restarted",
                 "retries")  # fmt: skip
        counts = dict.fromkeys(names, 0)
        counts["restarted"] = len(stale)
        counts["from_carry_over"] = len(kept)
        filtered: list[tuple[str, tuple[Sample, ...]]] = []
        errors: list[str] = []
        rounds_allowed = cfg.max_generation_rounds if cfg.dynamic_sampling else 1
        num_rounds = num_paused = 0
        while len(kept) < need and num_rounds < rounds_allowed and not self._aborted:
            await self._wait_resumed()
            num_rounds += 1
            interruptions = (self._num_pauses, self._num_held)
            items, num_restarted = self._draw(math.ceil((need - len(kept)) * cfg.over_sampling_factor), train_version)
            counts["requested"] += len(items)
            counts["restarted"] += num_restarted
            results: dict[int, tuple[Sample, ...] | str] = {}
            limiter = anyio.CapacityLimiter(cfg.max_concurrency)
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._aborted:
                    scope.cancel()
                cut = self._cut_tail if cfg.partial else None
                first_n = FirstN(need - len(kept), scope, self._transform, cut) if cfg.tail == "first_n" else None
                async with anyio.create_task_group() as tg:
                    for rid, item in enumerate(items):
                        on_group = None if first_n is None else first_n.on_group(results)
                        tg.start_soon(self._request, rid, item, limiter, results, counts, on_group)
            self._scope = None
            if self._tail_cut:  # every request cut short is back
                self._tail_cut = False
                if self._resume is not None:
                    self._resume()
            if first_n is not None and first_n.error is not None:
                raise first_n.error
            groups: list[tuple[_Item, tuple[Sample, ...]]] = []
            for rid, item in enumerate(items):
                result = results.get(rid)
                if result is None:
                    self._requeue(item)
                    counts["aborted"] += 1
                elif isinstance(result, str):
                    counts["failed"] += 1
                    if len(errors) < _MAX_ERRORS_REPORTED:
                        errors.append(result)
                elif any(is_partial(s) for s in result):  # cut short: continued, not restarted
                    self._partial_groups.append((item[0], item[1], result))
                    counts["aborted"] += 1
                    counts["partial"] += 1
                else:
                    groups.append((item, result))
            if (self._num_pauses, self._num_held) != interruptions:  # a round cut short is not one of the allowed
                num_rounds -= 1
                num_paused += 1
            if first_n is None:  # scored per group (as first_n does), each kept with its prompt
                outs = [(item, self._transform([g])) for item, g in groups]
            else:  # every group that finished was scored on arrival (in request order here)
                outs = [(items[rid], first_n.outs[rid]) for rid in sorted(first_n.outs)]
            new = [(item[0], item[1], g) for item, o in outs for g in o.kept]
            filtered.extend(f for _, o in outs for f in o.filtered)
            counts["filtered"] += sum(len(o.filtered) for _, o in outs)
            room = need - len(kept)
            kept.extend(g for _, _, g in new[:room])
            self._carry.extend(new[room:])
            counts["kept_new"] += min(room, len(new))
            counts["carried_over"] += max(0, len(new) - room)
        aborted, self._aborted = self._aborted, False  # an abort ends one step: the next one runs
        extra = {"num_rounds": num_rounds, "num_paused_rounds": num_paused, "aborted": aborted, "errors": errors}
        carry = [g for _, _, g in self._carry]
        return to_batch(kept, filtered, counts, extra, epoch=epoch, step=step, carry=carry, group_size=n)

    def _transform(self, groups: list[tuple[Sample, ...]]) -> Transformed:
        return apply_sample_transforms(groups, reward_fn=self._reward_fn, filter_fn=self._filter_fn)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: the carry-over cache, the prompts of aborted requests with their
        positions in the data stream (their seeds come from those), and the partial groups."""
        return dump_state(self._carry, self._pending_prompts, self._partial_groups)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` saved (a state without `pending_positions`, from before seeds
        followed positions, restores its pending prompts without seeds; one without
        `partial_groups`, none)."""
        carry, pending, partial = parse_state(state, self._config.samples_per_prompt)
        if partial and self._continue_fn is None:
            raise ValueError(f"the state holds {len(partial)} partial groups; continuing them needs a continue_fn")
        self._carry = carry
        self._pending_prompts = pending
        self._partial_groups = partial
