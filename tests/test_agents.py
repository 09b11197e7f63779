"""Agents written against openai.AsyncOpenAI, trained through the agent endpoint on a tiny local model:
tokens recorded exactly as sampled, a template that is not append-only split, seeded runs identical
at any concurrency, and an RL run whose reward rises."""

import copy
import json

import pytest
import torch
import trio

from rollouts.backends import InProcessEngine, build_components
from rollouts.data import DataBuffer
from rollouts.loops import (
    AgentError,
    CoalescingEngine,
    NullLogger,
    RLHooks,
    RLModels,
    RolloutContext,
    RunOutputs,
    agent_reward,
    agent_rollout,
    run_rl_training,
)
from rollouts.loops.recipes.tiny import EOS, build_tiny_model, build_tokenizer
from rollouts.loops.rollouts.environments import safe_arithmetic
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams

openai = pytest.importorskip("openai")

CORPUS = [f"{a}*{b}={a * b} calc: {a}*{b} = {a * b} answer: {a * b}" for a in range(2, 10) for b in range(2, 10)]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer(CORPUS, vocab_size=48)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer, model


class Recording:
    """An engine wrapper keeping every (prompt ids, returned Sample) it served."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    @property
    def name(self):
        return self.engine.name

    async def generate(self, prompts, params):
        samples = await self.engine.generate(prompts, params)
        self.calls.append((tuple(prompts[0]), samples[0]))
        return samples


def client(base_url):
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60.0)


async def calculator_agent(base_url, record):
    """Two turns: the model's reply is run on a calculator, whose result comes back as a user message."""
    chat = client(base_url)
    messages = [{"role": "user", "content": record["prompt"]}]
    first = await chat.chat.completions.create(model="policy", messages=messages, max_tokens=6, logprobs=True)
    reply = first.choices[0].message.content
    try:
        result = f"= {safe_arithmetic(reply.replace('calc:', '').strip())}"
    except ValueError:
        result = "= error"
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result}]
    final = await chat.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return 1.0 if final.choices[0].message.content.strip() == record["answer"] else 0.0


def _context(engine, tokenizer, *, n, seed=None, max_new_tokens=6):
    return RolloutContext(
        engine=engine,
        sampling=SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed),
        encode_prompt=lambda r: tokenizer.encode(r["prompt"]),
        tokenizer=tokenizer,
    )


def test_the_calculator_agent_is_recorded_exactly_as_sampled(tiny):
    tokenizer, model = tiny
    engine = Recording(InProcessEngine(model, tokenizer=tokenizer))
    (sample,) = trio.run(
        agent_rollout(calculator_agent), {"prompt": "6*7=", "answer": "42"}, _context(engine, tokenizer, n=1)
    )
    (prompt1, turn1), (prompt2, turn2) = engine.calls
    assert prompt1 == tuple(tokenizer.encode("6*7=", add_special_tokens=False))
    context1 = prompt1 + tuple(turn1.response_tokens)
    assert prompt2[: len(context1)] == context1  # turn 2 continues the ids as sampled, never re-tokenized
    assert tuple(sample.tokens) == prompt2 + tuple(turn2.response_tokens)
    assert sample.metadata["episode_pieces"] == 1 and sample.metadata["turns"] == 2
    # trained: exactly the engine's tokens; masked: the prompt and what the agent appended
    added = len(prompt2) - len(context1)
    mask = [0.0] * len(prompt1) + [1.0] * turn1.response_length + [0.0] * added + [1.0] * turn2.response_length
    assert list(sample.loss_mask) == mask
    expected = [*turn1.rollout_logprobs, *[0.0] * added, *turn2.rollout_logprobs]
    assert list(sample.rollout_logprobs) == expected  # bit for bit
    assert sample.metadata["agent_reward"] in (0.0, 1.0)
    assert [m["role"] for m in sample.metadata["transcript"]] == ["user", "assistant", "user", "assistant"]


