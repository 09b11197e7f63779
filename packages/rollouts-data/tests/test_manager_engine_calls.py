"""AsyncRolloutManager with a generate function that takes `engine_calls` (multi-turn episodes
continued in place across a pause): a pause waits for the engine calls in flight, never for an
episode between turns; the calls cut short continue after it under the new weights; an episode
grown too stale by the pause is generated again from its prompt; the pause does not count against
the attempt's request_timeout_s.

The fake engine is event-driven: a call runs until the test releases the engine or aborts it (the
call comes back cut short); each call records the weight version it ran under.
"""

import anyio
import pytest

from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.types import RolloutConfig, Sample, Status, thaw

PROMPT = [1, 2]


class Engine:
    def __init__(self, *, expect_running):
        self.version = 0
        self.release, self.abort_event = anyio.Event(), anyio.Event()
        self.running, self.expect_running, self.all_running = 0, expect_running, anyio.Event()
        self.calls = 0  # engine calls started

    def abort(self):
        self.abort_event.set()

    def update(self, version):
        self.version, self.abort_event = version, anyio.Event()

    async def call(self, *, slow):
        """One engine call: (the version it ran under, whether it was cut short)."""
        self.calls += 1
        version = self.version
        if not slow or self.release.is_set():
            return version, False
        self.running += 1
        if self.running == self.expect_running:
            self.all_running.set()
        try:
            with anyio.fail_after(10):  # bound: the test releases or aborts every call
                async with anyio.create_task_group() as tg:

                    async def wait(event):
                        await event.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(wait, self.release)
                    tg.start_soon(wait, self.abort_event)
            return version, self.abort_event.is_set()
        finally:
            self.running -= 1


def episodes_of(engine, between):
    """A generate function of two-turn episodes: episode 0's first turn is quick, then it waits
    for `between` (an environment's step); episode 1's first turn runs until released or cut."""

    async def generate(prompt, n, *, engine_calls):
        async def episode(i):
            versions = []  # one per engine call: turn 1, its continuation if cut, turn 2
            async with engine_calls.call(oldest_version=None):
                version, cut = await engine.call(slow=i == 1)
            versions.append(version)
            if cut:
                async with engine_calls.call(oldest_version=min(versions), continues=True):
                    version, _ = await engine.call(slow=False)
                versions.append(version)
            await between.wait()
            async with engine_calls.call(oldest_version=min(versions)):
                version, _ = await engine.call(slow=False)
            versions.append(version)
            out[i] = Sample(
                tokens=[*PROMPT, *range(10, 10 + len(versions))],
                num_prompt_tokens=len(PROMPT),
                loss_mask=[0.0] * len(PROMPT) + [1.0] * len(versions),
                status=Status.COMPLETED,
                weight_version=min(versions),
                metadata={"version_segments": [[v, 1] for v in versions], "prompt_id": prompt},
            )

        out: list = [None] * n
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(episode, i)
        return out

    return generate


async def step_across_a_pause(engine, manager, between, *, train_version=None, pause_s=0.0):
    """One step; once the slow first turns run, a pause (the engine's abort) during which episodes
    between turns are let go on and the engine takes version 1."""
    out = {}

    async def step():
        out["batch"] = await manager.generate_batch(step=0, train_version=train_version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        with anyio.fail_after(10):
            await engine.all_running.wait()
            async with manager.paused(interrupt=engine.abort):  # waits for the calls, not the episodes
                assert engine.running == 0
                calls = engine.calls
                between.set()  # episodes between turns go on: their next calls wait for the pause's end
                await anyio.wait_all_tasks_blocked()
                assert engine.calls == calls
                await anyio.sleep(pause_s)
                engine.update(1)
            engine.release.set()
    return out["batch"]


def balanced(md):
    parts = ("kept_new", "carried_over", "filtered", "failed", "aborted")
    return md["groups_requested"] == sum(md[f"groups_{k}"] for k in parts)


@pytest.mark.anyio
async def test_a_pause_waits_for_engine_calls_not_for_episodes_between_turns():
    engine, between = Engine(expect_running=2), anyio.Event()
    manager = AsyncRolloutManager(
        DataBuffer(list(range(8)), shuffle=False),
        RolloutConfig(batch_size=2, samples_per_prompt=2, request_timeout_s=30.0, partial=True),
        episodes_of(engine, between),
        continue_fn=lambda prompt, group: group,
    )
    batch = await step_across_a_pause(engine, manager, between)
    md = batch.metadata
    assert batch.num_kept == 4 and balanced(md) and not md["errors"]
    assert md["groups_partial"] == 2 and md["groups_aborted"] == 0 and md["groups_requested"] == 2
    assert md["groups_restarted"] == 0 and md["groups_retries"] == 0
    by_episode = sorted((thaw(s.metadata["version_segments"]), s.weight_version) for s in batch.samples)
    # episode 0: turn 1 before the pause, turn 2 after; episode 1: cut, continued and turn 2 after
    assert by_episode == [([[0, 1], [1, 1]], 0)] * 2 + [([[0, 1], [1, 1], [1, 1]], 0)] * 2


@pytest.mark.anyio
async def test_an_episode_too_stale_after_a_pause_is_generated_again_from_its_prompt():
    engine, between = Engine(expect_running=2), anyio.Event()
    manager = AsyncRolloutManager(
        DataBuffer(list(range(8)), shuffle=False),
        RolloutConfig(batch_size=2, samples_per_prompt=2, request_timeout_s=30.0, partial=True),
        episodes_of(engine, between),
        continue_fn=lambda prompt, group: group,
        max_staleness=0,
    )
    batch = await step_across_a_pause(engine, manager, between, train_version=1)
    md = batch.metadata
    assert batch.num_kept == 4 and balanced(md) and not md["errors"]
    assert md["groups_restarted"] == 2 and md["groups_aborted"] == 2 and md["groups_requested"] == 4
    assert md["groups_partial"] == 0
    assert sorted({s.metadata["prompt_id"] for s in batch.samples}) == [0, 1]  # the same prompts, again
    assert all(s.weight_version == 1 for s in batch.samples)  # generated again under the new weights


@pytest.mark.anyio
async def test_a_pause_does_not_count_against_the_request_timeout():
    engine, between = Engine(expect_running=2), anyio.Event()
    manager = AsyncRolloutManager(
        DataBuffer(list(range(8)), shuffle=False),
        RolloutConfig(batch_size=2, samples_per_prompt=2, request_timeout_s=0.5, max_retries=0, partial=True),
        episodes_of(engine, between),
        continue_fn=lambda prompt, group: group,
    )
    batch = await step_across_a_pause(engine, manager, between, pause_s=1.0)  # twice the request's bound
    assert batch.num_kept == 4 and not batch.metadata["errors"] and batch.metadata["groups_partial"] == 2


def test_only_a_generate_function_naming_engine_calls_gets_them():
    from rollouts.data.manager_parts import takes_engine_calls

    async def named(prompt, n, *, engine_calls): ...
    async def positional(prompt, n, engine_calls=None): ...
    async def kwargs(prompt, n, **kw): ...
    async def seed_only(prompt, n, *, seed=None): ...

    assert takes_engine_calls(named) and takes_engine_calls(positional)
    assert not takes_engine_calls(kwargs) and not takes_engine_calls(seed_only) and not takes_engine_calls(len)
