"""Agents written against openai.AsyncOpenAI, trained through the agent endpoint on a tiny local model:
tokens recorded exactly as sampled, a template that is not append-only split, seeded runs identical
at any concurrency, and an RL run whose reward rises."""

import copy
import json
import random

import pytest
import torch
import trio

from rollouts.backends import InProcessEngine, build_components
from rollouts.data import DataBuffer, tokenize_conversation
from rollouts.loops import (
    AgentError,
    CoalescingEngine,
    NullLogger,
    RLHooks,
    RLModels,
    RolloutContext,
    RunOutputs,
    agent_rollout,
    run_rl_training,
)
from rollouts.loops.recipes.tiny import EOS, build_tiny_model, build_tokenizer
from rollouts.loops.rollouts.environments import safe_arithmetic
from rollouts.loops.sft import run_sft_training
from rollouts.types import CheckpointConfig, OptimizerConfig, RLConfig, RolloutConfig, SamplingParams, SFTConfig

openai = pytest.importorskip("openai")

CORPUS = [
    f"{a}{op}{b}= calc: {a}{op}{b} = {a * b} answer: {a + b}" for a in range(2, 10) for b in range(2, 10) for op in "*+"
]


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
    first = await chat.chat.completions.create(model="policy", messages=messages, max_tokens=8, logprobs=True)
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


PROBLEMS = [(a, b) for a in range(10) for b in range(10) if a + b < 10]  # one-digit sums


def _transcript(a, b, answer):
    """A calculator episode as calculator_agent plays it, with `answer` as the final reply."""
    return [
        {"role": "user", "content": f"{a}+{b}="},
        {"role": "assistant", "content": f"calc: {a}+{b}"},
        {"role": "user", "content": f"= {a + b}"},
        {"role": "assistant", "content": str(answer)},
    ]


@pytest.fixture(scope="module")
def calculator_model(tiny):
    """The tiny model taught the calculator task's format by SFT on a sloppy teacher: it always calls
    the calculator, but half of its final answers are a random digit instead of the result. The
    model learns to call the calculator and to copy its result only some of the time: RL's to fix."""
    tokenizer, _ = tiny
    model = _tiny_model(tokenizer, seed=1)
    rng = random.Random(0)
    demos = [
        tokenize_conversation(
            _transcript(a, b, a + b if rng.random() < 0.5 else rng.randrange(10)), tokenizer, max_length=64
        )
        for _ in range(4)
        for a, b in PROBLEMS
    ]
    config = SFTConfig(
        num_steps=150,
        batch_size=16,
        max_length=64,
        optimizer=OptimizerConfig(lr=3e-3, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=config.num_steps)
    run_sft_training(components, DataBuffer(demos, seed=0), config, logger=NullLogger())
    return model


def _tiny_model(tokenizer, *, seed):
    return build_tiny_model(
        len(tokenizer),
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
    )


@torch.no_grad()
def answer_probability(model, tokenizer):
    """The model's probability of giving the calculator's result as its final answer (its digits and
    EOS) after a correct call, averaged over the problems: the expected reward given the call."""
    probabilities = []
    for a, b in PROBLEMS:
        ids = tokenizer.encode(tokenizer.apply_chat_template(_transcript(a, b, a + b), tokenize=False))
        answer = 2  # the digit and EOS
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        targets = torch.tensor(ids[1:])
        token_logprobs = logprobs.gather(1, targets[:, None])[:, 0]
        probabilities.append(float(token_logprobs[-answer:].sum().exp()))
    return sum(probabilities) / len(probabilities)


def _calculator_run(model, tokenizer, run_dir, *, steps, concurrency):
    """`steps` of GRPO on the calculator agent through the endpoint; the per-step metrics."""
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in PROBLEMS]
    config = RLConfig(
        num_steps=steps,
        max_tokens_per_micro_batch=1024,
        rollout=RolloutConfig(
            batch_size=4,
            samples_per_prompt=8,
            max_concurrency=concurrency,
            request_timeout_s=120.0,
            sampling=SamplingParams(temperature=1.0, max_new_tokens=8, seed=0),
        ),
        optimizer=OptimizerConfig(lr=1e-3, schedule="constant"),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=config.num_steps)
    engine = CoalescingEngine(InProcessEngine(model, tokenizer=tokenizer), max_prompts_per_call=64)
    episodes = []

    def reward(sample, record):  # the agent's own reward, keeping each episode's tokens
        episodes.append(tuple(sample.tokens))
        return sample.metadata["agent_reward"]

    state, history = run_rl_training(
        RLModels(policy=components, engine=engine, engine_shares_model=True),
        DataBuffer(records, seed=0),
        config,
        reward=reward,
        encode_prompt=lambda r: tokenizer.encode(r["prompt"], add_special_tokens=False),
        output=RunOutputs(run_dir=run_dir, logger=NullLogger(), resume=False),
        hooks=RLHooks(rollout=agent_rollout(calculator_agent, timeout_s=60.0)),
        tokenizer=tokenizer,
    )
    assert state.step == steps and all(h["num_failed"] == 0 for h in history), json.dumps(history[-1])[:500]
    assert all(h["num_split_episodes"] == 0 for h in history)  # the tiny template is append-only
    return sorted(episodes), history


def test_the_calculator_agent_trains_through_the_endpoint_and_its_reward_rises(tiny, calculator_model, tmp_path):
    tokenizer, _ = tiny
    model = copy.deepcopy(calculator_model)
    before = answer_probability(model, tokenizer)
    _, history = _calculator_run(model, tokenizer, tmp_path, steps=12, concurrency=4)
    after = answer_probability(model, tokenizer)
    rewards = [round(h["reward_mean"], 3) for h in history]
    assert after > before + 0.15, (before, after, rewards)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards


def test_a_seeded_calculator_run_is_bit_identical_at_two_concurrencies(tiny, calculator_model, tmp_path):
    """Episodes and trained weights are the same whether the groups' episodes run one group at a
    time or four at once (sharing the engine's batches)."""
    tokenizer, _ = tiny
    runs = {}
    for concurrency in (1, 4):
        model = copy.deepcopy(calculator_model)
        episodes, history = _calculator_run(
            model, tokenizer, tmp_path / f"c{concurrency}", steps=2, concurrency=concurrency
        )
        runs[concurrency] = episodes, [h["grad_norm"] for h in history], model.state_dict()
    assert runs[1][0] == runs[4][0] and len(set(runs[1][0])) > 8  # the same episodes, and not all alike
    assert runs[1][1] == runs[4][1] and all(g > 0 for g in runs[1][1])
    for name, tensor in runs[1][2].items():
        torch.testing.assert_close(runs[4][2][name], tensor, rtol=0, atol=0, msg=name)
