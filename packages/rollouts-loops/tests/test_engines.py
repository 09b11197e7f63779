"""CoalescingEngine: concurrent calls become batched calls; deadlines and cancellations stay per caller."""

from __future__ import annotations

import threading
import time

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.backends import InProcessEngine
from rollouts.loops.engines.coalescing import CoalescingEngine
from rollouts.loops.recipes.tiny import build_tiny_model
from rollouts.sync import HTTPOptions, RetryPolicy
from rollouts.types import Sample, SamplingParams, Status


class BlockingEngine:
    """Answers each prompt with its own tokens plus one; blocks `delay_s` per call like a forward pass."""

    name = "blocking"

    def __init__(self, delay_s: float = 0.0, fail_calls: tuple[int, ...] = ()) -> None:
        self.delay_s = delay_s
        self.fail_calls = fail_calls
        self.calls: list[list[tuple[int, ...]]] = []

    def sample(self, prompts, params, seeds=None):
        self.calls.append([tuple(p) for p in prompts])
        time.sleep(self.delay_s)
        if len(self.calls) - 1 in self.fail_calls:
            raise RuntimeError(f"call {len(self.calls) - 1} failed")
        return [
            Sample(
                tokens=(*p, 1), num_prompt_tokens=len(p), loss_mask=(0.0,) * len(p) + (1.0,), status=Status.COMPLETED
            )
            for p in prompts
            for _ in range(params.n)
        ]

    async def update_weights_from_disk(self, path, weight_version):
        pass

    async def weight_version(self):
        return None

    async def health(self):
        return True


def _prompts(caller: int, count: int) -> list[list[int]]:
    return [[caller + 2, i + 2] for i in range(count)]


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    cap=st.integers(1, 8),
    ns=st.lists(st.integers(1, 2), min_size=8, max_size=8),
)
def test_every_caller_gets_exactly_its_own_samples(counts, cap, ns):
    inner = BlockingEngine()
    engine = CoalescingEngine(inner, max_prompts_per_call=cap, window_s=0.01)
    got: dict[int, list[Sample]] = {}

    async def call(caller):
        params = SamplingParams(n=ns[caller], max_new_tokens=1)
        got[caller] = await engine.generate(_prompts(caller, counts[caller]), params)

    async def main():
        async with trio.open_nursery() as nursery:
            for caller in range(len(counts)):
                nursery.start_soon(call, caller)

    trio.run(main)
    for caller, count in enumerate(counts):
        expected = [(*p, 1) for p in _prompts(caller, count) for _ in range(ns[caller])]
        assert [s.tokens for s in got[caller]] == expected
    for prompts in inner.calls:  # a batch never mixes params and stays within the cap (one caller may exceed it)
        assert len(prompts) <= max(cap, max(counts))
        assert len({ns[p[0] - 2] for p in prompts}) == 1
    assert sum(len(c) for c in inner.calls) == sum(counts)


def test_concurrent_calls_within_the_window_go_out_as_one_call():
    inner = BlockingEngine()
    engine = CoalescingEngine(inner, max_prompts_per_call=64, window_s=0.05)
    params = SamplingParams(max_new_tokens=1)

    async def main():
        async with trio.open_nursery() as nursery:
            for caller in range(6):
                nursery.start_soon(engine.generate, _prompts(caller, 2), params)

    trio.run(main)
    assert len(inner.calls) == 1 and len(inner.calls[0]) == 12


def test_a_lone_caller_does_not_wait_out_the_window_and_a_burst_still_batches():
    """The adaptive gather waits only while callers are still joining: a lone call goes out at once
    (a 30 s window would otherwise hold it), a burst of start_soon callers goes out as one call."""
    inner = BlockingEngine()
    engine = CoalescingEngine(inner, max_prompts_per_call=64, window_s=30.0)
    params = SamplingParams(max_new_tokens=1)

    async def lone():
        start = trio.current_time()
        await engine.generate(_prompts(0, 1), params)
        return trio.current_time() - start

    assert trio.run(lone) < 30.0

    async def burst():
        async with trio.open_nursery() as nursery:
            for caller in range(8):
                nursery.start_soon(engine.generate, _prompts(caller, 1), params)

    inner.calls.clear()
    trio.run(burst)
    assert [len(c) for c in inner.calls] == [8]


