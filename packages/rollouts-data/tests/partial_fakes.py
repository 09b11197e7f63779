"""The fakes of the partial-rollout manager tests: an event-driven engine whose requests run until the
test releases them (they complete) or aborts the engine (they come back partial, with the tokens
"decoded" so far under the engine's weight version); continuing appends the rest under the engine's
version at that time.
"""

import anyio

from rollouts.data import AsyncRolloutManager, DataBuffer
from rollouts.data.rollout import is_partial
from rollouts.types import RolloutConfig, Sample, Status

PROMPT_LEN, PARTIAL_LEN, FULL_LEN = 2, 3, 5


def sample(prompt, i, *, length, version, partial=False, segments=None):
    return Sample(
        prompt=str(prompt),
        tokens=[1, 2] + [10 + i] * length,
        num_prompt_tokens=PROMPT_LEN,
        loss_mask=[0, 0] + [1] * length,
        rollout_logprobs=[-0.1 * (v + 1) for v, n in (segments or [[version, length]]) for _ in range(n)],
        weight_version=version,
        status=Status.ABORTED if partial else Status.COMPLETED,
        metadata={
            "prompt_id": prompt,
            "r": float(i),
            **({"partial": True} if partial else {}),
            "version_segments": segments or [[version, length]],
        },
    )


class FakeEngine:
    """Requests wait for `release` (complete) or `abort()` (partial); `version` is the weights'."""

    def __init__(self):
        self.version = 0
        self.aborted = False
        self.release = anyio.Event()
        self.abort_event = anyio.Event()
        self.running = 0
        self.all_running = anyio.Event()
        self.expect_running = 0
        self.generate_calls: list = []
        self.continue_calls: list = []
        self.fast: set = set()  # prompts that complete at once
        self.num_resumes = 0

    def resume(self):
        self.num_resumes += 1
        self.aborted, self.abort_event = False, anyio.Event()

    def abort(self):
        self.aborted = True
        self.abort_event.set()

    def update(self, version):
        self.version, self.aborted, self.abort_event = version, False, anyio.Event()

    async def _run(self, prompt=None):
        if prompt in self.fast:
            return True
        self.running += 1
        if self.running == self.expect_running:
            self.all_running.set()
        try:
            if not self.aborted:
                with anyio.fail_after(10):  # bound: the test releases or aborts every request
                    async with anyio.create_task_group() as tg:

                        async def wait(event):
                            await event.wait()
                            tg.cancel_scope.cancel()

                        tg.start_soon(wait, self.release)
                        tg.start_soon(wait, self.abort_event)
            return not self.aborted
        finally:
            self.running -= 1

    async def generate(self, prompt, n):
        self.generate_calls.append(prompt)
        version = self.version
        if await self._run(prompt):
            return [sample(prompt, i, length=FULL_LEN, version=version) for i in range(n)]
        return [sample(prompt, i, length=PARTIAL_LEN, version=version, partial=True) for i in range(n)]

    async def continue_group(self, prompt, group):
        self.continue_calls.append((prompt, [s.to_dict() for s in group]))
        assert all(is_partial(s) for s in group)
        version = self.version
        if not await self._run():
            return list(group)  # aborted again before any new token
        rest = FULL_LEN - PARTIAL_LEN
        return [
            sample(
                prompt,
                i,
                length=FULL_LEN,
                version=min(s.weight_version, version),
                segments=[*s.metadata["version_segments"], [version, rest]],
            )
            for i, s in enumerate(group)
        ]


def cfg(**kw):
    base = {"batch_size": 4, "samples_per_prompt": 2, "max_concurrency": 8, "request_timeout_s": 30.0, "partial": True}
    return RolloutConfig(**{**base, **kw})


def make_manager(engine, config, prompts=16):
    return AsyncRolloutManager(
        DataBuffer(list(range(prompts)), shuffle=False),
        config,
        engine.generate,
        reward_fn=lambda s, record: s.metadata["r"],
        continue_fn=engine.continue_group,
    )


def segments(s):
    return [list(x) for x in s.metadata["version_segments"]]


def balanced(md):
    parts = ("kept_new", "carried_over", "filtered", "failed", "aborted")
    return md["groups_requested"] == sum(md[f"groups_{k}"] for k in parts)


async def step_with(engine, manager, *, running, while_running):
    """Run one step; once `running` requests are in flight, await `while_running()` (pauses, syncs),
    then let the engine finish. Returns the step's batch."""
    engine.expect_running = running
    out = {}

    async def step():
        out["batch"] = await manager.generate_batch(step=0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        with anyio.fail_after(10):
            await engine.all_running.wait()
        await while_running()
        engine.expect_running = 0
        engine.release.set()
    return out["batch"]


async def sync_mid_step(engine, manager, *, running, version=1):
    """Run one step; once `running` requests are in flight, pause (aborting them), 'sync', release."""

    async def sync():
        async with manager.paused(interrupt=engine.abort):
            assert engine.running == 0  # every running request came back before the sync
            engine.update(version)

    return await step_with(engine, manager, running=running, while_running=sync)
