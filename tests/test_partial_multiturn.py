"""Multi-turn partial rollouts on the in-process engine: an environment, tool or agent episode whose
turn a weight sync cuts short is continued in place under the new weights, each token keeping the
version and the log-prob of the weights that sampled it, and the RL loop runs such episodes across
its syncs (rl.rollout.partial with an environment rollout).

The sync is placed mid-turn by events: the sampler's first call (or, through the loop, the first
call of each later batch's first turns) stops after CUT tokens until the sync's abort."""

from __future__ import annotations

import copy
import dataclasses
import threading

import numpy as np
import pytest
import torch
import trio

import rollouts.backends.sampling.engine as inprocess
from rollouts.backends import InProcessEngine
from rollouts.data import DataBuffer
from rollouts.loops import CoalescingEngine, RolloutContext, environment_reward, environment_rollout, tool_rollout
from rollouts.loops.recipes.tiny import build_tiny_model, build_tokenizer
from rollouts.loops.rollouts.functions import rollout_manager
from rollouts.loops.rollouts.scoring import Reward
from rollouts.sync.partial import token_versions
from rollouts.types import AlgorithmConfig, EnvStep, RLConfig, RolloutConfig, SamplingParams, Status, thaw

CUT, MAX_NEW = 3, 6  # tokens sampled before the sync, a turn's budget
OBSERVATION = [7, 8]  # what the environment answers between turns (ids)
REAL_GENERATE = inprocess.generate
CORPUS = [f"{a}*{b}={a * b} calc: {a}*{b} = {a * b} answer: {a * b}" for a in range(2, 10) for b in range(2, 10)]


@pytest.fixture(scope="module")
def tiny():
    """A tokenizer with a chat template and two tiny models, the weights before (v0) and after (v1)
    the sync; no EOS, so every turn fills its budget."""
    tokenizer = build_tokenizer(CORPUS, vocab_size=48)
    kw = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}
    v0, v1 = (build_tiny_model(len(tokenizer), max_position_embeddings=256, seed=s, **kw) for s in (0, 1))
    return tokenizer, v0.eval(), v1.eval()


def cut_first_call(monkeypatch, cut=CUT):
    """The sampler's first call stops after `cut` token steps until the engine's abort (the sync's);
    returns the event set once it is there."""
    real, mid, first = REAL_GENERATE, threading.Event(), [True]

    def gated(model, prompts, *, should_abort, **kw):
        gate, first[0], checks = first[0], False, [0]

        def check():
            checks[0] += 1
            if gate and checks[0] == cut:
                mid.set()
                assert should_abort.__self__.wait(30), "the sync's abort never came"  # the engine's Event
            return should_abort()

        return real(model, prompts, should_abort=check, **kw)

    monkeypatch.setattr(inprocess, "generate", gated)
    return mid


def teacher_forced(model, tokens, start, end):
    """Log-prob of tokens[t] given tokens[:t] for start <= t < end."""
    with torch.no_grad():
        logits = model(torch.tensor([list(tokens[:end])])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:end])[:, None])[:, 0]
    return lp[start - 1 :].numpy()


def one_step_across_a_sync(engine, v1, rollout, ctx, mid, *, reward):
    """One step of the loop's rollout manager (rl.rollout.partial) for one prompt; once the first turn
    is mid-way, the sync the loop makes: the manager paused, the engine aborted, v1 loaded as version 1."""
    config = RLConfig(
        overlap=True,
        rollout=RolloutConfig(batch_size=1, samples_per_prompt=ctx.sampling.n, partial=True, sampling=ctx.sampling),
        algorithm=AlgorithmConfig(advantage_estimator="reinforce_pp"),  # one episode per prompt
    )
    records = [{"prompt": "6*7=", "answer": "42", "ids": [20, 21, 22]}]
    manager = rollout_manager(DataBuffer(records, shuffle=False), config, rollout, ctx, Reward.of(reward), None)
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:

            async def step():
                out["batch"] = await manager.generate_batch(step=0, train_version=1)

            nursery.start_soon(step)
            assert await trio.to_thread.run_sync(mid.wait, 30), "the first turn never reached the middle"
            async with manager.paused(engine.abort):  # the loop's sync (rl.generation._load)
                await engine.load_weights(dict(v1.state_dict()), 1)
                engine.resume()

    trio.run(main)
    return out["batch"]