def _timed_calls(engine, timeouts, *, start_gap_s=0.001):
    """Run one call per timeout, concurrently; returns {caller: ("ok" | "timeout" | error, seconds)}."""
    outcome: dict[int, tuple[str, float]] = {}
    params = SamplingParams(max_new_tokens=1)

    async def call(caller, timeout, t0):
        try:
            with trio.fail_after(timeout):
                samples = await engine.generate(_prompts(caller, 1), params)
            assert samples[0].tokens == (caller + 2, 2, 1)
            outcome[caller] = ("ok", trio.current_time() - t0)
        except trio.TooSlowError:
            outcome[caller] = ("timeout", trio.current_time() - t0)
        except Exception as e:  # reported, not raised: the test compares every caller's fate
            outcome[caller] = (repr(e), trio.current_time() - t0)

    async def main():
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for caller, timeout in enumerate(timeouts):
                nursery.start_soon(call, caller, timeout, t0)
                await trio.sleep(start_gap_s)

    trio.run(main)
    return outcome


def test_a_leader_deadline_covers_only_its_own_batch():
    # One prompt per call, 0.3 s each: the first caller's own batch is done at ~0.3 s, within its
    # 0.6 s; the later batches run after it and must neither time it out nor fail.
    engine = CoalescingEngine(BlockingEngine(delay_s=0.3), max_prompts_per_call=1, window_s=0.01)
    outcome = _timed_calls(engine, [0.6, 10.0, 10.0])
    assert {caller: status for caller, (status, _) in outcome.items()} == {0: "ok", 1: "ok", 2: "ok"}
    assert outcome[0][1] < 0.6


def test_a_leader_cancelled_in_its_window_hands_the_queue_on():
    inner = BlockingEngine(delay_s=0.05)
    engine = CoalescingEngine(inner, max_prompts_per_call=64, window_s=0.5, adaptive=False)
    outcome = _timed_calls(engine, [0.1, 10.0, 10.0])
    assert outcome[0][0] == "timeout"
    assert outcome[1][0] == "ok" and outcome[2][0] == "ok"
    assert [p for call in inner.calls for p in call] == [(3, 2), (4, 2)]  # the cancelled prompt never ran


def test_a_caller_cancelled_while_queued_is_never_generated():
    inner = BlockingEngine(delay_s=0.3)
    engine = CoalescingEngine(inner, max_prompts_per_call=1, window_s=0.01)
    outcome = _timed_calls(engine, [10.0, 0.1, 10.0])
    assert [outcome[c][0] for c in range(3)] == ["ok", "timeout", "ok"]
    assert [p for call in inner.calls for p in call] == [(2, 2), (4, 2)]


def test_a_caller_gone_while_its_batch_waited_for_a_thread_never_holds_the_lead():
    """The leader takes [its call, B] and waits for a worker thread; B's caller is cancelled, then
    the leader's: their batch goes back to the queue without B, so a later call is served instead of
    waiting for a lead handed to a caller that is gone."""
    inner = BlockingEngine()
    engine = CoalescingEngine(inner, max_prompts_per_call=8, window_s=0.01)
    params = SamplingParams(max_new_tokens=1)
    outcome = {}

    async def call(caller, timeout_s):
        try:
            with trio.fail_after(timeout_s):
                await engine.generate(_prompts(caller, 1), params)
            outcome[caller] = "ok"
        except trio.TooSlowError:
            outcome[caller] = "timeout"

    async def main():
        threads = trio.to_thread.current_default_thread_limiter()
        holder, tokens = object(), threads.total_tokens
        threads.total_tokens = 1
        await threads.acquire_on_behalf_of(holder)  # no worker thread until released below
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 0, 0.3)  # the leader: gives up while waiting for a thread
                await trio.sleep(0)  # caller 0 is first in the queue, and leads
                nursery.start_soon(call, 1, 0.1)  # in the leader's batch: gives up first
                await trio.sleep(0.4)
                nursery.start_soon(call, 2, 5.0)
                await trio.sleep(0.1)
                threads.release_on_behalf_of(holder)
        finally:
            threads.total_tokens = tokens

    trio.run(main)
    assert outcome == {0: "timeout", 1: "timeout", 2: "ok"}
    assert inner.calls == [[(4, 2)]]