def test_a_template_that_drops_earlier_assistant_turns_splits_the_episode(tiny):
    tokenizer, model = tiny
    tok = copy.deepcopy(tokenizer)  # a copy with its own template: the fixture's is left as it is
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
        "{% elif m['role'] == 'assistant' and loop.last %}{{ m['content'] }}" + EOS + "{% endif %}{% endfor %}"
    )
    engine = Recording(InProcessEngine(model, tokenizer=tok))
    samples = trio.run(agent_rollout(calculator_agent), {"prompt": "6*7=", "answer": "42"}, _context(engine, tok, n=1))
    assert len(samples) == 2 and [s.metadata["episode_piece"] for s in samples] == [0, 1]
    assert {s.metadata["episode_pieces"] for s in samples} == {2}
    assert len({s.metadata["episode_id"] for s in samples}) == 1
    for sample, (prompt, turn) in zip(samples, engine.calls, strict=True):  # each piece: its own prompt + sampled ids
        assert tuple(sample.tokens) == prompt + tuple(turn.response_tokens)
        assert sample.num_prompt_tokens == len(prompt)
        assert list(sample.rollout_logprobs) == list(turn.rollout_logprobs)


def test_a_seeded_agent_run_is_identical_at_two_concurrencies(tiny):
    tokenizer, model = tiny
    records = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in [(2, 3), (4, 5), (6, 7)]]
    rollout = agent_rollout(calculator_agent)

    def run(concurrent):
        engine = CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=16)
        out = [None] * len(records)

        async def one(i):
            out[i] = await rollout(records[i], _context(engine, tokenizer, n=3, seed=100 + i))

        async def main():
            if concurrent:
                async with trio.open_nursery() as nursery:
                    for i in range(len(records)):
                        nursery.start_soon(one, i)
            else:
                for i in range(len(records)):
                    await one(i)

        trio.run(main)
        return [s for group in out for s in group]

    one_at_a_time, all_at_once = run(False), run(True)
    assert [(tuple(s.tokens), s.loss_mask) for s in one_at_a_time] == [
        (tuple(s.tokens), s.loss_mask) for s in all_at_once
    ]
    assert len({tuple(s.tokens) for s in one_at_a_time}) > len(records)  # seeded episodes of a group differ
    # The log-probs come from forward passes over differently composed batches: float32 rounding of
    # a few ulp of the logits (|logprob| < 8 here), never more.
    for a, b in zip(one_at_a_time, all_at_once, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), rtol=0, atol=16 * 8 * 2**-23
        )


def test_a_failing_agent_is_named_with_its_episode_and_cause(tiny):
    tokenizer, model = tiny

    async def broken(base_url, record):
        await client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "2"}])
        raise KeyError("no tool named 'calc'")

    ctx = _context(InProcessEngine(model, tokenizer=tokenizer), tokenizer, n=2)
    with pytest.raises(AgentError, match=r"agent '.*broken', episode \d: KeyError: .*no tool named"):
        trio.run(agent_rollout(broken), {"prompt": "2*3="}, ctx)

    async def silent(base_url, record):
        return 1.0

    with pytest.raises(AgentError, match="made no request"):
        trio.run(agent_rollout(silent, name="silent.py:run"), {"prompt": "2*3="}, ctx)


async def sevens_agent(base_url, record):
    """Two turns; each reply that starts with "7" earns 0.5 (a task the tiny model learns in a few steps)."""
    chat = client(base_url)
    messages, reward = [{"role": "user", "content": record["prompt"]}], 0.0
    for _ in range(2):
        reply = (await chat.chat.completions.create(model="policy", messages=messages, max_tokens=3)).choices[0]
        reward += 0.5 if reply.message.content.startswith("7") else 0.0
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": "="}]
    return reward


def test_an_agent_trains_through_the_endpoint_and_its_reward_rises(tiny, tmp_path):
    tokenizer, _ = tiny
    torch.manual_seed(0)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=1,
    )
    records = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a in range(2, 10) for b in range(2, 10)]
    config = RLConfig(
        num_steps=10,
        max_tokens_per_micro_batch=1024,
        rollout=RolloutConfig(
            batch_size=4,
            samples_per_prompt=8,
            max_concurrency=4,
            request_timeout_s=120.0,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=3, seed=0),
        ),
        optimizer=OptimizerConfig(lr=1e-2, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=config.num_steps)
    engine = CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=64)
    state, history = run_rl_training(
        RLModels(policy=components, engine=engine, engine_shares_model=True),
        DataBuffer(records, seed=0),
        config,
        reward=agent_reward(),
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger(), resume=False),
        hooks=RLHooks(rollout=agent_rollout(sevens_agent, timeout_s=60.0)),
        tokenizer=tokenizer,
    )
    assert all(h["num_split_episodes"] == 0 for h in history)  # the tiny template is append-only
    rewards = [h["reward_mean"] for h in history]
    assert state.step == config.num_steps
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    assert all(h["num_failed"] == 0 for h in history), json.dumps(history[-1])[:500]