def check_logprobs(sample, turns, v0, v1):
    """Each model token's log-prob is its weights' (v0 before the cut, v1 after); observations 0."""
    tokens, versions = list(sample.tokens), token_versions(sample)
    start = sample.num_prompt_tokens
    for lo, hi in turns:  # model turns, as token positions
        for t in range(lo, hi):
            model = v0 if versions[t - start] == 0 else v1
            expected = teacher_forced(model, tokens, t, t + 1)[0]
            np.testing.assert_allclose(sample.rollout_logprobs[t - start], expected, atol=1e-4)
    masked = [lp for lp, m in zip(sample.rollout_logprobs, sample.loss_mask[start:], strict=True) if m == 0]
    assert masked == [0.0] * len(masked)


class TwoTurns:
    """Answers OBSERVATION after the first turn, ends after the second (reward 1.0)."""

    def reset(self, record):
        return record["ids"]

    def step(self, text, ids):
        self.turns = getattr(self, "turns", 0) + 1
        return EnvStep(observation=OBSERVATION, reward=float(self.turns == 2), done=self.turns == 2)


def _engine(model, tokenizer):
    return CoalescingEngine(InProcessEngine(copy.deepcopy(model), shares_training_model=False, tokenizer=tokenizer))


def _ctx(engine, tokenizer, n=1):
    sampling = SamplingParams(n=n, max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    return RolloutContext(engine=engine, sampling=sampling, encode_prompt=lambda r: r["ids"], tokenizer=tokenizer)


def test_an_environment_episode_cut_mid_turn_by_a_sync_is_continued_in_place(tiny, monkeypatch):
    tokenizer, v0, v1 = tiny
    engine, mid = _engine(v0, tokenizer), cut_first_call(monkeypatch)
    rollout = environment_rollout(TwoTurns, max_turns=2, max_total_tokens=64)
    batch = one_step_across_a_sync(engine, v1, rollout, _ctx(engine, tokenizer), mid, reward=environment_reward)
    md = batch.metadata
    assert md["groups_partial"] == 1 and md["groups_aborted"] == 0 and not md["errors"]  # continued, not restarted
    (sample,) = batch.samples
    p = sample.num_prompt_tokens
    # turn 1: CUT tokens of v0 and the rest of its budget of v1; the observation; turn 2 all v1
    assert thaw(sample.metadata["version_segments"]) == [[0, CUT], [1, MAX_NEW - CUT], [None, 2], [1, MAX_NEW]]
    assert sample.weight_version == 0 and sample.status is Status.COMPLETED and sample.reward == 1.0
    assert list(sample.tokens[p + MAX_NEW : p + MAX_NEW + 2]) == OBSERVATION
    assert list(sample.loss_mask) == [0.0] * p + [1.0] * MAX_NEW + [0.0] * 2 + [1.0] * MAX_NEW
    check_logprobs(sample, [(p, p + MAX_NEW), (p + MAX_NEW + 2, p + 2 * MAX_NEW + 2)], v0, v1)


def test_a_tool_episode_cut_mid_turn_by_a_sync_is_continued_in_place(tiny, monkeypatch):
    tokenizer, v0, v1 = tiny
    calls = []

    def tool(call):
        calls.append(call)
        return "= 42"

    def run(stop_token_ids):
        engine, mid = _engine(v0, tokenizer), cut_first_call(monkeypatch)
        rollout = tool_rollout(tool_parser=lambda text: None if calls else text, tool_executor=tool, max_turns=2)
        ctx = _ctx(engine, tokenizer)
        ctx = dataclasses.replace(ctx, sampling=dataclasses.replace(ctx.sampling, stop_token_ids=stop_token_ids))
        return one_step_across_a_sync(engine, v1, rollout, ctx, mid, reward=lambda s, r: 1.0)

    # A tool is called on a turn that ends at a stop token: the first turn's tokens (seeded, so the same
    # again) name one the turn samples first after the cut, under v1, as the stop of the run tested.
    (dry,) = run(()).samples
    turn = list(dry.response_tokens)
    j = next(j for j in range(CUT, MAX_NEW) if turn[j] not in turn[:j])
    batch = run((turn[j],))
    assert batch.metadata["groups_partial"] == 1 and not batch.metadata["errors"]
    (sample,) = batch.samples
    tool_ids = tokenizer.encode("= 42", add_special_tokens=False)
    p, k = sample.num_prompt_tokens, len(tool_ids)
    segments = thaw(sample.metadata["version_segments"])
    assert segments[:3] == [[0, CUT], [1, j + 1 - CUT], [None, k]] and segments[3][0] == 1 and len(segments) == 4
    assert sample.metadata["tool_calls"] == 1 and sample.weight_version == 0
    end = p + j + 1
    assert list(sample.tokens[p:end]) == turn[: j + 1]
    # the tool saw the whole first turn's text, continued across the sync
    assert calls == [tokenizer.decode(turn[: j + 1], skip_special_tokens=True)]
    assert list(sample.tokens[end : end + k]) == tool_ids
    assert list(sample.loss_mask) == [0.0] * p + [1.0] * (j + 1) + [0.0] * k + [1.0] * segments[3][1]
    check_logprobs(sample, [(p, end), (end + k, len(sample.tokens))], v0, v1)


def test_an_agent_episode_through_the_endpoint_is_continued_across_a_sync(tiny, monkeypatch):
    openai = pytest.importorskip("openai")
    from rollouts.loops import agent_reward, agent_rollout

    tokenizer, v0, v1 = tiny
    engine, mid = _engine(v0, tokenizer), cut_first_call(monkeypatch)
    replies = []

    async def agent(base_url, record):
        chat = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60.0)
        messages = [{"role": "user", "content": record["prompt"]}]
        for _ in range(2):
            reply = await chat.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_NEW)
            replies.append(reply.choices[0].message.content)
            messages += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": "="}]
        return 1.0

    ctx = _ctx(engine, tokenizer)
    batch = one_step_across_a_sync(engine, v1, agent_rollout(agent), ctx, mid, reward=agent_reward())
    assert batch.metadata["groups_partial"] == 1 and not batch.metadata["errors"]
    (sample,) = batch.samples
    segments = thaw(sample.metadata["version_segments"])
    # turn 1 cut after CUT tokens and continued under v1; what the agent added; turn 2 all v1
    assert segments[:2] == [[0, CUT], [1, MAX_NEW - CUT]] and segments[2][0] is None
    assert segments[3:] == [[1, MAX_NEW]] and sample.weight_version == 0
    p, added = sample.num_prompt_tokens, segments[2][1]
    assert list(sample.loss_mask) == [0.0] * p + [1.0] * MAX_NEW + [0.0] * added + [1.0] * MAX_NEW
    check_logprobs(sample, [(p, p + MAX_NEW), (p + MAX_NEW + added, p + 2 * MAX_NEW + added)], v0, v1)
    # the agent was answered with the whole first turn, continued across the sync
    first = tokenizer.decode(list(sample.tokens[p : p + MAX_NEW]), skip_special_tokens=False)
    assert replies[0] == first