def test_a_failed_batch_fails_its_callers_only():
    inner = BlockingEngine(delay_s=0.02, fail_calls=(0,))
    engine = CoalescingEngine(inner, max_prompts_per_call=1, window_s=0.01)
    outcome = _timed_calls(engine, [10.0, 10.0])
    assert "call 0 failed" in outcome[0][0] and outcome[1][0] == "ok"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_prompts_per_call"):
        CoalescingEngine(BlockingEngine(), max_prompts_per_call=0)
    with pytest.raises(ValueError, match="window_s"):
        CoalescingEngine(BlockingEngine(), window_s=-1.0)


# ---------------------------------------------------------------- one remote engine's sync bound


class HangingReload:
    """A remote engine whose reload never answers (its own request timeout would be far longer)."""

    name = "http://engine-a:8000"

    def __init__(self):
        self.reload_started = trio.Event()

    async def update_weights_from_disk(self, path, weight_version):
        self.reload_started.set()
        await trio.sleep_forever()

    async def weight_version(self):
        return 0

    async def health(self):
        return True


def test_a_single_remote_engine_gets_sync_timeout_s_on_its_reload():
    from rollouts.loops.engines.remote import BoundedSync
    from rollouts.sync import WeightSyncError

    inner = HangingReload()
    engine = BoundedSync(inner, sync_timeout_s=0.05)
    assert engine.name == inner.name and trio.run(engine.health)  # everything else passes through

    async def main():
        with trio.fail_after(10):  # a guard only: the bound under test is 0.05 s
            await engine.update_weights_from_disk("/abs/weights", 1)

    with pytest.raises(WeightSyncError, match="engine-a"):
        trio.run(main)
    assert inner.reload_started.is_set()


def test_remote_engine_bounds_a_single_url_by_sync_timeout_s():
    from rollouts.loops.engines.remote import BoundedSync, remote_engine

    engine = remote_engine(
        "vllm",
        ["http://127.0.0.1:1"],
        api_key_env="",
        http=HTTPOptions(timeout_s=5.0, retry=RetryPolicy(max_retries=0)),
        sync_timeout_s=7.0,
    )
    assert isinstance(engine, BoundedSync) and engine.sync_timeout_s == 7.0


def test_remote_engine_for_partial_rollouts_keeps_aborted_responses_and_refuses_sglang():
    from rollouts.loops.engines.remote import remote_engine

    common = {
        "api_key_env": "",
        "http": HTTPOptions(timeout_s=5.0, retry=RetryPolicy(max_retries=0)),
        "sync_timeout_s": 7.0,
    }
    engine = remote_engine("vllm", ["http://127.0.0.1:1"], partial=True, **common)
    assert engine.engine.keep_partial and engine.engine.pause_mode == "abort"  # a sync cuts responses short
    plain = remote_engine("vllm", ["http://127.0.0.1:1"], **common)
    assert not plain.engine.keep_partial and plain.engine.pause_mode == "wait"
    with pytest.raises(ValueError, match="rl.rollout.partial needs .* 'vllm', not 'sglang'"):
        remote_engine("sglang", ["http://127.0.0.1:1"], partial=True, **common)


