"""Environments run token-in/token-out: masks, per-turn log-probs, bounds, and the calculator example."""

import asyncio
import math

import pytest
import trio

from rollouts.loops.rollouts.environments import CalculatorEnv, environment_reward, environment_rollout, safe_arithmetic
from rollouts.loops.rollouts.functions import RolloutContext
from rollouts.loops.rollouts.multiturn import EnvironmentFailure
from rollouts.types import EnvStep, Sample, SamplingParams, Status


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Answers each call with the next scripted turn; log-prob -0.5 per token."""

    def __init__(self, turns):
        self.turns, self.prompts = list(turns), []

    async def generate(self, prompts, params):
        (prompt,) = prompts
        self.prompts.append(list(prompt))
        text = self.turns.pop(0)
        ids = [ord(c) for c in text]
        return [
            Sample(
                tokens=(*prompt, *ids),
                num_prompt_tokens=len(prompt),
                loss_mask=[0.0] * len(prompt) + [1.0] * len(ids),
                response=text,
                rollout_logprobs=[-0.5] * len(ids),
                weight_version=3,
            )
        ]


def _run(env_factory, turns, *, max_turns=4, step_timeout_s=5.0, record=None, async_loop="asyncio"):
    tok = CharTokenizer()
    ctx = RolloutContext(
        engine=ScriptedEngine(turns),
        sampling=SamplingParams(n=1, max_new_tokens=16),
        encode_prompt=lambda r: tok.encode(r["prompt"]),
        tokenizer=tok,
    )
    rollout = environment_rollout(
        env_factory, max_turns=max_turns, step_timeout_s=step_timeout_s, async_loop=async_loop
    )
    (sample,) = trio.run(rollout, record or {"prompt": "Q:", "answer": "36"}, ctx)
    return sample, ctx.engine


def test_the_calculator_episode_masks_tool_output_and_keeps_turn_log_probs():
    sample, engine = _run(CalculatorEnv, ["calc: 12*3", "answer: 36"])
    assert sample.status is Status.COMPLETED and environment_reward(sample, {}) == 1.0
    text = "".join(chr(t) for t in sample.tokens)
    assert text == "Q:calc: 12*3\n= 36\nanswer: 36"
    mask = {c: m for c, m in zip(text, sample.loss_mask, strict=True)}
    observation = "\n= 36\n"
    start = text.index(observation)
    assert sample.loss_mask[start : start + len(observation)] == (0.0,) * len(observation)
    assert sample.loss_mask[:2] == (0.0, 0.0) and mask["a"] == 1.0
    trained = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask[2:], strict=True) if m]
    assert trained == [-0.5] * len("calc: 12*3answer: 36")
    assert engine.prompts[1] == [ord(c) for c in "Q:calc: 12*3\n= 36\n"]  # continued from the exact ids


def test_a_wrong_answer_scores_zero_and_a_tool_error_is_shown_not_raised():
    sample, _ = _run(CalculatorEnv, ["calc: __import__('os')", "answer: 35"])
    assert environment_reward(sample, {}) == 0.0 and "error: only numbers" in "".join(chr(t) for t in sample.tokens)


def test_an_environment_that_never_ends_is_truncated_at_max_turns():
    class Endless:
        def reset(self, record):
            return "go"

        def step(self, text, ids):
            return EnvStep(observation="!", reward=0.25)

    sample, _ = _run(Endless, ["a", "b", "c", "d", "e"], max_turns=3)
    assert sample.status is Status.TRUNCATED and sample.metadata["turns"] == 3
    assert environment_reward(sample, {}) == 0.75


def test_a_hung_environment_fails_within_its_timeout():
    class Hangs:
        def reset(self, record):
            return "go"

        async def step(self, text, ids):
            await trio.sleep(3600)

    with pytest.raises(EnvironmentFailure, match="Hangs.step took longer than 0.05 s; its task is cancelled"):
        _run(Hangs, ["a"], step_timeout_s=0.05, async_loop="caller")


@pytest.mark.parametrize("expression, value", [("12*3", 36), ("(1+2)/4", 0.75), ("-7//2", -4), ("10 % 4", 2)])
def test_safe_arithmetic(expression, value):
    assert math.isclose(safe_arithmetic(expression), value)


@pytest.mark.parametrize(
    "expression", ["2**100", "__import__('os')", "a+1", "1/0", "9" * 300, "10**13", "99999999*99999999"]
)
def test_safe_arithmetic_refuses_everything_else(expression):
    with pytest.raises(ValueError):
        safe_arithmetic(expression)


def test_env_step_checks_its_fields():
    with pytest.raises(ValueError, match="finite"):
        EnvStep(reward=math.nan)
    with pytest.raises(TypeError, match="token ids"):
        EnvStep(observation=[1, -2])


# ---------------------------------------------------------------- OpenEnv-style clients


class _Result:
    def __init__(self, observation, reward, done):
        self.observation, self.reward, self.done = observation, reward, done


class GuessClient:
    """An OpenEnv-style client: reset(target=...) and step(action) return results; reward None until the end."""

    def __init__(self):
        self.target = None

    def reset(self, target):
        self.target = target
        return _Result({"text": "guess 0-9:"}, None, False)

    def step(self, action):
        if action["guess"] == self.target:
            return _Result({"text": ""}, 1.0, True)
        return _Result({"text": " higher" if action["guess"] < self.target else " lower"}, None, False)


class AsyncGuessClient(GuessClient):
    async def reset(self, target):
        await asyncio.sleep(0)  # an asyncio client, as most SDKs are
        return GuessClient.reset(self, target)

    async def step(self, action):
        await asyncio.sleep(0)
        return GuessClient.step(self, action)


@pytest.mark.parametrize("client", [GuessClient, AsyncGuessClient])
def test_an_openenv_style_client_runs_as_an_environment(client):
    from rollouts.loops.rollouts.environments import OpenEnvAdapter

    def make_env():
        return OpenEnvAdapter(
            client(),
            to_action=lambda text: {"guess": int(text.strip() or -1)},
            render=lambda obs: obs["text"],
            reset_kwargs=lambda record: {"target": record["target"]},
        )

    sample, engine = _run(make_env, ["3", "7"], record={"prompt": "", "target": 7})
    assert "".join(chr(t) for t in sample.tokens) == "guess 0-9:3 higher7"
    assert sample.status is Status.COMPLETED and environment_reward(sample, {}) == 1.0
    assert engine.prompts[1] == [ord(c) for c in "guess 0-9:3 higher"]


def test_an_openenv_result_without_done_is_named():
    from rollouts.loops.rollouts.environments import OpenEnvAdapter

    class Broken(GuessClient):
        def step(self, action):
            return {"observation": "x", "reward": 0.0}

    env = OpenEnvAdapter(Broken(), to_action=lambda text: {"guess": 1}, reset_kwargs=lambda r: {"target": 2})
    env.reset({})
    with pytest.raises(TypeError, match="has no 'reward'"):
        env.step("1", [49])


class CountingTokenizer(CharTokenizer):
    """Counts the characters it was asked to encode."""

    def __init__(self):
        self.encoded = 0

    def encode(self, text, add_special_tokens=False):
        self.encoded += len(text)
        return super().encode(text)


def test_a_huge_observation_ends_the_episode_without_being_tokenized_whole():
    huge = "x" * 20_000_000

    class Floods:
        def reset(self, record):
            return "go"

        def step(self, text, ids):
            return EnvStep(observation=huge)

    tok = CountingTokenizer()
    ctx = RolloutContext(
        engine=ScriptedEngine(["a"]),
        sampling=SamplingParams(n=1, max_new_tokens=16),
        encode_prompt=lambda r: tok.encode(r["prompt"]),
        tokenizer=tok,
    )
    rollout = environment_rollout(Floods, max_turns=4, max_total_tokens=48, step_timeout_s=5.0)
    (sample,) = trio.run(rollout, {"prompt": "Q:"}, ctx)
    assert sample.status is Status.TRUNCATED and len(sample.tokens) == len("goa")
    assert tok.encoded < 48 * 64 + 100  # a prefix of at most 64 characters per token of room


def test_a_huge_first_observation_is_named_without_being_tokenized_whole():
    class Floods:
        def reset(self, record):
            return "y" * 5_000_000

        def step(self, text, ids):
            return EnvStep(observation="", done=True)

    tok = CountingTokenizer()
    ctx = RolloutContext(
        engine=ScriptedEngine(["a"]),
        sampling=SamplingParams(n=1, max_new_tokens=16),
        encode_prompt=lambda r: tok.encode(r["prompt"]),
        tokenizer=tok,
    )
    rollout = environment_rollout(Floods, max_total_tokens=48, step_timeout_s=5.0)
    with pytest.raises(ValueError, match=r"first observation \(5000000 characters\) leaves no room"):
        trio.run(rollout, {"prompt": "Q:"}, ctx)
    assert tok.encoded < 48 * 64


def test_a_huge_prompt_record_is_refused_without_being_tokenized_whole():
    from rollouts.loops.rollouts.functions import check_prompt_lengths

    tok = CountingTokenizer()
    records = [{"prompt": "1+1="}, {"prompt": "9" * 100_000_000}]
    with pytest.raises(ValueError, match=r"1 of 2 prompts cannot fit.*record 1 \(100000000 characters, over 40 prompt"):
        check_prompt_lengths(
            records, lambda r: tok.encode(r["prompt"]), max_new_tokens=8, max_context=48, max_sample_tokens=None
        )
    assert tok.encoded < 48 * 64