# ---------------------------------------------------------------- through the RL loop

B, N = 2, 2  # groups per step, episodes per group


class Turns:
    """Two turns with OBSERVATION in between; reset answers the record's ids (batch and index)."""

    def reset(self, record):
        return [3 + record["id"] // 8, 3 + record["id"] % 8]

    def step(self, text, ids):
        self.turns = getattr(self, "turns", 0) + 1
        return EnvStep(observation=OBSERVATION, reward=float(ids[-1] % 2), done=self.turns == 2)


def test_the_rl_loop_continues_environment_episodes_across_its_syncs(tiny, tmp_path, monkeypatch):
    """Overlap with partial rollouts: batch b >= 1 generates while step b - 1 trains, and the first
    sampler call of its first turns stops after CUT tokens until the sync's abort (training of step
    b - 1 waits until it is there), so each sync lands mid-turn."""
    import rollouts.loops.rl.step as step_module
    from rollouts.backends import build_components
    from rollouts.loops import NullLogger, RLHooks, RLModels, RunOutputs, run_rl_training
    from rollouts.types import CheckpointConfig, OptimizerConfig

    num_steps = 3
    mid = {b: threading.Event() for b in range(num_steps)}  # batch b's first turns reached the middle
    cut: set[int] = set()
    real_update = step_module.rl_update

    def gated(model, prompts, *, should_abort, **kw):
        firsts = {(p[0] - 3) * 8 + p[1] - 3 for p in prompts if len(p) == 2}  # first turns: the record ids
        batch = min((i // B for i in firsts), default=0)
        gate = batch >= 1 and batch not in cut
        cut.add(batch)
        checks = [0]

        def check():
            checks[0] += 1
            if gate and checks[0] == CUT:
                mid[batch].set()
                assert should_abort.__self__.wait(60), "the sync's abort never came"
            return should_abort()

        return REAL_GENERATE(model, prompts, should_abort=check, **kw)

    trained = []

    def recording_update(components, state, samples, config, **kw):
        trained.append(list(samples))
        if state.step + 1 < num_steps:  # the next batch is generating: the sync lands mid-turn
            assert mid[state.step + 1].wait(60), "the next batch never reached the middle of a turn"
        return real_update(components, state, samples, config, **kw)

    monkeypatch.setattr(inprocess, "generate", gated)
    monkeypatch.setattr(step_module, "rl_update", recording_update)
    tokenizer, v0, _ = tiny
    model = copy.deepcopy(v0).train()
    config = RLConfig(
        num_steps=num_steps,
        overlap=True,
        max_tokens_per_micro_batch=64,
        rollout=RolloutConfig(
            batch_size=B,
            samples_per_prompt=N,
            partial=True,
            sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=0),
        ),
        optimizer=OptimizerConfig(schedule="constant", lr=1e-3),
        checkpoint=CheckpointConfig(every_steps=0, keep_last=1),
    )
    components = build_components(model, config.optimizer, num_training_steps=num_steps)
    _, history = run_rl_training(
        RLModels(policy=components, engine=_engine(model, tokenizer)),
        DataBuffer([{"prompt": f"p{i}", "id": i} for i in range(40)], shuffle=False),
        config,
        reward=environment_reward,
        encode_prompt=lambda r: [3 + r["id"] // 8, 3 + r["id"] % 8],
        output=RunOutputs(run_dir=tmp_path, logger=NullLogger()),
        hooks=RLHooks(rollout=environment_rollout(Turns, max_turns=2, max_total_tokens=64)),
        tokenizer=tokenizer,
    )
    assert len(history) == num_steps and all(m["num_trained"] == B * N for m in history)
    assert all(m["num_failed"] == 0 and m["groups_restarted"] == 0 for m in history)
    assert history[0]["groups_partial"] == 0 and all(m["groups_partial"] >= 1 for m in history[1:])
    ids = [sorted({s.metadata["id"] for s in samples}) for samples in trained]
    assert ids == [list(range(b * B, (b + 1) * B)) for b in range(num_steps)]  # none lost, none trained twice
    for b, samples in enumerate(trained[1:], start=1):  # generated across the sync after step b - 1
        cut_short = [s for s in samples if {v for v, _ in s.metadata["version_segments"]} == {b - 1, b, None}]
        assert cut_short, f"no episode of batch {b} spans the sync"
        for s in cut_short:
            first, rest = s.metadata["version_segments"][:2]
            assert first[0] == b - 1 and rest[0] == b and first[1] + rest[1] == MAX_NEW
            assert s.weight_version == b - 1  # the oldest token's: staleness 1
    assert all(m["num_too_stale"] == 0 for m in history)
