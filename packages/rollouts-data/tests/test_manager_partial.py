"""AsyncRolloutManager with partial rollouts: a pause (a weight sync) mid-step has the engine cut the
running requests short; their groups come back partial and are continued, not restarted.

The fake engine below is event-driven: a request runs until the test releases it (it completes) or
aborts the engine (it comes back partial, with the tokens "decoded" so far under the engine's
weight version). Continuing appends the rest under the engine's version at that time.
"""

import json

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partial_fakes import (
    FULL_LEN,
    PARTIAL_LEN,
    FakeEngine,
    balanced,
    cfg,
    make_manager,
    sample,
    segments,
    step_with,
    sync_mid_step,
)

from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.data.manager import TailCut
from rollouts.types import Status


@pytest.mark.anyio
async def test_a_pause_mid_step_continues_the_partial_groups_under_the_new_weights():
    engine = FakeEngine()
    manager = make_manager(engine, cfg())
    batch = await sync_mid_step(engine, manager, running=4)
    md = batch.metadata
    assert batch.num_kept == 8 and balanced(md)
    assert md["groups_partial"] == 4 and md["groups_aborted"] == 4 and md["groups_requested"] == 8
    assert md["num_rounds"] == 1 and md["num_paused_rounds"] == 1
    assert sorted(engine.generate_calls) == [0, 1, 2, 3]  # each prompt generated once: continued, never restarted
    assert sorted(p for p, _ in engine.continue_calls) == [0, 1, 2, 3]
    for s in batch.samples:
        assert s.status is Status.COMPLETED and s.response_length == FULL_LEN
        assert segments(s) == [[0, PARTIAL_LEN], [1, FULL_LEN - PARTIAL_LEN]]
        assert s.weight_version == 0  # the oldest: a staleness bound holds for every token
    assert manager.num_partial_groups == 0 and manager.num_pending_prompts == 0


@pytest.mark.anyio
async def test_requests_waiting_for_a_slot_do_not_start_during_a_pause():
    engine = FakeEngine()
    manager = make_manager(engine, cfg(max_concurrency=2))
    batch = await sync_mid_step(engine, manager, running=2)
    md = batch.metadata
    assert batch.num_kept == 8 and balanced(md)
    assert md["groups_partial"] == 2  # 2 cut short; the 2 waiting start once the pause is over
    assert sorted(engine.generate_calls) == [0, 1, 2, 3]
    continued = sorted(p for p, _ in engine.continue_calls)
    by_prompt = {s.metadata["prompt_id"]: segments(s) for s in batch.samples}
    assert len(continued) == 2
    for prompt, segs in by_prompt.items():  # cut short: both versions; started after the sync: the new one
        assert segs == ([[0, PARTIAL_LEN], [1, FULL_LEN - PARTIAL_LEN]] if prompt in continued else [[1, FULL_LEN]])


@pytest.mark.anyio
async def test_a_step_started_during_a_pause_waits_for_its_end():
    engine = FakeEngine()
    engine.release.set()
    manager = make_manager(engine, cfg())
    out = {}

    async def step():
        out["batch"] = await manager.generate_batch(step=0)

    async with anyio.create_task_group() as tg:
        async with manager.paused(interrupt=engine.abort):
            tg.start_soon(step)
            await anyio.wait_all_tasks_blocked()
            assert engine.generate_calls == []
            engine.update(1)
    assert out["batch"].num_kept == 8 and {s.weight_version for s in out["batch"].samples} == {1}


