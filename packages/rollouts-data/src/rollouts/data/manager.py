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

Seeds: with `config.sampling.seed` set, each request gets its own seed, derived from that seed and
the prompt's position in the data stream (`request_seed`), and passed to a generate function that
takes a `seed` keyword. A prompt's samples then depend on its position, not on which requests ran
beside it or finished first, so a run repeats exactly at any concurrency; a retry or an aborted
prompt served again keeps its seed.

Sync generate functions run in worker threads; on timeout or abort the thread is abandoned (its
result discarded), since Python cannot cancel a running thread. The manager runs under asyncio and
trio alike (anyio); a generate function may be a coroutine function of the running event loop's library.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Mapping
from typing import Any

import anyio

from rollouts.data.buffer import DataBuffer
from rollouts.data.filters import check_reward_nonzero_std
from rollouts.data.rollout import Transformed, apply_sample_transforms, assign_groups, convert_to_batch, validate_group
from rollouts.types import FilterFn, GenerateFn, RewardFn, RolloutBatch, RolloutConfig, Sample, thaw

__all__ = ["AsyncRolloutManager", "request_seed"]

_MAX_ERRORS_REPORTED = 8  # keep batch metadata small when many requests fail the same way


def request_seed(seed: int, position: int) -> int:
    """The sampling seed of the prompt at `position` in the data stream (epoch * num_prompts + index
    within the epoch) of a run seeded with `seed`: a 63-bit hash, so neighbouring positions and
    seeds give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _takes_seed(fn: Any) -> bool:
    """Whether `fn` accepts a `seed` keyword (explicitly, or through **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "seed" and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        for p in params
    )