class PickyEngine:
    """Refuses a whole call when any prompt in it is longer than `max_len` (as a context limit does)."""

    name = "picky"

    def __init__(self, max_len):
        self.max_len, self.calls = max_len, []

    def sample(self, prompts, params, seeds=None):
        self.calls.append(len(prompts))
        if any(len(p) > self.max_len for p in prompts):
            raise ValueError(f"a prompt is longer than {self.max_len} tokens")
        return [
            Sample(
                tokens=(*p, 1), num_prompt_tokens=len(p), loss_mask=(0.0,) * len(p) + (1.0,), status=Status.COMPLETED
            )
            for p in prompts
            for _ in range(params.n)
        ]

    async def update_weights_from_disk(self, path, weight_version):
        pass

    async def weight_version(self):
        return 0

    async def health(self):
        return True


def test_one_bad_prompt_fails_only_its_own_request():
    inner = PickyEngine(max_len=3)
    engine = CoalescingEngine(inner, max_prompts_per_call=8, window_s=0.05)
    outcomes = {}

    async def one(name, prompt):
        try:
            outcomes[name] = await engine.generate([prompt], SamplingParams(n=2, max_new_tokens=1))
        except ValueError as e:
            outcomes[name] = e

    async def main():
        async with trio.open_nursery() as nursery:
            for name, prompt in [("a", [1, 2]), ("long", [1, 2, 3, 4, 5]), ("b", [3])]:
                nursery.start_soon(one, name, prompt)

    trio.run(main)
    assert isinstance(outcomes["long"], ValueError)
    assert [s.prompt_tokens for s in outcomes["a"]] == [(1, 2)] * 2 and [s.prompt_tokens for s in outcomes["b"]] == [
        (3,)
    ] * 2
    # the batch, its halves ([1] and [2]), then the failing half's halves where it holds two (callers queue in any order)
    assert inner.calls in ([3, 1, 2], [3, 1, 2, 1, 1])


class AbortableEngine:
    """Generates one token per step in the worker thread until `abort()`; then the rows are partial."""

    name = "abortable"

    def __init__(self) -> None:
        import threading

        self.started = threading.Event()
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()

    def resume(self) -> None:
        self.aborted.clear()

    def sample(self, prompts, params, seeds=None):
        self.started.set()
        steps = 0
        while not self.aborted.is_set() and steps < params.max_new_tokens:
            steps += 1
            time.sleep(0.001)  # one "token step" of work
        status = Status.ABORTED if steps < params.max_new_tokens else Status.TRUNCATED
        return [
            Sample(
                tokens=(*p, *[2] * steps),
                num_prompt_tokens=len(p),
                loss_mask=(0.0,) * len(p) + (1.0,) * steps,
                status=status,
                metadata={"partial": True} if status is Status.ABORTED else {},
            )
            for p in prompts
            for _ in range(params.n)
        ]


def test_abort_cuts_a_batch_running_in_the_worker_thread():
    inner = AbortableEngine()
    engine = CoalescingEngine(inner)

    async def run():
        out = []
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def call():
                    out.extend(await engine.generate([[5, 6]], SamplingParams(n=2, max_new_tokens=10**6)))

                nursery.start_soon(call)
                assert await trio.to_thread.run_sync(inner.started.wait, 30.0)  # the batch is running
                engine.abort()
        return out

    samples = trio.run(run)
    assert [s.status for s in samples] == [Status.ABORTED] * 2 and all(s.metadata["partial"] for s in samples)
    assert all(1 <= s.response_length < 10**6 for s in samples)
    with pytest.raises(TypeError, match=r"blocking: the inner engine \(BlockingEngine\) has no resume\(\)"):
        CoalescingEngine(BlockingEngine()).resume()


# ---------------------------------------------------------------- a bad prompt among good ones


class CheckingEngine(PickyEngine):
    """Refuses a whole call holding an id outside its vocabulary (as the in-process sampler does), and
    checks a caller's prompts alone with `check_prompts`; each call blocks until `release` is set."""

    name = "checking"
    vocab_size = 100

    def __init__(self):
        super().__init__(max_len=1_000)
        self.release = threading.Event()

    def check_prompts(self, prompts, params):
        for i, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad} outside the vocabulary [0, {self.vocab_size})")

    def sample(self, prompts, params, seeds=None):
        self.release.wait(20)
        self.check_prompts(prompts, params)
        return super().sample(prompts, params, seeds)