@pytest.mark.anyio
async def test_partial_groups_survive_a_checkpoint_and_a_resumed_run_continues_them():
    engine = FakeEngine()
    manager = make_manager(engine, cfg())
    engine.expect_running = 4
    out = {}

    async def step():
        out["batch"] = await manager.generate_batch(step=0)

    async with anyio.create_task_group() as tg:  # the step is aborted during the sync: it ends there
        tg.start_soon(step)
        with anyio.fail_after(10):
            await engine.all_running.wait()
        async with manager.paused(interrupt=engine.abort):
            manager.abort()
    assert out["batch"].num_kept == 0 and manager.num_partial_groups == 4
    state = json.loads(json.dumps(manager.state_dict()))  # JSON, as a checkpoint holds it
    saved = {g["prompt"]: g["samples"] for g in state["partial_groups"]}
    assert sorted(saved) == [0, 1, 2, 3]

    resumed_engine = FakeEngine()
    resumed_engine.update(1)
    resumed_engine.release.set()
    resumed = make_manager(resumed_engine, cfg())
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    batch = await resumed.generate_batch(step=0)
    assert resumed_engine.generate_calls == []  # nothing restarted
    assert dict(resumed_engine.continue_calls) == saved  # each continued from the tokens saved
    assert batch.num_kept == 8
    assert all(segments(s) == [[0, 3], [1, 2]] for s in batch.samples)


@pytest.mark.anyio
async def test_a_group_aborted_again_while_continuing_is_kept_partial():
    engine = FakeEngine()
    manager = make_manager(engine, cfg())
    engine.expect_running = 4
    out = {}

    async def step():
        out["batch"] = await manager.generate_batch(step=0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        for version in (1, 2):  # two syncs land mid-step: the continuations are cut short too
            with anyio.fail_after(10):
                await engine.all_running.wait()
            engine.all_running = anyio.Event()
            async with manager.paused(interrupt=engine.abort):
                engine.update(version)
        engine.expect_running = 0
        engine.release.set()
    batch = out["batch"]
    assert batch.num_kept == 8 and balanced(batch.metadata) and batch.metadata["groups_partial"] == 8
    assert batch.metadata["num_paused_rounds"] == 2
    assert all(segments(s) == [[0, 3], [2, 2]] for s in batch.samples)


def test_partial_needs_a_continue_fn_and_a_saved_partial_group_needs_one_too():
    with pytest.raises(ValueError, match="partial=True needs a continue_fn"):
        AsyncRolloutManager(DataBuffer([1, 2]), cfg(), lambda p, n: [])
    plain = AsyncRolloutManager(DataBuffer([1, 2]), cfg(partial=False), lambda p, n: [])
    group = [sample(0, i, length=3, version=0, partial=True).to_dict() for i in range(2)]
    state = {
        "carry_over": [],
        "pending_prompts": [],
        "partial_groups": [{"position": 0, "prompt": 0, "samples": group}],
    }
    with pytest.raises(ValueError, match="needs a continue_fn"):
        plain.load_state_dict(state)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"position": 0, "prompt": 0}, "mapping of position, prompt and samples"),
        ({"position": "0", "prompt": 0, "samples": []}, "position must be an int"),
        ({"position": 0, "prompt": 0, "samples": []}, "2 samples, at least one partial; got 0"),
    ],
)
def test_malformed_saved_partial_groups_are_refused_by_name(entry, match):
    manager = AsyncRolloutManager(DataBuffer([1, 2]), cfg(), lambda p, n: [], continue_fn=lambda p, g: g)
    with pytest.raises(ValueError, match=match):
        manager.load_state_dict({"carry_over": [], "pending_prompts": [], "partial_groups": [entry]})


@pytest.mark.anyio
async def test_pauses_do_not_nest():
    manager = AsyncRolloutManager(DataBuffer([1, 2]), cfg(), lambda p, n: [], continue_fn=lambda p, g: g)
    async with manager.paused():
        with pytest.raises(RuntimeError, match="already paused"):
            async with manager.paused():
                pass


