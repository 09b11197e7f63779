"""Environment code that fails is named and bounded: a step that blocks, raises (sync or async) or
uses asyncio gives one EnvironmentFailure naming the environment, the call, the turn and the cause,
within its time limit; seeded episodes and turns get seeds of their own."""

import asyncio
import threading

import pytest
import trio

from rollouts.data.user_code import user_threads
from rollouts.loops.rollouts.environments import environment_reward, environment_rollout
from rollouts.loops.rollouts.functions import RolloutContext
from rollouts.loops.rollouts.multiturn import EnvironmentFailure, part_seed
from rollouts.types import EnvStep, Sample, SamplingParams, Status

RELEASE = threading.Event()  # set at the end of the module: lets the abandoned threads return


@pytest.fixture(scope="module", autouse=True)
def _release_blocked_threads():
    yield
    RELEASE.set()


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class EchoEngine:
    """Answers every call with "a"; records each call's seed."""

    name = "echo"

    def __init__(self):
        self.seeds = []

    async def generate(self, prompts, params):
        (prompt,) = prompts
        self.seeds.append(params.seed)
        await trio.sleep(0)
        return [
            Sample(
                tokens=(*prompt, 97),
                num_prompt_tokens=len(prompt),
                loss_mask=(0.0,) * len(prompt) + (1.0,),
                response="a",
                rollout_logprobs=(-0.5,),
                weight_version=1,
            )
        ]


def _context(engine, *, n=4, seed=None):
    tok = CharTokenizer()
    return RolloutContext(
        engine=engine,
        sampling=SamplingParams(n=n, max_new_tokens=4, seed=seed),
        encode_prompt=lambda r: tok.encode(r["prompt"]),
        tokenizer=tok,
    )


class Prompted:
    def reset(self, record):
        return record["prompt"]


class Blocks(Prompted):
    def step(self, text, ids):
        RELEASE.wait(600)  # a sync call doing I/O that never answers


class Raises(Prompted):
    def step(self, text, ids):
        raise ValueError("the sandbox is gone")


class AsyncRaises(Prompted):
    async def step(self, text, ids):
        await trio.sleep(0)
        raise ValueError("the async sandbox is gone")


class UsesAsyncio(Prompted):
    async def step(self, text, ids):
        await asyncio.sleep(0.01)
        raise ValueError("the asyncio sandbox is gone")


class HangsInAsyncio(Prompted):
    async def step(self, text, ids):
        await asyncio.sleep(600)


class ResetRaises:
    def reset(self, record):
        raise KeyError("task")

    def step(self, text, ids):
        return EnvStep(done=True)


class AnswersText(Prompted):
    def step(self, text, ids):
        return "done"


CASES = [
    (
        Blocks,
        "caller",
        r"environment Blocks, step at turn 1: .*Blocks.step took longer than 0.5 s; its worker thread is abandoned \(\d+ threads for user code hung\)",
    ),
    (Raises, "caller", r"environment Raises, step at turn 1: .*Raises.step raised ValueError: the sandbox is gone$"),
    (
        AsyncRaises,
        "caller",
        r"environment AsyncRaises, step at turn 1: .*AsyncRaises.step raised ValueError: the async sandbox is gone$",
    ),
    (
        UsesAsyncio,
        "asyncio",
        r"environment UsesAsyncio, step at turn 1: .*UsesAsyncio.step raised ValueError: the asyncio sandbox is gone$",
    ),
    (
        HangsInAsyncio,
        "asyncio",
        r"environment HangsInAsyncio, step at turn 1: .*HangsInAsyncio.step took longer than 0.5 s; its task is cancelled$",
    ),
    (ResetRaises, "asyncio", r"environment ResetRaises, reset at turn 0: .*ResetRaises.reset raised KeyError: 'task'$"),
    (AnswersText, "asyncio", r"environment AnswersText, step at turn 1: step must return an EnvStep, got str$"),
]


@pytest.mark.parametrize("env, async_loop, message", CASES, ids=[c[0].__name__ for c in CASES])
def test_a_failing_environment_is_one_named_error_within_its_limit(env, async_loop, message):
    rollout = environment_rollout(env, max_turns=2, max_total_tokens=64, step_timeout_s=0.5, async_loop=async_loop)
    engine = EchoEngine()

    async def main():
        start = trio.current_time()
        with pytest.raises(EnvironmentFailure, match=message) as info:  # one error, not an ExceptionGroup
            await rollout({"prompt": "Q:"}, _context(engine))
        return info.value, trio.current_time() - start

    error, took_s = trio.run(main)
    assert took_s < 0.5 + 2.0  # the limit, and the scheduling around it
    assert error.__cause__ is not None or env is AnswersText  # the user's exception, where there was one


def test_abandoned_threads_are_counted_and_bounded_by_the_pool():
    rollout = environment_rollout(Blocks, max_turns=2, max_total_tokens=64, step_timeout_s=0.05, async_loop="caller")

    async def main():
        for _ in range(2):
            with pytest.raises(EnvironmentFailure, match="abandoned"):
                await rollout({"prompt": "Q:"}, _context(EchoEngine(), n=2))
        return user_threads().hung

    assert trio.run(main) >= 2  # every episode's blocked step holds its thread, counted


def test_an_asyncio_environment_runs_to_the_end():
    class Polite(Prompted):
        async def step(self, text, ids):
            await asyncio.sleep(0.001)
            return EnvStep(reward=1.0, done=True)

    rollout = environment_rollout(Polite, max_turns=2, max_total_tokens=64, step_timeout_s=5.0)
    samples = trio.run(rollout, {"prompt": "Q:"}, _context(EchoEngine()))
    assert [environment_reward(s, {}) for s in samples] == [1.0] * 4
    assert all(s.status is Status.COMPLETED for s in samples)


class Endless(Prompted):
    def step(self, text, ids):
        return EnvStep(observation="!")


@pytest.mark.parametrize("seed", [None, 7])
def test_each_episode_and_turn_of_a_seeded_group_gets_its_own_seed(seed):
    engine = EchoEngine()
    rollout = environment_rollout(Endless, max_turns=3, max_total_tokens=64, step_timeout_s=5.0)
    trio.run(rollout, {"prompt": "Q:"}, _context(engine, seed=seed))
    if seed is None:
        assert engine.seeds == [None] * 12  # an unseeded run stays unseeded
    else:
        expected = {part_seed(part_seed(seed, i), t) for i in range(4) for t in range(3)}
        assert sorted(engine.seeds) == sorted(expected) and len(expected) == 12


def test_part_seeds_are_63_bit_and_differ_from_their_neighbours():
    seeds = [part_seed(s, i) for s in range(20) for i in range(20)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert part_seed(None, 3) is None