def test_a_prompt_the_engine_refuses_fails_its_caller_at_once_and_the_others_are_served():
    inner = CheckingEngine()
    engine = CoalescingEngine(inner, max_prompts_per_call=8, window_s=0.05)
    outcomes = {}

    async def one(name, prompt, failed):
        try:
            outcomes[name] = await engine.generate([prompt], SamplingParams(n=2, max_new_tokens=1))
        except ValueError as e:
            outcomes[name] = e
            failed.set()

    async def main():
        failed = trio.Event()
        with trio.fail_after(10):  # a guard against a hang only: the bad caller fails before any batch runs
            async with trio.open_nursery() as nursery:
                for name, prompt in [("a", [1, 2]), ("oov", [1, 4242]), ("b", [3])]:
                    nursery.start_soon(one, name, prompt, failed)
                await failed.wait()  # while the batch of the good callers is still held in the engine
                assert "a" not in outcomes and "b" not in outcomes
                inner.release.set()

    trio.run(main)
    assert isinstance(outcomes["oov"], ValueError) and "[4242]" in str(outcomes["oov"])
    assert [s.prompt_tokens for s in outcomes["a"]] == [(1, 2)] * 2
    assert [s.prompt_tokens for s in outcomes["b"]] == [(3,)] * 2
    assert inner.calls == [2]  # one batch of the good callers: nobody ran alone


def test_the_in_process_engine_refuses_an_empty_or_unknown_prompt_before_batching():
    model = build_tiny_model(vocab_size=32, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64)
    engine = CoalescingEngine(InProcessEngine(model, shares_training_model=False), max_prompts_per_call=8)
    outcomes = {}

    async def one(name, prompt):
        try:
            outcomes[name] = await engine.generate([prompt], SamplingParams(max_new_tokens=2))
        except ValueError as e:
            outcomes[name] = str(e)

    async def main():
        async with trio.open_nursery() as nursery:
            for name, prompt in [("a", [1, 2]), ("oov", [5, 99]), ("empty", []), ("long", [3] * 127), ("b", [3])]:
                nursery.start_soon(one, name, prompt)

    trio.run(main)
    assert "token ids [99] outside the vocabulary [0, 32)" in outcomes["oov"]
    assert "prompt 0 is empty" in outcomes["empty"]
    assert "max_position_embeddings (128)" in outcomes["long"]
    assert len(outcomes["a"]) == 1 and len(outcomes["b"]) == 1


def test_one_bad_request_among_many_costs_a_few_calls_not_one_per_request():
    inner = PickyEngine(max_len=3)
    engine = CoalescingEngine(inner, max_prompts_per_call=16, window_s=0.05)
    outcomes = {}

    async def one(i, prompt):
        try:
            outcomes[i] = await engine.generate([prompt], SamplingParams(max_new_tokens=1))
        except ValueError as e:
            outcomes[i] = e

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i, [1, 2, 3, 4] if i == 5 else [i + 2])

    trio.run(main)
    assert isinstance(outcomes.pop(5), ValueError)
    assert all(samples[0].prompt_tokens == (i + 2,) for i, samples in outcomes.items())
    assert sorted(inner.calls) == [1, 1, 2, 2, 4, 4, 8, 8, 16]  # halves of the failing half down to the bad one


@pytest.mark.parametrize("short", [0, 1, 3])
def test_a_caller_cancelled_while_a_failed_batch_is_split_leaves_the_others_served(short):
    inner = BlockingEngine(delay_s=0.05, fail_calls=(0,))
    engine = CoalescingEngine(inner, max_prompts_per_call=8, window_s=0.01)
    timeouts = [10.0] * 4
    timeouts[short] = 0.08  # ends while the halves run
    outcome = _timed_calls(engine, timeouts, start_gap_s=0.0)
    assert all(outcome[c][0] == "ok" for c in range(4) if c != short), outcome
    assert outcome[short][0] in ("ok", "timeout")