class _FirstN:
    """tail="first_n": scores each group as it arrives (scoring is per group, so the same as after
    the round) and cancels the round once `room` groups are kept; a scoring error ends the round
    and is raised after it, as it would be without first_n."""

    def __init__(self, room: int, scope: anyio.CancelScope, transform: Any) -> None:
        self.room, self.scope, self.transform = room, scope, transform
        self.num_kept = 0
        self.error: Exception | None = None
        self.outs: dict[int, Transformed] = {}  # request id -> its scored, filtered group

    def on_group(self, results: dict[int, Any]) -> Any:
        def done(rid: int) -> None:
            try:
                self.outs[rid] = self.transform([results[rid]])
                self.num_kept += len(self.outs[rid].kept)
            except Exception as e:  # raised by generate_batch once the round is over
                self.error = self.error or e
                self.scope.cancel()
            if self.num_kept >= self.room:
                self.scope.cancel()

        return done


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
    ) -> None:
        """`source`: what generates (an engine's name or URL), named in the failure of a request
        that timed out, which otherwise has no error of its own to say where it hung."""
        if not callable(generate_fn):
            raise TypeError(f"generate_fn must be callable, got {type(generate_fn).__name__}")
        self._buffer = buffer
        self._config = config
        self._generate_fn = generate_fn
        self._reward_fn = reward_fn
        if filter_fn is None and config.dynamic_sampling:
            filter_fn = check_reward_nonzero_std()
        self._filter_fn = filter_fn
        self._takes_seed = _takes_seed(generate_fn)
        self._source = source
        self._carry: list[tuple[Sample, ...]] = []
        self._pending_prompts: list[tuple[int | None, Any]] = []  # (position in the data stream, prompt)
        self._scope: anyio.CancelScope | None = None
        self._aborted = False
        self._thread_limiter = anyio.CapacityLimiter(config.max_concurrency)

    @property
    def num_carried_over_groups(self) -> int:
        """Kept groups waiting in the carry-over cache for the next step."""
        return len(self._carry)

    @property
    def num_pending_prompts(self) -> int:
        """Prompts of aborted requests, served first by the next step."""
        return len(self._pending_prompts)

    def abort(self) -> None:
        """Stop the step in progress now: in-flight requests are cancelled, finished groups kept.

        Called between steps, it applies to the next one (which then returns only carried-over
        groups), so an abort racing the start of a step is never lost.
        """
        self._aborted = True
        if self._scope is not None:
            self._scope.cancel()

    def _draw_prompts(self, num: int) -> list[tuple[int | None, Any]]:
        """(position in the data stream, prompt) of the next `num` prompts, aborted ones first."""
        from_pending, self._pending_prompts = self._pending_prompts[:num], self._pending_prompts[num:]
        rest = num - len(from_pending)
        if not rest:
            return from_pending
        start = self._buffer.epoch_id * len(self._buffer) + self._buffer.sample_offset
        drawn = self._buffer.get_prompts(rest)
        return from_pending + [(start + i, p) for i, p in enumerate(drawn)]

    def _seed_of(self, position: int | None) -> int | None:
        base = self._config.sampling.seed
        return None if base is None or position is None else request_seed(base, position)

    async def _call(self, prompt: Any, n: int, seed: int | None) -> Any:
        fn = self._generate_fn
        kwargs = {"seed": seed} if self._takes_seed and seed is not None else {}
        if inspect.iscoroutinefunction(fn):
            result = await fn(prompt, n, **kwargs)
        else:
            result = await anyio.to_thread.run_sync(
                lambda: fn(prompt, n, **kwargs), abandon_on_cancel=True, limiter=self._thread_limiter
            )
            if inspect.isawaitable(result):
                result = await result
        return validate_group(result, n, prompt=prompt)

    async def _request(
        self,
        rid: int,
        position: int | None,
        prompt: Any,
        limiter: anyio.CapacityLimiter,
        results: dict[int, tuple[Sample, ...] | str],
        counts: dict[str, int],
        on_group: Any = None,
    ) -> None:
        cfg = self._config
        errors = []
        async with limiter:
            for attempt in range(cfg.max_retries + 1):
                try:
                    with anyio.move_on_after(cfg.request_timeout_s) as deadline:
                        results[rid] = await self._call(prompt, cfg.samples_per_prompt, self._seed_of(position))
                    if not deadline.cancelled_caught:
                        counts["retries"] += attempt
                        if on_group is not None:
                            on_group(rid)
                        return
                    where = f" waiting for {self._source}" if self._source else ""
                    errors.append(f"timed out after {cfg.request_timeout_s} s{where} (rollout.request_timeout_s)")
                except Exception as e:  # a failed request is retried, then counted; never lost
                    errors.append(f"{type(e).__name__}: {e}")
        counts["retries"] += cfg.max_retries
        results[rid] = f"prompt {prompt!r:.80} failed {len(errors)} times; last: {errors[-1]}"

    async def generate_batch(self, *, step: int) -> RolloutBatch:
        """Generate, score and filter one step's groups; returns them as a RolloutBatch."""
        cfg, n = self._config, self._config.samples_per_prompt
        need = cfg.batch_size
        epoch = self._buffer.epoch_id
        kept, self._carry = self._carry[:need], self._carry[need:]
        counts = {k: 0 for k in ("requested", "kept_new", "carried_over", "filtered", "failed", "aborted", "retries")}
        counts["from_carry_over"] = len(kept)
        filtered: list[tuple[str, tuple[Sample, ...]]] = []
        errors: list[str] = []
        rounds_allowed = cfg.max_generation_rounds if cfg.dynamic_sampling else 1
        num_rounds = 0
        while len(kept) < need and num_rounds < rounds_allowed and not self._aborted:
            num_rounds += 1
            prompts = self._draw_prompts(math.ceil((need - len(kept)) * cfg.over_sampling_factor))
            counts["requested"] += len(prompts)
            results: dict[int, tuple[Sample, ...] | str] = {}
            limiter = anyio.CapacityLimiter(cfg.max_concurrency)
            with anyio.CancelScope() as scope:
                self._scope = scope
                if self._aborted:
                    scope.cancel()
                first_n = _FirstN(need - len(kept), scope, self._transform) if cfg.tail == "first_n" else None
                async with anyio.create_task_group() as tg:
                    for rid, (position, prompt) in enumerate(prompts):
                        on_group = None if first_n is None else first_n.on_group(results)
                        tg.start_soon(self._request, rid, position, prompt, limiter, results, counts, on_group)
            self._scope = None
            if first_n is not None and first_n.error is not None:
                raise first_n.error
            groups = []
            for rid, (position, prompt) in enumerate(prompts):
                result = results.get(rid)
                if result is None:
                    self._pending_prompts.append((position, prompt))
                    counts["aborted"] += 1
                elif isinstance(result, str):
                    counts["failed"] += 1
                    if len(errors) < _MAX_ERRORS_REPORTED:
                        errors.append(result)
                else:
                    groups.append(result)
            if first_n is None:
                out = self._transform(groups)
            else:  # every group that finished was scored on arrival (in request order here)
                outs = [first_n.outs[rid] for rid in sorted(first_n.outs)]
                out = Transformed(kept=sum((o.kept for o in outs), ()), filtered=sum((o.filtered for o in outs), ()))
            filtered.extend(out.filtered)
            counts["filtered"] += len(out.filtered)
            room = need - len(kept)
            kept.extend(out.kept[:room])
            self._carry.extend(out.kept[room:])
            counts["kept_new"] += min(room, len(out.kept))
            counts["carried_over"] += max(0, len(out.kept) - room)
        samples = [s for g in assign_groups(kept) for s in g]
        filter_reasons: dict[str, int] = {}
        for reason, g in filtered:
            filter_reasons[reason] = filter_reasons.get(reason, 0) + len(g)
        metadata: dict[str, Any] = {f"groups_{k}": v for k, v in counts.items()}
        aborted, self._aborted = self._aborted, False  # an abort ends one step: the next one runs
        metadata |= {"num_rounds": num_rounds, "aborted": aborted, "errors": errors}
        return convert_to_batch(
            samples,
            epoch=epoch,
            step=step,
            num_filtered=sum(len(g) for _, g in filtered),
            num_failed=counts["failed"] * n,
            num_carried_over=sum(len(g) for g in self._carry),
            filter_reasons=filter_reasons,
            metadata=metadata,
        )

    def _transform(self, groups: list[tuple[Sample, ...]]) -> Transformed:
        return apply_sample_transforms(groups, reward_fn=self._reward_fn, filter_fn=self._filter_fn)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: the carry-over cache, and the prompts of aborted requests with their
        positions in the data stream (their seeds come from those)."""
        return {
            "carry_over": [[s.to_dict() for s in g] for g in self._carry],
            "pending_prompts": [thaw(p) for _, p in self._pending_prompts],
            "pending_positions": [pos for pos, _ in self._pending_prompts],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` saved (a state without `pending_positions`, from before seeds
        followed positions, restores its pending prompts without seeds)."""
        keys, required = set(state), {"carry_over", "pending_prompts"}
        if not required <= keys <= required | {"pending_positions"}:
            raise ValueError(
                "manager state keys must be ['carry_over', 'pending_positions', 'pending_prompts'], "
                f"got {sorted(state)}"
            )
        carry = [tuple(Sample.from_dict(d) for d in g) for g in state["carry_over"]]
        for i, g in enumerate(carry):
            if len(g) != self._config.samples_per_prompt:
                expected = self._config.samples_per_prompt
                raise ValueError(f"carry_over[{i}] has {len(g)} samples, expected samples_per_prompt={expected}")
        prompts = list(state["pending_prompts"])
        positions = list(state.get("pending_positions", [None] * len(prompts)))
        if len(positions) != len(prompts) or not all(p is None or isinstance(p, int) for p in positions):
            raise ValueError(
                f"pending_positions must be {len(prompts)} ints (one per pending prompt), got {positions!r:.120}"
            )
        self._carry = carry
        self._pending_prompts = list(zip(positions, prompts, strict=True))
