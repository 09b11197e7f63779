"""AsyncRolloutManager with tail="first_n": a step takes the first groups to finish and aborts the slow tail.

Runs on trio's MockClock, so generation times are virtual: a long-tailed draw costs no wall time.
"""

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.data.filters import check_reward_nonzero_std
from rollouts.types import RolloutConfig, Sample, Status


def make_group(prompt, n, *, rewards=None):
    rewards = rewards or [float(i) for i in range(n)]
    return [
        Sample(
            tokens=[1, 2 + i],
            num_prompt_tokens=1,
            loss_mask=[0, 1],
            status=Status.COMPLETED,
            metadata={"prompt_id": prompt, "r": r},
        )
        for i, r in enumerate(rewards)
    ]


def reward_from_metadata(sample, record):
    return sample.metadata["r"]


def balanced(md):
    parts = ("kept_new", "carried_over", "filtered", "failed", "aborted")
    return md["groups_requested"] == sum(md[f"groups_{k}"] for k in parts)


def cfg(**kw):
    return RolloutConfig(
        **{"batch_size": 6, "samples_per_prompt": 2, "max_concurrency": 3, "request_timeout_s": 5.0} | kw
    )


def timed_gen(delays, calls):
    async def gen(prompt, n):
        calls.append(prompt)
        await trio.sleep(delays[prompt % len(delays)])
        return make_group(prompt, n)

    return gen


def run_steps(manager, num_steps):
    async def run():
        out = []
        for step in range(num_steps):
            start = trio.current_time()
            batch = await manager.generate_batch(step=step)
            out.append((batch, trio.current_time() - start))
        return out

    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


def prompt_ids(batch):
    return sorted({s.metadata["prompt_id"] for s in batch.samples})


def test_first_n_returns_the_fastest_groups_and_requeues_the_tail():
    delays = [1.0, 50.0, 2.0, 3.0, 40.0, 4.0, 5.0, 60.0]  # a slow tail: prompts 1, 4 and 7
    for tail, want_time in (("wait", 60.0), ("first_n", 4.0)):
        calls = []
        config = cfg(batch_size=4, over_sampling_factor=2.0, max_concurrency=8, request_timeout_s=100.0, tail=tail)
        manager = AsyncRolloutManager(DataBuffer(list(range(8)), shuffle=False), config, timed_gen(delays, calls))
        [(batch, elapsed)] = run_steps(manager, 1)
        assert elapsed == pytest.approx(want_time)
        md = batch.metadata
        assert balanced(md) and md["groups_requested"] == 8 and md["aborted"] is False
        if tail == "wait":  # the first four in request order; the rest carried over
            assert prompt_ids(batch) == [0, 1, 2, 3] and manager.num_carried_over_groups == 4
        else:  # at 4 s prompt 5 fills the batch; 6 (due at 5 s), 4, 1 and 7 are aborted and re-queued
            assert prompt_ids(batch) == [0, 2, 3, 5] and manager.num_carried_over_groups == 0
            assert md["groups_aborted"] == 4 and manager.num_pending_prompts == 4
            assert sorted(p for _, p in manager.queue.pending) == [1, 4, 6, 7]


@settings(max_examples=40, deadline=None)
@given(
    delays=st.lists(st.integers(1, 1000), min_size=12, max_size=12),
    batch_size=st.integers(1, 4),
    factor=st.sampled_from([1.0, 1.5, 2.0]),
)
def test_first_n_never_loses_or_repeats_a_prompt(delays, batch_size, factor):
    calls = []
    config = cfg(
        batch_size=batch_size, over_sampling_factor=factor, max_concurrency=12, request_timeout_s=5000.0, tail="first_n"
    )
    manager = AsyncRolloutManager(
        DataBuffer(list(range(100)), shuffle=False), config, timed_gen([float(d) for d in delays], calls)
    )
    steps = run_steps(manager, 3)
    trained = [p for batch, _ in steps for p in prompt_ids(batch)]
    assert len(trained) == len(set(trained)) == 3 * batch_size  # every step full, no prompt trained twice
    drawn = delays[: -(-batch_size * int(2 * factor) // 2)]  # step 0 draws ceil(batch_size * factor) prompts
    assert steps[0][1] == pytest.approx(sorted(drawn)[batch_size - 1])  # over once its batch_size-th is done
    for batch, elapsed in steps:
        assert balanced(batch.metadata)
        # a step lasts until its batch_size-th fastest request (of those it ran) finished, never longer
        assert elapsed <= max(delays[p % 12] for p in prompt_ids(batch)) + 1e-9
    waiting = set(calls) - set(trained)
    carried = [s.metadata["prompt_id"] for g in manager.queue.carry for s in g[:1]]
    requeued = [p for _, p in manager.queue.pending]
    # what was drawn and not trained waits, once, in the carry-over cache or the queue
    assert sorted(carried + requeued) == sorted(waiting)


def test_first_n_with_dynamic_sampling_counts_only_kept_groups():
    delays = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    calls = []

    async def gen(prompt, n):
        calls.append(prompt)
        await trio.sleep(delays[prompt])
        return make_group(prompt, n, rewards=[1.0, 1.0] if prompt < 2 else [0.0, 1.0])  # 0 and 1 filtered

    config = cfg(batch_size=2, over_sampling_factor=3.0, max_concurrency=6, dynamic_sampling=True, tail="first_n")
    manager = AsyncRolloutManager(
        DataBuffer(list(range(6)), shuffle=False),
        config,
        gen,
        reward_fn=reward_from_metadata,
        filter_fn=check_reward_nonzero_std(),
    )
    [(batch, elapsed)] = run_steps(manager, 1)
    assert prompt_ids(batch) == [2, 3] and elapsed == pytest.approx(4.0)
    assert batch.metadata["groups_filtered"] == 2 and batch.metadata["groups_aborted"] == 2 and balanced(batch.metadata)


def test_first_n_raises_a_reward_error_as_without_it():
    async def gen(prompt, n):
        await trio.sleep(1.0)
        return make_group(prompt, n)

    def bad_reward(sample, record):
        return float("nan")

    for tail in ("wait", "first_n"):
        manager = AsyncRolloutManager(
            DataBuffer(list(range(4)), shuffle=False), cfg(tail=tail), gen, reward_fn=bad_reward
        )
        with pytest.raises(ValueError, match="finite float"):
            run_steps(manager, 1)


def test_a_bad_tail_is_refused_by_name():
    with pytest.raises(ValueError, match=r"RolloutConfig.tail must be 'wait' or 'first_n', got 'fastest'"):
        cfg(tail="fastest")
