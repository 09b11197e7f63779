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
so no token is decoded twice; a paused round does not count against `max_generation_rounds`. A
generate function naming an `engine_calls` keyword (multi-turn episodes, which cannot be continued
from their tokens alone) gets an `EngineCalls` per attempt (rollouts.data.manager_gate) and keeps
its episodes going across the pause instead: the pause waits only for its engine calls in flight,
never for an episode between turns. With tail="first_n", `tail_cut` (the engine's abort and
resume) cuts the round's tail short the same way once the step's groups are kept, and it is
carried to the next step as partial groups. Partial groups are counted in groups_aborted (and
groups_partial), and kept across steps and in `state_dict`.

Staleness (`max_staleness`, `generate_batch(train_version=...)`): a sample is as old as its oldest
token. A partial group carried across syncs, or a kept group in the carry-over cache, that would be
trained over `max_staleness` versions after its oldest token is generated again from its prompt
(same position and seed, its tokens discarded), not trained stale nor dropped. In groups_restarted.

Seeds: with `config.sampling.seed` set, a generate function taking `seed` gets one per request,
from that seed and the prompt's position in the data stream (`request_seed`; kept by a retry or a
re-served aborted prompt), so a run repeats exactly at any concurrency.

State: what waits to be served (carry-over cache, pending prompts, partial groups) is one
`PromptQueue` value (rollouts.data.manager_round), replaced by pure functions at each change; a
`Gate` (rollouts.data.manager_gate) holds requests during a pause or a tail cut, counts those
running, carries an abort, and says whether a round was cut short. A round gives a `Round` value
(its requests' fates noted in a `RoundLog`); a step adds up their `Counts`.

Sync generate functions run in worker threads; on timeout or abort the thread is abandoned (its
result discarded: Python cannot cancel a running thread). Runs under asyncio and trio (anyio); a
generate function may be a coroutine function of the running event loop's library.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio

from rollouts.data.buffer import DataBuffer
from rollouts.data.filters import check_reward_nonzero_std
from rollouts.data.manager_gate import EngineCalls, Gate, TailCut
from rollouts.data.manager_parts import FirstN, count_causes, request_seed, takes_engine_calls, takes_seed
from rollouts.data.manager_round import (
    Counts,
    Outcome,
    PromptQueue,
    Request,
    Round,
    RoundLog,
    add_carry,
    draw,
    restart_stale,
    settle,
    take_carry,
    to_batch,
)
from rollouts.data.rollout import Transformed, apply_sample_transforms, validate_group
from rollouts.data.user_code import call_user, user_error_text
from rollouts.types import FilterFn, GenerateFn, RewardFn, RolloutBatch, RolloutConfig, Sample

__all__ = ["AsyncRolloutManager", "ContinueFn", "TailCut", "request_seed"]

ContinueFn = Callable[..., Awaitable[Sequence[Sample]]]
"""(prompt, group) -> the group with its partial samples continued (and scored once none is
partial); may take a `seed` keyword like a GenerateFn. The loops build it from an engine
(rollouts.loops.rollouts.functions.group_continuer), since continuing needs one."""

_MAX_ERRORS_REPORTED = 8  # keep batch metadata small when many requests fail the same way
_LAST = "; last: "  # between a failed request's prompt and the error it failed with last


def _check_setup(config: RolloutConfig, generate_fn: Any, continue_fn: Any, tail_cut: TailCut | None) -> None:
    if not callable(generate_fn):
        raise TypeError(f"generate_fn must be callable, got {type(generate_fn).__name__}")
    if continue_fn is not None and not callable(continue_fn):
        raise TypeError(f"continue_fn must be callable or None, got {type(continue_fn).__name__}")
    if config.partial and continue_fn is None:
        raise ValueError("RolloutConfig.partial=True needs a continue_fn ((prompt, partial group) -> continued group)")
    if config.partial and config.tail == "first_n" and tail_cut is None:
        raise ValueError(
            "RolloutConfig.partial with tail='first_n' needs interrupt and resume (the engine's, as tail_cut)"
        )


class AsyncRolloutManager:
    """Generates the groups of one training step at a time; holds the carry-over cache between steps.

    `source`: what generates (an engine's name or URL), named in the failure of a request that
    timed out, which otherwise has no error of its own to say where it hung.
    `continue_fn`: continues a group holding partial samples (needed by `config.partial`); without
    it a group holding a partial sample is a failed request.
    `tail_cut` (an engine's abort() and resume()): with `config.partial` and tail="first_n", the
    requests still running once the step's groups are kept are cut short by its `interrupt` and
    carried as partial groups (continued next step), not cancelled and restarted; its `resume` is
    called once they are back.
    `max_pause_s`: bound on a step's wait for a `paused()` block to end.
    `max_staleness`: a partial group whose oldest token would be trained over this many versions
    late is restarted from its prompt (module docstring); None: always continued.
    """

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
        tail_cut: TailCut | None = None,
        max_pause_s: float = 3600.0,
        max_staleness: int | None = None,
    ) -> None:
        _check_setup(config, generate_fn, continue_fn, tail_cut)
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
        self._filter_fn = check_reward_nonzero_std() if filter_fn is None and config.dynamic_sampling else filter_fn
        self._takes_seed = takes_seed(generate_fn)
        self._takes_engine_calls = config.partial and takes_engine_calls(generate_fn)
        self._train_version: int | None = None  # the step's, for the staleness of episodes held by a pause
        self._continue_takes_seed = continue_fn is not None and takes_seed(continue_fn)
        self._source = source
        self._max_staleness = max_staleness
        self._thread_limiter = anyio.CapacityLimiter(config.max_concurrency)
        # the state that changes while it runs: a value replaced at each change, and the gate
        self._queue = PromptQueue()
        self._gate = Gate(
            tail_cut=tail_cut, request_timeout_s=config.request_timeout_s, max_pause_s=max_pause_s, source=source
        )

    @property
    def queue(self) -> PromptQueue:
        """What waits to be served: the carry-over cache, pending prompts, partial groups."""
        return self._queue

    @property
    def num_carried_over_groups(self) -> int:
        """Kept groups waiting in the carry-over cache for the next step."""
        return len(self._queue.carry)

    @property
    def num_pending_prompts(self) -> int:
        """Prompts of aborted requests, served first by the next step."""
        return len(self._queue.pending)

    @property
    def num_partial_groups(self) -> int:
        """Groups holding partial samples, continued first by the next round."""
        return len(self._queue.partial)

    def abort(self) -> None:
        """Stop the step in progress now: in-flight requests are cancelled, finished groups kept.

        Called between steps, it applies to the next one (which then returns only carried-over
        groups), so an abort racing the start of a step is never lost.
        """
        self._gate.abort()

    @asynccontextmanager
    async def paused(self, interrupt: Callable[[], object] | None = None) -> AsyncIterator[None]:
        """Hold generation for the block (a weight sync): no request starts until it ends.

        With `interrupt` (an engine's abort()), it is called and the block is entered once the
        requests running have come back (partial groups, kept to continue), at most twice
        rollout.request_timeout_s; without it the requests keep running (an engine that aborts
        them itself, as vLLM's pause in mode 'abort' does). The step in progress, if any, goes on
        after the block, continuing the partial groups first."""
        async with self._gate.paused(interrupt):
            yield

    def _draw(self, num: int, train_version: int | None) -> tuple[tuple[Request, ...], int]:
        """The next `num` requests: the queue's first (`draw`), then new prompts with their
        positions in the data stream; and the number of partial groups restarted."""
        requests, num_restarted, self._queue = draw(
            self._queue, num, train_version=train_version, max_staleness=self._max_staleness
        )
        rest = num - len(requests)
        if rest:
            start = self._buffer.epoch_id * len(self._buffer) + self._buffer.sample_offset
            requests += tuple((start + i, p, None) for i, p in enumerate(self._buffer.get_prompts(rest)))
        return requests, num_restarted

    def _seed_of(self, position: int | None) -> int | None:
        base = self._config.sampling.seed
        return None if base is None or position is None else request_seed(base, position)

    async def _call(
        self, prompt: Any, group: tuple[Sample, ...] | None, seed: int | None, calls: EngineCalls | None
    ) -> tuple[Sample, ...]:
        n = self._config.samples_per_prompt
        if group is None:
            fn: Any = self._generate_fn
            args: tuple[Any, ...] = (prompt, n)
            kwargs: dict[str, Any] = {"seed": seed} if self._takes_seed and seed is not None else {}
            kwargs |= {} if calls is None else {"engine_calls": calls}
        else:
            fn, args = self._continue_fn, (prompt, group)
            kwargs = {"seed": seed} if self._continue_takes_seed and seed is not None else {}
        # unbounded here: the attempt's deadline (request_timeout_s) bounds it and names the engine
        call = functools.partial(fn, *args, **kwargs)
        result = await call_user(call, timeout_s=math.inf, limiter=self._thread_limiter)
        return validate_group(result, n, prompt=prompt, allow_partial=self._continue_fn is not None)

    def _engine_calls(self, deadline: anyio.CancelScope, group: tuple[Sample, ...] | None) -> Any:
        """The attempt's EngineCalls (a context), for a generate function that takes them; else None."""
        if group is not None or not self._takes_engine_calls:
            return contextlib.nullcontext(None)
        return self._gate.calls_counted(deadline, train_version=self._train_version, max_staleness=self._max_staleness)

    async def _attempt(self, request: Request) -> tuple[Outcome, bool]:
        """One attempt at `request`, bounded by request_timeout_s: its outcome, and whether a
        response of it was cut short by a pause and continued in place (EngineCalls)."""
        position, prompt, group = request
        timeout_s = self._config.request_timeout_s
        calls: EngineCalls | None = None
        try:
            with anyio.move_on_after(timeout_s) as deadline, self._engine_calls(deadline, group) as calls:
                result = await self._call(prompt, group, self._seed_of(position), calls)
        except Exception as e:  # a failed request is retried, then counted; never lost
            restarted = calls is not None and calls.restarted  # what the cancellation made user code raise
            return (None, False) if restarted else (user_error_text(e), False)
        if calls is not None and calls.restarted:
            return None, False
        if not deadline.cancelled_caught:
            return result, calls is not None and calls.continued
        where = f" waiting for {self._source}" if self._source else ""
        return f"timed out after {timeout_s} s{where} (rollout.request_timeout_s)", False

    async def _request(
        self,
        rid: int,
        request: Request,
        limiter: anyio.CapacityLimiter,
        log: RoundLog,
        on_group: Callable[[int], None] | None,
    ) -> None:
        """Runs `request` (retried up to max_retries); its group or failure goes in log.results[rid],
        its retries in log.retries[rid]. No result goes in where a hold kept it from starting or
        retrying, or where its episodes were too stale after a pause (log.restarted)."""
        max_retries = self._config.max_retries
        errors = []
        async with limiter:
            if self._gate.holding():  # paused or tail cut: not started, served again after
                return
            with self._gate.running():
                for attempt in range(max_retries + 1):
                    if attempt and self._gate.holding():  # no retry during a pause: served again after it
                        return
                    outcome, continued = await self._attempt(request)
                    if outcome is None:  # served again from its prompt, as a stale partial group is
                        log.restarted.add(rid)
                        return
                    if isinstance(outcome, str):
                        errors.append(outcome)
                        continue
                    log.results[rid], log.retries[rid] = outcome, attempt
                    if continued:
                        log.continued.add(rid)
                    if on_group is not None:  # first_n scores it now, and may end the round
                        on_group(rid)
                    return
        log.retries[rid] = max_retries  # every retry spent
        log.results[rid] = f"prompt {request[1]!r:.80} failed {len(errors)} times{_LAST}{errors[-1]}"

    async def _round(self, room: int, train_version: int | None) -> Round:
        """One round: requests for `room` groups (over-sampled) run, then settled and scored."""
        cfg = self._config
        requests, num_restarted = self._draw(math.ceil(room * cfg.over_sampling_factor), train_version)
        log = RoundLog()
        limiter = anyio.CapacityLimiter(cfg.max_concurrency)
        with anyio.CancelScope() as scope:
            self._gate.begin_round(scope)
            cut = self._gate.cut_tail if cfg.partial else None  # else first_n cancels the tail
            score = functools.partial(self._score_request, requests)
            first_n = FirstN(room, scope, score, cut) if cfg.tail == "first_n" else None
            async with anyio.create_task_group() as tg:
                for rid, request in enumerate(requests):
                    on_group = None if first_n is None else first_n.on_group(log.results)
                    tg.start_soon(self._request, rid, request, limiter, log, on_group)
        cut_short = self._gate.end_round()
        if first_n is not None and first_n.error is not None:
            raise first_n.error
        self._queue, counts, errors, finished = settle(self._queue, requests, log.results)
        if first_n is None:  # scored per group (as first_n does), each kept with its prompt
            outs = [(request, self._transform(request[1], g)) for request, g in finished]
        else:  # every group that finished was scored on arrival (in request order here)
            outs = [(requests[rid], first_n.outs[rid]) for rid in sorted(first_n.outs)]
        filtered = tuple(f for _, o in outs for f in o.filtered)
        counts += Counts(
            requested=len(requests),
            restarted=num_restarted + len(log.restarted),
            filtered=len(filtered),
            retries=sum(log.retries.values()),
            partial=sum(isinstance(log.results.get(rid), tuple) for rid in log.continued),
        )
        kept = tuple((r[0], r[1], g) for r, o in outs for g in o.kept)
        return Round(counts=counts, kept=kept, filtered=filtered, errors=tuple(errors), cut_short=cut_short)

    async def generate_batch(self, *, step: int, train_version: int | None = None) -> RolloutBatch:
        """Generate, score and filter one step's groups; returns them as a RolloutBatch.
        `train_version`: the weight version the batch will be trained at (the staleness bound of
        partial groups is checked against it; None: not checked)."""
        cfg, need = self._config, self._config.batch_size
        epoch, self._train_version = self._buffer.epoch_id, train_version
        self._queue, num_stale = restart_stale(self._queue, train_version, self._max_staleness)
        kept, self._queue = take_carry(self._queue, need)
        counts = Counts(restarted=num_stale, from_carry_over=len(kept))
        filtered: list[tuple[str, tuple[Sample, ...]]] = []
        errors: list[str] = []
        causes: dict[str, int] = {}
        rounds_allowed = cfg.max_generation_rounds if cfg.dynamic_sampling else 1
        num_rounds = num_paused = 0
        while len(kept) < need and num_rounds < rounds_allowed and not self._gate.aborted:
            await self._gate.wait_resumed()
            room = need - len(kept)
            done = await self._round(room, train_version)
            # a round a pause (or a held request) cut short is not one of the rounds allowed
            num_rounds, num_paused = (num_rounds, num_paused + 1) if done.cut_short else (num_rounds + 1, num_paused)
            kept.extend(g for _, _, g in done.kept[:room])
            self._queue = add_carry(self._queue, done.kept[room:])  # kept beyond the need: the next step's
            num_new = len(done.kept)
            counts += done.counts + Counts(kept_new=min(room, num_new), carried_over=max(0, num_new - room))
            filtered.extend(done.filtered)
            errors = [*errors, *done.errors][:_MAX_ERRORS_REPORTED]  # the step's first failures
            causes = count_causes(causes, done.errors, last=_LAST, max_causes=_MAX_ERRORS_REPORTED)
        extra = {
            "num_rounds": num_rounds,
            "num_paused_rounds": num_paused,
            "aborted": self._gate.take_abort(),  # an abort ends one step: the next one runs
            "errors": errors,
            "error_causes": causes,
        }
        carry = [g for _, _, g in self._queue.carry]
        return to_batch(
            kept, filtered, counts, extra, epoch=epoch, step=step, carry=carry, group_size=cfg.samples_per_prompt
        )

    def _transform(self, prompt: Any, group: tuple[Sample, ...]) -> Transformed:
        """One group rewarded (each sample with its prompt record) and filtered."""
        return apply_sample_transforms([group], reward_fn=self._reward_fn, filter_fn=self._filter_fn, records=[prompt])

    def _score_request(self, requests: tuple[Request, ...], rid: int, group: tuple[Sample, ...]) -> Transformed:
        return self._transform(requests[rid][1], group)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: the carry-over cache, the prompts of aborted requests with their
        positions in the data stream (their seeds come from those), and the partial groups."""
        return self._queue.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` saved (a state without `pending_positions` restores its
        pending prompts without seeds; one without `partial_groups`, none)."""
        queue = PromptQueue.from_state(state, self._config.samples_per_prompt)
        if queue.partial and self._continue_fn is None:
            raise ValueError(
                f"the state holds {len(queue.partial)} partial groups; continuing them needs a continue_fn"
            )
        self._queue = queue