@settings(max_examples=25, deadline=None)
@given(
    running=st.integers(1, 4),
    concurrency=st.integers(1, 6),
    batch_size=st.integers(1, 5),
    steps=st.integers(1, 3),
)
def test_every_prompt_is_trained_once_whatever_the_pause_lands_on(running, concurrency, batch_size, steps):
    """Each step is paused once `running` requests are in flight: across steps no prompt is lost,
    none is generated twice, and the counts add up."""
    running = min(running, concurrency, batch_size)

    async def main():
        engine = FakeEngine()
        manager = make_manager(engine, cfg(batch_size=batch_size, max_concurrency=concurrency), prompts=100)
        trained, num_partial = [], 0
        for version in range(1, steps + 1):
            engine.release, engine.all_running = anyio.Event(), anyio.Event()
            batch = await sync_mid_step(engine, manager, running=running, version=version)
            assert balanced(batch.metadata) and batch.num_kept == 2 * batch_size
            trained += [s.metadata["prompt_id"] for s in batch.samples[::2]]
            num_partial += batch.metadata["groups_partial"]
            assert batch.metadata["groups_partial"] >= running
        assert sorted(trained) == list(range(steps * batch_size))  # none lost, none trained twice
        assert sorted(engine.generate_calls) == sorted(trained)  # none restarted
        assert len(engine.continue_calls) == num_partial

    anyio.run(main, backend="trio")


@pytest.mark.anyio
async def test_first_n_cuts_the_tail_short_and_carries_it_as_partial_groups():
    engine = FakeEngine()
    engine.fast = {0, 2}
    config = cfg(batch_size=2, over_sampling_factor=2.0, tail="first_n")
    manager = AsyncRolloutManager(
        DataBuffer(list(range(16)), shuffle=False),
        config,
        engine.generate,
        reward_fn=lambda s, record: s.metadata["r"],
        continue_fn=engine.continue_group,
        tail_cut=TailCut(interrupt=engine.abort, resume=engine.resume),
    )
    batch = await manager.generate_batch(step=0)  # 0 and 2 finish; the slow 1 and 3 are cut short
    md = batch.metadata
    assert sorted({s.metadata["prompt_id"] for s in batch.samples}) == [0, 2] and balanced(md)
    # the slow ones that had started come back partial; one not started yet is served again as a prompt
    assert md["groups_partial"] == manager.num_partial_groups and md["groups_aborted"] == 2
    assert manager.num_partial_groups + manager.num_pending_prompts == 2
    assert engine.num_resumes == 1 and not engine.aborted  # resumed once the cut requests were back
    partial = {g["prompt"] for g in manager.state_dict()["partial_groups"]}
    engine.release.set()
    engine.fast = set(range(16))
    batch = await manager.generate_batch(step=1)  # continued first: never restarted
    still = {g["prompt"] for g in manager.state_dict()["partial_groups"]}  # a tail may be cut again
    assert {p for p, _ in engine.continue_calls} | still == partial
    assert all(engine.generate_calls.count(p) <= 1 for p in range(16))  # none restarted
    assert balanced(batch.metadata) and batch.num_kept == 4


def test_first_n_partial_needs_the_engines_abort_and_resume():
    with pytest.raises(ValueError, match="needs interrupt and resume"):
        AsyncRolloutManager(DataBuffer([1, 2]), cfg(tail="first_n"), lambda p, n: [], continue_fn=lambda p, g: g)


@pytest.mark.anyio
async def test_a_pause_right_after_another_does_not_end_the_step_short():
    """A sync's pause, then at once an evaluation's: the step waits out both and fills its batch."""
    engine = FakeEngine()
    manager = make_manager(engine, cfg())

    async def two_pauses():
        async with manager.paused(interrupt=engine.abort):
            engine.update(1)
            await anyio.wait_all_tasks_blocked()  # the step waits for this pause's end
        async with manager.paused(interrupt=engine.abort):  # no checkpoint between the two
            engine.resume()
            await anyio.wait_all_tasks_blocked()

    batch = await step_with(engine, manager, running=4, while_running=two_pauses)
    assert batch.num_kept == 8 and balanced(batch.metadata) and batch.metadata["groups_partial"] == 4
    assert all(segments(s) == [[0, PARTIAL_LEN], [1, FULL_LEN - PARTIAL_LEN]] for s in batch.samples)
