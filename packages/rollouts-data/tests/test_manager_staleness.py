"""AsyncRolloutManager with partial rollouts and a staleness bound: a partial group carried across
syncs whose oldest token would be trained more than `max_staleness` versions late is restarted from
its prompt (same position, same seed), never continued into a sample the trainer drops, never lost.

The event-driven FakeEngine is partial_fakes.py's.
"""

import json

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partial_fakes import PARTIAL_LEN, FakeEngine, balanced, cfg, sample, segments

from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.data.manager import request_seed
from rollouts.types import SamplingParams


def saved_partial_state(versions):
    """A manager state holding one partial group per entry of `versions` (prompt i at position i,
    its tokens generated under versions[i])."""
    groups = [
        {"position": i, "prompt": i, "samples": [sample(i, r, length=PARTIAL_LEN, version=v, partial=True).to_dict() for r in range(2)]}
        for i, v in enumerate(versions)
    ]  # fmt: skip
    return json.loads(json.dumps({"carry_over": [], "pending_prompts": [], "partial_groups": groups}))


def staleness_manager(engine, config, *, max_staleness, generate=None, buffer=None):
    return AsyncRolloutManager(
        buffer or DataBuffer(list(range(16)), shuffle=False),
        config,
        generate or engine.generate,
        reward_fn=lambda s, record: s.metadata["r"],
        continue_fn=engine.continue_group,
        max_staleness=max_staleness,
    )


@pytest.mark.anyio
async def test_a_partial_group_too_stale_for_its_step_is_restarted_and_one_within_the_bound_continued():
    engine = FakeEngine()
    engine.update(2)
    engine.release.set()
    seeds = {}

    async def generate(prompt, n, *, seed=None):
        seeds[prompt] = seed
        return await engine.generate(prompt, n)

    config = cfg(batch_size=2, sampling=SamplingParams(seed=7))
    manager = staleness_manager(engine, config, max_staleness=1, generate=generate)
    manager.load_state_dict(saved_partial_state([0, 1]))  # prompt 0 cut under version 0, prompt 1 under 1
    batch = await manager.generate_batch(step=0, train_version=2)
    md = batch.metadata
    assert md["groups_restarted"] == 1 and md["groups_requested"] == 2 and balanced(md)
    assert engine.generate_calls == [0] and seeds == {0: request_seed(7, 0)}  # restarted: same position, same seed
    assert [p for p, _ in engine.continue_calls] == [1]  # within the bound: continued
    by_prompt = {s.metadata["prompt_id"]: s for s in batch.samples}
    assert segments(by_prompt[0]) == [[2, 5]]  # the stale tokens discarded
    assert segments(by_prompt[1]) == [[1, PARTIAL_LEN], [2, 2]]
    assert all(2 - s.weight_version <= 1 for s in batch.samples)


@pytest.mark.anyio
async def test_without_a_train_version_or_a_bound_partial_groups_are_always_continued():
    for max_staleness, train_version in ((None, 9), (1, None)):
        engine = FakeEngine()
        engine.update(9)
        engine.release.set()
        manager = staleness_manager(engine, cfg(batch_size=2), max_staleness=max_staleness)
        manager.load_state_dict(saved_partial_state([0, 0]))
        batch = await manager.generate_batch(step=0, train_version=train_version)
        assert batch.metadata["groups_restarted"] == 0 and engine.generate_calls == []
        assert all(segments(s) == [[0, PARTIAL_LEN], [9, 2]] for s in batch.samples)


def test_a_negative_max_staleness_is_refused():
    with pytest.raises(ValueError, match=r"max_staleness must be >= 0, got -1"):
        staleness_manager(FakeEngine(), cfg(), max_staleness=-1)


@settings(max_examples=30, deadline=None)
@given(
    max_staleness=st.integers(1, 2),
    batch_size=st.integers(1, 3),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 1), st.integers(1, 2)),  # (step ends at the sync, lag, versions synced)
        min_size=1,
        max_size=6,
    ),
)
def test_no_trained_sample_is_ever_too_stale_and_no_prompt_is_lost_or_trained_twice(max_staleness, batch_size, steps):
    """Each step is paused mid-generation for a sync that moves the engine `bump` versions on; some
    steps end there (their partial groups carried to later steps, across more syncs). A step is
    trained at the engine's version when it started plus `lag`. Whatever the sequence: every trained
    sample is within max_staleness of its step's version, every prompt drawn is trained once or
    still held by the manager, and a prompt is generated afresh once plus once per restart."""

    async def main():
        engine, buffer = FakeEngine(), DataBuffer(list(range(200)), shuffle=False)
        config = cfg(batch_size=batch_size, max_concurrency=batch_size)
        manager = staleness_manager(engine, config, max_staleness=max_staleness, buffer=buffer)
        trained, restarted = [], 0
        for step, (ends_at_sync, lag, bump) in enumerate(steps):
            train_version = engine.version + lag
            engine.release, engine.all_running, engine.expect_running = anyio.Event(), anyio.Event(), batch_size
            out = {}

            async def run(step=step, train_version=train_version, out=out):
                out["batch"] = await manager.generate_batch(step=step, train_version=train_version)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                with anyio.fail_after(10):
                    await engine.all_running.wait()
                async with manager.paused(interrupt=engine.abort):
                    engine.update(engine.version + bump)
                    if ends_at_sync:
                        manager.abort()
                engine.expect_running = 0
                engine.release.set()
            batch = out["batch"]
            assert balanced(batch.metadata)
            assert all(train_version - s.weight_version <= max_staleness for s in batch.samples)
            trained += [s.metadata["prompt_id"] for s in batch.samples[::2]]
            restarted += batch.metadata["groups_restarted"]
        held = [g["prompt"] for g in manager.state_dict()["partial_groups"]] + manager.state_dict()["pending_prompts"]
        assert len(trained) == len(set(trained)) and not set(trained) & set(held)  # none trained twice
        assert sorted(trained + held) == list(range(buffer.sample_offset))  # none lost
        assert len(engine.generate_calls) == len(set(engine.generate_calls)) + restarted

    anyio.run(main, backend="trio")


@pytest.mark.anyio
async def test_a_kept_group_carried_over_too_stale_is_generated_again_from_its_prompt():
    engine = FakeEngine()
    engine.release.set()
    config = cfg(batch_size=1, over_sampling_factor=2.0)
    manager = staleness_manager(engine, config, max_staleness=1)
    first = await manager.generate_batch(step=0, train_version=0)  # 2 groups kept: 1 trained, 1 carried
    assert manager.num_carried_over_groups == 1 and first.metadata["groups_carried_over"] == 1
    state = json.loads(json.dumps(manager.state_dict()))
    assert state["carry_over_prompts"] == [1] and state["carry_over_positions"] == [1]
    engine.update(2)
    second = await manager.generate_batch(step=1, train_version=2)  # the carried group: 2 versions old
    md = second.metadata
    assert md["groups_restarted"] == 1 and md["groups_from_carry_over"] == 0 and balanced(md)
    assert sorted(engine.generate_calls) == [0, 1, 1, 2]  # prompt 1 generated again, under version 2
    assert {(s.metadata["prompt_id"], s.weight_version) for s in second.samples} == {(1, 2)}

    resumed = staleness_manager(FakeEngine(), config, max_staleness=1)
    old = {k: v for k, v in state.items() if not k.startswith("carry_over_")}  # saved before prompts were kept
    resumed.load_state_dict(old)
    batch = await resumed.generate_batch(step=1, train_version=2)
    assert batch.metadata["groups_restarted"] == 0 and batch.metadata["groups_from_carry_over"] == 1
